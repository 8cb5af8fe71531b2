// AdamW's elementwise update and the gradients' sum of squares (ops.hpp); the optimizer and
// gradient clipping (src/train/optim.cpp) drive them.
#include <algorithm>
#include <cmath>

#include "core/dispatch.hpp"
#include "core/parallel.hpp"
#include "core/simd.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

double sum_squares(const float* x, int64_t n) {
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  return deterministic_sum(chunks, [&](int64_t c) {
    const int64_t c0 = c * kChunk, len = std::min(kChunk, n - c0);
    return static_cast<double>(simd::dot(x + c0, x + c0, len));
  });
}

// Memory-bound: 28 bytes per parameter.
ATTNRES_KERNEL
void adamw_update_in_parallel(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                              const AdamStep& k) {
#pragma omp for simd schedule(static) nowait
  for (int64_t i = 0; i < n; i++) row::adamw(&p[i], g[i], &m[i], &v[i], decay, k);
}

}  // namespace attnres::ops
