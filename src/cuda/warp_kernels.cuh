// Fast GPU versions of the row functors whose one-thread-per-row form reads memory uncoalesced
// (src/cuda/row_kernels.hpp): one warp per row (or per (row, head) slice), each lane taking every
// 32nd channel, partial sums combined with warp shuffles. Same fields, same results to rounding;
// CudaExec (backend_cuda.cu) runs these in place of the functor's own operator() and the functors
// stay the reference: the cuda-host backend runs them on every machine, and the GPU tests compare
// the cuda backend with the CPU ops. Included by backend_cuda.cu, and by
// tests/test_warp_kernels.cpp, which runs each kernel on 32 host threads standing in for a warp's
// lanes (tests/warp_emulation.hpp) against its functor, so these kernels are tested on every
// machine too.
#pragma once

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

#include <cmath>

#include "cuda/row_kernels.hpp"

#if defined(__CUDACC__)
#define ATTNRES_UNROLL _Pragma("unroll")
#else
#define ATTNRES_UNROLL
#endif

namespace attnres::cuda::warp {

constexpr int kWarp = 32;
// The depth-mix kernels hold a row slice in registers, K channels per lane (K * 32 >= d/H; the
// launcher picks K from 4, 8, 16, 24, 32; wider slices fall back to the reference functor).

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Calls body(row, lane) with one warp per row (grid-stride over rows); blockDim.x is a multiple of
// 32, so every warp is whole and all its lanes share each row.
template <class Body>
__global__ void rows_kernel(Body body, int64_t rows) {
  const int lane = threadIdx.x % kWarp;
  const int64_t per_block = blockDim.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * per_block;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x / kWarp; r < rows;
       r += warps) {
    body(r, lane);
  }
}

// A source's (token, head) slice into the lane's registers vv[j] = channel lane + 32 j (0 past
// dh), from its bf16 copy where it has one: one branch per slice, not per element.
template <int kMaxPerLane>
__device__ inline void load_slice(float (&vv)[kMaxPerLane], const rows::Source& s, int64_t off,
                                  int64_t dh, int lane) {
  if (s.vb) {
    ATTNRES_UNROLL
    for (int j = 0; j < kMaxPerLane; j++) {
      const int64_t c = lane + j * kWarp;
      vv[j] = c < dh ? rows::bf16_bits_to_float(s.vb[off + c]) : 0.0f;
    }
  } else {
    ATTNRES_UNROLL
    for (int j = 0; j < kMaxPerLane; j++) {
      const int64_t c = lane + j * kWarp;
      vv[j] = c < dh ? s.v[off + c] : 0.0f;
    }
  }
}

// Calls run(Body<K>{args...}) with the smallest register tile K (channels per lane: 4, 8, 16, 24
// or 32) that holds a dh-channel slice; false, without calling it, when dh > 1024.
template <template <int> class Body, class Run, class... Args>
bool with_tile(int64_t dh, const Run& run, const Args&... args) {
  if (dh <= 4 * kWarp) return run(Body<4>{args...}), true;
  if (dh <= 8 * kWarp) return run(Body<8>{args...}), true;
  if (dh <= 16 * kWarp) return run(Body<16>{args...}), true;
  if (dh <= 24 * kWarp) return run(Body<24>{args...}), true;
  if (dh <= 32 * kWarp) return run(Body<32>{args...}), true;
  return false;
}

struct RmsNormForward {
  rows::RmsNormForward f;
  __device__ void operator()(int64_t n, int lane) const {
    const float* x = f.inp + n * f.C;
    float ss = 0.0f;
    for (int64_t c = lane; c < f.C; c += kWarp) ss += x[c] * x[c];
    const float r = ops::row::rms_scale(warp_sum(ss), f.C, f.eps);
    if (f.rstd && lane == 0) f.rstd[n] = r;
    for (int64_t c = lane; c < f.C; c += kWarp) f.out[n * f.C + c] = x[c] * r * f.g[c];
  }
};

struct RmsNormBackwardInput {
  rows::RmsNormBackwardInput f;
  __device__ void operator()(int64_t n, int lane) const {
    const float* x = f.inp + n * f.C;
    const float* dy = f.dout + n * f.C;
    const float r = f.rstd[n];
    float dot = 0.0f;
    for (int64_t c = lane; c < f.C; c += kWarp) dot += f.g[c] * dy[c] * x[c];
    const float k = r * r * r * warp_sum(dot) / static_cast<float>(f.C);
    for (int64_t c = lane; c < f.C; c += kWarp)
      f.dinp[n * f.C + c] += r * f.g[c] * dy[c] - k * x[c];
  }
};

// Online log-sum-exp per lane, then merged across the warp.
struct CrossEntropyForward {
  rows::CrossEntropyForward f;
  __device__ void operator()(int64_t n, int lane) const {
    const float* l = f.logits + n * f.V;
    float mx = -INFINITY, z = 0.0f;
    for (int64_t j = lane; j < f.V; j += kWarp) {
      const float v = l[j];
      if (v > mx) {
        z *= ::expf(mx - v);
        mx = v;
      }
      z += v == -INFINITY ? 0.0f : ::expf(v - mx);  // a -inf logit adds nothing (not NaN)
    }
    const float m = warp_max(mx);
    z = warp_sum(mx == -INFINITY ? 0.0f : z * ::expf(mx - m));
    if (lane == 0) {
      const float s = m + ::logf(z);
      f.lse[n] = s;
      if (f.losses) f.losses[n] = s - l[f.targets[n]];
    }
  }
};

struct DepthRstd {  // row = n * H + h
  rows::DepthRstd f;
  __device__ void operator()(int64_t idx, int lane) const {
    const int64_t dh = f.d / f.H, n = idx / f.H, h = idx % f.H;
    const float* x = f.v + n * f.d + h * dh;
    float ss = 0.0f;
    for (int64_t c = lane; c < dh; c += kWarp) ss += x[c] * x[c];
    ss = warp_sum(ss);
    if (lane == 0) f.rstd[idx] = ops::row::rms_scale(ss, dh, f.eps);
  }
};

// The depth mix of one (token, head) slice: the query slice and the running mix in registers,
// each source read once (coalesced across lanes), scores by warp reduction, online softmax.
template <int kMaxPerLane>
struct DepthMixForward {
  rows::DepthMixForward f;
  __device__ void operator()(int64_t idx, int lane) const {
    const rows::Mix& m = f.m;
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    const float* qh = f.q + n * f.q_ld + h * dh;
    float q[kMaxPerLane], acc[kMaxPerLane];
    ATTNRES_UNROLL
    for (int j = 0; j < kMaxPerLane; j++) {
      const int64_t c = lane + j * kWarp;
      q[j] = c < dh ? qh[c] : 0.0f;
      acc[j] = 0.0f;
    }
    float mx = -INFINITY, z = 0.0f;
    for (int64_t i = 0; i < f.S; i++) {
      float vv[kMaxPerLane], dot = 0.0f;
      load_slice(vv, f.src[i], off, dh, lane);
      ATTNRES_UNROLL
      for (int j = 0; j < kMaxPerLane; j++) dot += q[j] * vv[j];
      dot = warp_sum(dot);
      const float s = m.key_norm ? dot * f.src[i].rstd[idx] : dot;
      float w;
      if (m.softmax) {
        if (s > mx) {
          const float scale = ::expf(mx - s);  // 0 for the first source
          ATTNRES_UNROLL
          for (int j = 0; j < kMaxPerLane; j++) acc[j] *= scale;
          z *= scale;
          mx = s;
        }
        w = ::expf(s - mx);
        z += w;
      } else {
        w = rows::sigmoid(s);
      }
      ATTNRES_UNROLL
      for (int j = 0; j < kMaxPerLane; j++) acc[j] += w * vv[j];
    }
    const float inv = m.softmax ? 1.0f / z : 1.0f;
    ATTNRES_UNROLL
    for (int j = 0; j < kMaxPerLane; j++) {
      const int64_t c = lane + j * kWarp;
      if (c < dh) f.x[off + c] = acc[j] * inv;
    }
    if (m.softmax && f.lse && lane == 0) f.lse[idx] = mx + ::logf(z);
  }
};

// Backward of DepthMixForward for one (token, head) slice (see rows::DepthMixBackward): dx, x and
// the query slice in registers; per source one read of v, one read-modify-write of dv.
template <int kMaxPerLane>
struct DepthMixBackward {
  rows::DepthMixBackward f;
  __device__ void operator()(int64_t idx, int lane) const {
    const rows::Mix& m = f.m;
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    const float* qh = f.q + n * f.q_ld + h * dh;
    float q[kMaxPerLane], g[kMaxPerLane], dq[kMaxPerLane];
    float D = 0.0f;
    ATTNRES_UNROLL
    for (int j = 0; j < kMaxPerLane; j++) {
      const int64_t c = lane + j * kWarp;
      q[j] = c < dh ? qh[c] : 0.0f;
      g[j] = c < dh ? f.dx[off + c] : 0.0f;
      if (m.softmax && c < dh) D += g[j] * f.x[off + c];
      dq[j] = 0.0f;
    }
    if (m.softmax) D = warp_sum(D);
    const float lse = m.softmax ? f.lse[idx] : 0.0f;
    for (int64_t i = 0; i < f.S; i++) {
      float vv[kMaxPerLane], dot = 0.0f, gv = 0.0f;
      load_slice(vv, f.src[i], off, dh, lane);
      ATTNRES_UNROLL
      for (int j = 0; j < kMaxPerLane; j++) {
        dot += q[j] * vv[j];
        gv += g[j] * vv[j];
      }
      dot = warp_sum(dot);
      gv = warp_sum(gv);
      const float r = m.key_norm ? f.src[i].rstd[idx] : 1.0f;
      const float s = m.key_norm ? dot * r : dot;
      const float a = ops::row::depth_weight(s, lse, m.softmax);
      const float ds = ops::row::depth_score_grad(a, gv, D, m.softmax);
      const float k = m.key_norm ? s * r * r / static_cast<float>(dh) : 0.0f;
      if (f.src[i].dv) {
        float* dv = f.src[i].dv + off;
        ATTNRES_UNROLL
        for (int j = 0; j < kMaxPerLane; j++) {
          const int64_t c = lane + j * kWarp;
          if (c < dh) dv[c] += a * g[j] + ds * (r * q[j] - k * vv[j]);
        }
      }
      ATTNRES_UNROLL
      for (int j = 0; j < kMaxPerLane; j++) dq[j] += ds * r * vv[j];
    }
    ATTNRES_UNROLL
    for (int j = 0; j < kMaxPerLane; j++) {
      const int64_t c = lane + j * kWarp;
      if (c < dh) f.dq[off + c] += dq[j];
    }
  }
};

// dx . x over one (token, head) slice (see rows::DepthDxDot).
struct DepthDxDot {
  rows::DepthDxDot f;
  __device__ void operator()(int64_t idx, int lane) const {
    const rows::Mix& m = f.m;
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    float acc = 0.0f;
    for (int64_t c = lane; c < dh; c += kWarp) acc += f.dx[off + c] * f.x[off + c];
    acc = warp_sum(acc);
    if (lane == 0) f.D[idx] = acc;
  }
};

// The by-source backward for one (token, head) slice (see rows::DepthSourceBackward): the
// source's slice and its gradient in registers; per reader one read of its dx and its query.
template <int kMaxPerLane>
struct DepthSourceBackward {
  rows::DepthSourceBackward f;
  __device__ void operator()(int64_t idx, int lane) const {
    const rows::Mix& m = f.m;
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    float vv[kMaxPerLane], dv[kMaxPerLane];
    load_slice(vv, f.src, off, dh, lane);
    ATTNRES_UNROLL
    for (int j = 0; j < kMaxPerLane; j++) {
      const int64_t c = lane + j * kWarp;
      dv[j] = 0.0f;
      if (f.vout && c < dh) f.vout[off + c] = vv[j];
    }
    const float r = m.key_norm ? f.src.rstd[idx] : 1.0f;
    for (int64_t k = 0; k < f.K; k++) {
      const rows::Reader R = f.rd[k];
      const float* qh = R.qg + h * dh;
      const float* gh = R.dx + off;
      float q[kMaxPerLane], g[kMaxPerLane], qv = 0.0f, gv = 0.0f;
      ATTNRES_UNROLL
      for (int j = 0; j < kMaxPerLane; j++) {
        const int64_t c = lane + j * kWarp;
        q[j] = c < dh ? qh[c] : 0.0f;
        g[j] = c < dh ? gh[c] : 0.0f;
        qv += q[j] * vv[j];
        gv += g[j] * vv[j];
      }
      qv = warp_sum(qv);
      gv = warp_sum(gv);
      const float s = m.key_norm ? qv * r : qv;
      const float a = ops::row::depth_weight(s, R.lse[idx], m.softmax);
      const float ds = ops::row::depth_score_grad(a, gv, R.D[idx], m.softmax);
      const float kk = m.key_norm ? s * r * r / static_cast<float>(dh) : 0.0f;
      ATTNRES_UNROLL
      for (int j = 0; j < kMaxPerLane; j++) dv[j] += a * g[j] + ds * (r * q[j] - kk * vv[j]);
      if (lane == 0) f.dsr[(h * f.K + k) * f.N + n] = ds * r;
    }
    ATTNRES_UNROLL
    for (int j = 0; j < kMaxPerLane; j++) {
      const int64_t c = lane + j * kWarp;
      if (c < dh) f.dv[off + c] = dv[j];
    }
  }
};

// Phase 1 of two-phase Block AttnRes for queries [k0, k0 + kn), kn <= kQueries: each source slice
// is read once and scored by all of them (the reference functor runs the queries one by one).
constexpr int kQueries = 4;
template <int kMaxPerLane>
struct DepthMixPhase1 {
  rows::DepthMixPhase1 f;
  int64_t k0, kn;
  __device__ void operator()(int64_t idx, int lane) const {
    const rows::Mix& m = f.m;
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    float acc[kQueries][kMaxPerLane], mx[kQueries], z[kQueries];
    ATTNRES_UNROLL
    for (int k = 0; k < kQueries; k++) {
      mx[k] = -INFINITY;
      z[k] = 0.0f;
      ATTNRES_UNROLL
      for (int j = 0; j < kMaxPerLane; j++) acc[k][j] = 0.0f;
    }
    for (int64_t i = 0; i < f.S; i++) {
      float vv[kMaxPerLane];
      load_slice(vv, f.src[i], off, dh, lane);
      const float r = m.key_norm ? f.src[i].rstd[idx] : 1.0f;
      ATTNRES_UNROLL
      for (int k = 0; k < kQueries; k++) {
        if (k >= kn) break;  // uniform across the warp
        const float* qh = f.q[k0 + k] + h * dh;
        float dot = 0.0f;
        ATTNRES_UNROLL
        for (int j = 0; j < kMaxPerLane; j++) {
          const int64_t c = lane + j * kWarp;
          if (c < dh) dot += qh[c] * vv[j];
        }
        const float s = warp_sum(dot) * r;
        if (s > mx[k]) {
          const float scale = ::expf(mx[k] - s);
          ATTNRES_UNROLL
          for (int j = 0; j < kMaxPerLane; j++) acc[k][j] *= scale;
          z[k] *= scale;
          mx[k] = s;
        }
        const float w = ::expf(s - mx[k]);
        z[k] += w;
        ATTNRES_UNROLL
        for (int j = 0; j < kMaxPerLane; j++) acc[k][j] += w * vv[j];
      }
    }
    ATTNRES_UNROLL
    for (int k = 0; k < kQueries; k++) {
      if (k >= kn) break;
      float* o = f.o[k0 + k] + off;
      const float inv = 1.0f / z[k];
      ATTNRES_UNROLL
      for (int j = 0; j < kMaxPerLane; j++) {
        const int64_t c = lane + j * kWarp;
        if (c < dh) o[c] = acc[k][j] * inv;
      }
      if (lane == 0) f.lse[k0 + k][idx] = mx[k] + ::logf(z[k]);
    }
  }
};

struct DepthMixPhase2 {  // row = n * H + h
  rows::DepthMixPhase2 f;
  __device__ void operator()(int64_t idx, int lane) const {
    const rows::Mix& m = f.m;
    const int64_t n = idx / m.H, h = idx % m.H, dh = m.dh(), off = n * m.d + h * dh;
    const float* qh = f.q + h * dh;
    float dot = 0.0f;
    for (int64_t c = lane; c < dh; c += kWarp) dot += qh[c] * f.p.at(off + c);
    dot = warp_sum(dot);
    const float s = m.key_norm ? dot * f.p.rstd[idx] : dot;
    const float l1 = f.lse1[idx];
    const float w = rows::sigmoid(s - l1);
    for (int64_t c = lane; c < dh; c += kWarp) {
      f.x[off + c] = f.o1[off + c] + w * (f.p.at(off + c) - f.o1[off + c]);
    }
    __syncwarp();  // every lane has read lse1 before lane 0 writes lse (in place: the same)
    if (lane == 0) {
      const float mxs = fmaxf(s, l1);
      f.lse[idx] = mxs + ::logf(::expf(l1 - mxs) + ::expf(s - mxs));
    }
  }
};

struct AttnSoftmaxForward {  // row r = (b H + h) T + t
  rows::AttnSoftmaxForward f;
  __device__ void operator()(int64_t r, int lane) const {
    const int64_t T = f.T, t = r % T;
    float* a = f.att + r * T;
    float mx = -INFINITY;
    for (int64_t u = lane; u <= t; u += kWarp) mx = fmaxf(mx, a[u]);
    mx = warp_max(mx);
    float z = 0.0f;
    for (int64_t u = lane; u <= t; u += kWarp) {
      const float e = ::expf(a[u] - mx);
      a[u] = e;
      z += e;
    }
    const float inv = 1.0f / warp_sum(z);
    for (int64_t u = lane; u < T; u += kWarp) a[u] = u <= t ? a[u] * inv : 0.0f;
  }
};

struct AttnSoftmaxBackward {
  rows::AttnSoftmaxBackward f;
  __device__ void operator()(int64_t r, int lane) const {
    const int64_t T = f.T, t = r % T;
    const float* p = f.att + r * T;
    float* g = f.d + r * T;
    float dot = 0.0f;
    for (int64_t u = lane; u <= t; u += kWarp) dot += p[u] * g[u];
    dot = warp_sum(dot);
    for (int64_t u = lane; u < T; u += kWarp) g[u] = u <= t ? f.scale * p[u] * (g[u] - dot) : 0.0f;
  }
};

// Flash attention's D: one warp per (b, t, h) row, lanes over the head's channels.
struct AttnRowDot {  // row i = (b T + t) H + h
  rows::AttnRowDot f;
  __device__ void operator()(int64_t i, int lane) const {
    const float* x = f.o + i * f.hd;
    const float* y = f.g + i * f.hd;
    float s = 0.0f;
    for (int64_t c = lane; c < f.hd; c += kWarp) s += x[c] * y[c];
    s = warp_sum(s);
    if (lane == 0) {
      const int64_t h = i % f.H, bt = i / f.H, b = bt / f.T, t = bt % f.T;
      f.d[(b * f.H + h) * f.T + t] = s;
    }
  }
};

// KV-cache decoding, one chunk of cached keys per warp (rows::AttnDecodePartial): lanes over the
// head's channels (the query and the running output in registers), one warp sum per key.
struct AttnDecodePartial {  // row = i C + c
  static constexpr int kPerLane = 8;
  static constexpr int64_t kMaxHead = kPerLane * kWarp;  // wider heads: the reference
  rows::AttnDecodePartial f;
  __device__ void operator()(int64_t idx, int lane) const {
    const int64_t i = idx / f.C, c = idx % f.C, t = i / f.H, h = i % f.H, hd = f.hd;
    const int64_t kv = (h / (f.H / f.Hkv)) * hd, ld = f.Hkv * hd, last = f.pos0 + t;
    const float scale = 1.0f / ::sqrtf(static_cast<float>(hd));
    float q[kPerLane], o[kPerLane];
    ATTNRES_UNROLL
    for (int k = 0; k < kPerLane; k++) {
      const int64_t e = lane + k * kWarp;
      q[k] = e < hd ? f.q[i * hd + e] : 0.0f;
      o[k] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int64_t u = c * f.KC; u < (c + 1) * f.KC && u <= last; u++) {
      const float* kr = f.kc + u * ld + kv;
      const float* vr = f.vc + u * ld + kv;
      float s = 0.0f;
      ATTNRES_UNROLL
      for (int k = 0; k < kPerLane; k++) {
        const int64_t e = lane + k * kWarp;
        if (e < hd) s += q[k] * kr[e];
      }
      s = warp_sum(s) * scale;
      if (s > m) {  // every lane has the same s, m and l
        const float r = ::expf(m - s);
        l *= r;
        ATTNRES_UNROLL
        for (int k = 0; k < kPerLane; k++) o[k] *= r;
        m = s;
      }
      const float p = ::expf(s - m);
      l += p;
      ATTNRES_UNROLL
      for (int k = 0; k < kPerLane; k++) {
        const int64_t e = lane + k * kWarp;
        if (e < hd) o[k] += p * vr[e];
      }
    }
    float* out = f.part + idx * (hd + 2);
    ATTNRES_UNROLL
    for (int k = 0; k < kPerLane; k++) {
      const int64_t e = lane + k * kWarp;
      if (e < hd) out[e] = o[k];
    }
    if (lane == 0) {
      out[hd] = m;
      out[hd + 1] = l;
    }
  }
};

}  // namespace attnres::cuda::warp
