// Dot products with several independent accumulators. A plain `omp simd` reduction keeps ONE
// vector accumulator, so a 512-float dot is a chain of 32 dependent FMAs (latency-bound, ~4x
// slower than the load ports allow). These use GCC/Clang vector extensions: 16-float vectors that
// compile to AVX-512 with -march=native on this machine, and to pairs of AVX2 or quads of SSE
// registers elsewhere, so the code stays portable. Summation order differs from a serial loop
// (fixed, so results are still deterministic).
#pragma once

#include <cstdint>
#include <cstring>

namespace attnres::simd {

typedef float f16v __attribute__((vector_size(64)));

[[gnu::always_inline]] inline f16v load(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));

// The sum of v's lanes by halving (8 + 8, 4 + 4, then pairs): four shuffle-and-add steps. A lane
// by lane sum is a chain of 15 dependent adds: a sixth of the d-128 depth backward's time.
[[gnu::always_inline]] inline float hsum(f16v v) {
  const f8v h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v q =
      __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// a . b over n floats.
[[gnu::always_inline]] inline float dot(const float* a, const float* b, int64_t n) {
  f16v s0 = {}, s1 = {}, s2 = {}, s3 = {};
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) {
    s0 += load(a + c) * load(b + c);
    s1 += load(a + c + 16) * load(b + c + 16);
    s2 += load(a + c + 32) * load(b + c + 32);
    s3 += load(a + c + 48) * load(b + c + 48);
  }
  for (; c + 16 <= n; c += 16) s0 += load(a + c) * load(b + c);
  float s = hsum((s0 + s1) + (s2 + s3));
  for (; c < n; c++) s += a[c] * b[c];
  return s;
}

// max of a[0..n), n >= 1 (no NaN handling beyond the comparisons' own).
[[gnu::always_inline]] inline float max(const float* a, int64_t n) {
  int64_t c = 0;
  float m = a[0];
  if (n >= 16) {
    f16v m0 = load(a), m1 = m0;
    for (c = 0; c + 32 <= n; c += 32) {
      const f16v x0 = load(a + c), x1 = load(a + c + 16);
      m0 = x0 > m0 ? x0 : m0;
      m1 = x1 > m1 ? x1 : m1;
    }
    for (; c + 16 <= n; c += 16) {
      const f16v x0 = load(a + c);
      m0 = x0 > m0 ? x0 : m0;
    }
    m0 = m1 > m0 ? m1 : m0;
    for (int k = 0; k < 16; k++) m = m0[k] > m ? m0[k] : m;
  }
  for (; c < n; c++) m = a[c] > m ? a[c] : m;
  return m;
}

// (a . b, c . b) in one pass over b. Each result is bit-identical to dot()'s (same accumulators,
// same order): callers rely on that, e.g. a softmax over ONE source must give exactly weight 1
// and a score gradient of exactly 0 whether the score came from dot() or dot2().
[[gnu::always_inline]] inline void dot2(const float* a, const float* c, const float* b, int64_t n,
                                        float* ab, float* cb) {
  f16v s0 = {}, s1 = {}, s2 = {}, s3 = {}, t0 = {}, t1 = {}, t2 = {}, t3 = {};
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    const f16v b0 = load(b + k), b1 = load(b + k + 16), b2 = load(b + k + 32),
               b3 = load(b + k + 48);
    s0 += load(a + k) * b0;
    s1 += load(a + k + 16) * b1;
    s2 += load(a + k + 32) * b2;
    s3 += load(a + k + 48) * b3;
    t0 += load(c + k) * b0;
    t1 += load(c + k + 16) * b1;
    t2 += load(c + k + 32) * b2;
    t3 += load(c + k + 48) * b3;
  }
  for (; k + 16 <= n; k += 16) {
    const f16v b0 = load(b + k);
    s0 += load(a + k) * b0;
    t0 += load(c + k) * b0;
  }
  float s = hsum((s0 + s1) + (s2 + s3)), t = hsum((t0 + t1) + (t2 + t3));
  for (; k < n; k++) {
    s += a[k] * b[k];
    t += c[k] * b[k];
  }
  *ab = s;
  *cb = t;
}

}  // namespace attnres::simd
