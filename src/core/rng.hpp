// Portable deterministic random numbers: the same seed gives the same stream on every platform
// (std:: distributions are implementation-defined, so we do not use them).
#pragma once

#include <cmath>
#include <cstdint>

namespace attnres {

// splitmix64: a strong 64-bit mixer; also used to derive independent streams from (seed, ids).
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(splitmix64(seed)) {}
  uint64_t next_u64() { return state_ = splitmix64(state_); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Standard normal via Box-Muller (one value per call; simple and portable).
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace attnres
