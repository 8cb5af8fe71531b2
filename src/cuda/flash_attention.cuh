// Causal attention without the (B,H,T,T) probabilities ("flash attention", Dao et al.): for bf16
// matmul precision on the GPU, in place of the batched GEMMs around the softmax kernels. A block
// of kWarps warps owns a 64-row tile of queries (or keys) of one (sequence, head), each warp 16 of
// its rows, and walks the other side in 64-row tiles that the block loads into shared memory once
// (fp32 from q|k|v, converted to bf16 on the way). Products run on the tensor cores (WMMA 16x16x16,
// bf16 operands, fp32 accumulation), the softmax in fp32 in each warp's shared memory. Only the
// rows' log-sum-exp (B,H,T) is kept for the backward.
//   forward   two passes over the key tiles: each row's max and sum (its log-sum-exp), then
//             O = sum softmax(S) V with the exact probabilities (no rescaling of O)
//   backward  D = rowsum(dO o O) (rows::AttnRowDot), then two kernels that each own what they
//             write, so no atomics and the result is deterministic: per key tile
//             dK += dS^T Q, dV += P^T dO over the query tiles at or after it (and over the query
//             heads of a GQA group, or per query head into shares summed afterwards: Args);
//             per query tile dQ += dS K over the key tiles up to it.
//             P = exp(scale S - lse), dS = scale P (dP - D), dP = dO V^T.
// Warps synchronise with __syncwarp and the block with __syncthreads (every warp reaches every
// __syncthreads, rows past T or not). tests/test_flash_attention.cpp runs these bodies on host
// threads (32 per warp, a block's warps together) with the WMMA operations emulated
// (tests/wmma_emulation.hpp) against the CPU ops. C++17 (nvcc compiles it).
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <mma.h>
#endif

#include <cmath>
#include <cstdint>

#include "cuda/warp_kernels.cuh"

namespace attnres::cuda::flash {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;
using warp::kWarp;
constexpr int kTile = 16;               // a warp's rows (the WMMA tile)
constexpr int kWarps = 4;               // warps per block
constexpr int kBlock = kTile * kWarps;  // a block's rows, and the other side's tile

struct Args {
  const float* qkv;   // q|k|v (B,T,ld)
  float* out;         // forward: O (B,T,H*hd)
  const float* dout;  // backward: dO (B,T,H*hd)
  float* dqkv;        // backward: (B,T,ld) +=
  float* lse;         // (B,H,T): written by the forward, read by the backward
  const float* dsum;  // backward: D (B,H,T)
  // GQA (H > Hkv): dK, dV per query head (B,H,T,hd) each, summed over each group afterwards
  // (rows::GqaSum), so every query head is a block of its own; null: one block per kv head.
  float* dk_part = nullptr;
  float* dv_part = nullptr;
  int64_t B, T, H, Hkv, ld;
  float scale;
  ATTNRES_HD int64_t tiles() const { return (T + kBlock - 1) / kBlock; }
};

__device__ __forceinline__ int64_t lesser(int64_t x, int64_t y) { return x < y ? x : y; }

// The head dimensions with a kernel (a multiple of 16, so WMMA tiles cover it).
inline bool supported(int64_t hd) { return hd == 16 || hd == 32 || hd == 64 || hd == 128; }

// Shared memory of a block for head dimension HD. Every part starts at a multiple of 32 bytes
// (WMMA's alignment) from a 128-byte aligned base.
template <int HD>
struct Smem {
  static constexpr int kRows = kTile * HD;  // one warp's 16 rows
  struct Warp {
    bf16 a[kRows];                  // this warp's rows: Q (forward, dQ) or K (dK/dV)
    bf16 b[kRows];                  // dO (dQ) or V (dK/dV)
    float s[kTile * kBlock];        // S (16 x 64): this warp's rows against the tile's
    float dp[kTile * kBlock];       // dP, the same shape
    bf16 p[kTile * kBlock];         // P as an operand
    bf16 ds[kTile * kBlock];        // dS as an operand
    float stage[kRows];             // accumulators on their way out
    float lse[kTile], dsum[kTile];  // this warp's query rows
  };
  bf16 x[kBlock * HD];              // the shared tile: K (forward, dQ) or Q (dK/dV)
  bf16 y[kBlock * HD];              // V (forward, dQ) or dO (dK/dV)
  float lse[kBlock], dsum[kBlock];  // dK/dV: the query tile's rows
  Warp w[kWarps];
};
static_assert(sizeof(Smem<16>) % 128 == 0 && sizeof(Smem<32>) % 128 == 0 &&
                  sizeof(Smem<64>) % 128 == 0 && sizeof(Smem<128>) % 128 == 0,
              "block slices keep the 128-byte alignment");
static_assert(sizeof(Smem<16>::Warp) % 128 == 0 && sizeof(Smem<128>::Warp) % 128 == 0,
              "warp slices keep the 128-byte alignment");

// Four consecutive floats of src (16-byte aligned: rows and head offsets are multiples of 4).
__device__ __forceinline__ void load4(float (&v)[4], const float* src) {
#if defined(__CUDACC__)
  const float4 f = *reinterpret_cast<const float4*>(src);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
#else
  for (int i = 0; i < 4; i++) v[i] = src[i];
#endif
}

// dst (R,HD) bf16 = rows [0, n) of src (row stride ld), zero beyond; `threads` threads, this one
// `tid`, four channels at a time.
template <int HD>
__device__ __forceinline__ void load_rows(bf16* dst, const float* src, int64_t ld, int64_t n, int R,
                                          int tid, int threads) {
  for (int i = tid * 4; i < R * HD; i += threads * 4) {
    const int r = i / HD, c = i % HD;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r < n) load4(v, src + r * ld + c);
    for (int j = 0; j < 4; j++) dst[i + j] = __float2bfloat16_rn(v[j]);
  }
}

// s (16, 64) fp32 = x (16,HD) y^T with y (64,HD): row-major tiles, s with leading dimension 64.
template <int HD>
__device__ __forceinline__ void products(float* s, const bf16* x, const bf16* y) {
  ATTNRES_UNROLL
  for (int n = 0; n < kBlock / 16; n++) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    ATTNRES_UNROLL
    for (int k = 0; k < HD; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;  // y^T
      wmma::load_matrix_sync(fa, x + k, HD);
      wmma::load_matrix_sync(fb, y + n * 16 * HD + k, HD);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(s + n * 16, acc, kBlock, wmma::mem_row_major);
  }
}

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// acc[n] (16, 16-column slice n of HD) += m (16,64) z (64,HD), both row-major.
template <int HD>
__device__ __forceinline__ void accumulate(Acc (&acc)[HD / 16], const bf16* m, const bf16* z) {
  ATTNRES_UNROLL
  for (int k = 0; k < kBlock / 16; k++) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, m + k * 16, kBlock);
    ATTNRES_UNROLL
    for (int n = 0; n < HD / 16; n++) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, z + k * 16 * HD + n * 16, HD);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// dst rows [0, n) (row stride ld) (+)= the accumulators, staged through shared memory.
template <int HD>
__device__ __forceinline__ void write_rows(float* dst, int64_t ld, int64_t n, bool add,
                                           const Acc (&acc)[HD / 16], float* stage, int lane) {
  ATTNRES_UNROLL
  for (int k = 0; k < HD / 16; k++) {
    wmma::store_matrix_sync(stage + k * 16, acc[k], HD, wmma::mem_row_major);
  }
  __syncwarp();
  for (int i = lane; i < kTile * HD; i += kWarp) {
    const int r = i / HD, c = i % HD;
    if (r < n) dst[r * ld + c] = add ? dst[r * ld + c] + stage[i] : stage[i];
  }
  __syncwarp();
}

// Offsets of sequence b's row t0: head h's q, kv head kh's k and v, in q|k|v (B,T,ld).
__device__ __forceinline__ int64_t q_at(const Args& a, int64_t b, int64_t t0, int64_t h, int hd) {
  return (b * a.T + t0) * a.ld + h * hd;
}
__device__ __forceinline__ int64_t k_at(const Args& a, int64_t b, int64_t t0, int64_t kh, int hd) {
  return (b * a.T + t0) * a.ld + (a.H + kh) * hd;
}
__device__ __forceinline__ int64_t v_at(const Args& a, int64_t b, int64_t t0, int64_t kh, int hd) {
  return (b * a.T + t0) * a.ld + (a.H + a.Hkv + kh) * hd;
}
__device__ __forceinline__ int64_t o_at(const Args& a, int64_t b, int64_t t0, int64_t h, int hd) {
  return (b * a.T + t0) * a.H * hd + h * hd;
}

// Forward of unit (b, h, query tile qt), warp w of the block.
template <int HD>
__device__ void forward_block(const Args& a, int64_t unit, int w, int lane, Smem<HD>& sm) {
  const int64_t nt = a.tiles(), qt = unit % nt, bh = unit / nt, h = bh % a.H, b = bh / a.H;
  const int64_t kh = h / (a.H / a.Hkv), t0 = qt * kBlock + w * kTile;  // this warp's first row
  const int64_t nq = t0 < a.T ? lesser(kTile, a.T - t0) : 0;
  const int tid = w * kWarp + lane, threads = kWarps * kWarp;
  typename Smem<HD>::Warp& m = sm.w[w];
  load_rows<HD>(m.a, a.qkv + q_at(a, b, t0 < a.T ? t0 : 0, h, HD), a.ld, nq, kTile, lane, kWarp);
  // Two lanes per query row r, 32 key columns each.
  const int r = lane / 2, c0 = (lane % 2) * 32;
  float mx = -INFINITY, l = 0.0f;
  for (int64_t kt = 0; kt <= qt; kt++) {  // pass 1: each row's max and sum
    const int64_t u0 = kt * kBlock, nk = lesser(kBlock, a.T - u0);
    __syncthreads();  // every warp is done with the previous tile
    load_rows<HD>(sm.x, a.qkv + k_at(a, b, u0, kh, HD), a.ld, nk, kBlock, tid, threads);
    __syncthreads();
    products<HD>(m.s, m.a, sm.x);
    __syncwarp();
    float tmax = -INFINITY;
    for (int j = 0; j < 32; j++) {
      const int64_t u = u0 + c0 + j;
      if (r < nq && u <= t0 + r) tmax = fmaxf(tmax, a.scale * m.s[r * kBlock + c0 + j]);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    const float nm = fmaxf(mx, tmax);
    float sum = 0.0f;
    if (nm != -INFINITY) {
      for (int j = 0; j < 32; j++) {
        const int64_t u = u0 + c0 + j;
        if (r < nq && u <= t0 + r) sum += ::expf(a.scale * m.s[r * kBlock + c0 + j] - nm);
      }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (nm != -INFINITY) {
      l = l * ::expf(mx - nm) + sum;
      mx = nm;
    }
  }
  const float lse = r < nq ? mx + ::logf(l) : 0.0f;  // a valid row sees its own key: l >= 1
  if (lane % 2 == 0) {
    m.lse[r] = lse;
    if (r < nq) a.lse[bh * a.T + t0 + r] = lse;
  }
  Acc acc[HD / 16];
  for (int n = 0; n < HD / 16; n++) wmma::fill_fragment(acc[n], 0.0f);
  for (int64_t kt = 0; kt <= qt; kt++) {  // pass 2: O += softmax(S) V
    const int64_t u0 = kt * kBlock, nk = lesser(kBlock, a.T - u0);
    __syncthreads();
    load_rows<HD>(sm.x, a.qkv + k_at(a, b, u0, kh, HD), a.ld, nk, kBlock, tid, threads);
    load_rows<HD>(sm.y, a.qkv + v_at(a, b, u0, kh, HD), a.ld, nk, kBlock, tid, threads);
    __syncthreads();
    products<HD>(m.s, m.a, sm.x);
    __syncwarp();
    for (int i = lane; i < kTile * kBlock; i += kWarp) {
      const int rr = i / kBlock;
      const int64_t u = u0 + i % kBlock;
      const bool ok = rr < nq && u <= t0 + rr;
      m.p[i] = __float2bfloat16_rn(ok ? ::expf(a.scale * m.s[i] - m.lse[rr]) : 0.0f);
    }
    __syncwarp();
    accumulate<HD>(acc, m.p, sm.y);
  }
  write_rows<HD>(a.out + o_at(a, b, t0 < a.T ? t0 : 0, h, HD), a.H * HD, nq, false, acc, m.stage,
                 lane);
}

// P and dS (bf16, into p and ds; R rows of 64 columns) from s = the raw scores, dp = dP, where
// element (i, j) pairs query t(i, j) and key u(i, j); lse and D per query via the callbacks.
// `ok(i, j)` says whether the pair is inside the causal mask and the sequence.
template <class Ok, class Query>
__device__ __forceinline__ void probabilities(const Args& a, const float* s, const float* dp,
                                              bf16* p, bf16* ds, const Ok& ok, const Query& query,
                                              const float* lse, const float* dsum, int lane) {
  for (int i = lane; i < kTile * kBlock; i += kWarp) {
    const int r = i / kBlock, c = i % kBlock;
    const bool in = ok(r, c);
    const int qi = query(r, c);
    const float pv = in ? ::expf(a.scale * s[i] - lse[qi]) : 0.0f;
    p[i] = __float2bfloat16_rn(pv);
    ds[i] = __float2bfloat16_rn(in ? a.scale * pv * (dp[i] - dsum[qi]) : 0.0f);
  }
}

// dK, dV of unit (b, kv head kh, key tile kt), warp w: over the group's query heads and the query
// tiles at or after the key tile (with dk_part: unit (b, query head h, key tile kt), that head's
// share only). The warp's products are transposed (its 16 keys against the tile's 64 queries):
// S^T = K Q^T, dP^T = V dO^T, so P^T and dS^T are row-major operands.
template <int HD>
__device__ void backward_kv_block(const Args& a, int64_t unit, int w, int lane, Smem<HD>& sm) {
  const bool part = a.dk_part != nullptr;
  const int64_t nt = a.tiles(), kt = unit % nt, bk = unit / nt, G = a.H / a.Hkv;
  const int64_t heads = part ? a.H : a.Hkv, hx = bk % heads, b = bk / heads;
  const int64_t kh = part ? hx / G : hx, h_begin = part ? hx : kh * G,
                h_end = part ? hx + 1 : (kh + 1) * G;
  const int64_t u0 = kt * kBlock + w * kTile;  // this warp's first key
  const int64_t nk = u0 < a.T ? lesser(kTile, a.T - u0) : 0, us = u0 < a.T ? u0 : 0;
  const int tid = w * kWarp + lane, threads = kWarps * kWarp;
  typename Smem<HD>::Warp& m = sm.w[w];
  load_rows<HD>(m.a, a.qkv + k_at(a, b, us, kh, HD), a.ld, nk, kTile, lane, kWarp);  // K
  load_rows<HD>(m.b, a.qkv + v_at(a, b, us, kh, HD), a.ld, nk, kTile, lane, kWarp);  // V
  Acc dk[HD / 16], dv[HD / 16];
  for (int n = 0; n < HD / 16; n++) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  for (int64_t h = h_begin; h < h_end; h++) {
    const int64_t bh = b * a.H + h;
    for (int64_t qt = kt; qt < nt; qt++) {
      const int64_t t0 = qt * kBlock, nq = lesser(kBlock, a.T - t0);
      __syncthreads();
      load_rows<HD>(sm.x, a.qkv + q_at(a, b, t0, h, HD), a.ld, nq, kBlock, tid, threads);  // Q
      load_rows<HD>(sm.y, a.dout + o_at(a, b, t0, h, HD), a.H * HD, nq, kBlock, tid,
                    threads);  // dO
      for (int i = tid; i < kBlock; i += threads) {
        sm.lse[i] = i < nq ? a.lse[bh * a.T + t0 + i] : 0.0f;
        sm.dsum[i] = i < nq ? a.dsum[bh * a.T + t0 + i] : 0.0f;
      }
      __syncthreads();
      if (u0 >= t0 + nq)
        continue;                     // every query of the tile is before these keys (no barrier
                                      // follows before the next __syncthreads)
      products<HD>(m.s, m.a, sm.x);   // S^T (16 keys, 64 queries)
      products<HD>(m.dp, m.b, sm.y);  // dP^T
      __syncwarp();
      probabilities(
          a, m.s, m.dp, m.p, m.ds,
          [&](int r, int c) { return r < nk && c < nq && u0 + r <= t0 + c; },
          [](int, int c) { return c; }, sm.lse, sm.dsum, lane);
      __syncwarp();
      accumulate<HD>(dv, m.p, sm.y);   // dV += P^T dO
      accumulate<HD>(dk, m.ds, sm.x);  // dK += dS^T Q
    }
  }
  if (part) {  // this head's share, (B,H,T,hd)
    const int64_t off = ((b * a.H + hx) * a.T + us) * HD;
    write_rows<HD>(a.dk_part + off, HD, nk, false, dk, m.stage, lane);
    write_rows<HD>(a.dv_part + off, HD, nk, false, dv, m.stage, lane);
    return;
  }
  write_rows<HD>(a.dqkv + k_at(a, b, us, kh, HD), a.ld, nk, true, dk, m.stage, lane);
  write_rows<HD>(a.dqkv + v_at(a, b, us, kh, HD), a.ld, nk, true, dv, m.stage, lane);
}

// dQ of unit (b, h, query tile qt), warp w: over the key tiles up to it.
template <int HD>
__device__ void backward_q_block(const Args& a, int64_t unit, int w, int lane, Smem<HD>& sm) {
  const int64_t nt = a.tiles(), qt = unit % nt, bh = unit / nt, h = bh % a.H, b = bh / a.H;
  const int64_t kh = h / (a.H / a.Hkv), t0 = qt * kBlock + w * kTile;  // this warp's first row
  const int64_t nq = t0 < a.T ? lesser(kTile, a.T - t0) : 0, ts = t0 < a.T ? t0 : 0;
  const int tid = w * kWarp + lane, threads = kWarps * kWarp;
  typename Smem<HD>::Warp& m = sm.w[w];
  load_rows<HD>(m.a, a.qkv + q_at(a, b, ts, h, HD), a.ld, nq, kTile, lane, kWarp);       // Q
  load_rows<HD>(m.b, a.dout + o_at(a, b, ts, h, HD), a.H * HD, nq, kTile, lane, kWarp);  // dO
  if (lane < kTile) {
    m.lse[lane] = lane < nq ? a.lse[bh * a.T + t0 + lane] : 0.0f;
    m.dsum[lane] = lane < nq ? a.dsum[bh * a.T + t0 + lane] : 0.0f;
  }
  Acc dq[HD / 16];
  for (int n = 0; n < HD / 16; n++) wmma::fill_fragment(dq[n], 0.0f);
  for (int64_t kt = 0; kt <= qt; kt++) {
    const int64_t u0 = kt * kBlock, nk = lesser(kBlock, a.T - u0);
    __syncthreads();
    load_rows<HD>(sm.x, a.qkv + k_at(a, b, u0, kh, HD), a.ld, nk, kBlock, tid, threads);  // K
    load_rows<HD>(sm.y, a.qkv + v_at(a, b, u0, kh, HD), a.ld, nk, kBlock, tid, threads);  // V
    __syncthreads();
    if (nq == 0) continue;
    products<HD>(m.s, m.a, sm.x);   // S (16 queries, 64 keys)
    products<HD>(m.dp, m.b, sm.y);  // dP
    __syncwarp();
    probabilities(
        a, m.s, m.dp, m.p, m.ds, [&](int r, int c) { return r < nq && u0 + c <= t0 + r; },
        [](int r, int) { return r; }, m.lse, m.dsum, lane);
    __syncwarp();
    accumulate<HD>(dq, m.ds, sm.x);  // dQ += dS K
  }
  write_rows<HD>(a.dqkv + q_at(a, b, ts, h, HD), a.ld, nq, true, dq, m.stage, lane);
}

// Units (blocks): forward and dQ B * H * tiles, dK/dV B * Hkv * tiles (with dk_part B * H * tiles).
inline int64_t query_units(const Args& a) { return a.B * a.H * a.tiles(); }
inline int64_t key_units(const Args& a) { return a.B * (a.dk_part ? a.H : a.Hkv) * a.tiles(); }

}  // namespace attnres::cuda::flash
