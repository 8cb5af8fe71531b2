// bf16 numbers as uint16_t bits: the top half of an fp32, rounded to nearest even. One definition
// for the CPU and the CUDA kernels (src/cuda/row_kernels.hpp uses these).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/host_device.hpp"

namespace attnres {

// Round to nearest, ties to even; NaN stays a (quiet) NaN. Bit-exact with
// __float2bfloat16_rn and torch's .to(torch.bfloat16).
ATTNRES_HD inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: keep sign, force quiet
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

ATTNRES_HD inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// out (n) = bf16(in (n)) on the host, threads over large n.
void to_bf16_host(uint16_t* out, const float* in, int64_t n);
// out (n) = float(in (n)) on the host.
void from_bf16_host(float* out, const uint16_t* in, int64_t n);

}  // namespace attnres
