// Deterministic parallel reductions: OpenMP's `reduction` clause combines the threads' partial
// sums in arrival order, so with 3+ threads a sum can change in its last bits from run to run.
// Runs must be bit-reproducible (resume, comparisons), so sums go through here instead.
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

namespace attnres {

// sum over i in [0, n) of term(i), in double; per-thread partials over static chunks, combined in
// thread order: the same result for the same n and thread count.
template <class F>
double deterministic_sum(int64_t n, F term) {
  const int nthr = omp_get_max_threads();
  std::vector<double> part(nthr, 0.0);
#pragma omp parallel num_threads(nthr)
  {
    double s = 0.0;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) s += term(i);
    part[omp_get_thread_num()] = s;
  }
  double total = 0.0;
  for (double p : part) total += p;
  return total;
}

// An exception must not leave an OpenMP region: it would end the process (std::terminate,
// "terminate called after throwing ..."), e.g. oneDNN's out-of-memory Error from a GEMM inside a
// parallel loop under `ulimit -v`. Loop bodies run through run(): the first exception is kept,
// later bodies are skipped, and rethrow() raises it after the region.
class RegionErrors {
 public:
  template <class F>
  void run(F&& body) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      body();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!first_) first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::exception_ptr first_;
};

}  // namespace attnres
