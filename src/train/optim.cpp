// AdamW, gradient clipping and learning-rate schedules (see attnres/optim.hpp).
#include "attnres/optim.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "attnres/error.hpp"
#include "backend/backend.hpp"
#include "core/step_scalars.hpp"
#include "ops/ops.hpp"

namespace attnres {

const char* to_string(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::wsd:
      return "wsd";
    case ScheduleKind::constant:
      return "constant";
    case ScheduleKind::cosine:
      break;
  }
  return "cosine";
}

ScheduleKind parse_schedule_kind(const std::string& s) {
  for (ScheduleKind k : {ScheduleKind::cosine, ScheduleKind::wsd, ScheduleKind::constant}) {
    if (s == to_string(k)) return k;
  }
  throw Error("unknown lr schedule '" + s + "'; use cosine, wsd or constant");
}

void ScheduleConfig::validate() const {
  // (the options are named: "min lr ratio must be ..." did not say which flag; 17th pass)
  check(warmup_steps >= 0,
        "the warm-up (--warmup) must be >= 0 steps, got " + std::to_string(warmup_steps));
  check(total_steps >= 1, "the steps (--steps) must be >= 1");
  check(min_lr_ratio >= 0 && min_lr_ratio <= 1,
        "the final lr / peak lr (--min-lr-ratio) must be in [0, 1], got " +
            std::to_string(min_lr_ratio));
  check(decay_fraction > 0 && decay_fraction <= 1,
        "the wsd schedule's decaying fraction of the steps (--decay-fraction) must be in (0, 1], "
        "got " +
            std::to_string(decay_fraction));
}

double lr_at(const ScheduleConfig& s, double base_lr, int64_t step) {
  if (step < s.warmup_steps) {
    return base_lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  const double lr_min = base_lr * s.min_lr_ratio;
  if (s.kind == ScheduleKind::constant) return base_lr;
  if (s.kind == ScheduleKind::wsd) {
    const int64_t decay_steps =
        std::max<int64_t>(1, static_cast<int64_t>(std::llround(s.decay_fraction * s.total_steps)));
    const int64_t decay_start = std::max(s.warmup_steps, s.total_steps - decay_steps);
    if (step < decay_start) return base_lr;
    double p = static_cast<double>(step - decay_start) /
               static_cast<double>(std::max<int64_t>(1, s.total_steps - decay_start));
    p = std::min(p, 1.0);
    return base_lr + (lr_min - base_lr) * p;
  }
  double p = static_cast<double>(step - s.warmup_steps) /
             static_cast<double>(std::max<int64_t>(1, s.total_steps - s.warmup_steps));
  p = std::min(p, 1.0);
  return lr_min + 0.5 * (base_lr - lr_min) * (1.0 + std::cos(M_PI * p));
}

// (the squares are all positive: the float chunk sums err by ~1e-7 relative)
double grad_norm(const float* grads, int64_t n) { return std::sqrt(ops::sum_squares(grads, n)); }

float clip_scale(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0f;
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

double clip_grad_norm(float* grads, int64_t n, double max_norm) {
  const double norm = grad_norm(grads, n);
  const float c = clip_scale(norm, max_norm);
  if (c != 1.0f) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) grads[i] *= c;
  }
  return norm;
}

AdamW::AdamW(const ParamLayout& layout, AdamWConfig cfg, Backend* be)
    : AdamW(layout, cfg, 0, layout.total(), be) {}

AdamW::AdamW(const ParamLayout& layout, AdamWConfig cfg, int64_t begin, int64_t end, Backend* be)
    : layout_(layout), cfg_(cfg), begin_(begin), end_(end), be_(be) {
  check(0 <= begin && begin <= end && end <= layout.total(),
        "internal: optimizer shard [" + std::to_string(begin) + ", " + std::to_string(end) +
            ") outside the " + std::to_string(layout.total()) + " parameters");
  try {
    m_.on(be).assign_zero(static_cast<size_t>(end - begin));
    v_.on(be).assign_zero(static_cast<size_t>(end - begin));
  } catch (const std::bad_alloc&) {
    throw out_of_memory("AdamW's two moments of " + std::to_string(end - begin) + " parameters",
                        8.0 * static_cast<double>(end - begin),
                        "lower --d-model, --n-layer or --vocab-size (or shard them over several "
                        "ranks with --zero1)");
  }
}

void AdamW::step(float* params, const float* grads, double lr, float grad_scale, double router_lr) {
  t_ += 1;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(cfg_.beta2, static_cast<double>(t_)));
  auto factors = [&](double rate) {
    return ops::AdamStep{static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2),
                         static_cast<float>(rate / bc1), static_cast<float>(1.0 / bc2_sqrt),
                         static_cast<float>(cfg_.eps),   grad_scale};
  };
  const ops::AdamStep k = factors(lr), kr = factors(router_lr >= 0 ? router_lr : lr);
  const double rlr = router_lr >= 0 ? router_lr : lr;
  const auto& entries = layout_.entries();
  // The part of entry i inside the owned range (all of it unless sharded), its factors, decay.
  auto part = [&](size_t i, int64_t& lo, int64_t& hi, const ops::AdamStep*& f, float& decay) {
    const ParamEntry& e = entries[i];
    lo = std::max(e.offset, begin_);
    hi = std::min(e.offset + e.numel, end_);
    const bool router = i >= first_router_;
    f = router ? &kr : &k;
    decay = e.decay ? static_cast<float>(1.0 - (router ? rlr : lr) * cfg_.weight_decay) : 1.0f;
  };
  if (be_ && !be_->is_cpu()) {  // one update per tensor on the device
    for (size_t i = 0; i < entries.size(); i++) {
      int64_t lo, hi;
      const ops::AdamStep* f;
      float decay;
      part(i, lo, hi, f, decay);
      if (lo >= hi) continue;
      be_->adamw_update(params + lo, grads + lo, m_.data() + (lo - begin_),
                        v_.data() + (lo - begin_), hi - lo, decay, *f);
    }
    return;
  }
  // One parallel region for all tensors, each split in static chunks with no barrier between.
#pragma omp parallel
  for (size_t i = 0; i < entries.size(); i++) {
    int64_t lo, hi;
    const ops::AdamStep* f;
    float decay;
    part(i, lo, hi, f, decay);
    if (lo >= hi) continue;
    ops::adamw_update_in_parallel(params + lo, grads + lo, m_.data() + (lo - begin_),
                                  v_.data() + (lo - begin_), hi - lo, decay, *f);
  }
}

void AdamW::write_factors(double lr, float* s) {
  t_ += 1;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(cfg_.beta2, static_cast<double>(t_)));
  // (the same floats as step()'s ops::AdamStep and decay)
  s[step::kBeta1] = static_cast<float>(cfg_.beta1);
  s[step::kBeta2] = static_cast<float>(cfg_.beta2);
  s[step::kStepSize] = static_cast<float>(lr / bc1);
  s[step::kInvBc2Sqrt] = static_cast<float>(1.0 / bc2_sqrt);
  s[step::kEps] = static_cast<float>(cfg_.eps);
  s[step::kDecay] = static_cast<float>(1.0 - lr * cfg_.weight_decay);
}

void AdamW::step_scaled(float* params, const float* grads, const float* dev_s) {
  check(be_ && !be_->is_cpu(), "internal: AdamW::step_scaled runs on a device backend");
  for (const ParamEntry& e : layout_.entries()) {
    const int64_t lo = std::max(e.offset, begin_), hi = std::min(e.offset + e.numel, end_);
    if (lo >= hi) continue;
    be_->adamw_update_scaled(params + lo, grads + lo, m_.data() + (lo - begin_),
                             v_.data() + (lo - begin_), hi - lo, e.decay, dev_s);
  }
}

}  // namespace attnres
