// The process's address space: how much it holds, and whether more could be had now. Used
// where a failure later would be costly (before --overwrite deletes an old run, before oneDNN
// JIT-compiles a kernel, which crashed instead of failing when the mapping was refused).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <fstream>

namespace attnres {

// The bytes of address space this process holds (/proc/self/statm), or 0 when unknown.
inline size_t address_space_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0;
  if (!(statm >> pages)) return 0;
  return pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

// Whether `bytes` more address space could be had now (mapped, not touched, and given back).
inline bool address_space_spare(size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return false;
  ::munmap(p, bytes);
  return true;
}

}  // namespace attnres
