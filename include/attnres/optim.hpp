// attnres/optim.hpp — AdamW, global gradient-norm clipping and learning-rate schedules.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnres/backend.hpp"
#include "attnres/params.hpp"

namespace attnres {

struct AdamWConfig {
  double lr = 1e-3;  // peak learning rate
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // decoupled; only on tensors whose ParamEntry::decay is set
};

// Learning-rate schedule: linear warm-up over warmup_steps, then
//   cosine:   half-cosine from lr down to lr * min_lr_ratio at total_steps;
//   wsd:      constant ("stable"), then linear decay to lr * min_lr_ratio over the last
//             decay_fraction of total_steps (warmup-stable-decay);
//   constant: lr after warm-up.
enum class ScheduleKind { cosine, wsd, constant };
// The name as the CLI and train_config.json spell it, and the parse back (Error naming the
// choices for anything else).
const char* to_string(ScheduleKind k);
ScheduleKind parse_schedule_kind(const std::string& s);

struct ScheduleConfig {
  ScheduleKind kind = ScheduleKind::cosine;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.1;
  double decay_fraction = 0.2;
  void validate() const;  // throws Error
};

// Learning rate for 0-based step `step`.
double lr_at(const ScheduleConfig& s, double base_lr, int64_t step);

// Global L2 norm of grads[0..n) (deterministic for a given thread count).
double grad_norm(const float* grads, int64_t n);
// torch's clip_grad_norm_ coefficient: max_norm / (norm + 1e-6) when that is < 1, else 1;
// max_norm <= 0 disables (1).
float clip_scale(double norm, double max_norm);
// Scales grads[0..n) by clip_scale(grad_norm(...), max_norm). Returns the norm before clipping.
// (The trainer instead passes clip_scale to AdamW::step, saving a pass over the gradients.)
double clip_grad_norm(float* grads, int64_t n, double max_norm);

// Decoupled-weight-decay Adam with torch.optim.AdamW's exact update:
//   p *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p -= lr / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps)
//
// A sharded AdamW (ZeRO stage 1) owns the moments of the flat parameter range [begin, end) only,
// and its step() updates only those parameters, with exactly the arithmetic of the full one.
// The moments live on backend `be` (null: the CPU), where step() runs: params and grads must be
// that backend's memory (Model::params() of a model on it).
class AdamW {
 public:
  AdamW(const ParamLayout& layout, AdamWConfig cfg, Backend* be = nullptr);
  // The shard [begin, end) of the flat parameters (0 <= begin <= end <= layout.total()).
  AdamW(const ParamLayout& layout, AdamWConfig cfg, int64_t begin, int64_t end,
        Backend* be = nullptr);
  // One update with learning rate lr on the gradients grads * grad_scale (the scale is applied
  // as one float multiply per element, exactly like scaling the gradients first); increments
  // step().
  // Tensors from layout entry `first_router_entry()` on (the residual mode's own: AttnRes
  // queries and key gains, ...) take learning rate router_lr instead when it is >= 0.
  void step(float* params, const float* grads, double lr, float grad_scale = 1.0f,
            double router_lr = -1.0);
  // Where the residual mode's tensors begin in the layout (Model::core_entries()); the default
  // (every entry a core one) gives all tensors the same learning rate.
  void set_first_router_entry(size_t k) { first_router_ = k; }
  size_t first_router_entry() const { return first_router_; }
  // The same update in two halves for a step that never waits for the host (on a device;
  // src/train/device_step.cpp): write_factors counts the step and writes its factors for
  // learning rate lr into the step scalars s (a host copy, core/step_scalars.hpp: kBeta1 ..
  // kDecay); step_scaled then updates with the device copy dev_s (clip factor, skip verdict
  // and all). A step whose verdict was "skip" is taken back with unstep().
  void write_factors(double lr, float* s);
  void step_scaled(float* params, const float* grads, const float* dev_s);
  void unstep() { t_ -= 1; }
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  // Moments of the owned range, in the backend's memory: element i belongs to flat parameter
  // begin() + i.
  DevBuf<float>& m() { return m_; }
  DevBuf<float>& v() { return v_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  bool sharded() const { return begin_ != 0 || end_ != layout_.total(); }
  const AdamWConfig& config() const { return cfg_; }

 private:
  const ParamLayout& layout_;
  AdamWConfig cfg_;
  int64_t begin_ = 0, end_ = 0;
  Backend* be_ = nullptr;
  DevBuf<float> m_, v_;
  int64_t t_ = 0;
  size_t first_router_ = static_cast<size_t>(-1);
};

}  // namespace attnres
