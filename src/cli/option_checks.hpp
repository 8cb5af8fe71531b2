// Checks of option values that CLI11's conversions would bend: an unsigned 64-bit value out of
// range (-1, 2^64 or more) was saturated to 2^64-1 without a word (sixteenth hostile pass).
#pragma once

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <string>

namespace attnres::cli {

// A whole number in [0, 2^64 - 1], in decimal digits only.
inline CLI::Validator uint64_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        const char* end = s.data() + s.size();
        const auto r = std::from_chars(s.data(), end, v);
        if (s.empty() || r.ec != std::errc() || r.ptr != end) {
          return "'" + s + "' is not a whole number in [0, 18446744073709551615]";
        }
        return "";
      },
      "UINT64");
}

}  // namespace attnres::cli
