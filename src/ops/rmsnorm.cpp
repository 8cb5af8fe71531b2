// RMSNorm (SPEC section 1): y = x * rsqrt(mean(x^2) + eps) * g.
#include <omp.h>

#include <cmath>
#include <vector>

#include "core/dispatch.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

ATTNRES_KERNEL
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* g, int64_t N,
                     int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N > 8)  // decoding: one row, no team
  for (int64_t n = 0; n < N; n++) {
    const float* x = inp + n * C;
    float* y = out + n * C;
    float ss = 0.0f;
    for (int64_t c = 0; c < C; c++) ss += x[c] * x[c];
    float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
    if (rstd) rstd[n] = r;
    for (int64_t c = 0; c < C; c++) y[c] = x[c] * r * g[c];
  }
}

// With xhat = x * r: dx = r * (g*dy - xhat * mean(g*dy * xhat)); dg = sum_n dy * xhat.
ATTNRES_KERNEL
void rmsnorm_backward(float* dinp, float* dg, const float* dout, const float* inp, const float* g,
                      const float* rstd, int64_t N, int64_t C) {
  // dg reduces over rows: each thread sums its own rows into a private row (one pass over the
  // data, cache-friendly), and the partial rows are added in thread order (deterministic).
  const int nthr = omp_get_max_threads();
  std::vector<float> part(static_cast<size_t>(nthr) * C, 0.0f);
#pragma omp parallel num_threads(nthr)
  {
    float* my = part.data() + static_cast<int64_t>(omp_get_thread_num()) * C;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      const float* x = inp + n * C;
      const float* dy = dout + n * C;
      float* dx = dinp + n * C;
      const float r = rstd[n];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < C; c++) dot += g[c] * dy[c] * x[c];
      const float k = dot * r * r / static_cast<float>(C);  // mean(g dy xhat) / r, folded
#pragma omp simd
      for (int64_t c = 0; c < C; c++) {
        dx[c] += r * (g[c] * dy[c] - x[c] * k);
        my[c] += dy[c] * x[c] * r;
      }
    }
  }
  for (int t = 0; t < nthr; t++) {
    const float* p = part.data() + static_cast<int64_t>(t) * C;
    for (int64_t c = 0; c < C; c++) dg[c] += p[c];
  }
}

}  // namespace attnres::ops
