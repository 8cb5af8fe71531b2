// AdamW's elementwise update (ops.hpp); the optimizer (src/train/optim.cpp) drives it.
#include <cmath>

#include "core/dispatch.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

// Memory-bound: 28 bytes per parameter.
ATTNRES_KERNEL
void adamw_update_in_parallel(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                              const AdamStep& k) {
#pragma omp for simd schedule(static) nowait
  for (int64_t i = 0; i < n; i++) {
    const float gi = k.grad_scale == 1.0f ? g[i] : g[i] * k.grad_scale;
    const float mi = k.b1 * m[i] + (1.0f - k.b1) * gi;
    const float vi = k.b2 * v[i] + (1.0f - k.b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float pd = p[i] * decay;
    p[i] = pd - k.step_size * mi / (std::sqrt(vi) * k.inv_bc2_sqrt + k.eps);
  }
}

}  // namespace attnres::ops
