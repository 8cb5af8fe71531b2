// The NCCL gradient all-reduce of multi-GPU data-parallel training (src/dist/nccl.hpp). NCCL is
// loaded with dlopen when a run needs it (libnccl.so.2 on the library path), so attnres links
// and runs without it; only the handful of functions used are looked up. One NCCL communicator
// per process, bootstrapped through the MPI communicator (rank 0's unique id broadcast); the
// all-reduce is queued on the legacy default stream, which the cuda backend's own stream (a
// blocking stream: backend_cuda.cu) is ordered with, so it runs after the backward that produced
// the gradients and before the update that reads them.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <string>

#include "attnres/error.hpp"
#include "dist/nccl.hpp"

namespace attnres::dist {

namespace {

struct NcclApi {
  ncclResult_t (*get_unique_id)(ncclUniqueId*) = nullptr;
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                             cudaStream_t) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;

  // Loads the library once per process; false with the reason in *why.
  static const NcclApi* load(std::string* why) {
    static NcclApi api;
    static std::string error;
    static const bool ok = [] {
      void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        const char* e = dlerror();
        error = std::string("cannot load libnccl.so.2 (") + (e ? e : "?") +
                "); add its folder to LD_LIBRARY_PATH";
        return false;
      }
      auto sym = [&](auto& fn, const char* name) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
        if (!fn) error = std::string("libnccl.so.2 has no ") + name;
        return fn != nullptr;
      };
      return sym(api.get_unique_id, "ncclGetUniqueId") &&
             sym(api.comm_init_rank, "ncclCommInitRank") && sym(api.all_reduce, "ncclAllReduce") &&
             sym(api.comm_destroy, "ncclCommDestroy") &&
             sym(api.error_string, "ncclGetErrorString");
    }();
    if (!ok && why) *why = error;
    return ok ? &api : nullptr;
  }
  void check(ncclResult_t r, const char* call) const {
    if (r != ncclSuccess)
      throw Error(std::string("NCCL call ") + call + " failed: " + error_string(r));
  }
};

class NcclReducer final : public DeviceReducer {
 public:
  NcclReducer(const NcclApi& api, ncclComm_t c) : api_(api), comm_(c) {}
  ~NcclReducer() override {
    cudaDeviceSynchronize();
    api_.comm_destroy(comm_);
  }
  void allreduce_sum(float* data, int64_t n) override {
    if (n <= 0) return;
    api_.check(api_.all_reduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_,
                               cudaStreamLegacy),
               "ncclAllReduce");
  }
  std::string method() const override { return "nccl"; }

 private:
  const NcclApi& api_;
  ncclComm_t comm_;
};

}  // namespace

std::unique_ptr<DeviceReducer> make_nccl_reducer(Communicator& comm, std::string* why) {
  std::string local;
  const NcclApi* api = NcclApi::load(&local);
  if (comm.any(api == nullptr)) {  // every rank agrees before any of them starts NCCL
    if (why) *why = api ? "NCCL could not be loaded on another rank" : local;
    return nullptr;
  }
  ncclUniqueId id{};
  if (comm.rank() == 0) api->check(api->get_unique_id(&id), "ncclGetUniqueId");
  comm.broadcast(&id, sizeof id, 0);
  ncclComm_t c = nullptr;
  api->check(api->comm_init_rank(&c, comm.size(), id, comm.rank()), "ncclCommInitRank");
  return std::make_unique<NcclReducer>(*api, c);
}

}  // namespace attnres::dist
