// What the CUDA build and machine offer, and the bf16 kernels (not yet part of the Backend). The
// backend's ops are tested by test_backend.cpp, whole models by test_backend_model.cpp. GPU tests
// are skipped, with the reason, in builds without CUDA (-DATTNRES_CUDA=ON, see
// scripts/cuda_build.sh) and on machines without a usable GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attnres/cuda.hpp"
#include "ops/ops.hpp"
#include "test_util.hpp"

#ifdef ATTNRES_WITH_CUDA
#include "cuda/device.hpp"
#include "cuda/row_kernels.hpp"
#endif

using namespace attnres;
using attnres::testing::randn;
using attnres::testing::rel_diff;

#define SKIP_WITHOUT_GPU()                                                     \
  do {                                                                         \
    std::string why;                                                           \
    if (cuda::device_count(&why) == 0) GTEST_SKIP() << "no GPU test: " << why; \
  } while (0)

TEST(Cuda, ReportsWhatThisBuildAndMachineOffer) {
  std::string why;
  const int n = cuda::device_count(&why);
  if (!cuda::compiled()) {
    EXPECT_EQ(n, 0);
    EXPECT_NE(why.find("-DATTNRES_CUDA=ON"), std::string::npos) << why;
  } else if (n == 0) {
    EXPECT_FALSE(why.empty());
  }
  std::printf("CUDA: %s\n", cuda::describe_device().c_str());
}

#ifdef ATTNRES_WITH_CUDA

namespace {

using cuda::DeviceVec;

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_diff(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

}  // namespace

// bf16 conversion bit-exact with the host functor; the bf16 GEMM within bf16 rounding of fp32.
TEST(Cuda, Bf16ConversionAndGemm) {
  SKIP_WITHOUT_GPU();
  for (const int64_t IC : {int64_t{128}, int64_t{100}}) {  // and one not a multiple of 8
    SCOPED_TRACE("IC=" + std::to_string(IC));
    const int64_t N = 96, OC = 64;
    const auto x = randn(N * IC, 81), w = randn(OC * IC, 82);
    DeviceVec<float> gx(x), gw(w), gy(N * OC), gback(N * IC);
    DeviceVec<uint16_t> bx(N * IC), bw(OC * IC);
    cuda::dev::to_bf16(bx.data(), gx.data(), N * IC);
    cuda::dev::to_bf16(bw.data(), gw.data(), OC * IC);
    std::vector<uint16_t> want(N * IC);
    for (int64_t i = 0; i < N * IC; i++) want[i] = cuda::rows::float_to_bf16_bits(x[i]);
    EXPECT_EQ(bx.download(), want);
    cuda::dev::from_bf16(gback.data(), bx.data(), N * IC);
    EXPECT_LT(rel(gback.download(), x), 4e-3);
    std::vector<float> y(N * OC);
    ops::matmul_forward(y.data(), x.data(), w.data(), N, IC, OC);
    cuda::dev::matmul_forward_bf16(gy.data(), bx.data(), bw.data(), N, IC, OC);
    EXPECT_LT(rel(gy.download(), y), 1e-2);
  }
}

#endif  // ATTNRES_WITH_CUDA
