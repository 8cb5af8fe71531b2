// Causal multi-head self-attention with grouped-query heads: query head h reads kv head
// h / (H / Hkv). Scores are scaled by 1/sqrt(hd) (SPEC section 1 / issue contract).
//
// The fast path runs per (batch, head) GEMMs through sgemm in 64-row blocks that skip the masked
// upper triangle, and materialises the (T,T) probability matrix for backward; softmax rows use the
// vectorised max/dot/exp. The reference path is plain loops.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/blas.hpp"
#include "core/dispatch.hpp"
#include "core/parallel.hpp"
#include "core/simd.hpp"
#include "core/vmath.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

// Row blocks of the causal score matrix: block [r0, r1) only needs keys [0, r1), so the GEMMs skip
// (most of) the masked upper triangle: 56% of the full T x T work for T = 512.
constexpr int64_t kRowBlock = 64;

ATTNRES_KERNEL
void attention_forward(float* out, float* att, const float* qkv, const AttnShape& s) {
  const int64_t T = s.T, H = s.H, hd = s.hd, ld = s.ld(), HD = H * hd, grp = H / s.Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  RegionErrors errors;  // sgemm may throw (out of memory)
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < s.B; b++) {
    for (int64_t h = 0; h < H; h++)
      errors.run([&] {
        const float* base = qkv + b * T * ld;
        const float* q = base + h * hd;
        const float* k = base + (H + h / grp) * hd;
        const float* v = base + (H + s.Hkv + h / grp) * hd;
        float* A = att + (b * H + h) * T * T;
        for (int64_t r0 = 0; r0 < T; r0 += kRowBlock) {
          const int64_t r1 = std::min(T, r0 + kRowBlock), M = r1 - r0;
          float* Ab = A + r0 * T;
          // Ab (M, r1) = q[r0:r1] k[0:r1]^T * scale
          sgemm(false, true, M, r1, hd, scale, q + r0 * ld, ld, k, ld, 0.0f, Ab, T);
          for (int64_t i = 0; i < M; i++) {
            float* row = Ab + i * T;
            const int64_t t = r0 + i;
            const float mx = simd::max(row, t + 1);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t u = 0; u <= t; u++) {
              row[u] = vexpf(row[u] - mx);
              sum += row[u];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t u = 0; u <= t; u++) row[u] *= inv;
            // Only this block's GEMM columns [0, r1) are ever read (here and in backward).
            std::fill(row + t + 1, row + r1, 0.0f);
          }
          // out[r0:r1] = Ab (M, r1) v[0:r1]
          sgemm(false, false, M, hd, r1, 1.0f, Ab, T, v, ld, 0.0f, out + (b * T + r0) * HD + h * hd,
                HD);
        }
      });
  }
  errors.rethrow();
}

ATTNRES_KERNEL
void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                        const float* att, const AttnShape& s) {
  const int64_t T = s.T, H = s.H, Hkv = s.Hkv, hd = s.hd, ld = s.ld(), HD = H * hd, grp = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // Parallel over (batch, kv head): the query heads of one group all add into the same dk/dv.
  RegionErrors errors;  // sgemm may throw (out of memory)
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < s.B; b++) {
    for (int64_t j = 0; j < Hkv; j++)
      errors.run([&] {
        const float* base = qkv + b * T * ld;
        float* dbase = dqkv + b * T * ld;
        const float* k = base + (H + j) * hd;
        const float* v = base + (H + Hkv + j) * hd;
        float* dk = dbase + (H + j) * hd;
        float* dv = dbase + (H + Hkv + j) * hd;
        for (int64_t h = j * grp; h < (j + 1) * grp; h++) {
          const float* q = base + h * hd;
          float* dq = dbase + h * hd;
          const float* A = att + (b * H + h) * T * T;
          const float* dO = dout + b * T * HD + h * hd;
          float* dA = scratch + (b * H + h) * T * T;
          for (int64_t r0 = 0; r0 < T; r0 += kRowBlock) {
            const int64_t r1 = std::min(T, r0 + kRowBlock), M = r1 - r0;
            const float* Ab = A + r0 * T;
            float* dAb = dA + r0 * T;
            // dAb (M, r1) = dO[r0:r1] v[0:r1]^T ; dv[0:r1] += Ab^T dO[r0:r1]
            sgemm(false, true, M, r1, hd, 1.0f, dO + r0 * HD, HD, v, ld, 0.0f, dAb, T);
            sgemm(true, false, r1, hd, M, 1.0f, Ab, T, dO + r0 * HD, HD, 1.0f, dv, ld);
            for (int64_t i = 0; i < M; i++) {  // softmax backward; masked entries stay zero
              const float* a = Ab + i * T;
              float* d = dAb + i * T;
              const int64_t t = r0 + i;
              const float dot = simd::dot(a, d, t + 1);
#pragma omp simd
              for (int64_t u = 0; u <= t; u++) d[u] = a[u] * (d[u] - dot) * scale;
              for (int64_t u = t + 1; u < r1; u++) d[u] = 0.0f;
            }
            // dq[r0:r1] += dS k[0:r1] ; dk[0:r1] += dS^T q[r0:r1]
            sgemm(false, false, M, hd, r1, 1.0f, dAb, T, k, ld, 1.0f, dq + r0 * ld, ld);
            sgemm(true, false, r1, hd, M, 1.0f, dAb, T, q + r0 * ld, ld, 1.0f, dk, ld);
          }
        }
      });
  }
  errors.rethrow();
}

void attention_forward_reference(float* out, float* att, const float* qkv, const AttnShape& s) {
  const int64_t T = s.T, H = s.H, hd = s.hd, ld = s.ld(), HD = H * hd, grp = H / s.Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> p(T);
  for (int64_t b = 0; b < s.B; b++) {
    for (int64_t h = 0; h < H; h++) {
      for (int64_t t = 0; t < T; t++) {
        const float* q = qkv + (b * T + t) * ld + h * hd;
        double mx = -1e300;
        for (int64_t u = 0; u <= t; u++) {
          const float* k = qkv + (b * T + u) * ld + (H + h / grp) * hd;
          double dot = 0.0;
          for (int64_t i = 0; i < hd; i++) dot += static_cast<double>(q[i]) * k[i];
          p[u] = dot * scale;
          mx = std::max(mx, p[u]);
        }
        double sum = 0.0;
        for (int64_t u = 0; u <= t; u++) sum += (p[u] = std::exp(p[u] - mx));
        float* A = att + ((b * H + h) * T + t) * T;
        for (int64_t u = 0; u < T; u++) A[u] = u <= t ? static_cast<float>(p[u] / sum) : 0.0f;
        float* o = out + (b * T + t) * HD + h * hd;
        for (int64_t i = 0; i < hd; i++) {
          double acc = 0.0;
          for (int64_t u = 0; u <= t; u++) {
            acc += p[u] / sum * qkv[(b * T + u) * ld + (H + s.Hkv + h / grp) * hd + i];
          }
          o[i] = static_cast<float>(acc);
        }
      }
    }
  }
}

void attention_backward_reference(float* dqkv, const float* dout, const float* qkv,
                                  const float* att, const AttnShape& s) {
  const int64_t T = s.T, H = s.H, hd = s.hd, ld = s.ld(), HD = H * hd, grp = H / s.Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> dA(T);
  for (int64_t b = 0; b < s.B; b++) {
    for (int64_t h = 0; h < H; h++) {
      const int64_t ko = (H + h / grp) * hd, vo = (H + s.Hkv + h / grp) * hd;
      for (int64_t t = 0; t < T; t++) {
        const float* A = att + ((b * H + h) * T + t) * T;
        const float* dO = dout + (b * T + t) * HD + h * hd;
        double dot = 0.0;
        for (int64_t u = 0; u <= t; u++) {
          const float* v = qkv + (b * T + u) * ld + vo;
          float* dv = dqkv + (b * T + u) * ld + vo;
          double d = 0.0;
          for (int64_t i = 0; i < hd; i++) {
            d += static_cast<double>(dO[i]) * v[i];
            dv[i] += A[u] * dO[i];
          }
          dA[u] = d;
          dot += A[u] * d;
        }
        const float* q = qkv + (b * T + t) * ld + h * hd;
        float* dq = dqkv + (b * T + t) * ld + h * hd;
        for (int64_t u = 0; u <= t; u++) {
          const double ds = A[u] * (dA[u] - dot) * scale;
          const float* k = qkv + (b * T + u) * ld + ko;
          float* dk = dqkv + (b * T + u) * ld + ko;
          for (int64_t i = 0; i < hd; i++) {
            dq[i] += static_cast<float>(ds * k[i]);
            dk[i] += static_cast<float>(ds * q[i]);
          }
        }
      }
    }
  }
}

ATTNRES_KERNEL
void attention_decode(float* out, const float* q, const float* kc, const float* vc, int64_t n,
                      int64_t pos0, int64_t H, int64_t Hkv, int64_t hd) {
  const int64_t grp = H / Hkv, kvld = Hkv * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int nthr = omp_get_max_threads();
  std::vector<float> scratch(static_cast<size_t>(nthr * (pos0 + n)));  // made outside the region
#pragma omp parallel num_threads(nthr)
  {
    float* sc = scratch.data() + omp_get_thread_num() * (pos0 + n);
#pragma omp for collapse(2) schedule(static)
    for (int64_t t = 0; t < n; t++) {
      for (int64_t h = 0; h < H; h++) {
        const int64_t P = pos0 + t + 1;  // keys visible to this query
        const float* qh = q + (t * H + h) * hd;
        const int64_t j = h / grp;
        float mx = -INFINITY;
        for (int64_t u = 0; u < P; u++) {
          sc[u] = simd::dot(qh, kc + u * kvld + j * hd, hd) * scale;
          mx = std::max(mx, sc[u]);
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t u = 0; u < P; u++) {
          sc[u] = vexpf(sc[u] - mx);
          sum += sc[u];
        }
        const float inv = 1.0f / sum;
        float* o = out + (t * H + h) * hd;
        for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
        for (int64_t u = 0; u < P; u++) {
          const float w = sc[u] * inv;
          const float* v = vc + u * kvld + j * hd;
#pragma omp simd
          for (int64_t i = 0; i < hd; i++) o[i] += w * v[i];
        }
      }
    }
  }
}

}  // namespace attnres::ops
