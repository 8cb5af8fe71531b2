// AdamW, gradient clipping and learning-rate schedules (see attnres/optim.hpp).
#include "attnres/optim.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "attnres/error.hpp"
#include "core/parallel.hpp"

namespace attnres {

void ScheduleConfig::validate() const {
  check(kind == "cosine" || kind == "wsd" || kind == "constant",
        "unknown lr schedule '" + kind + "'; use cosine, wsd or constant");
  check(warmup_steps >= 0, "warmup steps must be >= 0");
  check(total_steps >= 1, "total steps must be >= 1");
  check(min_lr_ratio >= 0 && min_lr_ratio <= 1, "min lr ratio must be in [0, 1]");
  check(decay_fraction > 0 && decay_fraction <= 1, "wsd decay fraction must be in (0, 1]");
}

double lr_at(const ScheduleConfig& s, double base_lr, int64_t step) {
  if (step < s.warmup_steps) {
    return base_lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  const double lr_min = base_lr * s.min_lr_ratio;
  if (s.kind == "constant") return base_lr;
  if (s.kind == "wsd") {
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

double clip_grad_norm(float* grads, int64_t n, double max_norm) {
  const double ss =
      deterministic_sum(n, [&](int64_t i) { return static_cast<double>(grads[i]) * grads[i]; });
  const double norm = std::sqrt(ss);
  if (max_norm > 0) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) {
      const float c = static_cast<float>(coef);
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; i++) grads[i] *= c;
    }
  }
  return norm;
}

AdamW::AdamW(const ParamLayout& layout, AdamWConfig cfg)
    : AdamW(layout, cfg, 0, layout.total()) {}

AdamW::AdamW(const ParamLayout& layout, AdamWConfig cfg, int64_t begin, int64_t end)
    : layout_(layout), cfg_(cfg), begin_(begin), end_(end) {
  check(0 <= begin && begin <= end && end <= layout.total(),
        "internal: optimizer shard [" + std::to_string(begin) + ", " + std::to_string(end) +
            ") outside the " + std::to_string(layout.total()) + " parameters");
  m_.assign(static_cast<size_t>(end - begin), 0.0f);
  v_.assign(static_cast<size_t>(end - begin), 0.0f);
}

void AdamW::step(float* params, const float* grads, double lr) {
  t_ += 1;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(cfg_.beta2, static_cast<double>(t_)));
  const float b1 = static_cast<float>(cfg_.beta1), b2 = static_cast<float>(cfg_.beta2);
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
  const float eps = static_cast<float>(cfg_.eps);
  for (const ParamEntry& e : layout_.entries()) {
    // The part of this tensor inside the owned range (all of it unless sharded).
    const int64_t lo = std::max(e.offset, begin_), hi = std::min(e.offset + e.numel, end_);
    if (lo >= hi) continue;
    const float decay = e.decay ? static_cast<float>(1.0 - lr * cfg_.weight_decay) : 1.0f;
    float* p = params + lo;
    const float* g = grads + lo;
    float* m = m_.data() + (lo - begin_);
    float* v = v_.data() + (lo - begin_);
    const int64_t n = hi - lo;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) {
      p[i] *= decay;
      m[i] = b1 * m[i] + (1.0f - b1) * g[i];
      v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
      p[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_bc2_sqrt + eps);
    }
  }
}

}  // namespace attnres
