// The device training step (device_step.hpp).
#include "train/device_step.hpp"

#include <utility>

#include "attnres/error.hpp"
#include "attnres/model.hpp"
#include "attnres/optim.hpp"
#include "backend/backend.hpp"
#include "core/step_scalars.hpp"

namespace attnres {

static_assert(step::kCount <= 32, "DeviceStep::host_ holds the step scalars");

DeviceStep::DeviceStep(Model& model, AdamW& opt, double max_norm, float grad_scale, bool graphs,
                       bool loss_check)
    : model_(model), opt_(opt), be_(model.backend()), grad_scale_(grad_scale), graphs_(graphs) {
  check(!be_.is_cpu(), "internal: DeviceStep runs on a device backend");
  check(!graphs || be_.can_capture(),
        "device " + be_.name() + " cannot capture steps as graphs; drop --cuda-graphs");
  scalars_.on(&be_).assign_zero(step::kCount);
  host_[step::kMaxNorm] = static_cast<float>(max_norm);
  host_[step::kLossCheck] = loss_check ? 1.0f : 0.0f;
  // Sizes the norm's scratch now (the result is discarded: begin() zeroes it), so that the first
  // update does not grow the backend's memory and with it invalidate a captured forward.
  be_.grad_norm_clip(scalars_.data(), model_.grads(), model_.layout().total());
}

DeviceStep::~DeviceStep() = default;

// Runs `work` (ops only: no uploads, downloads or allocations once warm) as a replay of its
// captured graph. Uncaptured: when graphs are off; the first time (it allocates what it needs);
// after a failed capture. The graph is captured again when the backend's memory changed since
// (an evaluation, say, grew a buffer: the graph's pointers may be stale), and graphs are turned
// off for good after two failed captures in a row (a residual mode whose step reads values back
// on the host, for one).
template <class F>
void DeviceStep::run(Slot& s, F&& work) {
  if (!graphs_) return work();
  if (s.graph && be_.memory_epoch() != s.epoch) {
    s.graph.reset();
    s.warm = false;  // (run once uncaptured first: it may need new memory)
  }
  if (!s.graph) {
    if (!s.warm) {
      work();
      s.warm = true;
      return;
    }
    try {
      be_.begin_capture();
      work();
      s.graph = be_.end_capture();
      s.epoch = be_.memory_epoch();
      s.failures = 0;
      captures_++;
    } catch (const Error& e) {
      be_.abort_capture();
      s.warm = false;
      if (++s.failures >= 2) {
        graphs_ = false;
        off_reason_ = e.what();
        fb_.graph.reset();
        up_.graph.reset();
      }
      work();  // nothing of it ran while capturing
      return;
    } catch (...) {
      be_.abort_capture();
      throw;
    }
  }
  s.graph->run();
  replays_++;
}

void DeviceStep::begin() {
  model_.zero_grad();
  be_.zero(scalars_.data(), sizeof(float) * (step::kOk + 1));  // loss, norm, clip, verdict
}

void DeviceStep::micro(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T) {
  model_.stage_batch(inputs, targets, B, T);
  if (fb_.B != B || fb_.T != T) {  // a captured forward is for one batch shape
    fb_.graph.reset();
    fb_.warm = false;
    fb_.B = B, fb_.T = T;
  }
  run(fb_, [&] {
    model_.forward_staged(scalars_.data());
    model_.backward();
  });
}

void DeviceStep::update() {
  const int64_t n = model_.layout().total();
  if (grad_scale_ != 1.0f) be_.scale(model_.grads(), grad_scale_, n);
  be_.grad_norm_clip(scalars_.data(), model_.grads(), n);
  opt_.step_scaled(model_.params(), model_.grads(), scalars_.data());
}

DeviceStep::Result DeviceStep::finish(double lr) {
  opt_.write_factors(lr, host_);
  be_.upload(scalars_.data() + step::kMaxNorm, host_ + step::kMaxNorm,
             sizeof(float) * (step::kCount - step::kMaxNorm));
  run(up_, [&] { update(); });
  be_.download(host_, scalars_.data(), sizeof(float) * (step::kOk + 1));  // waits for the step
  Result r;
  r.loss_sum = host_[step::kLoss];
  r.norm = host_[step::kNorm];
  r.ok = host_[step::kOk] != 0.0f;
  if (!r.ok) opt_.unstep();
  return r;
}

}  // namespace attnres
