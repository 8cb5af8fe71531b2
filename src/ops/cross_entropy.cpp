// Fused log-softmax + cross-entropy over the vocabulary.
#include <algorithm>
#include <cmath>

#include "core/dispatch.hpp"
#include "core/parallel.hpp"
#include "core/vmath.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

ATTNRES_KERNEL
double cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                             int64_t N, int64_t V) {
  const double total = deterministic_sum(N, [&](int64_t n) {
    const float* z = logits + n * V;
    float mx = z[0];
    for (int64_t v = 1; v < V; v++) mx = std::max(mx, z[v]);
    double sum = 0.0;  // double: V can be large and the loss is what we report
    for (int64_t v = 0; v < V; v++) sum += std::exp(static_cast<double>(z[v] - mx));
    const double l = static_cast<double>(mx) + std::log(sum);
    if (lse) lse[n] = static_cast<float>(l);
    const double loss = l - z[targets[n]];
    if (losses) losses[n] = static_cast<float>(loss);
    return loss;
  });
  return N > 0 ? total / static_cast<double>(N) : 0.0;
}

ATTNRES_KERNEL
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, int64_t N, int64_t V, float dloss) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const float* z = logits + n * V;
    float* dz = dlogits + n * V;
    const float l = lse[n];
#pragma omp simd
    for (int64_t v = 0; v < V; v++) dz[v] = vexpf(z[v] - l) * dloss;
    dz[targets[n]] -= dloss;
  }
}

}  // namespace attnres::ops
