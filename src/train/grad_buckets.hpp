// The gradient sum of data-parallel training, overlapped with the backward pass: the flat
// gradient buffer is cut into fixed buckets (bucket_elems() values from offset 0, the bounds
// comm.allreduce_sum uses on the whole buffer); as the backward reports tensors final
// (Model::GradReady), each bucket whose tensors are all final is handed to a BackgroundReducer,
// which sums it over the ranks while the backward goes on. Same buckets, same sums: the result
// is bit-identical to comm.allreduce_sum(grads, total) after the backward.
// ZeRO-1 (shard bounds given): each bucket is reduce-scattered instead, so each rank receives
// only the part of it in its own shard [bounds[rank], bounds[rank + 1]) summed (the rest of its
// buffer is left unsummed).
#pragma once

#include <cstdint>
#include <vector>

#include "attnres/dist.hpp"

namespace attnres {

class ParamLayout;

class GradBuckets {
 public:
  // shard_bounds: null to all-reduce, else the ranks' shards (size() + 1 bounds) to reduce-scatter.
  GradBuckets(dist::Communicator& comm, const ParamLayout& layout, float* grads,
              const std::vector<int64_t>* shard_bounds = nullptr);
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

  dist::Communicator& comm_;
  float* grads_;
  int64_t total_, chunk_;
  std::vector<int64_t> need_;                 // per bucket: tensor values in it
  std::vector<int64_t> left_;                 // per bucket: of those, not yet final
  std::vector<std::vector<int64_t>> counts_;  // ZeRO-1, per bucket: its values in each shard
  size_t sent_ = 0;
  dist::BackgroundReducer reducer_;  // (last: destroyed, so drained, first)
};

}  // namespace attnres
