#include "train/grad_buckets.hpp"

#include <algorithm>
#include <climits>

#include "attnres/error.hpp"
#include "attnres/params.hpp"

namespace attnres {

GradBuckets::GradBuckets(dist::Communicator& comm, const ParamLayout& layout, float* grads)
    : reducer_(comm),
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
  const int64_t off = static_cast<int64_t>(b) * chunk_;
  reducer_.submit(grads_ + off, std::min(chunk_, total_ - off));
  sent_++;
}

void GradBuckets::finish() {
  reducer_.wait();
  check(sent_ == left_.size(), "internal: the backward left gradient buckets unreported");
}

}  // namespace attnres
