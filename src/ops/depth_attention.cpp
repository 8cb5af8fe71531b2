// Depth attention: the AttnRes mix of earlier sublayer outputs (SPEC sections 2-4).
//
// Fused: each token's scores, softmax and weighted sum are computed in one pass over the sources
// with an online softmax (running max m, normaliser l, unnormalised sum acc), so nothing of size
// (sources x tokens x d) is ever materialised. Backward recomputes each score from the source and
// the saved log-sum-exp, and uses sum_j a_j (dx . v_j) = dx . x (x is the forward output), so it
// too is a single pass over the sources.
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "ops/ops.hpp"

namespace attnres::ops {

namespace {

inline float dotf(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < n; c++) s += a[c] * b[c];
  return s;
}

// (a . b, c . b) in one pass over b.
inline void dot2(const float* a, const float* c, const float* b, int64_t n, float* ab, float* cb) {
  float s1 = 0.0f, s2 = 0.0f;
#pragma omp simd reduction(+ : s1, s2)
  for (int64_t i = 0; i < n; i++) {
    s1 += a[i] * b[i];
    s2 += c[i] * b[i];
  }
  *ab = s1;
  *cb = s2;
}

inline float sigmoidf(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// Score of source i at row n, head h: qg . v over the head's slice, times the key's inverse RMS.
inline float score(const DepthSource& s, const float* q, int64_t n, int64_t h, const DepthMix& m) {
  const int64_t dh = m.dh();
  const float dot = dotf(q + h * dh, s.v + n * m.d + h * dh, dh);
  return m.key_norm ? dot * s.rstd[n * m.H + h] : dot;
}

}  // namespace

void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H, float eps) {
  const int64_t dh = d / H;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    for (int64_t h = 0; h < H; h++) {
      const float* x = v + n * d + h * dh;
      const float ss = dotf(x, x, dh);
      rstd[n * H + h] = 1.0f / std::sqrt(ss / static_cast<float>(dh) + eps);
    }
  }
}

void depth_mix_forward(float* x, float* lse, const DepthSource* src, int64_t S, const float* qg,
                       int64_t q_ld, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
#pragma omp parallel
  {
    std::vector<float> mx(H), l(H);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      const float* q = qg + n * q_ld;
      float* acc = x + n * d;  // accumulate in place
      for (int64_t c = 0; c < d; c++) acc[c] = 0.0f;
      for (int64_t h = 0; h < H; h++) {
        mx[h] = -std::numeric_limits<float>::infinity();
        l[h] = 0.0f;
      }
      for (int64_t i = 0; i < S; i++) {
        const float* v = src[i].v + n * d;
        for (int64_t h = 0; h < H; h++) {
          const float s = score(src[i], q, n, h, m);
          float* a = acc + h * dh;
          const float* vh = v + h * dh;
          if (m.softmax) {
            if (s > mx[h]) {  // rescale the running sums to the new maximum
              const float r = std::exp(mx[h] - s);
              l[h] *= r;
#pragma omp simd
              for (int64_t c = 0; c < dh; c++) a[c] *= r;
              mx[h] = s;
            }
            const float p = std::exp(s - mx[h]);
            l[h] += p;
#pragma omp simd
            for (int64_t c = 0; c < dh; c++) a[c] += p * vh[c];
          } else {
            const float p = sigmoidf(s);
#pragma omp simd
            for (int64_t c = 0; c < dh; c++) a[c] += p * vh[c];
          }
        }
      }
      if (m.softmax) {
        for (int64_t h = 0; h < H; h++) {
          const float inv = 1.0f / l[h];
          float* a = acc + h * dh;
#pragma omp simd
          for (int64_t c = 0; c < dh; c++) a[c] *= inv;
          if (lse) lse[n * H + h] = mx[h] + std::log(l[h]);
        }
      }
    }
  }
}

void depth_mix_forward_reference(float* x, float* lse, const DepthSource* src, int64_t S,
                                 const float* qg, int64_t q_ld, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
  std::vector<double> s(S), a(S);
  for (int64_t n = 0; n < N; n++) {
    const float* q = qg + n * q_ld;
    for (int64_t h = 0; h < H; h++) {
      double mx = -1e300;
      for (int64_t i = 0; i < S; i++) {
        const float* v = src[i].v + n * d + h * dh;
        double dot = 0, ss = 0;
        for (int64_t c = 0; c < dh; c++) {
          dot += double(q[h * dh + c]) * v[c];
          ss += double(v[c]) * v[c];
        }
        // The reference recomputes the key's RMS itself rather than trusting rstd.
        s[i] = m.key_norm ? dot / std::sqrt(ss / double(dh) + double(m.eps)) : dot;
        mx = std::max(mx, s[i]);
      }
      double z = 0;
      for (int64_t i = 0; i < S; i++) {
        a[i] = m.softmax ? std::exp(s[i] - mx) : 1.0 / (1.0 + std::exp(-s[i]));
        z += a[i];
      }
      if (m.softmax) {
        for (int64_t i = 0; i < S; i++) a[i] /= z;
        if (lse) lse[n * H + h] = static_cast<float>(mx + std::log(z));
      }
      for (int64_t c = 0; c < dh; c++) {
        double acc = 0;
        for (int64_t i = 0; i < S; i++) acc += a[i] * src[i].v[n * d + h * dh + c];
        x[n * d + h * dh + c] = static_cast<float>(acc);
      }
    }
  }
}

void depth_mix_weights(double* wsum, const DepthSource* src, int64_t S, const float* qg,
                       int64_t q_ld, const DepthMix& m, int64_t N) {
  std::vector<double> s(S);
  for (int64_t n = 0; n < N; n++) {
    for (int64_t h = 0; h < m.H; h++) {
      double mx = -1e300, z = 0;
      for (int64_t i = 0; i < S; i++) mx = std::max(mx, s[i] = score(src[i], qg + n * q_ld, n, h, m));
      for (int64_t i = 0; i < S; i++) {
        s[i] = m.softmax ? std::exp(s[i] - mx) : 1.0 / (1.0 + std::exp(-s[i]));
        z += s[i];
      }
      for (int64_t i = 0; i < S; i++) wsum[i] += m.softmax ? s[i] / z : s[i];
    }
  }
}

void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                        const DepthSource* src, int64_t S, const float* qg, int64_t q_ld,
                        const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
  const bool shared_q = q_ld == 0;
  const int nthr = omp_get_max_threads();
  // Shared query: each thread sums its rows' query gradient privately; combined in thread order
  // below so results do not depend on scheduling.
  std::vector<float> part(shared_q ? static_cast<size_t>(nthr) * d : 0, 0.0f);
#pragma omp parallel num_threads(nthr)
  {
    std::vector<float> D(H);
    float* my_dq = shared_q ? part.data() + static_cast<int64_t>(omp_get_thread_num()) * d : nullptr;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      const float* q = qg + n * q_ld;
      const float* g = dx + n * d;
      float* dq = shared_q ? my_dq : dqg + n * d;
      if (m.softmax) {
        for (int64_t h = 0; h < H; h++) D[h] = dotf(g + h * dh, x + n * d + h * dh, dh);
      }
      for (int64_t i = 0; i < S; i++) {
        const float* v = src[i].v + n * d;
        float* dv = src[i].dv ? src[i].dv + n * d : nullptr;
        for (int64_t h = 0; h < H; h++) {
          const float* vh = v + h * dh;
          const float* gh = g + h * dh;
          float qv, da;  // q . v (the raw score) and dx . v (= d loss / d a_i), one pass over v
          dot2(q + h * dh, gh, vh, dh, &qv, &da);
          const float s = m.key_norm ? qv * src[i].rstd[n * H + h] : qv;
          float a, ds;
          if (m.softmax) {
            a = std::exp(s - lse[n * H + h]);
            ds = a * (da - D[h]);
          } else {
            a = sigmoidf(s);
            ds = a * (1.0f - a) * da;
          }
          // s = r (qg . v) with r = rsqrt(mean(v^2) + eps): ds/dv = r qg - s r^2 v / dh.
          const float r = m.key_norm ? src[i].rstd[n * H + h] : 1.0f;
          const float kv = m.key_norm ? s * r * r / static_cast<float>(dh) : 0.0f;
          const float* qh = q + h * dh;
          float* dqh = dq + h * dh;
          const float dsr = ds * r;
          if (dv) {
            float* dvh = dv + h * dh;
#pragma omp simd
            for (int64_t c = 0; c < dh; c++) {
              dvh[c] += a * gh[c] + ds * (r * qh[c] - kv * vh[c]);
              dqh[c] += dsr * vh[c];
            }
          } else {
#pragma omp simd
            for (int64_t c = 0; c < dh; c++) dqh[c] += dsr * vh[c];
          }
        }
      }
    }
  }
  if (shared_q) {
    for (int t = 0; t < nthr; t++) {
      for (int64_t c = 0; c < d; c++) dqg[c] += part[static_cast<int64_t>(t) * d + c];
    }
  }
}

void depth_mix_phase1(float* const* o, float* const* lse, const DepthSource* src, int64_t S,
                      const float* const* qg, int64_t K, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
#pragma omp parallel
  {
    std::vector<float> mx(K * H), l(K * H);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      for (int64_t k = 0; k < K; k++) {
        for (int64_t c = 0; c < d; c++) o[k][n * d + c] = 0.0f;
      }
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      // Each source row is loaded once and scored by all K queries (SPEC 4, phase 1).
      for (int64_t i = 0; i < S; i++) {
        const float* v = src[i].v + n * d;
        for (int64_t k = 0; k < K; k++) {
          for (int64_t h = 0; h < H; h++) {
            const float s = score(src[i], qg[k], n, h, m);
            float& M = mx[k * H + h];
            float& L = l[k * H + h];
            float* a = o[k] + n * d + h * dh;
            const float* vh = v + h * dh;
            if (s > M) {
              const float r = std::exp(M - s);
              L *= r;
#pragma omp simd
              for (int64_t c = 0; c < dh; c++) a[c] *= r;
              M = s;
            }
            const float p = std::exp(s - M);
            L += p;
#pragma omp simd
            for (int64_t c = 0; c < dh; c++) a[c] += p * vh[c];
          }
        }
      }
      for (int64_t k = 0; k < K; k++) {
        for (int64_t h = 0; h < H; h++) {
          const float inv = 1.0f / l[k * H + h];
          float* a = o[k] + n * d + h * dh;
#pragma omp simd
          for (int64_t c = 0; c < dh; c++) a[c] *= inv;
          lse[k][n * H + h] = mx[k * H + h] + std::log(l[k * H + h]);
        }
      }
    }
  }
}

void depth_mix_phase2(float* x, float* lse, const float* o1, const float* lse1,
                      const DepthSource& p, const float* qg, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    for (int64_t h = 0; h < H; h++) {
      const float s = score(p, qg, n, h, m);
      const float l1 = lse1[n * H + h];
      const float w = sigmoidf(s - l1);  // weight of the new source after merging
      const float* ob = o1 + n * d + h * dh;
      const float* pv = p.v + n * d + h * dh;
      float* xh = x + n * d + h * dh;
#pragma omp simd
      for (int64_t c = 0; c < dh; c++) xh[c] = ob[c] + w * (pv[c] - ob[c]);
      const float mx = std::max(s, l1);
      lse[n * H + h] = mx + std::log(std::exp(l1 - mx) + std::exp(s - mx));
    }
  }
}

}  // namespace attnres::ops
