// SwiGLU gate: out = silu(h1) * h3 with silu(x) = x * sigmoid(x).
#include <cmath>

#include "core/dispatch.hpp"
#include "core/vmath.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

ATTNRES_KERNEL
void swiglu_forward(float* out, const float* h13, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static) if (N > 8)  // decoding: one row, no team
  for (int64_t n = 0; n < N; n++) {
    const float* h1 = h13 + n * 2 * F;
    const float* h3 = h1 + F;
    float* o = out + n * F;
#pragma omp simd
    for (int64_t f = 0; f < F; f++) {
      o[f] = row::swiglu(h1[f], h3[f], 1.0f / (1.0f + vexpf(-h1[f])));
    }
  }
}

ATTNRES_KERNEL
void swiglu_backward(float* dh13, const float* dout, const float* h13, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const float* h1 = h13 + n * 2 * F;
    const float* h3 = h1 + F;
    const float* d = dout + n * F;
    float* d1 = dh13 + n * 2 * F;
    float* d3 = d1 + F;
#pragma omp simd
    for (int64_t f = 0; f < F; f++) {
      row::swiglu_backward(&d1[f], &d3[f], d[f], h1[f], h3[f], 1.0f / (1.0f + vexpf(-h1[f])));
    }
  }
}

}  // namespace attnres::ops
