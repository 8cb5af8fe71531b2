// Causal attention without the (B,H,T,T) probabilities ("flash attention", Dao et al.): for bf16
// matmul precision on the GPU, in place of the batched GEMMs around the softmax kernels. Each warp
// owns 16 queries (or 16 keys) of one (sequence, head) and walks the other side in 16-row tiles;
// the products run on the tensor cores (WMMA, bf16 operands, fp32 accumulation), the softmax in
// fp32 in shared memory. Only the rows' log-sum-exp (B,H,T) is kept for the backward.
//   forward   two passes over the key tiles: the row max and sum (the log-sum-exp), then
//             O = sum softmax(S) V with the exact probabilities (no rescaling of O)
//   backward  D = rowsum(dO o O) (rows::AttnRowDot), then two kernels that each own what they
//             write, so no atomics and the result is deterministic: per key tile
//             dK += dS^T Q, dV += P^T dO over the query tiles at or after it (and over the query
//             heads of a GQA group); per query tile dQ += dS K over the key tiles up to it.
//             P = exp(scale S - lse), dS = scale P (dP - D), dP = dO V^T.
// Every warp is independent (its own slice of shared memory; only __syncwarp), so
// tests/test_flash_attention.cpp runs these bodies on 32 host threads per warp with the WMMA
// operations emulated (tests/wmma_emulation.hpp) against the CPU ops. C++17 (nvcc compiles it).
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
constexpr int kTile = 16;  // queries or keys per warp step (the WMMA tile)
using warp::kWarp;

struct Args {
  const float* qkv;   // q|k|v (B,T,ld)
  float* out;         // forward: O (B,T,H*hd)
  const float* o;     // backward: the forward's O (B,T,H*hd)
  const float* dout;  // backward: dO (B,T,H*hd)
  float* dqkv;        // backward: (B,T,ld) +=
  float* lse;         // (B,H,T): written by the forward, read by the backward
  const float* dsum;  // backward: D (B,H,T)
  int64_t B, T, H, Hkv, ld;
  float scale;
  ATTNRES_HD int64_t tiles() const { return (T + kTile - 1) / kTile; }
};

__device__ __forceinline__ int64_t lesser(int64_t x, int64_t y) { return x < y ? x : y; }

// The head dimensions with a kernel (a multiple of 16, so WMMA tiles cover it).
inline bool supported(int64_t hd) { return hd == 16 || hd == 32 || hd == 64 || hd == 128; }

// One warp's shared memory for head dimension HD; every part starts at a multiple of 32 bytes
// (WMMA's alignment) from a 128-byte aligned base.
template <int HD>
struct Smem {
  static constexpr int kRows = kTile * HD;  // one 16-row tile
  bf16 a[kRows];                            // this warp's own tile (Q, or K)
  bf16 b[kRows];                            // the other side's K (or Q)
  bf16 c[kRows];                            // V (or dO)
  bf16 g[kRows];                            // dO (dQ kernel: dO; dKV kernel: V)
  float s[kTile * kTile];                   // scores S
  float dp[kTile * kTile];                  // dP
  bf16 p[kTile * kTile];                    // P as an operand
  bf16 ds[kTile * kTile];                   // dS as an operand
  float stage[kRows];                       // accumulators on their way out
  float lse[kTile], dsum[kTile];            // per row of the query tile
};
static_assert(sizeof(Smem<16>) % 128 == 0 && sizeof(Smem<32>) % 128 == 0 &&
                  sizeof(Smem<64>) % 128 == 0 && sizeof(Smem<128>) % 128 == 0,
              "warp slices keep the 128-byte alignment");

// dst (16,HD) bf16 = rows [0, n) of src (row stride ld), zero beyond.
template <int HD>
__device__ __forceinline__ void load_tile(bf16* dst, const float* src, int64_t ld, int64_t n,
                                          int lane) {
  for (int i = lane; i < kTile * HD; i += kWarp) {
    const int r = i / HD, c = i % HD;
    dst[i] = __float2bfloat16_rn(r < n ? src[r * ld + c] : 0.0f);
  }
}

// s (16,16) fp32 = x (16,HD) y^T, x and y row-major tiles.
template <int HD>
__device__ __forceinline__ void products(float* s, const bf16* x, const bf16* y) {
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  ATTNRES_UNROLL
  for (int k = 0; k < HD; k += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;  // y^T
    wmma::load_matrix_sync(fa, x + k, HD);
    wmma::load_matrix_sync(fb, y + k, HD);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(s, acc, kTile, wmma::mem_row_major);
}

// acc[n] (16, 16-column slice n of HD) += op(m) (16,16) z (16,HD): m row-major (or transposed:
// col_major reads m^T), z a row-major tile.
template <int HD, class Layout>
__device__ __forceinline__ void accumulate(
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> (&acc)[HD / 16], const bf16* m,
    const bf16* z) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, Layout> fa;
  wmma::load_matrix_sync(fa, m, kTile);
  ATTNRES_UNROLL
  for (int n = 0; n < HD / 16; n++) {
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
    wmma::load_matrix_sync(fb, z + n * 16, HD);
    wmma::mma_sync(acc[n], fa, fb, acc[n]);
  }
}

// dst rows [0, n) (row stride ld) (+)= the accumulators, staged through shared memory.
template <int HD>
__device__ __forceinline__ void write_rows(
    float* dst, int64_t ld, int64_t n, bool add,
    const wmma::fragment<wmma::accumulator, 16, 16, 16, float> (&acc)[HD / 16], float* stage,
    int lane) {
  ATTNRES_UNROLL
  for (int k = 0; k < HD / 16; k++) wmma::store_matrix_sync(stage + k * 16, acc[k], HD, wmma::mem_row_major);
  __syncwarp();
  for (int i = lane; i < kTile * HD; i += kWarp) {
    const int r = i / HD, c = i % HD;
    if (r < n) dst[r * ld + c] = add ? dst[r * ld + c] + stage[i] : stage[i];
  }
  __syncwarp();
}

// Sequence b's rows from t0: head h's q, kv head kh's k and v, in q|k|v (B,T,ld).
__device__ __forceinline__ int64_t q_at(const Args& a, int64_t b, int64_t t0, int64_t h, int hd) {
  return (b * a.T + t0) * a.ld + h * hd;
}
__device__ __forceinline__ int64_t k_at(const Args& a, int64_t b, int64_t t0, int64_t kh, int hd) {
  return (b * a.T + t0) * a.ld + (a.H + kh) * hd;
}
__device__ __forceinline__ int64_t v_at(const Args& a, int64_t b, int64_t t0, int64_t kh, int hd) {
  return (b * a.T + t0) * a.ld + (a.H + a.Hkv + kh) * hd;
}

// Forward of unit (b, h, query tile qt): out rows and lse.
template <int HD>
__device__ void forward_warp(const Args& a, int64_t unit, int lane, Smem<HD>& m) {
  const int64_t nt = a.tiles(), qt = unit % nt, bh = unit / nt, h = bh % a.H, b = bh / a.H;
  const int64_t kh = h / (a.H / a.Hkv), t0 = qt * kTile, nq = lesser(kTile, a.T - t0);
  load_tile<HD>(m.a, a.qkv + q_at(a, b, t0, h, HD), a.ld, nq, lane);
  // Two lanes per query row r, 8 key columns each.
  const int r = lane / 2, c0 = (lane % 2) * 8;
  float mx = -INFINITY, l = 0.0f;
  for (int64_t kt = 0; kt <= qt; kt++) {  // pass 1: the row's max and sum
    const int64_t u0 = kt * kTile, nk = lesser(kTile, a.T - u0);
    __syncwarp();
    load_tile<HD>(m.b, a.qkv + k_at(a, b, u0, kh, HD), a.ld, nk, lane);
    __syncwarp();
    products<HD>(m.s, m.a, m.b);
    __syncwarp();
    float x[8], tmax = -INFINITY;
    for (int j = 0; j < 8; j++) {
      const int64_t u = u0 + c0 + j;
      x[j] = (r < nq && u <= t0 + r) ? a.scale * m.s[r * kTile + c0 + j] : -INFINITY;
      tmax = fmaxf(tmax, x[j]);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    const float nm = fmaxf(mx, tmax);
    float sum = 0.0f;
    if (nm != -INFINITY) {
      for (int j = 0; j < 8; j++) sum += ::expf(x[j] - nm);
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
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[HD / 16];
  for (int n = 0; n < HD / 16; n++) wmma::fill_fragment(acc[n], 0.0f);
  for (int64_t kt = 0; kt <= qt; kt++) {  // pass 2: O += softmax(S) V
    const int64_t u0 = kt * kTile, nk = lesser(kTile, a.T - u0);
    __syncwarp();
    load_tile<HD>(m.b, a.qkv + k_at(a, b, u0, kh, HD), a.ld, nk, lane);
    load_tile<HD>(m.c, a.qkv + v_at(a, b, u0, kh, HD), a.ld, nk, lane);
    __syncwarp();
    products<HD>(m.s, m.a, m.b);
    __syncwarp();
    for (int i = lane; i < kTile * kTile; i += kWarp) {
      const int rr = i / kTile;
      const int64_t u = u0 + i % kTile;
      const bool ok = rr < nq && u <= t0 + rr;
      m.p[i] = __float2bfloat16_rn(ok ? ::expf(a.scale * m.s[i] - m.lse[rr]) : 0.0f);
    }
    __syncwarp();
    accumulate<HD, wmma::row_major>(acc, m.p, m.c);
  }
  __syncwarp();
  write_rows<HD>(a.out + (b * a.T + t0) * a.H * HD + h * HD, a.H * HD, nq, false, acc, m.stage,
                 lane);
}

// P and dS (bf16, in m.p and m.ds) of query tile t0 (nq rows) against key tile u0 (nk rows), from
// m.s = Q K^T, m.dp = dO V^T and the rows' lse and D in m.lse, m.dsum.
template <int HD>
__device__ __forceinline__ void probabilities(const Args& a, int64_t t0, int64_t nq, int64_t u0,
                                              int64_t nk, Smem<HD>& m, int lane) {
  for (int i = lane; i < kTile * kTile; i += kWarp) {
    const int r = i / kTile, c = i % kTile;
    const bool ok = r < nq && c < nk && u0 + c <= t0 + r;
    const float p = ok ? ::expf(a.scale * m.s[i] - m.lse[r]) : 0.0f;
    m.p[i] = __float2bfloat16_rn(p);
    m.ds[i] = __float2bfloat16_rn(ok ? a.scale * p * (m.dp[i] - m.dsum[r]) : 0.0f);
  }
}

// The rows' lse and D of query tile t0 (nq rows) of head bh into shared memory.
__device__ __forceinline__ void load_rows(const Args& a, int64_t bh, int64_t t0, int64_t nq,
                                          float* lse, float* dsum, int lane) {
  if (lane < kTile) {
    lse[lane] = lane < nq ? a.lse[bh * a.T + t0 + lane] : 0.0f;
  } else {
    const int r = lane - kTile;
    dsum[r] = r < nq ? a.dsum[bh * a.T + t0 + r] : 0.0f;
  }
}

// dK, dV of unit (b, kv head kh, key tile kt): over the group's query heads and the query tiles
// at or after the key tile.
template <int HD>
__device__ void backward_kv_warp(const Args& a, int64_t unit, int lane, Smem<HD>& m) {
  const int64_t nt = a.tiles(), kt = unit % nt, bk = unit / nt, kh = bk % a.Hkv, b = bk / a.Hkv;
  const int64_t G = a.H / a.Hkv, u0 = kt * kTile, nk = lesser(kTile, a.T - u0);
  load_tile<HD>(m.a, a.qkv + k_at(a, b, u0, kh, HD), a.ld, nk, lane);  // K
  load_tile<HD>(m.g, a.qkv + v_at(a, b, u0, kh, HD), a.ld, nk, lane);  // V
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> dk[HD / 16], dv[HD / 16];
  for (int n = 0; n < HD / 16; n++) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  for (int64_t h = kh * G; h < (kh + 1) * G; h++) {
    const int64_t bh = b * a.H + h;
    for (int64_t qt = kt; qt < nt; qt++) {
      const int64_t t0 = qt * kTile, nq = lesser(kTile, a.T - t0);
      __syncwarp();
      load_tile<HD>(m.b, a.qkv + q_at(a, b, t0, h, HD), a.ld, nq, lane);           // Q
      load_tile<HD>(m.c, a.dout + (b * a.T + t0) * a.H * HD + h * HD, a.H * HD, nq, lane);  // dO
      load_rows(a, bh, t0, nq, m.lse, m.dsum, lane);
      __syncwarp();
      products<HD>(m.s, m.b, m.a);   // S = Q K^T
      products<HD>(m.dp, m.c, m.g);  // dP = dO V^T
      __syncwarp();
      probabilities<HD>(a, t0, nq, u0, nk, m, lane);
      __syncwarp();
      accumulate<HD, wmma::col_major>(dv, m.p, m.c);   // dV += P^T dO
      accumulate<HD, wmma::col_major>(dk, m.ds, m.b);  // dK += dS^T Q
    }
  }
  __syncwarp();
  write_rows<HD>(a.dqkv + k_at(a, b, u0, kh, HD), a.ld, nk, true, dk, m.stage, lane);
  write_rows<HD>(a.dqkv + v_at(a, b, u0, kh, HD), a.ld, nk, true, dv, m.stage, lane);
}

// dQ of unit (b, h, query tile qt): over the key tiles up to it.
template <int HD>
__device__ void backward_q_warp(const Args& a, int64_t unit, int lane, Smem<HD>& m) {
  const int64_t nt = a.tiles(), qt = unit % nt, bh = unit / nt, h = bh % a.H, b = bh / a.H;
  const int64_t kh = h / (a.H / a.Hkv), t0 = qt * kTile, nq = lesser(kTile, a.T - t0);
  load_tile<HD>(m.a, a.qkv + q_at(a, b, t0, h, HD), a.ld, nq, lane);                    // Q
  load_tile<HD>(m.g, a.dout + (b * a.T + t0) * a.H * HD + h * HD, a.H * HD, nq, lane);  // dO
  load_rows(a, bh, t0, nq, m.lse, m.dsum, lane);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> dq[HD / 16];
  for (int n = 0; n < HD / 16; n++) wmma::fill_fragment(dq[n], 0.0f);
  for (int64_t kt = 0; kt <= qt; kt++) {
    const int64_t u0 = kt * kTile, nk = lesser(kTile, a.T - u0);
    __syncwarp();
    load_tile<HD>(m.b, a.qkv + k_at(a, b, u0, kh, HD), a.ld, nk, lane);  // K
    load_tile<HD>(m.c, a.qkv + v_at(a, b, u0, kh, HD), a.ld, nk, lane);  // V
    __syncwarp();
    products<HD>(m.s, m.a, m.b);   // S = Q K^T
    products<HD>(m.dp, m.g, m.c);  // dP = dO V^T
    __syncwarp();
    probabilities<HD>(a, t0, nq, u0, nk, m, lane);
    __syncwarp();
    accumulate<HD, wmma::row_major>(dq, m.ds, m.b);  // dQ += dS K
  }
  __syncwarp();
  write_rows<HD>(a.dqkv + q_at(a, b, t0, h, HD), a.ld, nq, true, dq, m.stage, lane);
}

// Units: forward and dQ (B * H * tiles), dKV (B * Hkv * tiles).
inline int64_t query_units(const Args& a) { return a.B * a.H * a.tiles(); }
inline int64_t key_units(const Args& a) { return a.B * a.Hkv * a.tiles(); }

}  // namespace attnres::cuda::flash
