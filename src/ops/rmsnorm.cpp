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
    const float r = row::rmsnorm(out + n * C, inp + n * C, g, C, eps);
    if (rstd) rstd[n] = r;
  }
}

// Each row's arithmetic: row_math.hpp (shared with the CUDA kernels).
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
      row::rmsnorm_backward<row::Sum::vectorised>(dinp + n * C, my, dout + n * C, inp + n * C, g,
                                                  rstd[n], C);
    }
  }
  for (int t = 0; t < nthr; t++) {
    const float* p = part.data() + static_cast<int64_t>(t) * C;
    for (int64_t c = 0; c < C; c++) dg[c] += p[c];
  }
}

}  // namespace attnres::ops
