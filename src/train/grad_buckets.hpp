// The gradient all-reduce of data-parallel training overlapped with the backward pass: the
// flat gradient buffer is cut into fixed buckets (bucket_elems() values from offset 0, the
// bounds comm.allreduce_sum uses on the whole buffer); as the backward reports tensors final
// (Model::GradReady), each bucket whose tensors are all final is handed to a BackgroundReducer,
// which sums it over the ranks while the backward goes on. Same buckets, same sums: the result
// is bit-identical to comm.allreduce_sum(grads, total) after the backward.
#pragma once

#include <cstdint>
#include <vector>

#include "attnres/dist.hpp"

namespace attnres {

class ParamLayout;

class GradBuckets {
 public:
  GradBuckets(dist::Communicator& comm, const ParamLayout& layout, float* grads);
  // Before the backward whose gradients are summed: every bucket is waiting again (and those
  // holding no tensor, only alignment padding, are sent at once).
  void begin();
  // (offset, count) of one tensor is final (every tensor once between begin and finish).
  void ready(int64_t offset, int64_t count);
  // Waits until every bucket is summed; Error if a tensor was not reported.
  void finish();
  int64_t buckets() const { return static_cast<int64_t>(need_.size()); }

 private:
  void send(size_t b);

  dist::BackgroundReducer reducer_;
  float* grads_;
  int64_t total_, chunk_;
  std::vector<int64_t> need_;  // per bucket: tensor values in it
  std::vector<int64_t> left_;  // per bucket: of those, not yet final
  size_t sent_ = 0;
};

}  // namespace attnres
