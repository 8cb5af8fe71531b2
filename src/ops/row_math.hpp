// The arithmetic of one row (or one element) of the row ops, written once: the CPU ops (src/ops)
// call these inside their loops over rows and threads, and the CUDA backend's functors
// (src/cuda/row_kernels.hpp: the kernels cuda-host runs and the fast GPU kernels are tested
// against) call them for their row or element. No threads, no allocation, no loops over rows.
// Same conventions as ops.hpp: shapes in comments, backward ACCUMULATES (+=).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.hpp"

namespace attnres::ops {

// One AdamW step's factors (attnres/optim.hpp): step_size = lr / (1 - b1^t), inv_bc2_sqrt =
// 1 / sqrt(1 - b2^t); the gradient is g * grad_scale (the clip factor).
struct AdamStep {
  float b1, b2, step_size, inv_bc2_sqrt, eps, grad_scale;
};

namespace row {

ATTNRES_HD inline float sigmoid(float a) { return 1.0f / (1.0f + ::expf(-a)); }

// r = rsqrt(ss / C + eps) for a row of C values whose squares sum to ss. A row whose squares
// overflow float (ss = inf) has no representable scale: NaN, not 0, which would make the row 0 and
// the logits uniform (a loss of exactly ln V reported as a result); NaN reaches the loss, and every
// check of it (a skipped step, eval's and generate's refusals).
ATTNRES_HD inline float rms_scale(float ss, int64_t C, float eps) {
  const float m = ss / static_cast<float>(C) + eps;
  return m <= 3.40282347e38f ? 1.0f / ::sqrtf(m) : ::nanf("");
}

// ---- RMSNorm (SPEC 1) ----  y (C) = x (C) * r * g (C), r = rsqrt(mean(x^2) + eps); returns r.
ATTNRES_HD inline float rmsnorm(float* y, const float* x, const float* g, int64_t C, float eps) {
  float ss = 0.0f;
  for (int64_t c = 0; c < C; c++) ss += x[c] * x[c];
  const float r = rms_scale(ss, C, eps);
  for (int64_t c = 0; c < C; c++) y[c] = x[c] * r * g[c];
  return r;
}
// How a row's sum runs: in index order (the same bits wherever the row lives in memory: the CUDA
// functors, which cuda-host runs to give identical results for identical inputs), or vectorised
// by the host compiler (the CPU ops: faster, the order of the sums, and so their rounding, may
// depend on the row's alignment).
enum class Sum { ordered, vectorised };

// With xhat = x r: dx (C) += r g dy - xhat r mean(g dy xhat); dg (C), if not null, += dy xhat
// (a caller that reduces the gain's gradient over rows itself passes null).
template <Sum kSum = Sum::ordered>
ATTNRES_HD inline void rmsnorm_backward(float* dx, float* dg, const float* dy, const float* x,
                                        const float* g, float r, int64_t C) {
  float dot = 0.0f;
  if constexpr (kSum == Sum::vectorised) {  // NOLINT(bugprone-branch-clone): (the pragma)
    ATTNRES_SIMD_SUM(dot)
    for (int64_t c = 0; c < C; c++) dot += g[c] * dy[c] * x[c];
  } else {
    for (int64_t c = 0; c < C; c++) dot += g[c] * dy[c] * x[c];
  }
  const float k = r * r * r * dot / static_cast<float>(C);  // r mean(g dy xhat), folded
  if (dg) {  // NOLINT(bugprone-branch-clone): clang-tidy 14 compares the pragmas only
    ATTNRES_SIMD
    for (int64_t c = 0; c < C; c++) {
      dx[c] += r * g[c] * dy[c] - k * x[c];
      dg[c] += dy[c] * x[c] * r;
    }
  } else {
    ATTNRES_SIMD
    for (int64_t c = 0; c < C; c++) dx[c] += r * g[c] * dy[c] - k * x[c];
  }
}

// ---- SwiGLU ----  one element: out = silu(a) b, with s = sigmoid(a) given (the CPU computes it
// with its vectorised exp); d silu(a)/da = s (1 + a (1 - s)).
ATTNRES_HD inline float swiglu(float a, float b, float s) { return a * s * b; }
ATTNRES_HD inline void swiglu_backward(float* da, float* db, float dy, float a, float b, float s) {
  *da += dy * b * s * (1.0f + a * (1.0f - s));
  *db += dy * a * s;
}

// ---- the small softmax ----  w (S) = softmax(z (S)) in double (S >= 1: the static residual's
// mixing weights); backward dz (S) += a_i (da_i - sum_j a_j da_j).
ATTNRES_HD inline void softmax_small(float* w, const float* z, int64_t S) {
  double mx = z[0];
  for (int64_t i = 1; i < S; i++) mx = z[i] > mx ? z[i] : mx;
  double sum = 0.0;
  for (int64_t i = 0; i < S; i++) sum += ::exp(static_cast<double>(z[i]) - mx);
  for (int64_t i = 0; i < S; i++) w[i] = static_cast<float>(::exp(z[i] - mx) / sum);
}
ATTNRES_HD inline void softmax_small_backward(float* dz, const float* a, const float* da,
                                              int64_t S) {
  double dot = 0.0;
  for (int64_t i = 0; i < S; i++) dot += static_cast<double>(a[i]) * da[i];
  for (int64_t i = 0; i < S; i++) dz[i] += static_cast<float>(a[i] * (da[i] - dot));
}

// ---- the AttnRes depth gate (SPEC 2) ----  for one source's score s at one (token, head):
// its weight a: exp(s - lse) under the softmax over the sources (lse their log-sum-exp), or
// sigmoid(s); and d loss / d s from a, g = dx . v and (softmax) D = dx . x = sum_j a_j (dx . v_j).
ATTNRES_HD inline float depth_weight(float s, float lse, bool softmax) {
  return softmax ? ::expf(s - lse) : sigmoid(s);
}
ATTNRES_HD inline float depth_score_grad(float a, float g, float D, bool softmax) {
  return softmax ? a * (g - D) : a * (1.0f - a) * g;
}

// ---- AdamW ----  torch.optim.AdamW's update of one element p with gradient g and moments m, v;
// decay = 1 - lr wd (or 1: no weight decay).
ATTNRES_HD inline void adamw(float* p, float g, float* m, float* v, float decay,
                             const AdamStep& k) {
  const float gi = k.grad_scale == 1.0f ? g : g * k.grad_scale;
  const float mi = k.b1 * *m + (1.0f - k.b1) * gi;
  const float vi = k.b2 * *v + (1.0f - k.b2) * gi * gi;
  *m = mi;
  *v = vi;
  *p = *p * decay - k.step_size * mi / (::sqrtf(vi) * k.inv_bc2_sqrt + k.eps);
}

}  // namespace row
}  // namespace attnres::ops
