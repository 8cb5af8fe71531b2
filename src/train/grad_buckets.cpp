#include "train/grad_buckets.hpp"

#include <algorithm>
#include <climits>

#include "attnres/error.hpp"
#include "attnres/params.hpp"

namespace attnres {

GradBuckets::GradBuckets(dist::Communicator& comm, const ParamLayout& layout, float* grads,
                         const std::vector<int64_t>* shard_bounds)
    : comm_(comm),
      grads_(grads),
      total_(layout.total()),
      chunk_(std::min<int64_t>(comm.bucket_elems(), INT_MAX)) {
  need_.assign(static_cast<size_t>((total_ + chunk_ - 1) / chunk_), 0);
  for (const ParamEntry& e : layout.entries()) {
    for (int64_t b = e.offset / chunk_; b * chunk_ < e.offset + e.numel; b++) {
      need_[static_cast<size_t>(b)] +=
          std::min(e.offset + e.numel, (b + 1) * chunk_) - std::max(e.offset, b * chunk_);
    }
  }
  if (!shard_bounds) return;
  const std::vector<int64_t>& sb = *shard_bounds;
  check(static_cast<int>(sb.size()) == comm.size() + 1 && sb.front() == 0 && sb.back() == total_,
        "internal: shard bounds do not cover the gradients");
  for (size_t b = 0; b < need_.size(); b++) {
    const int64_t lo = static_cast<int64_t>(b) * chunk_, hi = std::min(total_, lo + chunk_);
    std::vector<int64_t>& c = counts_.emplace_back();
    for (size_t r = 0; r + 1 < sb.size(); r++) {
      c.push_back(std::max<int64_t>(0, std::min(hi, sb[r + 1]) - std::max(lo, sb[r])));
    }
  }
}

void GradBuckets::begin() {
  left_ = need_;
  sent_ = 0;
  for (size_t b = 0; b < left_.size(); b++) {
    if (left_[b] == 0) send(b);
  }
}

void GradBuckets::ready(int64_t offset, int64_t count) {
  for (int64_t b = offset / chunk_; b * chunk_ < offset + count; b++) {
    int64_t& left = left_[static_cast<size_t>(b)];
    left -= std::min(offset + count, (b + 1) * chunk_) - std::max(offset, b * chunk_);
    check(left >= 0, "internal: a gradient tensor was reported final twice");
    if (left == 0) send(static_cast<size_t>(b));
  }
}

void GradBuckets::send(size_t b) {
  float* data = grads_ + static_cast<int64_t>(b) * chunk_;
  if (counts_.empty()) {
    const int64_t n = std::min(chunk_, total_ - static_cast<int64_t>(b) * chunk_);
    reducer_.submit([this, data, n] { comm_.allreduce_sum(data, n); });
  } else {
    reducer_.submit([this, data, b] { comm_.reduce_scatter_sum(data, counts_[b]); });
  }
  sent_++;
}

void GradBuckets::finish() {
  reducer_.wait();
  check(sent_ == left_.size(), "internal: the backward left gradient buckets unreported");
}

}  // namespace attnres
