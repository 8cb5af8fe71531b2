// The out-of-memory Error and the cause of a caught exception (attnres/error.hpp).
#include <cstdio>
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

}  // namespace attnres
