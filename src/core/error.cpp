// The out-of-memory Error, the cause of a caught exception and a shell word (attnres/error.hpp).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <new>

#include "attnres/error.hpp"

namespace attnres {

Error out_of_memory(const std::string& what, double bytes, const std::string& fix) {
  char size[32];
  if (bytes >= 1024.0 * 1024 * 1024) {
    std::snprintf(size, sizeof size, "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
  } else {
    std::snprintf(size, sizeof size, "%.0f MiB", bytes / (1024.0 * 1024));
  }
  return Error("out of memory: " + what + " need " + size + ", more than this process could get; " +
               fix + " (or raise ulimit -v)");
}

std::string cause_of(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e)) {
    return "out of memory (this process could get no more; raise ulimit -v or free memory)";
  }
  return e.what();
}

std::string shell_word(const std::string& s) {
  const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("_./:=@%+,-", c) != nullptr;
  });
  if (plain) return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace attnres
