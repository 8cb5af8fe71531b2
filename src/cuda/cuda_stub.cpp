// attnres/cuda.hpp in a build without the CUDA backend (ATTNRES_CUDA=OFF, the default).
#include "attnres/cuda.hpp"

namespace attnres::cuda {

namespace {
const char* kWhy =
    "this attnres was built without CUDA: configure with -DATTNRES_CUDA=ON (needs nvcc and "
    "cuBLAS, e.g. scripts/cuda_build.sh)";
}

bool compiled() { return false; }

int device_count(std::string* why) {
  if (why) *why = kWhy;
  return 0;
}

std::string describe_device(int) { return kWhy; }

}  // namespace attnres::cuda
