#include "core/profile.hpp"

#include <atomic>

namespace attnres::prof {

namespace {
std::atomic<bool> g_on{false};
double g_sec[kOpCount][kPhaseCount] = {};
void (*g_sync)(void*) = nullptr;
void* g_sync_ctx = nullptr;
Phase g_phase = kForward;
bool g_region = false;
}  // namespace

const char* op_name(int op) {
  static const char* names[kOpCount] = {
      "embedding",   "rmsnorm",  "matmul",        "rope",
      "attention",   "swiglu",   "cross-entropy", "residual/depth mix",
      "elementwise", "optimizer"};
  return op >= 0 && op < kOpCount ? names[op] : "?";
}
void enable(bool on) { g_on.store(on); }
bool enabled() { return g_on.load(std::memory_order_relaxed); }
void reset() {
  for (auto& r : g_sec) {
    for (double& x : r) x = 0;
  }
}
double seconds(int op, int phase) { return g_sec[op][phase]; }
// Called from the (single) thread that drives the model; ops parallelise inside.
void add(int op, int phase, double s) { g_sec[op][phase] += s; }
void set_synchronizer(void (*fn)(void*), void* ctx) {
  g_sync = fn;
  g_sync_ctx = ctx;
}
void synchronize() {
  if (g_sync) g_sync(g_sync_ctx);
}

Phase phase() { return g_phase; }
void set_phase(Phase p) { g_phase = p; }
bool in_region() { return g_region; }

// The scope is made before the region opens (so it times), and ends after it closes.
Region::Region(int op) : scope_(op, g_phase), opened_(!g_region) { g_region = true; }
Region::~Region() {
  if (opened_) g_region = false;
}

}  // namespace attnres::prof
