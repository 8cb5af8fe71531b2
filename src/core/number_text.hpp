// A number as the shortest text that reads back as that number: for values a message tells the
// user to give (31st hostile pass: a share of 0.123456789 printed with %g as 0.123457 was then
// refused as larger than itself).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace attnres {

inline std::string exact_text(double x) {
  char b[40];
  for (int digits = 6; digits <= 17; digits++) {
    std::snprintf(b, sizeof b, "%.*g", digits, x);
    if (std::strtod(b, nullptr) == x) break;
  }
  return b;
}

}  // namespace attnres
