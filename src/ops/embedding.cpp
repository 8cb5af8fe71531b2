// Token embedding lookup and its scatter-add backward.
#include <cstring>

#include "ops/ops.hpp"

namespace attnres::ops {

void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    std::memcpy(out + n * C, wte + static_cast<int64_t>(ids[n]) * C, sizeof(float) * C);
  }
}

void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C) {
  // Serial over rows (repeated ids would race); the work is tiny next to any GEMM.
  for (int64_t n = 0; n < N; n++) {
    float* dst = dwte + static_cast<int64_t>(ids[n]) * C;
    const float* src = dout + n * C;
    for (int64_t c = 0; c < C; c++) dst[c] += src[c];
  }
}

}  // namespace attnres::ops
