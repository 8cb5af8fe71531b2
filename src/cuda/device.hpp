// The CUDA backend's device memory and kernels (src/cuda/device_ops.cu), callable from plain C++:
// no CUDA header is needed to use them. Every function throws attnres::Error naming the failing
// CUDA call when the device reports an error. Shapes and semantics are those of the CPU ops with
// the same names (src/ops/ops.hpp); all pointers here are device pointers; every backward
// ACCUMULATES. Work is queued on the default stream; download() waits for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace attnres::cuda {

// n elements of T in device memory, freed on destruction.
template <class T>
class DeviceVec;  // T = float, int32_t or uint16_t (bf16 bits)

template <class T>
class DeviceVec {
 public:
  DeviceVec() = default;
  explicit DeviceVec(int64_t n);
  explicit DeviceVec(const std::vector<T>& host);
  ~DeviceVec();
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  DeviceVec(DeviceVec&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  T* data() { return p_; }
  const T* data() const { return p_; }
  int64_t size() const { return n_; }
  void upload(const std::vector<T>& host);
  std::vector<T> download() const;  // waits for queued work

 private:
  T* p_ = nullptr;
  int64_t n_ = 0;
};

// Waits for all queued device work; throws on a device error.
void synchronize();

namespace dev {

struct DepthSource {  // as ops::DepthSource, device pointers
  const float* v;
  const float* rstd;
  float* dv;
};
struct DepthMix {
  int64_t d = 0, H = 1;
  bool softmax = true, key_norm = true;
};

void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N, int64_t C);
void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C);
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* g, int64_t N,
                     int64_t C, float eps);
void rmsnorm_backward(float* dinp, float* dg, const float* dout, const float* inp, const float* g,
                      const float* rstd, int64_t N, int64_t C);
// cuBLAS sgemm, row-major as ops::matmul_forward/backward: out (N,OC) = inp (N,IC) @ w^T.
void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC, int64_t OC,
                    bool accumulate = false);
void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                     int64_t N, int64_t IC, int64_t OC);
// bf16 (as uint16_t bits, round to nearest even) <-> fp32, n elements.
void to_bf16(uint16_t* out, const float* in, int64_t n);
void from_bf16(float* out, const uint16_t* in, int64_t n);
// Mixed precision: out (N,OC) fp32 = inp (N,IC) bf16 @ w^T (w (OC,IC) bf16), fp32 accumulation
// on the tensor cores (cublasGemmEx).
void matmul_forward_bf16(float* out, const uint16_t* inp, const uint16_t* w, int64_t N, int64_t IC,
                         int64_t OC, bool accumulate = false);
void rope_forward(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                  int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0);
void rope_backward(float* dx, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                   int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0);
void swiglu_forward(float* out, const float* h13, int64_t N, int64_t F);
void swiglu_backward(float* dh13, const float* dout, const float* h13, int64_t N, int64_t F);
// losses (N) may be null; returns nothing (the mean is the caller's reduction of losses).
void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                           int64_t N, int64_t V);
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, int64_t N, int64_t V, float dloss);
void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H, float eps);
struct AttnShape {
  int64_t B, T, H, Hkv, hd;
};
// out (B,T,H*hd), att (B,H,T,T) from qkv (B,T,(H+2Hkv)hd), as ops::attention_forward.
void attention_forward(float* out, float* att, const float* qkv, const AttnShape& s);
// dqkv +=; scratch (B,H,T,T).
void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                        const float* att, const AttnShape& s);
// AdamW on n elements (one tensor): decay = 1 - lr wd for decayed tensors, else 1;
// step_size = lr / (1 - b1^t); inv_bc2_sqrt = 1 / sqrt(1 - b2^t) (attnres/optim.hpp).
struct AdamStep {
  float b1, b2, step_size, inv_bc2_sqrt, eps, grad_scale;
};
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                  const AdamStep& k);
// src: a HOST array of S sources holding device pointers.
void depth_mix_forward(float* x, float* lse, const DepthSource* src, int64_t S, const float* qg,
                       int64_t q_ld, const DepthMix& m, int64_t N);
// dqg: (d) += when q_ld == 0 (reduced over tokens in order), else (N,d) +=.
void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                        const DepthSource* src, int64_t S, const float* qg, int64_t q_ld,
                        const DepthMix& m, int64_t N);

}  // namespace dev
}  // namespace attnres::cuda
