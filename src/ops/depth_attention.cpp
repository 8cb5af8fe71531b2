// Depth attention: the AttnRes mix of earlier sublayer outputs (SPEC sections 2-4).
//
// Memory-bound: a mixer over S sources reads S (N,d) arrays (and backward read-modify-writes their
// gradients) to do O(S d) flops per token. So the kernels are organised around the bytes: tokens
// go in tiles, and within a tile source by source, so every source is read in long contiguous
// runs (a token-by-token walk over 17+ interleaved sources ran at half the bandwidth). Forward:
// pass 1 scores the tile against every source, a softmax over the sources (vectorised exp), pass 2
// sums while the tile's rows are still in L2; only the log-sum-exp (N,H) is kept. Backward needs
// no second pass over memory: the saved lse gives each weight directly, and sum_j a_j (dx . v_j)
// = dx . x (x is the forward output), so each source row is read from memory once: a tile's
// scores, their weights by one vectorised exp, then the updates while the tile is in cache.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dispatch.hpp"
#include "core/simd.hpp"
#include "core/vmath.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

namespace {

using simd::dot2;
inline float dotf(const float* a, const float* b, int64_t n) { return simd::dot(a, b, n); }

// Rows per tile for the two-pass kernels (forward, phase 1): a tile's rows of every source must
// stay in L2 (1 MiB per core on Zen 5) between the pass that scores them and the pass that sums
// them. Within a tile the kernels walk source by source, so each source is read in contiguous runs
// of tile x d floats: long enough for the hardware prefetchers, which a token-by-token walk over
// 17+ interleaved sources defeats.
inline int64_t tile_rows(int64_t S, int64_t d) {
  const int64_t bytes = S * d * static_cast<int64_t>(sizeof(float));
  return std::clamp<int64_t>((512 << 10) / std::max<int64_t>(bytes, 1), 8, 64);
}
// The backward reads each source row once, so only dx's tile is reused: longer runs pay.
inline int64_t backward_tile_rows(int64_t d) {
  return std::clamp<int64_t>((256 << 10) / (d * static_cast<int64_t>(sizeof(float))), 8, 64);
}

// Up to this many rows (token-by-token decoding) a kernel runs on the calling thread: waking the
// OpenMP team costs more than the work.
[[maybe_unused]] constexpr int64_t kSerialRows = 8;  // unused when built without OpenMP

// Software prefetch of the row n floats long starting at p, kPrefetchRows rows ahead of use.
constexpr int64_t kPrefetchRows = 4;
inline void prefetch_row(const float* p, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) __builtin_prefetch(p + c, 0, 3);
}

// w (n) <- softmax(w); returns the log-sum-exp.
inline float softmax_inplace(float* w, int64_t n) {
  float mx = w[0];
  for (int64_t i = 1; i < n; i++) mx = std::max(mx, w[i]);
  float z = 0.0f;
#pragma omp simd reduction(+ : z)
  for (int64_t i = 0; i < n; i++) {
    w[i] = vexpf(w[i] - mx);
    z += w[i];
  }
  const float inv = 1.0f / z;
#pragma omp simd
  for (int64_t i = 0; i < n; i++) w[i] *= inv;
  return mx + std::log(z);
}

// out_k (dh) = sum_i w_k[i] v_i for KB outputs at once: each source's slice is loaded once for all
// KB outputs, and the sums stay in registers over the sources (64 floats at a time: 4 KB vector
// accumulators). Adding a_i v_i into the output row source after source loaded and stored that
// row once per source: a third of the two-phase forward's time at d 128. off: the slice's offset
// in every source (n d + h dh). Summation order: sources in order, as before.
template <int KB>
[[gnu::always_inline]] inline void mix_slices(float* const* out, const float* const* w,
                                              const DepthSource* src, int64_t S, int64_t off,
                                              int64_t dh) {
  using simd::f16v;
  using simd::load;
  int64_t c = 0;
  for (; c + 64 <= dh; c += 64) {
    f16v acc[KB][4] = {};
    for (int64_t i = 0; i < S; i++) {
      const float* v = src[i].v + off + c;
      const f16v v0 = load(v), v1 = load(v + 16), v2 = load(v + 32), v3 = load(v + 48);
      for (int k = 0; k < KB; k++) {
        const float a = w[k][i];
        acc[k][0] += a * v0;
        acc[k][1] += a * v1;
        acc[k][2] += a * v2;
        acc[k][3] += a * v3;
      }
    }
    for (int k = 0; k < KB; k++) std::memcpy(out[k] + c, acc[k], sizeof acc[k]);
  }
  for (; c + 16 <= dh; c += 16) {
    f16v acc[KB] = {};
    for (int64_t i = 0; i < S; i++) {
      const f16v v0 = load(src[i].v + off + c);
      for (int k = 0; k < KB; k++) acc[k] += w[k][i] * v0;
    }
    for (int k = 0; k < KB; k++) std::memcpy(out[k] + c, &acc[k], sizeof acc[k]);
  }
  for (; c < dh; c++) {
    for (int k = 0; k < KB; k++) {
      float acc = 0.0f;
      for (int64_t i = 0; i < S; i++) acc += w[k][i] * src[i].v[off + c];
      out[k][c] = acc;
    }
  }
}

// mix_slices for any count K of outputs, in groups of up to four.
inline void mix_slices_any(float* const* out, const float* const* w, int64_t K,
                           const DepthSource* src, int64_t S, int64_t off, int64_t dh) {
  for (int64_t k = 0; k < K; k += 4) {
    switch (std::min<int64_t>(K - k, 4)) {
      case 1:
        mix_slices<1>(out + k, w + k, src, S, off, dh);
        break;
      case 2:
        mix_slices<2>(out + k, w + k, src, S, off, dh);
        break;
      case 3:
        mix_slices<3>(out + k, w + k, src, S, off, dh);
        break;
      default:
        mix_slices<4>(out + k, w + k, src, S, off, dh);
        break;
    }
  }
}

using row::sigmoid;

// Score of source i at row n, head h: qg . v over the head's slice, times the key's inverse RMS.
inline float score(const DepthSource& s, const float* q, int64_t n, int64_t h, const DepthMix& m) {
  const int64_t dh = m.dh();
  const float dot = dotf(q + h * dh, s.v + n * m.d + h * dh, dh);
  return m.key_norm ? dot * s.rstd[n * m.H + h] : dot;
}

// One (row, head) of a mixer's backward into one source v, given its score s = r (q . v) (r = rs,
// the key's inverse RMS, rsqrt(mean(v^2) + eps); 1 without key norm), its weight a (from the
// saved lse, or the sigmoid) and ds = d loss / d s (from a, dx . v and D = dx . x). With
// ds/dv = r q - s r^2 v / dh: dv += a dx + ds (r q - s r^2 v / dh) and dq += ds r v.
[[gnu::always_inline]] inline void mix_update_row(float* dvh, float* dqh, const float* vh,
                                                  const float* gh, const float* qh, float a,
                                                  float ds, float s, float rs, const DepthMix& m) {
  const int64_t dh = m.dh();
  const float dsr = ds * rs;
  const float kv = m.key_norm ? ds * s * rs * rs / static_cast<float>(dh) : 0.0f;
#pragma omp simd
  for (int64_t c = 0; c < dh; c++) {
    dvh[c] += a * gh[c] + dsr * qh[c] - kv * vh[c];
    dqh[c] += dsr * vh[c];
  }
}

// The backward's first pass at one (row n, head h) of source v: its score s = r (q . v) and
// dx . v, in one pass over v's slice (q: the reader's query, dx: its gradient rows).
[[gnu::always_inline]] inline void score_and_grad_dot(float* s, float* gv, const float* q,
                                                      const float* dx, const DepthSource& v,
                                                      int64_t n, int64_t h, const DepthMix& m) {
  const int64_t d = m.d, dh = m.dh();
  float qv;
  dot2(q + h * dh, dx + n * d + h * dh, v.v + n * d + h * dh, dh, &qv, gv);
  *s = m.key_norm ? qv * v.rstd[n * m.H + h] : qv;
}

// The weights a of nh scores s at once: exp(s - lse) against the rows' saved log-sum-exp
// (softmax; a vectorised exp), or sigmoid(s).
[[gnu::always_inline]] inline void tile_weights(float* a, const float* s, const float* lse,
                                                int64_t nh, bool softmax) {
  if (softmax) {
#pragma omp simd
    for (int64_t j = 0; j < nh; j++) a[j] = vexpf(s[j] - lse[j]);
  } else {
    for (int64_t j = 0; j < nh; j++) a[j] = sigmoid(s[j]);
  }
}

// A depth backward's updates from one reader over a tile of rows (depth_sources_backward and
// depth_mix_backward, pass 2), for heads of NV x 16 floats with a query shared by the rows: per
// head, the query slice and its gradient's sum stay in registers over the tile's rows and the G
// sources (mix_update_row loaded and stored the query gradient at every row). dv += a dx + ds r q
// - kv v; dq += ds r v. The key norm's kv term: applied here (KvInPlace), or summed per (source,
// row, head) into kv, for the caller to apply once after all the readers. dx, Dt: the reader's
// dx rows and the tile's D (Dt[r H + h]).
template <int NV, bool KvInPlace>
[[gnu::always_inline]] inline void update_tile(float* const* dv, const DepthSource* src, int64_t G,
                                               const float* dx, const float* qg, const float* Dt,
                                               float* dqk, const float* aw, const float* gv,
                                               const float* sc, float* kv, int64_t n0, int64_t nb,
                                               const DepthMix& m) {
  using simd::f16v;
  using simd::load;
  const int64_t d = m.d, H = m.H, dh = m.dh(), nh = nb * H;
  for (int64_t h = 0; h < H; h++) {
    f16v q[NV], acc[NV];
    for (int j = 0; j < NV; j++) {
      q[j] = load(qg + h * dh + 16 * j);
      acc[j] = f16v{};
    }
    for (int64_t r = 0; r < nb; r++) {
      const int64_t n = n0 + r;
      for (int64_t g = 0; g < G; g++) {
        const int64_t i = g * nh + r * H + h;
        const float rs = m.key_norm ? src[g].rstd[n * H + h] : 1.0f;
        const float ds =
            row::depth_score_grad(aw[i], gv[i], m.softmax ? Dt[r * H + h] : 0.0f, m.softmax);
        const float dsr = ds * rs, a = aw[i];
        const float k = m.key_norm ? ds * sc[i] * rs * rs / static_cast<float>(dh) : 0.0f;
        if (!KvInPlace) kv[i] += k;
        float* dvh = dv[g] + n * d + h * dh;
        const float* x = dx + n * d + h * dh;
        const float* vh = src[g].v + n * d + h * dh;
        for (int j = 0; j < NV; j++) {
          const f16v v = load(vh + 16 * j);
          f16v t = load(dvh + 16 * j);
          t += a * load(x + 16 * j);
          t += dsr * q[j];
          if (KvInPlace) t -= k * v;
          std::memcpy(dvh + 16 * j, &t, sizeof t);
          acc[j] += dsr * v;
        }
      }
    }
    float* dqh = dqk + h * dh;
    for (int j = 0; j < NV; j++) {
      const f16v t = load(dqh + 16 * j) + acc[j];
      std::memcpy(dqh + 16 * j, &t, sizeof t);
    }
  }
}

// update_tile for heads of nv x 16 floats (1 <= nv <= 8); false for other heads. (Inlined, like
// update_tile, into the kernels, which are compiled once per instruction set: dispatch.hpp.)
template <bool KvInPlace>
[[gnu::always_inline]] inline bool update_tile_any(int64_t nv, float* const* dv,
                                                   const DepthSource* src, int64_t G,
                                                   const float* dx, const float* qg,
                                                   const float* Dt, float* dqk, const float* aw,
                                                   const float* gv, const float* sc, float* kv,
                                                   int64_t n0, int64_t nb, const DepthMix& m) {
#define ATTNRES_UPDATE_TILE(NV)                                                         \
  case NV:                                                                              \
    update_tile<NV, KvInPlace>(dv, src, G, dx, qg, Dt, dqk, aw, gv, sc, kv, n0, nb, m); \
    return true;
  switch (nv) {
    ATTNRES_UPDATE_TILE(1)
    ATTNRES_UPDATE_TILE(2)
    ATTNRES_UPDATE_TILE(3)
    ATTNRES_UPDATE_TILE(4)
    ATTNRES_UPDATE_TILE(5)
    ATTNRES_UPDATE_TILE(6)
    ATTNRES_UPDATE_TILE(7)
    ATTNRES_UPDATE_TILE(8)
    default:
      return false;
  }
#undef ATTNRES_UPDATE_TILE
}

}  // namespace

ATTNRES_KERNEL
void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H, float eps) {
  const int64_t dh = d / H;
#pragma omp parallel for schedule(static) if (N > kSerialRows)
  for (int64_t n = 0; n < N; n++) {
    for (int64_t h = 0; h < H; h++) {
      const float* x = v + n * d + h * dh;
      const float ss = dotf(x, x, dh);
      rstd[n * H + h] = row::rms_scale(ss, dh, eps);
    }
  }
}

ATTNRES_KERNEL
void depth_mix_forward(float* x, float* lse, const DepthSource* src, int64_t S, const float* qg,
                       int64_t q_ld, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
  const int64_t TB = std::min(tile_rows(S, d), std::max<int64_t>(N, 1));
  const int64_t tiles = (N + TB - 1) / TB;
  // Per-thread scratch made before the region: an exception (out of memory) must not leave it.
  const int nthr = omp_get_max_threads();
  std::vector<float> scratch(static_cast<size_t>(nthr * TB * H * S));
#pragma omp parallel num_threads(nthr) if (N > kSerialRows)
  {
    float* a = scratch.data() + omp_get_thread_num() * TB * H * S;  // weights [row][head][source]
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t n0 = t * TB, nb = std::min(TB, N - n0);
      // Pass 1: every score of the tile, source by source (each source's rows are contiguous).
      for (int64_t i = 0; i < S; i++) {
        for (int64_t r = 0; r < nb; r++) {
          const int64_t n = n0 + r;
          if (r + kPrefetchRows < nb) prefetch_row(src[i].v + (n + kPrefetchRows) * d, d);
          for (int64_t h = 0; h < H; h++)
            a[(r * H + h) * S + i] = score(src[i], qg + n * q_ld, n, h, m);
        }
      }
      // Gates: softmax over the sources (vectorised exp) or sigmoid.
      for (int64_t rh = 0; rh < nb * H; rh++) {
        float* w = a + rh * S;
        if (m.softmax) {
          const float l = softmax_inplace(w, S);
          if (lse) lse[n0 * H + rh] = l;
        } else {
          for (int64_t i = 0; i < S; i++) w[i] = sigmoid(w[i]);
        }
      }
      // Pass 2: the weighted sums, row by row from the tile's rows still in cache.
      for (int64_t r = 0; r < nb; r++) {
        const int64_t n = n0 + r;
        for (int64_t h = 0; h < H; h++) {
          float* out = x + n * d + h * dh;
          const float* w = a + (r * H + h) * S;
          mix_slices<1>(&out, &w, src, S, n * d + h * dh, dh);
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
      for (int64_t i = 0; i < S; i++)
        mx = std::max(mx, s[i] = score(src[i], qg + n * q_ld, n, h, m));
      for (int64_t i = 0; i < S; i++) {
        s[i] = m.softmax ? std::exp(s[i] - mx) : 1.0 / (1.0 + std::exp(-s[i]));
        z += s[i];
      }
      for (int64_t i = 0; i < S; i++) wsum[i] += m.softmax ? s[i] / z : s[i];
    }
  }
}

ATTNRES_KERNEL
void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                        const DepthSource* src, int64_t S, const float* qg, int64_t q_ld,
                        const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
  const bool shared_q = q_ld == 0;
  const int64_t nv = dh % 16 == 0 && dh <= 128 ? dh / 16 : 0;  // (update_tile)
  const int nthr = omp_get_max_threads();
  const int64_t TB = backward_tile_rows(d);
  const int64_t tiles = (N + TB - 1) / TB;
  // Shared query: each thread sums its rows' query gradient privately; combined in thread order
  // below so results do not depend on scheduling.
  std::vector<float> part(shared_q ? static_cast<size_t>(nthr) * d : 0, 0.0f);
  std::vector<float> scratch(static_cast<size_t>(nthr * 4 * TB * H));  // made outside the region
#pragma omp parallel num_threads(nthr)
  {
    float* D = scratch.data() + omp_get_thread_num() * 4 * TB * H;  // dx . x per row and head
    float* sc = D + TB * H;  // one source's scores, weights and dx . v over the tile
    float* aw = sc + TB * H;
    float* gv = aw + TB * H;
    float* my_dq =
        shared_q ? part.data() + static_cast<int64_t>(omp_get_thread_num()) * d : nullptr;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t n0 = t * TB, nb = std::min(TB, N - n0);
      if (m.softmax) {
        for (int64_t r = 0; r < nb; r++) {
          const int64_t n = n0 + r;
          for (int64_t h = 0; h < H; h++)
            D[r * H + h] = dotf(dx + n * d + h * dh, x + n * d + h * dh, dh);
        }
      }
      // Source by source over the tile's rows (long contiguous runs of v and dv); the softmax
      // weight is known from the saved lse: q . v and dx . v in one pass over the tile, the
      // weights of the whole tile at once (a vectorised exp), then the updates while the rows
      // are in cache.
      const int64_t nh = nb * H;
      for (int64_t i = 0; i < S; i++) {
        for (int64_t r = 0; r < nb; r++) {
          const int64_t n = n0 + r;
          if (r + kPrefetchRows < nb) prefetch_row(src[i].v + (n + kPrefetchRows) * d, d);
          const float* q = qg + n * q_ld;
          for (int64_t h = 0; h < H; h++) {
            score_and_grad_dot(&sc[r * H + h], &gv[r * H + h], q, dx, src[i], n, h, m);
          }
        }
        tile_weights(aw, sc, m.softmax ? lse + n0 * H : nullptr, nh, m.softmax);
        float* const dvs[1] = {src[i].dv};
        if (shared_q && src[i].dv &&
            update_tile_any<true>(nv, dvs, src + i, 1, dx, qg, D, my_dq, aw, gv, sc, nullptr, n0,
                                  nb, m)) {
          continue;
        }
        for (int64_t r = 0; r < nb; r++) {
          const int64_t n = n0 + r;
          if (src[i].dv && r + kPrefetchRows < nb) {
            prefetch_row(src[i].dv + (n + kPrefetchRows) * d, d);
          }
          const float* q = qg + n * q_ld;
          float* dq = shared_q ? my_dq : dqg + n * d;
          for (int64_t h = 0; h < H; h++) {
            const int64_t j = r * H + h;
            const float rs = m.key_norm ? src[i].rstd[n * H + h] : 1.0f;
            const float ds =
                row::depth_score_grad(aw[j], gv[j], m.softmax ? D[j] : 0.0f, m.softmax);
            if (src[i].dv) {
              mix_update_row(src[i].dv + n * d + h * dh, dq + h * dh, src[i].v + n * d + h * dh,
                             dx + n * d + h * dh, q + h * dh, aw[j], ds, sc[j], rs, m);
            } else {
              const float dsr = ds * rs;
              const float* vh = src[i].v + n * d + h * dh;
              float* dqh = dq + h * dh;
#pragma omp simd
              for (int64_t c = 0; c < dh; c++) dqh[c] += dsr * vh[c];
            }
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

ATTNRES_KERNEL
void depth_dx_dot(float* D, const float* dx, const float* x, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    for (int64_t h = 0; h < H; h++)
      D[n * H + h] = dotf(dx + n * d + h * dh, x + n * d + h * dh, dh);
  }
}

ATTNRES_KERNEL
void depth_sources_backward(float* const* dv, const DepthSource* src, int64_t G,
                            const DepthReader* rd, int64_t K, float* dq, int64_t dq_stride,
                            int nthr, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
  const int64_t TB = backward_tile_rows(d);
  const int64_t tiles = (N + TB - 1) / TB;
  const int64_t tile = G * TB * H;  // one tile's (source, row, head) entries
  // Heads of up to 8 x 16 floats take update_tile (registers); others mix_update_row.
  const int64_t nv = dh % 16 == 0 && dh <= 128 ? dh / 16 : 0;
  // Per thread: a tile's scores s, weights a and dx . v, and update_tile's key-norm terms; made
  // outside the region.
  std::vector<float> scratch(static_cast<size_t>(nthr * 4 * tile));
#pragma omp parallel num_threads(nthr)
  {
    float* my_dq = dq + static_cast<int64_t>(omp_get_thread_num()) * dq_stride;
    float* sc = scratch.data() + static_cast<int64_t>(omp_get_thread_num()) * 4 * tile;
    float* aw = sc + tile;
    float* gv = aw + tile;
    float* kv = gv + tile;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t n0 = t * TB, nb = std::min(TB, N - n0), nh = nb * H;
      // The tiles of the G gradients stay in L2 across the readers.
      for (int64_t g = 0; g < G; g++) std::fill(dv[g] + n0 * d, dv[g] + (n0 + nb) * d, 0.0f);
      std::fill(kv, kv + tile, 0.0f);
      // Reader by reader, each streaming its dx over the tile once for all G sources.
      for (int64_t k = 0; k < K; k++) {
        const DepthReader& R = rd[k];
        float* dqk = my_dq + R.dq_offset;
        // Pass 1: q . v and dx . v of every (source, row, head) of the tile.
        for (int64_t r = 0; r < nb; r++) {
          const int64_t n = n0 + r;
          // One core keeps too few cache misses in flight to stream at full bandwidth, and the
          // hardware prefetchers lose track of many interleaved streams: fetch ahead explicitly.
          if (r + kPrefetchRows < nb) prefetch_row(R.dx + (n + kPrefetchRows) * d, d);
          for (int64_t g = 0; g < G; g++) {
            for (int64_t h = 0; h < H; h++) {
              const int64_t i = g * nh + r * H + h;
              score_and_grad_dot(&sc[i], &gv[i], R.qg, R.dx, src[g], n, h, m);
            }
          }
        }
        // The weights of the whole tile at once (a vectorised exp: one scalar expf per row and
        // reader was a sixth of this kernel's time at d 128).
        for (int64_t g = 0; g < G; g++) {
          tile_weights(aw + g * nh, sc + g * nh, m.softmax ? R.lse + n0 * H : nullptr, nh,
                       m.softmax);
        }
        // Pass 2: the updates, the rows of v and dx still in cache.
        if (update_tile_any<false>(nv, dv, src, G, R.dx, R.qg, R.D + n0 * H, dqk, aw, gv, sc, kv,
                                   n0, nb, m)) {
          continue;
        }
        for (int64_t r = 0; r < nb; r++) {
          const int64_t n = n0 + r;
          for (int64_t g = 0; g < G; g++) {
            for (int64_t h = 0; h < H; h++) {
              const int64_t i = g * nh + r * H + h;
              const float rs = m.key_norm ? src[g].rstd[n * H + h] : 1.0f;
              const float ds =
                  row::depth_score_grad(aw[i], gv[i], m.softmax ? R.D[n * H + h] : 0.0f, m.softmax);
              mix_update_row(dv[g] + n * d + h * dh, dqk + h * dh, src[g].v + n * d + h * dh,
                             R.dx + n * d + h * dh, R.qg + h * dh, aw[i], ds, sc[i], rs, m);
            }
          }
        }
      }
      // update_tile's key-norm terms, summed over the readers: dv -= kv v.
      if (nv > 0 && m.key_norm) {
        for (int64_t g = 0; g < G; g++) {
          for (int64_t r = 0; r < nb; r++) {
            for (int64_t h = 0; h < H; h++) {
              const float c = kv[g * nh + r * H + h];
              float* dvh = dv[g] + (n0 + r) * d + h * dh;
              const float* vh = src[g].v + (n0 + r) * d + h * dh;
#pragma omp simd
              for (int64_t e = 0; e < dh; e++) dvh[e] -= c * vh[e];
            }
          }
        }
      }
    }
  }
}

void depth_source_backward(float* dv, const DepthSource& src, const DepthReader* rd, int64_t K,
                           float* dq, int64_t dq_stride, int nthr, const DepthMix& m, int64_t N) {
  depth_sources_backward(&dv, &src, 1, rd, K, dq, dq_stride, nthr, m, N);
}

ATTNRES_KERNEL
void depth_mix_phase1(float* const* o, float* const* lse, const DepthSource* src, int64_t S,
                      const float* const* qg, int64_t K, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
  const int64_t TB = std::min(tile_rows(S, d), std::max<int64_t>(N, 1));
  const int64_t tiles = (N + TB - 1) / TB;
  const int nthr = omp_get_max_threads();
  std::vector<float> scratch(static_cast<size_t>(nthr * K * TB * H * S));  // outside the region
  std::vector<std::vector<float*>> outs(static_cast<size_t>(nthr),
                                        std::vector<float*>(static_cast<size_t>(K)));
  std::vector<std::vector<const float*>> ws(static_cast<size_t>(nthr),
                                            std::vector<const float*>(static_cast<size_t>(K)));
#pragma omp parallel num_threads(nthr) if (N > kSerialRows)
  {
    float* a =
        scratch.data() + omp_get_thread_num() * K * TB * H * S;  // [query][row][head][source]
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t n0 = t * TB, nb = std::min(TB, N - n0);
      // Each source row is loaded once and scored by all K queries (SPEC 4, phase 1).
      for (int64_t i = 0; i < S; i++) {
        for (int64_t r = 0; r < nb; r++) {
          const int64_t n = n0 + r;
          for (int64_t k = 0; k < K; k++) {
            for (int64_t h = 0; h < H; h++)
              a[((k * TB + r) * H + h) * S + i] = score(src[i], qg[k], n, h, m);
          }
        }
      }
      for (int64_t k = 0; k < K; k++) {
        for (int64_t rh = 0; rh < nb * H; rh++)
          lse[k][n0 * H + rh] = softmax_inplace(a + (k * TB * H + rh) * S, S);
      }
      // The K weighted sums of each row at once, from the tile's rows still in cache.
      std::vector<float*>& out = outs[static_cast<size_t>(omp_get_thread_num())];
      std::vector<const float*>& w = ws[static_cast<size_t>(omp_get_thread_num())];
      for (int64_t r = 0; r < nb; r++) {
        const int64_t n = n0 + r;
        for (int64_t h = 0; h < H; h++) {
          for (int64_t k = 0; k < K; k++) {
            out[static_cast<size_t>(k)] = o[k] + n * d + h * dh;
            w[static_cast<size_t>(k)] = a + ((k * TB + r) * H + h) * S;
          }
          mix_slices_any(out.data(), w.data(), K, src, S, n * d + h * dh, dh);
        }
      }
    }
  }
}

ATTNRES_KERNEL
void depth_mix_phase2(float* x, float* lse, const float* o1, const float* lse1,
                      const DepthSource& p, const float* qg, const DepthMix& m, int64_t N) {
  const int64_t d = m.d, H = m.H, dh = m.dh();
#pragma omp parallel for schedule(static) if (N > kSerialRows)
  for (int64_t n = 0; n < N; n++) {
    for (int64_t h = 0; h < H; h++) {
      const float s = score(p, qg, n, h, m);
      const float l1 = lse1[n * H + h];
      const float w = sigmoid(s - l1);  // weight of the new source after merging
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
