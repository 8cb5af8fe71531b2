// Device copies of the small host arrays the kernels and batched GEMMs read (depth-source tables,
// GEMM pointer arrays), keyed by their bytes: a training step passes the same pointers every step
// (its buffers persist), so after the first step no table is copied again and no copy waits on
// the host. Equal bytes mean equal contents, so a hit is always correct, even for freed and reused
// addresses. C++17 (nvcc compiles it).
#pragma once

#include <string>
#include <unordered_map>

namespace attnres::cuda {

template <class Exec>
class TableCache {
 public:
  explicit TableCache(Exec& x) : x_(x) {}
  ~TableCache() {
    try {
      clear();
    } catch (...) {  // a failing device at exit: the process's memory goes with it
    }
  }
  TableCache(const TableCache&) = delete;
  TableCache& operator=(const TableCache&) = delete;

  // The executor-memory copy of `bytes` bytes at `host`.
  const void* get(const void* host, size_t bytes) {
    key_.assign(static_cast<const char*>(host), bytes);  // reuses its capacity: no allocation
    auto it = tables_.find(key_);
    if (it != tables_.end()) return it->second;
    if (tables_.size() >= kMaxTables) clear();  // shapes keep changing: start over
    void* d = x_.alloc(bytes);
    x_.upload(d, host, bytes);
    tables_.emplace(key_, d);
    return d;
  }
  void clear() {
    if (tables_.empty()) return;
    x_.synchronize();  // a queued kernel may still read a table
    for (auto& [key, p] : tables_) x_.release(p, key.size());
    tables_.clear();
  }
  size_t size() const { return tables_.size(); }

 private:
  static constexpr size_t kMaxTables = 4096;
  Exec& x_;
  std::unordered_map<std::string, void*> tables_;
  std::string key_;
};

}  // namespace attnres::cuda
