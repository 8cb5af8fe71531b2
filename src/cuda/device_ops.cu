// The CUDA backend's runtime and kernels (src/cuda/device.hpp, attnres/cuda.hpp): device
// detection, device memory, cuBLAS GEMMs and the row kernels of src/cuda/row_kernels.hpp launched
// one functor index per thread.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <string>

#include "attnres/cuda.hpp"
#include "attnres/error.hpp"
#include "cuda/device.hpp"
#include "cuda/row_kernels.hpp"

namespace attnres::cuda {

namespace {

void check_cuda(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return;
  throw Error(std::string("CUDA call ") + call + " failed: " + cudaGetErrorString(e));
}
void check_cublas(cublasStatus_t s, const char* call) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw Error(std::string("cuBLAS call ") + call + " failed with status " +
              std::to_string(static_cast<int>(s)));
}
#define ATTNRES_CUDA_CHECK(x) check_cuda((x), #x)
#define ATTNRES_CUBLAS_CHECK(x) check_cublas((x), #x)

cublasHandle_t blas() {
  static thread_local cublasHandle_t h = [] {
    cublasHandle_t x = nullptr;
    ATTNRES_CUBLAS_CHECK(cublasCreate(&x));
    // fp32 GEMMs stay fp32 (no TF32): the tests compare with the CPU at fp32 tolerances.
    ATTNRES_CUBLAS_CHECK(cublasSetMathMode(x, CUBLAS_DEFAULT_MATH));
    return x;
  }();
  return h;
}

template <class F>
__global__ void rows_kernel(F f, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    f(i);
  }
}

// One thread per functor index (grid-stride beyond 2^20 threads).
template <class F>
void launch(const F& f, int64_t n) {
  if (n <= 0) return;
  constexpr int kThreads = 128;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 13);
  rows_kernel<<<static_cast<unsigned>(blocks), kThreads>>>(f, n);
  ATTNRES_CUDA_CHECK(cudaGetLastError());
}

// The sources of a depth mix, copied to the device for the kernel (kept between calls).
const rows::Source* device_sources(const dev::DepthSource* src, int64_t S) {
  static thread_local rows::Source* buf = nullptr;
  static thread_local int64_t cap = 0;
  if (S > cap) {
    if (buf) {
      ATTNRES_CUDA_CHECK(cudaDeviceSynchronize());  // no kernel may still read the old array
      rows::Source* old = buf;
      buf = nullptr;  // never left pointing at freed memory, even if what follows throws
      cap = 0;
      ATTNRES_CUDA_CHECK(cudaFree(old));
    }
    ATTNRES_CUDA_CHECK(cudaMalloc(&buf, sizeof(rows::Source) * S));
    cap = S;
  }
  std::vector<rows::Source> h(S);
  for (int64_t i = 0; i < S; i++) h[i] = {src[i].v, src[i].rstd, src[i].dv};
  // Synchronous copy on the default stream: ordered after the kernels that read the old contents.
  ATTNRES_CUDA_CHECK(cudaMemcpy(buf, h.data(), sizeof(rows::Source) * S, cudaMemcpyHostToDevice));
  return buf;
}

rows::Mix row_mix(const dev::DepthMix& m) {
  rows::Mix r;
  r.d = m.d;
  r.H = m.H;
  r.softmax = m.softmax;
  r.key_norm = m.key_norm;
  return r;
}

}  // namespace

// ---------------------------------------------------------------- attnres/cuda.hpp

bool compiled() { return true; }

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = std::string("no usable CUDA device: ") + cudaGetErrorString(e);
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device found";
  return n;
}

std::string describe_device(int dev) {
  std::string why;
  if (device_count(&why) <= dev) return why.empty() ? "no CUDA device " + std::to_string(dev) : why;
  cudaDeviceProp p{};
  ATTNRES_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.255s, sm_%d%d, %d SMs, %.1f GiB; driver %d.%d, runtime %d.%d",
                p.name, p.major, p.minor, p.multiProcessorCount,
                static_cast<double>(p.totalGlobalMem) / (1 << 30), drv / 1000, (drv % 1000) / 10,
                rt / 1000, (rt % 1000) / 10);
  return buf;
}

// ---------------------------------------------------------------- memory

template <class T>
DeviceVec<T>::DeviceVec(int64_t n) : n_(n) {
  check(n >= 0, "internal: DeviceVec of negative size");
  if (n == 0) return;
  ATTNRES_CUDA_CHECK(cudaMalloc(&p_, sizeof(T) * static_cast<size_t>(n)));
  const cudaError_t e = cudaMemset(p_, 0, sizeof(T) * static_cast<size_t>(n));
  if (e != cudaSuccess) {  // the destructor does not run for a constructor that throws
    cudaFree(p_);
    p_ = nullptr;
    check_cuda(e, "cudaMemset(p_, 0, bytes)");
  }
}
template <class T>
DeviceVec<T>::DeviceVec(const std::vector<T>& host) : DeviceVec(static_cast<int64_t>(host.size())) {
  upload(host);
}
template <class T>
DeviceVec<T>::~DeviceVec() {
  if (p_) cudaFree(p_);
}
template <class T>
void DeviceVec<T>::upload(const std::vector<T>& host) {
  check(static_cast<int64_t>(host.size()) == n_, "internal: DeviceVec upload of the wrong size");
  if (n_ > 0) {
    ATTNRES_CUDA_CHECK(
        cudaMemcpy(p_, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice));
  }
}
template <class T>
std::vector<T> DeviceVec<T>::download() const {
  std::vector<T> h(static_cast<size_t>(n_));
  if (n_ > 0) {
    ATTNRES_CUDA_CHECK(cudaMemcpy(h.data(), p_, sizeof(T) * h.size(), cudaMemcpyDeviceToHost));
  }
  return h;
}
template class DeviceVec<float>;
template class DeviceVec<int32_t>;
template class DeviceVec<uint16_t>;

void synchronize() { ATTNRES_CUDA_CHECK(cudaDeviceSynchronize()); }

// ---------------------------------------------------------------- ops

namespace dev {

void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N, int64_t C) {
  launch(rows::EmbeddingForward{out, ids, wte, C}, N);
}
void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C) {
  launch(rows::EmbeddingBackward{dwte, dout, ids, N, C}, C);
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* g, int64_t N,
                     int64_t C, float eps) {
  launch(rows::RmsNormForward{out, rstd, inp, g, C, eps}, N);
}
void rmsnorm_backward(float* dinp, float* dg, const float* dout, const float* inp, const float* g,
                      const float* rstd, int64_t N, int64_t C) {
  launch(rows::RmsNormBackwardInput{dinp, dout, inp, g, rstd, C}, N);
  launch(rows::RmsNormBackwardGain{dg, dout, inp, rstd, N, C}, C);
}

// cuBLAS takes int dimensions.
int dim(int64_t x) {
  check(x >= 0 && x <= INT_MAX, "matrix dimension " + std::to_string(x) +
                                    " is outside cuBLAS's int range; use smaller batches");
  return static_cast<int>(x);
}

// Row-major X (r, c) is column-major X^T; see the derivations beside each call.
void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC, int64_t OC,
                    bool accumulate) {
  const int n = dim(N), ic = dim(IC), oc = dim(OC);
  if (N == 0 || OC == 0) return;
  if (IC == 0) {  // an empty sum (cuBLAS rejects a leading dimension of 0)
    if (!accumulate) ATTNRES_CUDA_CHECK(cudaMemset(out, 0, sizeof(float) * N * OC));
    return;
  }
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  // out^T (OC,N) = w (OC,IC) . inp^T (IC,N): w is stored as w^T column-major -> op T.
  ATTNRES_CUBLAS_CHECK(cublasSgemm(blas(), CUBLAS_OP_T, CUBLAS_OP_N, oc, n, ic, &one, w, ic, inp,
                                   ic, &beta, out, oc));
}
void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                     int64_t N, int64_t IC, int64_t OC) {
  const int n = dim(N), ic = dim(IC), oc = dim(OC);
  if (N == 0 || IC == 0 || OC == 0) return;  // nothing to add
  const float one = 1.0f;
  if (dinp) {
    // dinp^T (IC,N) += w^T (IC,OC) . dout^T (OC,N)
    ATTNRES_CUBLAS_CHECK(cublasSgemm(blas(), CUBLAS_OP_N, CUBLAS_OP_N, ic, n, oc, &one, w, ic, dout,
                                     oc, &one, dinp, ic));
  }
  if (dw) {
    // dw^T (IC,OC) += inp^T (IC,N) . dout (N,OC)
    ATTNRES_CUBLAS_CHECK(cublasSgemm(blas(), CUBLAS_OP_N, CUBLAS_OP_T, ic, oc, n, &one, inp, ic,
                                     dout, oc, &one, dw, ic));
  }
}

void to_bf16(uint16_t* out, const float* in, int64_t n) { launch(rows::ToBf16{out, in}, n); }
void from_bf16(float* out, const uint16_t* in, int64_t n) { launch(rows::FromBf16{out, in}, n); }

void matmul_forward_bf16(float* out, const uint16_t* inp, const uint16_t* w, int64_t N, int64_t IC,
                         int64_t OC, bool accumulate) {
  const int n = dim(N), ic = dim(IC), oc = dim(OC);
  if (N == 0 || OC == 0) return;
  if (IC == 0) {
    if (!accumulate) ATTNRES_CUDA_CHECK(cudaMemset(out, 0, sizeof(float) * N * OC));
    return;
  }
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  // As matmul_forward: out^T (OC,N) = w (OC,IC) . inp^T (IC,N), bf16 inputs, fp32 out/compute.
  ATTNRES_CUBLAS_CHECK(cublasGemmEx(blas(), CUBLAS_OP_T, CUBLAS_OP_N, oc, n, ic, &one, w,
                                    CUDA_R_16BF, ic, inp, CUDA_R_16BF, ic, &beta, out, CUDA_R_32F,
                                    oc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void rope_forward(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                  int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) {
  launch(rows::Rope{x, cos_t, sin_t, T, n_heads, hd, ld, pos0, 1.0f}, B * T * n_heads * (hd / 2));
}
void rope_backward(float* dx, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                   int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) {
  launch(rows::Rope{dx, cos_t, sin_t, T, n_heads, hd, ld, pos0, -1.0f}, B * T * n_heads * (hd / 2));
}

void swiglu_forward(float* out, const float* h13, int64_t N, int64_t F) {
  launch(rows::SwigluForward{out, h13, F}, N * F);
}
void swiglu_backward(float* dh13, const float* dout, const float* h13, int64_t N, int64_t F) {
  launch(rows::SwigluBackward{dh13, dout, h13, F}, N * F);
}

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                           int64_t N, int64_t V) {
  launch(rows::CrossEntropyForward{losses, lse, logits, targets, V}, N);
}
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, int64_t N, int64_t V, float dloss) {
  launch(rows::CrossEntropyBackward{dlogits, logits, lse, targets, V, dloss}, N);
}

void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H, float eps) {
  launch(rows::DepthRstd{rstd, v, d, H, eps}, N * H);
}

void depth_mix_forward(float* x, float* lse, const DepthSource* src, int64_t S, const float* qg,
                       int64_t q_ld, const DepthMix& m, int64_t N) {
  launch(rows::DepthMixForward{x, lse, device_sources(src, S), S, qg, q_ld, row_mix(m)}, N * m.H);
}

void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                        const DepthSource* src, int64_t S, const float* qg, int64_t q_ld,
                        const DepthMix& m, int64_t N) {
  const rows::Source* s = device_sources(src, S);
  if (q_ld != 0) {  // per-token queries: each (row, head) slice owns its gradient
    launch(rows::DepthMixBackward{dqg, dx, x, lse, s, S, qg, q_ld, row_mix(m)}, N * m.H);
    return;
  }
  DeviceVec<float> dq(N * m.d);  // per-row query gradients, then reduced over rows in order
  launch(rows::DepthMixBackward{dq.data(), dx, x, lse, s, S, qg, q_ld, row_mix(m)}, N * m.H);
  launch(rows::DepthQueryReduce{dqg, dq.data(), N, m.d}, m.d);
  synchronize();  // dq is freed on return
}

void attention_forward(float* out, float* att, const float* qkv, const AttnShape& s) {
  const rows::AttnDims d{s.B, s.T, s.H, s.Hkv, s.hd};
  launch(rows::AttentionForward{out, att, qkv, d}, s.B * s.H * s.T);
}

void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                        const float* att, const AttnShape& s) {
  const rows::AttnDims d{s.B, s.T, s.H, s.Hkv, s.hd};
  launch(rows::AttentionBackwardQuery{dqkv, scratch, dout, qkv, att, d}, s.B * s.H * s.T);
  launch(rows::AttentionBackwardKeyValue{dqkv, scratch, dout, qkv, att, d}, s.B * s.Hkv * s.T);
}

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                  const AdamStep& k) {
  launch(
      rows::AdamW{p, g, m, v, k.b1, k.b2, k.step_size, k.inv_bc2_sqrt, k.eps, k.grad_scale, decay},
      n);
}

}  // namespace dev
}  // namespace attnres::cuda
