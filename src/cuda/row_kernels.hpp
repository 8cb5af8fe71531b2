// The CUDA backend's elementwise and row-wise kernels, written once as functors that run on both
// sides: on the GPU each thread calls one functor index (src/cuda/device_ops.cu, launch_rows), and
// on the host tests/test_cuda_rows.cpp calls every index in a loop (run_rows_host) and compares
// the results with the CPU ops (src/ops). So the kernels' arithmetic and indexing are tested on
// every machine, and only the launch itself needs a GPU.
//
// This first version maps one thread to one row (or one (row, head) slice, or one column): simple
// and deterministic (no atomics; column reductions loop over rows in order), not yet coalesced.
// Same shapes and conventions as src/ops/ops.hpp; every backward ACCUMULATES (+=).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/bf16.hpp"
#include "core/host_device.hpp"
#include "core/step_scalars.hpp"
#include "ops/row_math.hpp"

namespace attnres::cuda::rows {

namespace row = ops::row;  // the arithmetic of one row, shared with the CPU ops
using row::sigmoid;

using attnres::bf16_bits_to_float;  // (core/bf16.hpp)
using attnres::float_to_bf16_bits;

// Calls f(i) for i in [0, n): the host stand-in for a kernel launch.
template <class F>
void run_rows_host(const F& f, int64_t n) {
  for (int64_t i = 0; i < n; i++) f(i);
}

// ---- elementwise ----  index i of n
struct Add {  // dst = a + b (dst may be a or b)
  float* dst;
  const float* a;
  const float* b;
  ATTNRES_HD void operator()(int64_t i) const { dst[i] = a[i] + b[i]; }
};
struct Mul {  // dst = a * b
  float* dst;
  const float* a;
  const float* b;
  ATTNRES_HD void operator()(int64_t i) const { dst[i] = a[i] * b[i]; }
};
struct AddRow {  // x (N,C) row r += row (C); index i = r C + c
  float* x;
  const float* row;
  int64_t C;
  ATTNRES_HD void operator()(int64_t i) const { x[i] += row[i % C]; }
};
struct MulRow {  // dst (N,C) = src (N,C) * row (C), broadcast over rows
  float* dst;
  const float* src;
  const float* row;
  int64_t C;
  ATTNRES_HD void operator()(int64_t i) const { dst[i] = src[i] * row[i % C]; }
};
struct AddProduct {  // dst += a * b
  float* dst;
  const float* a;
  const float* b;
  ATTNRES_HD void operator()(int64_t i) const { dst[i] += a[i] * b[i]; }
};
struct Scale {  // x *= s
  float* x;
  float s;
  ATTNRES_HD void operator()(int64_t i) const { x[i] *= s; }
};
// index t of P: out[t] = sum of x[i] (or x[i]^2) over i = t, t + P, t + 2P, ... < n, in double
// (neighbouring indices read neighbouring elements: coalesced on the GPU). The caller adds out in
// order.
template <class T, bool kSquare = false>
struct SumStrided {
  double* out;
  const T* x;
  int64_t n, P;
  ATTNRES_HD void operator()(int64_t t) const {
    double s = 0.0;
    for (int64_t i = t; i < n; i += P) {
      const double v = static_cast<double>(x[i]);
      s += kSquare ? v * v : v;
    }
    out[t] = s;
  }
};
using SumSquares = SumStrided<float, true>;

// ---- a training step's scalars (core/step_scalars.hpp) ----  one index
// s[kLoss] += (the P partial sums, added in order) * scale: a micro-batch's mean loss.
struct LossAdd {
  float* s;
  const double* part;
  int64_t P;
  double scale;
  ATTNRES_HD void operator()(int64_t) const {
    double acc = 0.0;
    for (int64_t p = 0; p < P; p++) acc += part[p];
    s[step::kLoss] += static_cast<float>(acc * scale);
  }
};
// From the P partial sums of the gradients' squares: the norm, the clip factor (clip_scale in
// attnres/optim.hpp, the same arithmetic) and whether the step may update.
struct NormClip {
  float* s;
  const double* part;
  int64_t P;
  ATTNRES_HD void operator()(int64_t) const {
    double sq = 0.0;
    for (int64_t p = 0; p < P; p++) sq += part[p];
    const double norm = ::sqrt(sq), max_norm = s[step::kMaxNorm];
    float clip = 1.0f;
    if (max_norm > 0) {
      const double coef = max_norm / (norm + 1e-6);
      if (coef < 1.0) clip = static_cast<float>(coef);
    }
    s[step::kNorm] = static_cast<float>(norm);
    s[step::kClip] = clip;
    // (x - x is 0 for a finite x, NaN for an infinite or NaN one)
    const double loss = s[step::kLoss];
    const bool loss_ok = s[step::kLossCheck] == 0.0f || loss - loss == 0.0;
    s[step::kOk] = loss_ok && norm - norm == 0.0 ? 1.0f : 0.0f;
  }
};

// ---- scalar mixes (static and DenseFormer residuals) ----  up to kMaxMix sources per launch,
// their pointers and weights passed by value.
constexpr int kMaxMix = 32;
// index k of n: out[k] (+)= sum_i w[i] src[i][k]
// (wp: the weights in device memory instead, where not null)
struct ScalarMix {
  float* out;
  const float* src[kMaxMix];
  float w[kMaxMix];
  int64_t S;
  bool accumulate;
  const float* wp = nullptr;
  ATTNRES_HD void operator()(int64_t k) const {
    float acc = accumulate ? out[k] : 0.0f;
    for (int64_t i = 0; i < S; i++) acc += (wp ? wp[i] : w[i]) * src[i][k];
    out[k] = acc;
  }
};
// index k: dsrc[i][k] += w[i] dout[k] (null dsrc[i]: skipped)
struct ScalarMixGrad {
  float* dsrc[kMaxMix];
  float w[kMaxMix];
  const float* dout;
  int64_t S;
  const float* wp = nullptr;
  ATTNRES_HD void operator()(int64_t k) const {
    const float g = dout[k];
    for (int64_t i = 0; i < S; i++) {
      if (dsrc[i]) dsrc[i][k] += (wp ? wp[i] : w[i]) * g;
    }
  }
};
// index t = i C + c: out[t] = the sum, in order, of part[i P + p] for p in chunk c of the P
// (chunks of ceil(P / C)); then PartialsToFloat adds the C chunk sums of each i in order.
struct ChunkSums {
  double* out;
  const double* part;
  int64_t P, C;
  ATTNRES_HD void operator()(int64_t t) const {
    const int64_t i = t / C, c = t % C, len = (P + C - 1) / C;
    double s = 0.0;
    for (int64_t p = c * len; p < P && p < (c + 1) * len; p++) s += part[i * P + p];
    out[t] = s;
  }
};
struct PartialsToFloat {
  float* out;
  const double* part;
  int64_t C;
  ATTNRES_HD void operator()(int64_t i) const {
    double s = 0.0;
    for (int64_t c = 0; c < C; c++) s += part[i * C + c];
    out[i] = static_cast<float>(s);
  }
};
// One thread: w (S) = softmax(z (S)), computed in double (the static residual's mixing weights).
struct SoftmaxSmall {
  float* w;
  const float* z;
  int64_t S;
  ATTNRES_HD void operator()(int64_t) const { row::softmax_small(w, z, S); }
};
// One thread: dz (S) += a_i (da_i - sum_j a_j da_j), the softmax's backward (in double).
struct SoftmaxSmallBackward {
  float* dz;
  const float* a;
  const float* da;
  int64_t S;
  ATTNRES_HD void operator()(int64_t) const { row::softmax_small_backward(dz, a, da, S); }
};
// index t = i P + p: part[t] = sum over k = p, p + P, ... < n of dout[k] src[i][k] (double)
struct ScalarMixDot {
  double* part;
  const float* src[kMaxMix];
  const float* dout;
  int64_t n, P;
  ATTNRES_HD void operator()(int64_t t) const {
    const float* x = src[t / P];
    double s = 0.0;
    for (int64_t k = t % P; k < n; k += P) s += static_cast<double>(dout[k]) * x[k];
    part[t] = s;
  }
};

// ---- embedding ----
// index n: out (N,C) row n = wte[ids[n]]
struct EmbeddingForward {  // index i = n * C + c
  float* out;
  const int32_t* ids;
  const float* wte;
  int64_t C;
  ATTNRES_HD void operator()(int64_t i) const {
    const int64_t n = i / C, c = i % C;
    out[i] = wte[static_cast<int64_t>(ids[n]) * C + c];
  }
};

// dwte[ids[n], c] += dout[n, c] with the rows grouped by token id (the caller sorts them stably on
// the host): rows perm[start[s]..start[s+1]) all hold token id[s], s < *G; index i = s * C + c
// adds them in row order (as ops::embedding_backward: deterministic, no atomics). Launched over
// N * C indices (G <= N is read on the device), those past the G groups do nothing.
struct EmbeddingBackwardGrouped {
  float* dwte;
  const float* dout;
  const int32_t* perm;
  const int32_t* start;
  const int32_t* id;
  const int32_t* G;
  int64_t C;
  ATTNRES_HD void operator()(int64_t i) const {
    const int64_t s = i / C, c = i % C;
    if (s >= *G) return;
    float* w = dwte + static_cast<int64_t>(id[s]) * C + c;
    float acc = *w;
    for (int32_t k = start[s]; k < start[s + 1]; k++)
      acc += dout[static_cast<int64_t>(perm[k]) * C + c];
    *w = acc;
  }
};

// ---- rmsnorm ----  y = x * r * g, r = 1 / sqrt(mean(x^2) + eps)
struct RmsNormForward {
  float* out;
  float* rstd;  // (N) may be null
  const float* inp;
  const float* g;
  int64_t C;
  float eps;
  ATTNRES_HD void operator()(int64_t n) const {
    const float r = row::rmsnorm(out + n * C, inp + n * C, g, C, eps);
    if (rstd) rstd[n] = r;
  }
};
// index n: dx += r (g dy - xhat mean(g dy xhat)), xhat = x r (the gain's gradient: below)
struct RmsNormBackwardInput {
  float* dinp;
  const float* dout;
  const float* inp;
  const float* g;
  const float* rstd;
  int64_t C;
  ATTNRES_HD void operator()(int64_t n) const {
    row::rmsnorm_backward(dinp + n * C, nullptr, dout + n * C, inp + n * C, g, rstd[n], C);
  }
};
// The gain's gradient dg[c] += sum_n dy[n,c] x[n,c] r[n] in two coalesced passes: partial sums over
// chunks of R rows (index i = k C + c: part[i] = the sum over rows [k R, k R + R)), then
// ColumnSumAdd adds the chunks in order (deterministic, no atomics).
struct RmsNormGainPartial {
  float* part;
  const float* dout;
  const float* inp;
  const float* rstd;
  int64_t N, C, R;
  ATTNRES_HD void operator()(int64_t i) const {
    const int64_t k = i / C, c = i % C, end = (k + 1) * R < N ? (k + 1) * R : N;
    float s = 0.0f;
    for (int64_t n = k * R; n < end; n++) s += dout[n * C + c] * inp[n * C + c] * rstd[n];
    part[i] = s;
  }
};
// index i = k C + c: part[i] = sum of x[n, c] over rows n in [k R, k R + R) of x (N,C).
struct ColumnPartial {
  float* part;
  const float* x;
  int64_t N, C, R;
  ATTNRES_HD void operator()(int64_t i) const {
    const int64_t k = i / C, c = i % C, end = (k + 1) * R < N ? (k + 1) * R : N;
    float s = 0.0f;
    for (int64_t n = k * R; n < end; n++) s += x[n * C + c];
    part[i] = s;
  }
};
// index c: dst[c] += sum over k < K of part[k C + c], in k order.
struct ColumnSumAdd {
  float* dst;
  const float* part;
  int64_t K, C;
  ATTNRES_HD void operator()(int64_t c) const {
    float s = 0.0f;
    for (int64_t k = 0; k < K; k++) s += part[k * C + c];
    dst[c] += s;
  }
};

// ---- swiglu ----  out = silu(h1) * h3; h13 (N,2F), index = n*F + f
struct SwigluForward {
  float* out;
  const float* h13;
  int64_t F;
  ATTNRES_HD void operator()(int64_t i) const {
    const int64_t n = i / F, f = i % F;
    const float a = h13[n * 2 * F + f], b = h13[n * 2 * F + F + f];
    out[i] = row::swiglu(a, b, sigmoid(a));
  }
};
struct SwigluBackward {
  float* dh13;
  const float* dout;
  const float* h13;
  int64_t F;
  ATTNRES_HD void operator()(int64_t i) const {
    const int64_t n = i / F, f = i % F;
    const float a = h13[n * 2 * F + f], b = h13[n * 2 * F + F + f];
    row::swiglu_backward(&dh13[n * 2 * F + f], &dh13[n * 2 * F + F + f], dout[i], a, b, sigmoid(a));
  }
};

// ---- rope ----  rotate-half; index = (row n, head h, pair i); sign +1 forward, -1 backward
struct Rope {
  float* x;
  const float* cos_t;
  const float* sin_t;
  int64_t T, n_heads, hd, ld, pos0;
  float sign;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t half = hd / 2;
    const int64_t i = idx % half, h = (idx / half) % n_heads, n = idx / (half * n_heads);
    const int64_t p = pos0 + n % T;
    const float c = cos_t[p * half + i], s = sign * sin_t[p * half + i];
    float* v = x + n * ld + h * hd;
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c - x2 * s;
    v[i + half] = x2 * c + x1 * s;
  }
};

// ---- cross-entropy ----  index n (a row of V logits)
struct CrossEntropyForward {
  float* losses;  // (N) may be null
  float* lse;     // (N)
  const float* logits;
  const int32_t* targets;
  int64_t V;
  ATTNRES_HD void operator()(int64_t n) const {
    const float* l = logits + n * V;
    float mx = l[0];
    for (int64_t j = 1; j < V; j++) mx = l[j] > mx ? l[j] : mx;
    float z = 0.0f;
    for (int64_t j = 0; j < V; j++) z += ::expf(l[j] - mx);
    const float s = mx + ::logf(z);
    lse[n] = s;
    if (losses) losses[n] = s - l[targets[n]];
  }
};
// dlogits = (softmax - onehot) * dloss, element i = n * V + j.
struct CrossEntropyGrad {
  const float* logits;
  const float* lse;
  const int32_t* targets;
  int64_t V;
  float dloss;
  ATTNRES_HD float at(int64_t i) const {
    const int64_t n = i / V, j = i % V;
    const float p = ::expf(logits[i] - lse[n]);
    return (p - (j == targets[n] ? 1.0f : 0.0f)) * dloss;
  }
};
// index i: dlogits[i]; may alias logits (each element read before written).
struct CrossEntropyBackward {
  float* dlogits;
  CrossEntropyGrad d;
  ATTNRES_HD void operator()(int64_t i) const { dlogits[i] = d.at(i); }
};
// The same rounded to bf16 (bits), for bf16 products that read it: g[i] = bf16(dlogits[i]).
struct CrossEntropyBackwardBf16 {
  uint16_t* g;
  CrossEntropyGrad d;
  ATTNRES_HD void operator()(int64_t i) const { g[i] = float_to_bf16_bits(d.at(i)); }
};

// ---- depth attention (SPEC 2-4) ----  index = n * H + h (one head slice of one token)
struct Source {
  const float* v;                // (N,d)
  const float* rstd;             // (N,H)
  float* dv;                     // (N,d) or null
  const uint16_t* vb = nullptr;  // (N,d) v in bf16: where set, the depth kernels read it instead
  ATTNRES_HD float at(int64_t i) const { return vb ? bf16_bits_to_float(vb[i]) : v[i]; }
};
struct Mix {
  int64_t d = 0, H = 1;
  bool softmax = true, key_norm = true;
  ATTNRES_HD int64_t dh() const { return d / H; }
};

// rstd (N,H) of v (N,d) per head slice.
struct DepthRstd {
  float* rstd;
  const float* v;
  int64_t d, H;
  float eps;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t dh = d / H, n = idx / H, h = idx % H;
    const float* x = v + n * d + h * dh;
    float ss = 0.0f;
    for (int64_t c = 0; c < dh; c++) ss += x[c] * x[c];
    rstd[idx] = row::rms_scale(ss, dh, eps);
  }
};

ATTNRES_HD inline float depth_score(const Source& s, const float* q, const Mix& m, int64_t n,
                                    int64_t h) {
  const int64_t dh = m.dh(), off = n * m.d + h * dh;
  float dot = 0.0f;
  for (int64_t c = 0; c < dh; c++) dot += q[c] * s.at(off + c);
  return m.key_norm ? dot * s.rstd[n * m.H + h] : dot;
}

// One pass over the sources with an online softmax: when a score exceeds the running maximum,
// the running sum and the partial mix are rescaled; x (N,d), lse (N,H) (softmax; may be null).
// q: the (d) query of every token when q_ld == 0, else row n at q + n * q_ld.
struct DepthMixForward {
  float* x;
  float* lse;
  const Source* src;
  int64_t S;
  const float* q;
  int64_t q_ld;
  Mix m;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh();
    const float* qh = q + n * q_ld + h * dh;
    float* out = x + n * m.d + h * dh;
    for (int64_t c = 0; c < dh; c++) out[c] = 0.0f;
    float mx = -INFINITY, z = 0.0f;
    for (int64_t i = 0; i < S; i++) {
      const float s = depth_score(src[i], qh, m, n, h);
      const Source& v = src[i];
      const int64_t off = n * m.d + h * dh;
      float w;
      if (m.softmax) {
        if (s > mx) {
          const float scale = ::expf(mx - s);  // 0 for the first source
          for (int64_t c = 0; c < dh; c++) out[c] *= scale;
          z *= scale;
          mx = s;
        }
        w = ::expf(s - mx);
        z += w;
      } else {
        w = sigmoid(s);
      }
      for (int64_t c = 0; c < dh; c++) out[c] += w * v.at(off + c);
    }
    if (m.softmax) {
      for (int64_t c = 0; c < dh; c++) out[c] /= z;
      if (lse) lse[idx] = mx + ::logf(z);
    }
  }
};

// Two-phase Block AttnRes (SPEC 4), static queries, softmax gate. Phase 1: up to kMaxQueries
// queries q[k] (d) mix the same S sources; o[k] (N,d) and lse[k] (N,H) as DepthMixForward's x and
// lse for each. (This reference runs the queries one after the other; the GPU kernel scores each
// source it reads with all of them.) index = n * H + h.
struct DepthMixPhase1 {
  static constexpr int kMaxQueries = 16;
  float* o[kMaxQueries];
  float* lse[kMaxQueries];
  const float* q[kMaxQueries];
  int64_t K;
  const Source* src;
  int64_t S;
  Mix m;
  ATTNRES_HD void operator()(int64_t idx) const {
    for (int64_t k = 0; k < K; k++) DepthMixForward{o[k], lse[k], src, S, q[k], 0, m}(idx);
  }
};
// Phase 2: merges the block's partial sum p into a phase-1 result (o1, lse1):
// x = o1 + sigmoid(s_p - lse1) (p - o1), lse = log(exp(lse1) + exp(s_p)). index = n * H + h.
struct DepthMixPhase2 {
  float* x;
  float* lse;
  const float* o1;
  const float* lse1;
  Source p;
  const float* q;
  Mix m;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    const float s = depth_score(p, q + h * dh, m, n, h);
    const float l1 = lse1[idx];
    const float w = sigmoid(s - l1);
    for (int64_t c = 0; c < dh; c++) x[off + c] = o1[off + c] + w * (p.at(off + c) - o1[off + c]);
    const float mx = s > l1 ? s : l1;
    lse[idx] = mx + ::logf(::expf(l1 - mx) + ::expf(s - mx));
  }
};

// Backward of DepthMixForward for one head slice: a_i from the saved lse (softmax) or sigmoid,
// g_i = dx . v_i, ds_i = a_i (g_i - dx . x) (softmax) or a_i (1 - a_i) g_i (sigmoid);
// dv_i += a_i dx + ds_i ds_i/dv_i (with the key norm: r q - s r^2 v / dh), and the query gradient
// ds_i * r v_i (or ds_i v_i) goes to dq: row n of a (N,d) buffer, which the caller reduces over
// tokens for a shared query (ColumnPartial + ColumnSumAdd) or which is the dynamic query's gradient
// itself.
struct DepthMixBackward {
  float* dq;  // (N,d) +=
  const float* dx;
  const float* x;
  const float* lse;
  const Source* src;
  int64_t S;
  const float* q;
  int64_t q_ld;
  Mix m;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    const float* qh = q + n * q_ld + h * dh;
    const float* g = dx + off;
    float D = 0.0f;
    if (m.softmax) {
      for (int64_t c = 0; c < dh; c++) D += g[c] * x[off + c];
    }
    for (int64_t i = 0; i < S; i++) {
      const float s = depth_score(src[i], qh, m, n, h);
      const float a = row::depth_weight(s, lse[idx], m.softmax);
      const Source& sv = src[i];
      float gv = 0.0f;
      for (int64_t c = 0; c < dh; c++) gv += g[c] * sv.at(off + c);
      const float ds = row::depth_score_grad(a, gv, D, m.softmax);
      const float r = m.key_norm ? src[i].rstd[idx] : 1.0f;
      const float k = m.key_norm ? s * r * r / static_cast<float>(dh) : 0.0f;
      if (src[i].dv) {
        float* dv = src[i].dv + off;
        for (int64_t c = 0; c < dh; c++) dv[c] += a * g[c] + ds * (r * qh[c] - k * sv.at(off + c));
      }
      for (int64_t c = 0; c < dh; c++) dq[off + c] += ds * r * sv.at(off + c);
    }
  }
};

// ---- by-source backward (Full AttnRes, static queries; ops::depth_source_backward) ----
// A mixer that reads the source: its dx (N,d), lse and D = dx . x (N,H), its query (d).
struct Reader {
  const float* dx;
  const float* lse;
  const float* D;
  const float* qg;
};
// index n * H + h: D = dx . x over the head slice.
struct DepthDxDot {
  float* D;
  const float* dx;
  const float* x;
  Mix m;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    float acc = 0.0f;
    for (int64_t c = 0; c < dh; c++) acc += dx[off + c] * x[off + c];
    D[idx] = acc;
  }
};
// index n * H + h: the source's whole gradient dv (OVERWRITTEN) from its K readers, as each
// reader's DepthMixBackward would add it; dsr ((H,K,N): [h][k][n]) gets ds * r, from which the
// caller forms the readers' query gradients (dq_k += sum_n dsr v_n per head: one GEMM per head).
// vout (N,d), if not null, gets the source values used (its bf16 copy widened: the GEMM's operand).
struct DepthSourceBackward {
  float* dv;
  float* dsr;
  Source src;  // v (or its bf16 copy) and rstd; dv unused
  const Reader* rd;
  int64_t K, N;
  Mix m;
  float* vout = nullptr;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    const float* rstd = src.rstd;
    float* d = dv + off;
    for (int64_t c = 0; c < dh; c++) d[c] = 0.0f;
    if (vout) {
      for (int64_t c = 0; c < dh; c++) vout[off + c] = src.at(off + c);
    }
    const float r = m.key_norm ? rstd[idx] : 1.0f;
    for (int64_t k = 0; k < K; k++) {
      const Reader& R = rd[k];
      const float* qh = R.qg + h * dh;
      const float* g = R.dx + off;
      float qv = 0.0f, gv = 0.0f;
      for (int64_t c = 0; c < dh; c++) {
        qv += qh[c] * src.at(off + c);
        gv += g[c] * src.at(off + c);
      }
      const float s = m.key_norm ? qv * r : qv;
      const float a = row::depth_weight(s, R.lse[idx], m.softmax);
      const float ds = row::depth_score_grad(a, gv, R.D[idx], m.softmax);
      const float kk = m.key_norm ? s * r * r / static_cast<float>(dh) : 0.0f;
      for (int64_t c = 0; c < dh; c++) d[c] += a * g[c] + ds * (r * qh[c] - kk * src.at(off + c));
      dsr[(h * K + k) * N + n] = ds * r;
    }
  }
};

// ---- causal self-attention ----  Run as batched GEMMs around these row kernels (RowBackend):
// scores = q k^T / sqrt(hd) into att (B,H,T,T), the causal softmax below in place, out = att v;
// the backward's dP = dout v^T goes through AttnSoftmaxBackward to dS, then dq = dS k, dk = dS^T q,
// dv = att^T dout. Rows are (b, h, t); a row's entries u > t are masked (probability zero).
// index r = (b H + h) T + t: att row r (T) = softmax over u <= t of the scores; 0 for u > t.
struct AttnSoftmaxForward {
  float* att;
  int64_t T;
  ATTNRES_HD void operator()(int64_t r) const {
    const int64_t t = r % T;
    float* a = att + r * T;
    float mx = a[0];
    for (int64_t u = 1; u <= t; u++) mx = a[u] > mx ? a[u] : mx;
    float z = 0.0f;
    for (int64_t u = 0; u <= t; u++) {
      a[u] = ::expf(a[u] - mx);
      z += a[u];
    }
    const float inv = 1.0f / z;
    for (int64_t u = 0; u <= t; u++) a[u] *= inv;
    for (int64_t u = t + 1; u < T; u++) a[u] = 0.0f;
  }
};
// index r as above: d row r holds dP (dL/d probabilities) and becomes dS (dL/d scores before the
// 1/sqrt(hd) scale, which is folded in): dS_u = scale P_u (dP_u - sum_v P_v dP_v), 0 for u > t.
struct AttnSoftmaxBackward {
  float* d;
  const float* att;
  int64_t T;
  float scale;
  ATTNRES_HD void operator()(int64_t r) const {
    const int64_t t = r % T;
    const float* p = att + r * T;
    float* g = d + r * T;
    float dot = 0.0f;
    for (int64_t u = 0; u <= t; u++) dot += p[u] * g[u];
    for (int64_t u = 0; u <= t; u++) g[u] = scale * p[u] * (g[u] - dot);
    for (int64_t u = t + 1; u < T; u++) g[u] = 0.0f;
  }
};

// GQA dK, dV from per-query-head shares (flash attention): index i = ((b T + t) Hkv + kh) hd + c;
// dqkv's k and v of (b, t, kh, c) += the sum over the group's G heads, in order, of
// dk_part / dv_part (B,H,T,hd) at head kh G + g.
struct GqaSum {
  float* dqkv;
  const float* dk_part;
  const float* dv_part;
  int64_t T, H, Hkv, hd, ld;
  ATTNRES_HD void operator()(int64_t i) const {
    const int64_t c = i % hd, kh = (i / hd) % Hkv, bt = i / (hd * Hkv), b = bt / T, t = bt % T;
    const int64_t G = H / Hkv;
    float sk = 0.0f, sv = 0.0f;
    for (int64_t g = 0; g < G; g++) {
      const int64_t off = ((b * H + kh * G + g) * T + t) * hd + c;
      sk += dk_part[off];
      sv += dv_part[off];
    }
    dqkv[bt * ld + (H + kh) * hd + c] += sk;
    dqkv[bt * ld + (H + Hkv + kh) * hd + c] += sv;
  }
};

// KV-cache decoding (src/ops attention_decode), split over the cached keys so a single new token
// still spreads over many threads ("flash-decoding"): query i = t H + h of the n new queries q
// (n,H,hd) at position pos0 + t sees keys [0, pos0 + t] of kc, vc (rows of Hkv*hd). Chunk c of C
// takes keys [c KC, (c + 1) KC): its running max m, sum l and unnormalised output o go to
// part[(i C + c) (hd + 2) ..] as o (hd), m, l (an empty chunk: m = -inf, l = 0, o = 0); the merge
// rescales the chunks to their common max. index = i C + c.
struct AttnDecodePartial {
  float* part;
  const float* q;
  const float* kc;
  const float* vc;
  int64_t pos0, H, Hkv, hd, KC, C;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t i = idx / C, c = idx % C, t = i / H, h = i % H;
    const int64_t kv = (h / (H / Hkv)) * hd, ld = Hkv * hd, last = pos0 + t;
    const float scale = 1.0f / ::sqrtf(static_cast<float>(hd));
    const float* qh = q + i * hd;
    float* o = part + idx * (hd + 2);
    for (int64_t e = 0; e < hd; e++) o[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int64_t u = c * KC; u < (c + 1) * KC && u <= last; u++) {
      const float* k = kc + u * ld + kv;
      const float* v = vc + u * ld + kv;
      float s = 0.0f;
      for (int64_t e = 0; e < hd; e++) s += qh[e] * k[e];
      s *= scale;
      if (s > m) {
        const float r = ::expf(m - s);
        l *= r;
        for (int64_t e = 0; e < hd; e++) o[e] *= r;
        m = s;
      }
      const float p = ::expf(s - m);
      l += p;
      for (int64_t e = 0; e < hd; e++) o[e] += p * v[e];
    }
    o[hd] = m;
    o[hd + 1] = l;
  }
};
// index = i hd + e: out[i hd + e] = sum_c o_c[e] exp(m_c - M) / sum_c l_c exp(m_c - M), M the
// chunks' max (chunk 0 always holds key 0: M is finite).
struct AttnDecodeMerge {
  float* out;
  const float* part;
  int64_t hd, C;
  ATTNRES_HD void operator()(int64_t idx) const {
    const int64_t i = idx / hd, e = idx % hd;
    const float* p = part + i * C * (hd + 2);
    float M = -INFINITY;
    for (int64_t c = 0; c < C; c++) M = fmaxf(M, p[c * (hd + 2) + hd]);
    float L = 0.0f, o = 0.0f;
    for (int64_t c = 0; c < C; c++) {
      const float* pc = p + c * (hd + 2);
      if (pc[hd] == -INFINITY) continue;
      const float w = ::expf(pc[hd] - M);
      L += w * pc[hd + 1];
      o += w * pc[e];
    }
    out[idx] = o / L;
  }
};

// index i = (b T + t) H + h of (B,T,H): d (B,H,T) at (b H + h) T + t = sum over c of
// g o (the row's hd-channel slice of head h in (B,T,H*hd) tensors; flash attention's D).
struct AttnRowDot {
  float* d;
  const float* o;
  const float* g;
  int64_t T, H, hd;
  ATTNRES_HD void operator()(int64_t i) const {
    const int64_t h = i % H, bt = i / H, b = bt / T, t = bt % T;
    const float* x = o + i * hd;
    const float* y = g + i * hd;
    float s = 0.0f;
    for (int64_t c = 0; c < hd; c++) s += x[c] * y[c];
    d[(b * H + h) * T + t] = s;
  }
};

// ---- AdamW ----  torch.optim.AdamW's update of element i (row_math.hpp; attnres/optim.hpp):
// decay = 1 - lr wd (or 1).
struct AdamW {
  float* p;
  const float* g;
  float* m;
  float* v;
  float b1, b2, step_size, inv_bc2_sqrt, eps, grad_scale, decay;
  ATTNRES_HD void operator()(int64_t i) const {
    row::adamw(&p[i], g[i], &m[i], &v[i], decay,
               ops::AdamStep{b1, b2, step_size, inv_bc2_sqrt, eps, grad_scale});
  }
};

// AdamW with the step's factors read from the step scalars s (written by the host and NormClip):
// the same arithmetic as AdamW; nothing changes when s[kOk] is 0.
struct AdamWScaled {
  float* p;
  const float* g;
  float* m;
  float* v;
  const float* s;
  bool decay;
  ATTNRES_HD void operator()(int64_t i) const {
    if (s[step::kOk] == 0.0f) return;
    AdamW{p,
          g,
          m,
          v,
          s[step::kBeta1],
          s[step::kBeta2],
          s[step::kStepSize],
          s[step::kInvBc2Sqrt],
          s[step::kEps],
          s[step::kClip],
          decay ? s[step::kDecay] : 1.0f}(i);
  }
};

// ---- bf16 storage (mixed precision: bf16 activations and weights for the GEMMs, bf16 depth
// sources, fp32 master weights and accumulation; the conversions are at the top) ----
// index i: out[i] = bf16(in[i]) / float(in[i])
struct ToBf16 {
  uint16_t* out;
  const float* in;
  ATTNRES_HD void operator()(int64_t i) const { out[i] = float_to_bf16_bits(in[i]); }
};
struct FromBf16 {
  float* out;
  const uint16_t* in;
  ATTNRES_HD void operator()(int64_t i) const { out[i] = bf16_bits_to_float(in[i]); }
};

}  // namespace attnres::cuda::rows
