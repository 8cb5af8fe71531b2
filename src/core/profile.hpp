// A tiny op-level profiler for `attnres bench` and cuda_bench: wall time per op family, forward
// and backward. Off by default; when off a scope costs one predictable branch. On a device whose
// ops run asynchronously, set_synchronizer makes each scope wait for the device at its start and
// end, so a scope's time is its ops' device time (plus a synchronisation each).
//
// The profiling backend (backend/backend.hpp, make_profiled_backend) times every backend op as
// a Scope of the op's family, in the current phase (set by the model with PhaseScope). A Region
// times a whole stretch of work as one family (the depth router's calls, the optimizer step):
// the ops inside it count towards the region, not their own families.
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
  kResidual,     // the DepthRouter: plain sums (prenorm) or depth attention (AttnRes)
  kElementwise,  // memory and elementwise ops outside a region (zeroing, copies, sums of squares)
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
// The phase the backend's ops count towards (kForward until set).
Phase phase();
void set_phase(Phase p);
// Whether a Region is open (its ops are timed by it, not one by one).
bool in_region();

class Scope {
 public:
  Scope(int op, int phase) : op_(op), phase_(phase), on_(enabled() && !in_region()) {
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

// The phase for the ops issued while it lives (the previous one restored after).
class PhaseScope {
 public:
  explicit PhaseScope(Phase p) : prev_(phase()) { set_phase(p); }
  ~PhaseScope() { set_phase(prev_); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Phase prev_;
};

// Times its lifetime as one family `op` in the current phase; the ops inside count towards it.
// Regions do not nest (an inner one counts towards the outer).
class Region {
 public:
  explicit Region(int op);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

 private:
  Scope scope_;
  bool opened_;
};

}  // namespace attnres::prof
