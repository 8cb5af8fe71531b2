// make_nccl_reducer (src/dist/nccl.hpp) in builds without CUDA or without nccl.h: multi-GPU runs
// sum their gradients through host memory instead.
#include "dist/nccl.hpp"

namespace attnres::dist {

std::unique_ptr<DeviceReducer> make_nccl_reducer(Communicator& comm, std::string* why) {
  (void)comm;
  if (why) *why = "this attnres was built without CUDA or without nccl.h";
  return nullptr;
}

}  // namespace attnres::dist
