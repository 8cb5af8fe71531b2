// make_device_reducer (attnres/dist.hpp): gradients in a backend's memory summed over the ranks.
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "backend/backend.hpp"
#include "dist/nccl.hpp"

namespace attnres::dist {

namespace {

class DirectReducer final : public DeviceReducer {
 public:
  explicit DirectReducer(Communicator& comm) : comm_(comm) {}
  void allreduce_sum(float* data, int64_t n) override { comm_.allreduce_sum(data, n); }
  std::string method() const override { return "direct"; }

 private:
  Communicator& comm_;
};

// Device memory through a host buffer, one all-reduce bucket at a time.
class StagedReducer final : public DeviceReducer {
 public:
  StagedReducer(Communicator& comm, Backend& be) : comm_(comm), be_(be) {}
  void allreduce_sum(float* data, int64_t n) override {
    const int64_t bucket = comm_.bucket_elems();
    host_.resize(static_cast<size_t>(std::min(n, bucket)));
    for (int64_t i = 0; i < n; i += bucket) {
      const int64_t m = std::min(bucket, n - i);
      be_.download(host_.data(), data + i, sizeof(float) * m);
      comm_.allreduce_sum(host_.data(), m);
      be_.upload(data + i, host_.data(), sizeof(float) * m);
    }
  }
  std::string method() const override { return "staged"; }

 private:
  Communicator& comm_;
  Backend& be_;
  std::vector<float> host_;
};

}  // namespace

std::unique_ptr<DeviceReducer> make_device_reducer(Communicator& comm, Backend& be,
                                                   std::string* note) {
  std::string want;
  if (const char* v = std::getenv("ATTNRES_DEVICE_REDUCE")) want = v;
  check(want.empty() || want == "direct" || want == "staged" || want == "nccl",
        "ATTNRES_DEVICE_REDUCE must be direct, staged or nccl, got '" + want + "'");
  check(want != "nccl" || !be.host_memory(),
        "ATTNRES_DEVICE_REDUCE=nccl needs GPU memory; device " + be.name() +
            " keeps its tensors in host memory (unset it, or use direct or staged)");
  if (want == "direct" || (want.empty() && be.host_memory())) {
    check(be.host_memory(),
          "ATTNRES_DEVICE_REDUCE=direct needs host memory; device " + be.name() + " has its own");
    return std::make_unique<DirectReducer>(comm);
  }
  if (want == "staged") return std::make_unique<StagedReducer>(comm, be);
  std::string why;
  auto nccl = make_nccl_reducer(comm, &why);  // collective: null on every rank or on none
  if (nccl) return nccl;
  check(want != "nccl", "ATTNRES_DEVICE_REDUCE=nccl: NCCL is unavailable: " + why);
  if (note) *note = "NCCL unavailable (" + why + "): gradients are summed through host memory";
  return std::make_unique<StagedReducer>(comm, be);
}

}  // namespace attnres::dist
