// Linear layers (no bias) on top of sgemm (fp32) and gemm_bf16 (bf16 operands). Weights are (OC,
// IC) so y = x W^T, as in PyTorch.
#include "core/blas.hpp"
#include "ops/ops.hpp"

namespace attnres::ops {

void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC, int64_t OC,
                    bool accumulate) {
  // out (N,OC) = inp (N,IC) * w^T (IC,OC)
  sgemm(false, true, N, OC, IC, 1.0f, inp, IC, w, IC, accumulate ? 1.0f : 0.0f, out, OC);
}

void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                     int64_t N, int64_t IC, int64_t OC) {
  // dinp (N,IC) += dout (N,OC) * w (OC,IC)
  if (dinp) sgemm(false, false, N, IC, OC, 1.0f, dout, OC, w, IC, 1.0f, dinp, IC);
  // dw (OC,IC) += dout^T (OC,N) * inp (N,IC)
  if (dw) sgemm(true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dw, IC);
}

void matmul_forward_bf16(float* out, const uint16_t* inp, const uint16_t* w, int64_t N, int64_t IC,
                         int64_t OC, bool accumulate) {
  // out (N,OC) = inp (N,IC) * w^T (IC,OC)
  gemm_bf16(false, true, N, OC, IC, inp, IC, w, IC, accumulate ? 1.0f : 0.0f, out, OC);
}

void matmul_backward_bf16(float* dinp, float* dw, const uint16_t* dout, const uint16_t* inp,
                          const uint16_t* w, int64_t N, int64_t IC, int64_t OC) {
  // dinp (N,IC) += dout (N,OC) * w (OC,IC)
  if (dinp) gemm_bf16(false, false, N, IC, OC, dout, OC, w, IC, 1.0f, dinp, IC);
  // dw (OC,IC) += dout^T (OC,N) * inp (N,IC)
  if (dw) gemm_bf16(true, false, OC, IC, N, dout, OC, inp, IC, 1.0f, dw, IC);
}

}  // namespace attnres::ops
