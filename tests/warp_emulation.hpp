// Runs warp-per-row CUDA kernels (src/cuda/warp_kernels.cuh) on the host: 32 threads stand in
// for a warp's lanes, and __shfl_xor_sync exchanges values through shared slots between two
// barriers, as the hardware does in lockstep. Include before the kernels. A kernel whose lanes
// disagree on how many shuffles they make would hang a real GPU; here the barrier times out and
// the test process aborts with a message instead.
#pragma once

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __global__

namespace warp_emulation {

constexpr int kLanes = 32;

class Barrier {  // a reusable barrier for kLanes threads that gives up after 20 s
 public:
  void wait() {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t gen = gen_;
    if (++count_ == kLanes) {
      count_ = 0;
      gen_++;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lk, std::chrono::seconds(20), [&] { return gen_ != gen; })) {
      std::fprintf(stderr, "warp emulation: the lanes of a warp disagree on their shuffles\n");
      std::abort();
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0;
  uint64_t gen_ = 0;
};

inline thread_local int lane = 0;
inline float slots[kLanes];
inline Barrier* barrier = nullptr;

// Calls body(row, lane) for every row, one host thread per lane (as warp::rows_kernel does with
// one warp).
template <class Body>
void run_warp(const Body& body, int64_t rows) {
  Barrier b;
  barrier = &b;
  std::vector<std::thread> lanes;
  for (int l = 0; l < kLanes; l++) {
    lanes.emplace_back([&body, rows, l] {
      lane = l;
      for (int64_t r = 0; r < rows; r++) body(r, l);
    });
  }
  for (auto& t : lanes) t.join();
  barrier = nullptr;
}

}  // namespace warp_emulation

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) {
  using namespace warp_emulation;
  slots[lane] = v;
  barrier->wait();
  const float r = slots[lane ^ lane_mask];
  barrier->wait();
  return r;
}

// Declared for warp::rows_kernel's definition; the tests call the kernel bodies directly.
struct WarpEmulationDim3 {
  unsigned x = 0;
};
inline WarpEmulationDim3 threadIdx, blockIdx, gridDim, blockDim;
