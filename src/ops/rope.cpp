// Rotary position embedding, rotate-half layout (GPT-NeoX / HF Llama): dimension i pairs with
// i + hd/2, both rotated by angle p * theta^(-2i/hd).
#include <cmath>

#include "core/dispatch.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

void rope_table(float* cos_t, float* sin_t, int64_t T_max, int64_t hd, double theta) {
  const int64_t half = hd / 2;
  for (int64_t p = 0; p < T_max; p++) {
    for (int64_t i = 0; i < half; i++) {
      // Computed in double so long positions keep their accuracy; matches torch's fp32 table to
      // rounding.
      double freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
      double a = static_cast<double>(p) * freq;
      cos_t[p * half + i] = static_cast<float>(std::cos(a));
      sin_t[p * half + i] = static_cast<float>(std::sin(a));
    }
  }
}

// sign = +1 rotates by +angle (forward), -1 by -angle (backward: R^T = R(-angle)).
static void rope_apply(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                       int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0, float sign) {
  const int64_t half = hd / 2;
#pragma omp parallel for collapse(2) schedule(static) if (B * T > 8)
  for (int64_t b = 0; b < B; b++) {
    for (int64_t t = 0; t < T; t++) {
      const float* c = cos_t + (pos0 + t) * half;
      const float* s = sin_t + (pos0 + t) * half;
      float* row = x + (b * T + t) * ld;
      for (int64_t h = 0; h < n_heads; h++) {
        float* v = row + h * hd;
        for (int64_t i = 0; i < half; i++) {
          float x1 = v[i], x2 = v[i + half];
          float sn = sign * s[i];
          v[i] = x1 * c[i] - x2 * sn;
          v[i + half] = x2 * c[i] + x1 * sn;
        }
      }
    }
  }
}

ATTNRES_KERNEL
void rope_forward(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                  int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) {
  rope_apply(x, cos_t, sin_t, B, T, n_heads, hd, ld, pos0, 1.0f);
}

ATTNRES_KERNEL
void rope_backward(float* dx, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                   int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) {
  rope_apply(dx, cos_t, sin_t, B, T, n_heads, hd, ld, pos0, -1.0f);
}

}  // namespace attnres::ops
