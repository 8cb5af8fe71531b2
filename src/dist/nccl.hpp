// The NCCL method of make_device_reducer (attnres/dist.hpp): src/cuda/nccl_reducer.cpp in CUDA
// builds that found nccl.h, a stub (src/dist/nccl_stub.cpp) otherwise.
#pragma once

#include <memory>
#include <string>

#include "attnres/dist.hpp"

namespace attnres::dist {

// An all-reduce over comm's ranks with NCCL on the current GPU (bootstrapped through comm), or
// null with the reason in *why (built without CUDA, libnccl.so.2 not found on some rank).
// Collective: every rank must call it, and all get a reducer or all get null.
std::unique_ptr<DeviceReducer> make_nccl_reducer(Communicator& comm, std::string* why);

}  // namespace attnres::dist
