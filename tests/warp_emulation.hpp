// Runs warp-per-row CUDA kernels (src/cuda/warp_kernels.cuh) on the host: 32 threads stand in
// for a warp's lanes, and __shfl_xor_sync exchanges values through shared slots between two
// barriers, as the hardware does in lockstep; run_block runs blocks of several warps
// (__syncthreads: a barrier of all their threads). Include before the kernels. A kernel whose
// lanes disagree on how many shuffles or barriers they make would hang a real GPU; here the
// barrier times out and the test process aborts with a message instead.
#pragma once

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __global__

namespace warp_emulation {

constexpr int kLanes = 32;
constexpr int kMaxWarps = 8;

class Barrier {  // a reusable barrier for `count` threads that gives up after 20 s
 public:
  explicit Barrier(int count = kLanes) : n_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      gen_++;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lk, std::chrono::seconds(20), [&] { return gen_ != gen; })) {
      std::fprintf(stderr, "warp emulation: the threads disagree on their barriers or shuffles\n");
      std::abort();
    }
  }

 private:
  int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0;
  uint64_t gen_ = 0;
};

inline thread_local int lane = 0;
inline thread_local int warp = 0;  // the warp of this thread in its block
inline float slots[kMaxWarps][kLanes];
inline Barrier* barriers[kMaxWarps] = {};  // one per warp: shuffles and __syncwarp
inline Barrier* block_barrier = nullptr;   // __syncthreads

// Calls body(row, lane) for every row, one host thread per lane (as warp::rows_kernel does with
// one warp).
template <class Body>
void run_warp(const Body& body, int64_t rows) {
  Barrier b;
  barriers[0] = &b;
  std::vector<std::thread> lanes;
  for (int l = 0; l < kLanes; l++) {
    lanes.emplace_back([&body, rows, l] {
      lane = l;
      warp = 0;
      for (int64_t r = 0; r < rows; r++) body(r, l);
    });
  }
  for (auto& t : lanes) t.join();
  barriers[0] = nullptr;
}

// Calls body(unit, warp, lane) for every unit with a block of `warps` warps (warps x 32 host
// threads, a barrier per warp and one for the block), as a kernel with one block per unit does.
template <class Body>
void run_block(const Body& body, int64_t units, int warps) {
  std::vector<std::unique_ptr<Barrier>> wb;
  for (int w = 0; w < warps; w++) {
    wb.push_back(std::make_unique<Barrier>(kLanes));
    barriers[w] = wb.back().get();
  }
  Barrier bb(warps * kLanes);
  block_barrier = &bb;
  std::vector<std::thread> threads;
  for (int w = 0; w < warps; w++) {
    for (int l = 0; l < kLanes; l++) {
      threads.emplace_back([&body, units, w, l] {
        lane = l;
        warp = w;
        for (int64_t u = 0; u < units; u++) body(u, w, l);
      });
    }
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < warps; w++) barriers[w] = nullptr;
  block_barrier = nullptr;
}

}  // namespace warp_emulation

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) {
  using namespace warp_emulation;
  float* s = slots[warp];
  s[lane] = v;
  barriers[warp]->wait();
  const float r = s[lane ^ lane_mask];
  barriers[warp]->wait();
  return r;
}
inline void __syncthreads() { warp_emulation::block_barrier->wait(); }
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) {
  warp_emulation::barriers[warp_emulation::warp]->wait();
}

// Declared for warp::rows_kernel's definition; the tests call the kernel bodies directly.
struct WarpEmulationDim3 {
  unsigned x = 0;
};
inline WarpEmulationDim3 threadIdx, blockIdx, gridDim, blockDim;
