// A weighted sum of sources with one scalar weight per source, and its backward.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dispatch.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

ATTNRES_KERNEL
void scalar_mix_forward(float* out, const float* const* src, const float* w, int64_t S, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < n; k++) {
    float acc = 0.0f;
    for (int64_t i = 0; i < S; i++) acc += w[i] * src[i][k];
    out[k] = acc;
  }
}

ATTNRES_KERNEL
void scalar_mix_backward(float* const* dsrc, double* dw, const float* dout, const float* const* src,
                         const float* w, int64_t S, int64_t n) {
  const int nthr = omp_get_max_threads();
  std::vector<double> part(static_cast<size_t>(nthr) * S, 0.0);
#pragma omp parallel num_threads(nthr)
  {
    double* my = part.data() + static_cast<int64_t>(omp_get_thread_num()) * S;
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n; k++) {
      const float g = dout[k];
      for (int64_t i = 0; i < S; i++) {
        my[i] += static_cast<double>(g) * src[i][k];
        if (dsrc[i]) dsrc[i][k] += w[i] * g;
      }
    }
  }
  for (int t = 0; t < nthr; t++) {
    for (int64_t i = 0; i < S; i++) dw[i] += part[static_cast<int64_t>(t) * S + i];
  }
}

void softmax_small(float* w, const float* z, int64_t S) {
  if (S > 0) row::softmax_small(w, z, S);
}

void softmax_small_backward(float* dz, const float* a, const float* da, int64_t S) {
  row::softmax_small_backward(dz, a, da, S);
}

}  // namespace attnres::ops
