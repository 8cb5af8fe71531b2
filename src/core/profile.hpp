// A tiny op-level profiler for `attnres bench` and cuda_bench: wall time per op family, forward
// and backward. Off by default; when off a scope costs one predictable branch. On a device whose
// ops run asynchronously, set_synchronizer makes each scope wait for the device at its start and
// end, so a scope's time is its ops' device time (plus a synchronisation each).
#pragma once

#include <chrono>
#include <cstdint>

namespace attnres::prof {

enum Op : int {
  kEmbedding,
  kRmsNorm,
  kMatmul,
  kRope,
  kAttention,
  kSwiglu,
  kCrossEntropy,
  kResidual,  // the DepthRouter: plain sums (prenorm) or depth attention (AttnRes)
  kOptimizer,
  kOpCount
};
enum Phase : int { kForward, kBackward, kPhaseCount };

const char* op_name(int op);
void enable(bool on);
bool enabled();
void reset();
// Seconds accumulated for (op, phase) since reset().
double seconds(int op, int phase);
void add(int op, int phase, double s);
// fn(ctx) waits for queued device work; null: nothing to wait for (the CPU).
void set_synchronizer(void (*fn)(void*), void* ctx);
void synchronize();

class Scope {
 public:
  Scope(int op, int phase) : op_(op), phase_(phase), on_(enabled()) {
    if (on_) {
      synchronize();
      t0_ = std::chrono::steady_clock::now();
    }
  }
  ~Scope() {
    if (on_) {
      synchronize();
      add(op_, phase_,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
    }
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  int op_, phase_;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace attnres::prof
