// attnres/buffer.hpp — large activation, parameter and optimizer buffers on transparent huge pages.
//
// The AttnRes depth mix and the optimizer stream tens of (N,d) arrays; with 4 KiB pages every
// 2 MiB of them costs 512 TLB entries, and the page walks showed up as ~20 % of the depth-mix
// backward. Allocations of 2 MiB or more are therefore aligned to 2 MiB and marked
// MADV_HUGEPAGE (Linux transparent huge pages in their default "madvise" mode); smaller ones,
// and systems without THP, get ordinary memory. Contents and sizes are unaffected.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace attnres {

template <class T>
struct LargePageAllocator {
  using value_type = T;
  static constexpr size_t kHuge = size_t{2} << 20;

  LargePageAllocator() = default;
  template <class U>
  LargePageAllocator(const LargePageAllocator<U>&) {}

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHuge) return static_cast<T*>(::operator new(bytes));
    const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = std::aligned_alloc(kHuge, rounded);
    if (p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    ::madvise(p, rounded, MADV_HUGEPAGE);  // advisory: failure just means 4 KiB pages
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHuge) {
      ::operator delete(p);
    } else {
      std::free(p);
    }
  }
  template <class U>
  bool operator==(const LargePageAllocator<U>&) const {
    return true;
  }
};

// A float buffer that may live on huge pages; otherwise a std::vector<float>.
using FloatBuf = std::vector<float, LargePageAllocator<float>>;

}  // namespace attnres
