// The out-of-memory Error (attnres/error.hpp).
#include <cstdio>

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

}  // namespace attnres
