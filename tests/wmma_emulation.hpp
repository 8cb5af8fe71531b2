// The few CUDA WMMA operations src/cuda/flash_attention.cuh uses (16x16x16 tiles, bf16 operands,
// fp32 accumulators), __nv_bfloat16 and __syncwarp, on the host, for kernels run by
// tests/warp_emulation.hpp's 32 lane threads. Each lane's fragment holds the whole tile (a real
// fragment spreads it over the lanes in an unspecified layout, so kernels may only load, multiply,
// fill and store fragments, never index them: these fragments have no x[]). Loads check WMMA's
// rules (32-byte aligned pointers, ldm a multiple of 16 bytes); a store writes each lane's share
// without synchronising, as on the hardware.
// Include after warp_emulation.hpp and before the kernels.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "warp_emulation.hpp"

struct __nv_bfloat16 {
  uint16_t bits;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {  // round to nearest even (no NaN inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

// Logical element (i, j) of the 16x16 tile (A: M x K, B: K x N, C: M x N) in v[i][j].
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation has 16x16x16 tiles only");
  float v[16][16];
};

namespace detail {
inline void check_operand(const void* p, unsigned ldm, size_t elem) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * elem) % 16 != 0) {
    std::fprintf(stderr, "wmma emulation: misaligned operand %p or ldm %u\n", p, ldm);
    std::abort();
  }
}
inline float value(const __nv_bfloat16& x) { return __bfloat162float(x); }
inline float value(const float& x) { return x; }
}  // namespace detail

template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  detail::check_operand(p, ldm, sizeof(T));
  for (int i = 0; i < 16; i++) {
    for (int j = 0; j < 16; j++) {
      f.v[i][j] =
          detail::value(std::is_same_v<Layout, row_major> ? p[i * ldm + j] : p[j * ldm + i]);
    }
  }
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t l) {
  detail::check_operand(p, ldm, sizeof(float));
  for (int i = 0; i < 16; i++) {
    for (int j = 0; j < 16; j++) f.v[i][j] = l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i];
  }
}
// Like the hardware's, no synchronisation: each lane writes its own 8 of the 256 elements (which
// ones is unspecified on a GPU; here every 32nd), so other lanes see the whole tile only after a
// __syncwarp.
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t l) {
  detail::check_operand(p, ldm, sizeof(float));
  for (int e = warp_emulation::lane; e < 256; e += warp_emulation::kLanes) {
    const int i = e / 16, j = e % 16;
    (l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i]) = f.v[i][j];
  }
}
template <class Use, class T, class Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float x) {
  for (auto& row : f.v) {
    for (float& e : row) e = x;
  }
}
// d = a b + c: products of bf16 values are exact in fp32; accumulated in fp32.
template <class T, class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  float r[16][16];
  for (int i = 0; i < 16; i++) {
    for (int j = 0; j < 16; j++) {
      float s = c.v[i][j];
      for (int k = 0; k < 16; k++) s += a.v[i][k] * b.v[k][j];
      r[i][j] = s;
    }
  }
  std::memcpy(d.v, r, sizeof r);
}

}  // namespace nvcuda::wmma
