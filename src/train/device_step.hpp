// A training step on a device backend that never waits for the host between its forward and its
// update: the loss is summed, the gradient norm taken, the clip factor and the skip verdict
// (non-finite loss or norm) decided, and AdamW applied, all on the device from the step scalars
// (core/step_scalars.hpp); the host reads them back once, after the update. Optionally the
// forward+backward and the update are captured once as CUDA graphs (Backend::begin_capture) and
// replayed every later step: one launch each instead of hundreds.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "attnres/backend.hpp"

namespace attnres {

class AdamW;
class Captured;
class Model;

class DeviceStep {
 public:
  // max_norm: the clip threshold (0: none); grad_scale multiplies the summed gradients before
  // the norm (1 / the micro-batches averaged); graphs: capture and replay. loss_check: a
  // non-finite loss skips the update too; with several ranks pass false, so that every rank
  // decides from the same summed gradients alone (a non-finite loss makes them non-finite).
  DeviceStep(Model& model, AdamW& opt, double max_norm, float grad_scale, bool graphs,
             bool loss_check = true);
  ~DeviceStep();

  // Zero gradients and loss; then micro() for each micro-batch; then finish().
  void begin();
  void micro(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T);
  struct Result {
    double loss_sum = 0.0;  // the micro-batches' mean losses, summed
    double norm = 0.0;      // the gradients' norm before clipping
    bool ok = true;         // false: the update was skipped (non-finite loss or norm)
  };
  Result finish(double lr);

  // Graph counts so far, and why graphs were turned off (empty while they are on or unused).
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }
  const std::string& off_reason() const { return off_reason_; }

 private:
  struct Slot {
    std::unique_ptr<Captured> graph;
    uint64_t epoch = 0;    // the backend's memory epoch the graph was captured at
    bool warm = false;     // ran once uncaptured since the last capture failure or change
    int64_t B = 0, T = 0;  // the batch shape it was captured for (forward+backward)
    int failures = 0;      // consecutive capture failures
  };
  template <class F>
  void run(Slot& s, F&& work);
  void update();

  Model& model_;
  AdamW& opt_;
  Backend& be_;
  float grad_scale_;
  bool graphs_;
  DevBuf<float> scalars_;  // step::kCount floats in the backend's memory
  float host_[32] = {};
  Slot fb_, up_;
  int64_t captures_ = 0, replays_ = 0;
  std::string off_reason_;
};

}  // namespace attnres
