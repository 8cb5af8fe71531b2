// attnres/cuda.hpp in a build without the CUDA backend (ATTNRES_CUDA=OFF, the default).
#include "attnres/cuda.hpp"
#include "attnres/error.hpp"
#include "backend/backend.hpp"

namespace attnres::cuda {

namespace {
const char* const kWhy =
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

namespace attnres {

std::shared_ptr<Backend> make_cuda_backend(int) {
  throw Error(std::string("device cuda is unavailable: ") + cuda::kWhy);
}

}  // namespace attnres
