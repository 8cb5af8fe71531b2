// GPU timings for tools/device_check.sh (built with -DATTNRES_CUDA=ON): cuBLAS fp32 GEMM
// throughput and the AttnRes depth-mix kernels at a training shape, as one short table. Prints the
// reason and exits 0 where no GPU is present.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "attnres/cuda.hpp"
#include "cuda/device.hpp"

using namespace attnres;

namespace {

// Median of `reps` timed runs after one warm-up, in milliseconds.
double time_ms(const std::function<void()>& f, int reps = 10) {
  f();
  cuda::synchronize();
  std::vector<double> t;
  for (int i = 0; i < reps; i++) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    cuda::synchronize();
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main() {
  std::string why;
  if (cuda::device_count(&why) == 0) {
    std::printf("cuda_bench: %s\n", why.c_str());
    return 0;
  }
  std::printf("device: %s\n", cuda::describe_device().c_str());
  std::printf("| kernel | shape | ms | rate |\n|---|---|---|---|\n");
  {
    const int64_t n = 4096;
    cuda::DeviceVec<float> a(n * n), b(n * n), c(n * n);
    const double ms =
        time_ms([&] { cuda::dev::matmul_forward(c.data(), a.data(), b.data(), n, n, n); });
    std::printf("| sgemm (cuBLAS, fp32) | %lld^3 | %.3f | %.1f TFLOP/s |\n",
                static_cast<long long>(n), ms, 2.0 * n * n * n / ms / 1e9);
  }
  {
    const int64_t N = 8192, d = 1024, S = 9;  // 8 sequences of 1024 tokens, d 1024, 9 sources
    std::vector<cuda::DeviceVec<float>> v, r, dv;
    std::vector<cuda::dev::DepthSource> src;
    for (int64_t i = 0; i < S; i++) {
      v.emplace_back(N * d);
      r.emplace_back(N);
      dv.emplace_back(N * d);
    }
    for (int64_t i = 0; i < S; i++) src.push_back({v[i].data(), r[i].data(), dv[i].data()});
    cuda::DeviceVec<float> q(d), dq(d), x(N * d), lse(N), dx(N * d);
    cuda::dev::DepthMix m;
    m.d = d;
    const double bytes_f = 4.0 * (S + 1) * N * d, bytes_b = 4.0 * (3 * S + 2) * N * d;
    const double f = time_ms([&] {
      cuda::dev::depth_mix_forward(x.data(), lse.data(), src.data(), S, q.data(), 0, m, N);
    });
    const double bw = time_ms([&] {
      cuda::dev::depth_mix_backward(dq.data(), dx.data(), x.data(), lse.data(), src.data(), S,
                                    q.data(), 0, m, N);
    });
    std::printf("| depth mix forward | N %lld, d %lld, %lld sources | %.3f | %.0f GB/s |\n",
                static_cast<long long>(N), static_cast<long long>(d), static_cast<long long>(S), f,
                bytes_f / f / 1e6);
    std::printf("| depth mix backward | same | %.3f | %.0f GB/s |\n", bw, bytes_b / bw / 1e6);
  }
  return 0;
}
