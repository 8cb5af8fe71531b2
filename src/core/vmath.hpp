// Vectorisable elementwise math. glibc's expf is a scalar call that compilers only vectorise under
// -ffast-math; this one is plain branch-free arithmetic, so `omp simd` loops turn it into AVX-512
// (or AVX2, or SSE) code with IEEE semantics kept for everything else. tests/test_ops.cpp checks it
// against std::exp over the whole float range.
#pragma once

#include <bit>
#include <cstdint>

namespace attnres {

// e^x with a relative error below 3e-7 (a few ulp) for x in [-87.3, 88.72]; inputs outside are
// clamped to that range (so e^-inf returns 1.2e-38 instead of 0, and nothing overflows). NaN in,
// NaN out (so a diverged loss stays detectable).
inline float vexpf(float x) {
  // Branch-free clamp (selects) and rounding, so loops calling this vectorise (std::floor would
  // not: GCC vectorises it only without trapping math).
  x = x < -87.3365f ? -87.3365f : x;
  x = x > 88.72f ? 88.72f : x;
  // NaN passes both clamps. Keep it out of n, whose float -> int conversion below is undefined
  // behaviour for NaN (UBSan reported it on a diverged run); it still reaches r, so the result
  // is NaN.
  const float xn = x == x ? x : 0.0f;
  // x = n ln2 + r, |r| <= ln2 / 2; ln2 split in two parts so n * ln2_hi is exact.
  // Round to nearest by adding and removing 1.5 * 2^23 (exact for |t| < 2^22).
  const float n = (xn * 1.44269504f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  // e^r by its degree-6 Taylor polynomial (error < 2e-8 on |r| <= 0.347), Horner form.
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // times 2^n = 2^n1 * 2^n2, each factor built in the exponent bits (|n| <= 128, so both
  // n1 + 127 and n2 + 127 stay well inside [1, 254]).
  const int32_t ni = static_cast<int32_t>(n), n1 = ni / 2, n2 = ni - n1;
  return p * std::bit_cast<float>((n1 + 127) << 23) * std::bit_cast<float>((n2 + 127) << 23);
}

}  // namespace attnres
