// The CUDA backend (attnres/backend.hpp "cuda", attnres/cuda.hpp, src/cuda/device.hpp): device
// detection, device memory, cuBLAS GEMMs and the row kernels of src/cuda/row_kernels.hpp launched
// one functor index per thread, driven by RowBackend (src/cuda/row_backend.hpp).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attnres/cuda.hpp"
#include "attnres/error.hpp"
#include "cuda/device.hpp"
#include "cuda/flash_attention.cuh"
#include "cuda/row_backend.hpp"
#include "cuda/row_kernels.hpp"
#include "cuda/warp_kernels.cuh"

namespace attnres::cuda {

namespace {

void check_cuda(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return;
  // Clear a non-sticky error, or a caller that handles this Error would see it again at the next
  // launch check (a sticky one stays: the context is unusable then).
  cudaGetLastError();
  throw Error(std::string("CUDA call ") + call + " failed: " + cudaGetErrorString(e));
}
void check_cublas(cublasStatus_t s, const char* call) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw Error(std::string("cuBLAS call ") + call + " failed with status " +
              std::to_string(static_cast<int>(s)));
}
#define ATTNRES_CUDA_CHECK(x) check_cuda((x), #x)
#define ATTNRES_CUBLAS_CHECK(x) check_cublas((x), #x)

// One handle per thread and device (a handle belongs to the device current at its creation).
cublasHandle_t blas() {
  static thread_local std::map<int, cublasHandle_t> handles;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice(&dev)");
  cublasHandle_t& h = handles[dev];
  if (!h) {
    ATTNRES_CUBLAS_CHECK(cublasCreate(&h));
    // fp32 GEMMs stay fp32 (no TF32): the tests compare with the CPU at fp32 tolerances.
    ATTNRES_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  }
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

// One thread per functor index (grid-stride beyond 2^20 threads), on stream st.
template <class F>
void launch(const F& f, int64_t n, cudaStream_t st = 0) {
  if (n <= 0) return;
  constexpr int kThreads = 128;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 13);
  rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(f, n);
  ATTNRES_CUDA_CHECK(cudaGetLastError());
}

// Flash attention (flash_attention.cuh): one block of flash::kWarps warps per unit, with the
// block's shared memory dynamic. Pass 0 forward, 1 dK/dV, 2 dQ.
template <int HD, int Pass>
__global__ void flash_kernel(flash::Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int w = threadIdx.x / warp::kWarp, lane = threadIdx.x % warp::kWarp;
  const int64_t u = blockIdx.x;
  flash::Smem<HD>& m = *reinterpret_cast<flash::Smem<HD>*>(smem);
  if constexpr (Pass == 0) flash::forward_block<HD>(a, u, w, lane, m);
  if constexpr (Pass == 1) flash::backward_kv_block<HD>(a, u, w, lane, m);
  if constexpr (Pass == 2) flash::backward_q_block<HD>(a, u, w, lane, m);
}
template <int HD, int Pass>
void launch_flash(const flash::Args& a, int64_t units, cudaStream_t st) {
  if (units == 0) return;
  constexpr size_t bytes = sizeof(flash::Smem<HD>);
  // Above the default 48 KiB of dynamic shared memory. The attribute belongs to the device current
  // at the call: set once per device (not while a step is being captured: the first, uncaptured
  // step sets it).
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  ATTNRES_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (dev >= 64 || !(done.load() & bit)) {
    ATTNRES_CUDA_CHECK(cudaFuncSetAttribute(flash_kernel<HD, Pass>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(bytes)));
    done.fetch_or(bit);
  }
  check(units <= INT_MAX, "internal: too many attention tiles for one launch");
  flash_kernel<HD, Pass>
      <<<static_cast<unsigned>(units), flash::kWarps * warp::kWarp, bytes, st>>>(a);
  ATTNRES_CUDA_CHECK(cudaGetLastError());
}
template <int Pass>
void run_flash(const flash::Args& a, int64_t hd, int64_t units, cudaStream_t st) {
  switch (hd) {
    case 16:
      return launch_flash<16, Pass>(a, units, st);
    case 32:
      return launch_flash<32, Pass>(a, units, st);
    case 64:
      return launch_flash<64, Pass>(a, units, st);
    case 128:
      return launch_flash<128, Pass>(a, units, st);
    default:
      throw Error("internal: flash attention has no kernel for head dimension " +
                  std::to_string(hd));
  }
}
flash::Args flash_args(const float* qkv, const ops::AttnShape& s) {
  flash::Args a{};
  a.qkv = qkv;
  a.B = s.B, a.T = s.T, a.H = s.H, a.Hkv = s.Hkv, a.ld = s.ld();
  a.scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  return a;
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

namespace {

// cuBLAS takes int dimensions.
int dim(int64_t x) {
  if (x < 0 || x > INT_MAX) {
    throw Error("matrix dimension " + std::to_string(x) +
                " is outside cuBLAS's int range; use smaller batches");
  }
  return static_cast<int>(x);
}

// Row-major C (M,N) = op(A) op(B) + beta C with bf16 A, B and fp32 C, accumulated in fp32 on the
// tensor cores (the contract of attnres::sgemm). Row-major C is column-major C^T = op(B)^T op(A)^T,
// and a row-major matrix is its own transpose column-major: cuBLAS gets B first (transposed when
// tb) and A second, m = N, n = M.
void gemm_bf16(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
               const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
               int64_t ldc) {
  if (M == 0 || N == 0) return;
  check(K > 0, "internal: bf16 GEMM with an empty inner dimension");
  const float one = 1.0f;
  ATTNRES_CUBLAS_CHECK(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    ta ? CUBLAS_OP_T : CUBLAS_OP_N, dim(N), dim(M), dim(K), &one, B,
                                    CUDA_R_16BF, dim(ldb), A, CUDA_R_16BF, dim(lda), &beta, C,
                                    CUDA_R_32F, dim(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The GPU executor of RowBackend: kernels, copies and GEMMs queued on the backend's own stream.
struct CudaExec {
  static const char* name() { return "cuda"; }
  static constexpr bool kHostMemory = false;
  static constexpr bool kFlashAttention = true;
  // A kernel for hd whose shared memory fits this device (hd 128 needs 145 KiB: not on sm_86/89).
  bool flash_attention_supported(int64_t hd) const {
    if (!flash::supported(hd)) return false;
    const size_t need = hd == 16   ? sizeof(flash::Smem<16>)
                        : hd == 32 ? sizeof(flash::Smem<32>)
                        : hd == 64 ? sizeof(flash::Smem<64>)
                                   : sizeof(flash::Smem<128>);
    return need <= static_cast<size_t>(smem_optin_);
  }
  // out (B,T,H*hd), lse (B,H,T) from q|k|v (B,T,ld).
  void flash_attention_forward(float* out, float* lse, const float* qkv, const ops::AttnShape& s) {
    flash::Args a = flash_args(qkv, s);
    a.out = out;
    a.lse = lse;
    run_flash<0>(a, s.hd, flash::query_units(a), s_);
  }
  // dqkv (B,T,ld) += from dout (B,T,H*hd), q|k|v, the forward's lse and D = rowsum(dout o out)
  // (both (B,H,T)); with dk_part, dv_part (B,H,T,hd) dK and dV per query head go there instead
  // (flash::Args).
  void flash_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                                const float* dsum, float* dk_part, float* dv_part,
                                const ops::AttnShape& s) {
    flash::Args a = flash_args(qkv, s);
    a.dout = dout;
    a.dqkv = dqkv;
    a.lse = const_cast<float*>(lse);
    a.dsum = dsum;
    a.dk_part = dk_part;
    a.dv_part = dv_part;
    run_flash<1>(a, s.hd, flash::key_units(a), s_);
    run_flash<2>(a, s.hd, flash::query_units(a), s_);
  }
  // Its own stream (blocking: ordered with the legacy default stream that synchronous copies and
  // other code use), its own cuBLAS handle on that stream with a fixed workspace (so a captured
  // GEMM allocates nothing).
  explicit CudaExec(int device) : device_(device) {
    try {
      ATTNRES_CUDA_CHECK(cudaSetDevice(device));
      ATTNRES_CUDA_CHECK(
          cudaDeviceGetAttribute(&smem_optin_, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      ATTNRES_CUDA_CHECK(cudaStreamCreate(&s_));
      cublasHandle_t h = nullptr;  // (h_ only once it is a handle)
      ATTNRES_CUBLAS_CHECK(cublasCreate(&h));
      h_ = h;
      // fp32 GEMMs stay fp32 (no TF32): the tests compare with the CPU at fp32 tolerances.
      ATTNRES_CUBLAS_CHECK(cublasSetMathMode(h_, CUBLAS_DEFAULT_MATH));
      ATTNRES_CUBLAS_CHECK(cublasSetStream(h_, s_));  // (resets the workspace: set it after)
      ATTNRES_CUDA_CHECK(cudaMalloc(&ws_, kWorkspace));
      ATTNRES_CUBLAS_CHECK(cublasSetWorkspace(h_, ws_, kWorkspace));
      ATTNRES_CUDA_CHECK(cudaMallocHost(&stage_, kStageSlots * kStageBytes));
      for (auto& e : stage_ev_) {
        ATTNRES_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      }
    } catch (...) {  // (no destructor runs for a constructor that throws)
      free_resources();
      throw;
    }
  }
  ~CudaExec() {
    if (capturing_) abort_capture();
    free_resources();
  }
  void free_resources() noexcept {
    if (s_) cudaStreamSynchronize(s_);
    for (auto& e : stage_ev_) {
      if (e) cudaEventDestroy(e);
      e = nullptr;
    }
    if (stage_) cudaFreeHost(stage_);
    if (h_) cublasDestroy(h_);
    if (ws_) cudaFree(ws_);
    if (s_) cudaStreamDestroy(s_);
    stage_ = nullptr, h_ = nullptr, ws_ = nullptr, s_ = nullptr;
  }
  CudaExec(const CudaExec&) = delete;
  CudaExec& operator=(const CudaExec&) = delete;
  static constexpr size_t kWorkspace = size_t{32} << 20;  // cuBLAS's recommendation for Hopper
  int device_ = 0;
  int smem_optin_ = 0;  // the most shared memory a block may ask for
  cudaStream_t s_ = nullptr;
  cublasHandle_t h_ = nullptr;
  void* ws_ = nullptr;
  uint64_t epoch_ = 0;
  bool capturing_ = false, freed_while_capturing_ = false;
  std::vector<void*> deferred_;  // frees asked for while capturing, done after it
  // Uploads go through pinned staging slots, copied asynchronously on the stream: the host does
  // not wait for the device's queued work (a training step's batch, staged while the previous
  // one still runs); a slot is reused once its copy is done (its event). Larger uploads (the
  // weights at start-up) are synchronous.
  static constexpr int kStageSlots = 16;
  static constexpr size_t kStageBytes = size_t{1} << 20;
  char* stage_ = nullptr;
  cudaEvent_t stage_ev_[kStageSlots] = {};
  int stage_next_ = 0;

  // A CUDA call that a stream capture cannot hold fails cleanly here, before it breaks the
  // capture (the trainer then runs the step uncaptured).
  void refuse_while_capturing(const char* what) const {
    if (capturing_) {
      throw Error(std::string("cannot capture the step: ") + what +
                  " while capturing (a replay could not repeat it)");
    }
  }
  void* alloc(size_t bytes) {
    refuse_while_capturing("an allocation");
    epoch_++;
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    ATTNRES_CUDA_CHECK(cudaMalloc(&p, bytes));
    const cudaError_t e = cudaMemset(p, 0, bytes);
    if (e != cudaSuccess) {
      cudaFree(p);
      check_cuda(e, "cudaMemset(p, 0, bytes)");
    }
    return p;
  }
  void release(void* p, size_t) noexcept {
    epoch_++;
    if (!p) return;
    if (capturing_) {
      freed_while_capturing_ = true;
      deferred_.push_back(p);
      return;
    }
    cudaDeviceSynchronize();  // no queued kernel may still use it (frees are rare: growth only)
    cudaFree(p);
  }
  void upload(void* dst, const void* host, size_t bytes) {
    refuse_while_capturing("an upload");
    if (bytes == 0) return;
    if (bytes > kStageBytes) {  // (the legacy stream's copy waits for the stream's work)
      ATTNRES_CUDA_CHECK(cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice));
      return;
    }
    const int k = stage_next_;
    stage_next_ = (k + 1) % kStageSlots;
    ATTNRES_CUDA_CHECK(cudaEventSynchronize(stage_ev_[k]));  // the slot's last copy is done
    char* slot = stage_ + static_cast<size_t>(k) * kStageBytes;
    std::memcpy(slot, host, bytes);
    ATTNRES_CUDA_CHECK(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, s_));
    ATTNRES_CUDA_CHECK(cudaEventRecord(stage_ev_[k], s_));
  }
  void download(void* host, const void* src, size_t bytes) {
    refuse_while_capturing("a download");
    if (bytes) ATTNRES_CUDA_CHECK(cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost));
  }
  void copy(void* dst, const void* src, size_t bytes) {
    ATTNRES_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s_));
  }
  void zero(void* p, size_t bytes) { ATTNRES_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s_)); }
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 int64_t rows) {
    ATTNRES_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes,
                                         static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, s_));
  }
  void synchronize() {
    refuse_while_capturing("a wait for the device");
    ATTNRES_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // ---- capture: the stream's work recorded into a CUDA graph ----
  struct Graph final : Captured {
    cudaGraphExec_t exec = nullptr;
    cudaStream_t stream = nullptr;
    ~Graph() override {
      if (exec) cudaGraphExecDestroy(exec);
    }
    void run() override { ATTNRES_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }
  };
  uint64_t epoch() const { return epoch_; }
  void begin_capture() {
    refuse_while_capturing("a second capture");
    // Global mode: any call that would synchronise with the capture (another thread's included)
    // fails instead of silently escaping it.
    ATTNRES_CUDA_CHECK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeGlobal));
    capturing_ = true;
    freed_while_capturing_ = false;
  }
  std::unique_ptr<Captured> end_capture() {
    check(capturing_, "internal: end_capture without begin_capture");
    capturing_ = false;
    cudaGraph_t g = nullptr;
    const cudaError_t e = cudaStreamEndCapture(s_, &g);
    flush_deferred();
    if (e != cudaSuccess || !g) {
      if (g) cudaGraphDestroy(g);
      check_cuda(e == cudaSuccess ? cudaErrorStreamCaptureInvalidated : e,
                 "cudaStreamEndCapture(s_, &g)");
    }
    if (freed_while_capturing_) {
      cudaGraphDestroy(g);
      throw Error("cannot capture the step: memory was freed while capturing");
    }
    auto out = std::make_unique<Graph>();
    out->stream = s_;
    const cudaError_t ei = cudaGraphInstantiate(&out->exec, g, 0);
    cudaGraphDestroy(g);
    check_cuda(ei, "cudaGraphInstantiate(&exec, g, 0)");
    return out;
  }
  void abort_capture() noexcept {
    if (!capturing_) return;
    capturing_ = false;
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(s_, &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();  // clear the capture's error, if any
    flush_deferred();
  }
  void flush_deferred() noexcept {
    for (void* p : deferred_) release(p, 0);
    deferred_.clear();
  }

  // A functor with no faster kernel runs one thread per index; the row reductions run one warp
  // per row (warp_kernels.cuh).
  template <class F>
  void launch(const F& f, int64_t n) {
    cuda::launch(f, n, s_);
  }
  void launch(const rows::RmsNormForward& f, int64_t n) { warps(warp::RmsNormForward{f}, n); }
  void launch(const rows::RmsNormBackwardInput& f, int64_t n) {
    warps(warp::RmsNormBackwardInput{f}, n);
  }
  void launch(const rows::CrossEntropyForward& f, int64_t n) {
    warps(warp::CrossEntropyForward{f}, n);
  }
  void launch(const rows::DepthRstd& f, int64_t n) { warps(warp::DepthRstd{f}, n); }
  void launch(const rows::AttnSoftmaxForward& f, int64_t n) {
    warps(warp::AttnSoftmaxForward{f}, n);
  }
  void launch(const rows::AttnSoftmaxBackward& f, int64_t n) {
    warps(warp::AttnSoftmaxBackward{f}, n);
  }
  void launch(const rows::DepthMixForward& f, int64_t n) {
    depth<warp::DepthMixForward>(f, f.m.dh(), n);
  }
  void launch(const rows::DepthMixBackward& f, int64_t n) {
    depth<warp::DepthMixBackward>(f, f.m.dh(), n);
  }
  void launch(const rows::DepthMixPhase1& f, int64_t n) {
    if (f.m.dh() > 32 * warp::kWarp) return cuda::launch(f, n, s_);  // wide: the reference
    for (int64_t k0 = 0; k0 < f.K; k0 += warp::kQueries) {
      const int64_t kn = std::min<int64_t>(warp::kQueries, f.K - k0);
      warp::with_tile<warp::DepthMixPhase1>(
          f.m.dh(), [&](const auto& b) { warps(b, n, 4); }, f, k0, kn);
    }
  }
  void launch(const rows::DepthMixPhase2& f, int64_t n) { warps(warp::DepthMixPhase2{f}, n); }
  void launch(const rows::DepthDxDot& f, int64_t n) { warps(warp::DepthDxDot{f}, n); }
  void launch(const rows::DepthSourceBackward& f, int64_t n) {
    depth<warp::DepthSourceBackward>(f, f.m.dh(), n);
  }
  void launch(const rows::AttnRowDot& f, int64_t n) { warps(warp::AttnRowDot{f}, n); }
  void launch(const rows::AttnDecodePartial& f, int64_t n) {
    if (f.hd > warp::AttnDecodePartial::kMaxHead) return cuda::launch(f, n, s_);  // reference
    warps(warp::AttnDecodePartial{f}, n);
  }
  // per_block warps per block: 8, or 4 for the register-heavy depth kernels (~170 registers per
  // thread: smaller blocks let more of them share a multiprocessor).
  template <class Body>
  void warps(const Body& body, int64_t rows, int per_block = 8) {
    if (rows <= 0) return;
    const int64_t blocks = std::min<int64_t>((rows + per_block - 1) / per_block, 1 << 16);
    warp::rows_kernel<<<static_cast<unsigned>(blocks), per_block * warp::kWarp, 0, s_>>>(body,
                                                                                         rows);
    ATTNRES_CUDA_CHECK(cudaGetLastError());
  }
  // The register tile that holds a (d/H)-channel slice; wider slices run the reference, one
  // thread per slice.
  template <template <int> class Body, class F>
  void depth(const F& f, int64_t dh, int64_t rows) {
    if (!warp::with_tile<Body>(
            dh, [&](const auto& b) { warps(b, rows, 4); }, f)) {
      cuda::launch(f, rows, s_);
    }
  }

  // Row-major X (r, c) is column-major X^T; see the derivations beside each call.
  void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC,
                      int64_t OC, bool accumulate) {
    const int n = dim(N), ic = dim(IC), oc = dim(OC);
    if (N == 0 || OC == 0) return;
    if (IC == 0) {  // an empty sum (cuBLAS rejects a leading dimension of 0)
      if (!accumulate) zero(out, sizeof(float) * N * OC);
      return;
    }
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    // out^T (OC,N) = w (OC,IC) . inp^T (IC,N): w is stored as w^T column-major -> op T.
    ATTNRES_CUBLAS_CHECK(
        cublasSgemm(h_, CUBLAS_OP_T, CUBLAS_OP_N, oc, n, ic, &one, w, ic, inp, ic, &beta, out, oc));
  }
  void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                       int64_t N, int64_t IC, int64_t OC) {
    const int n = dim(N), ic = dim(IC), oc = dim(OC);
    if (N == 0 || IC == 0 || OC == 0) return;  // nothing to add
    const float one = 1.0f;
    if (dinp) {
      // dinp^T (IC,N) += w^T (IC,OC) . dout^T (OC,N)
      ATTNRES_CUBLAS_CHECK(cublasSgemm(h_, CUBLAS_OP_N, CUBLAS_OP_N, ic, n, oc, &one, w, ic, dout,
                                       oc, &one, dinp, ic));
    }
    if (dw) {
      // dw^T (IC,OC) += inp^T (IC,N) . dout (N,OC)
      ATTNRES_CUBLAS_CHECK(cublasSgemm(h_, CUBLAS_OP_N, CUBLAS_OP_T, ic, oc, n, &one, inp, ic, dout,
                                       oc, &one, dw, ic));
    }
  }

  void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                 const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    cuda::gemm_bf16(h_, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  }
  // Batched, with the operand order of gemm_bf16 above; the pointer table is device memory.
  void gemm_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                    const void* const* table, int64_t lda, int64_t ldb, float beta, int64_t ldc,
                    int64_t count) {
    if (count == 0 || M == 0 || N == 0) return;
    check(K > 0, "internal: batched GEMM with an empty inner dimension");
    const auto* t = reinterpret_cast<const float* const*>(table);
    ATTNRES_CUBLAS_CHECK(
        cublasSgemmBatched(h_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                           dim(N), dim(M), dim(K), &alpha, t + count, dim(ldb), t, dim(lda), &beta,
                           const_cast<float* const*>(t + 2 * count), dim(ldc), dim(count)));
  }
  // The same with bf16 operands and fp32 results, accumulated in fp32 on the tensor cores.
  void gemm_batched_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                         const void* const* table, int64_t lda, int64_t ldb, float beta,
                         int64_t ldc, int64_t count) {
    if (count == 0 || M == 0 || N == 0) return;
    check(K > 0, "internal: batched GEMM with an empty inner dimension");
    ATTNRES_CUBLAS_CHECK(cublasGemmBatchedEx(
        h_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, dim(N), dim(M), dim(K),
        &alpha, table + count, CUDA_R_16BF, dim(ldb), table, CUDA_R_16BF, dim(lda), &beta,
        const_cast<void* const*>(table + 2 * count), CUDA_R_32F, dim(ldc), dim(count),
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
};

}  // namespace

// ---------------------------------------------------------------- bf16 (device.hpp)

namespace dev {

void to_bf16(uint16_t* out, const float* in, int64_t n) { launch(rows::ToBf16{out, in}, n); }
void from_bf16(float* out, const uint16_t* in, int64_t n) { launch(rows::FromBf16{out, in}, n); }

void matmul_forward_bf16(float* out, const uint16_t* inp, const uint16_t* w, int64_t N, int64_t IC,
                         int64_t OC, bool accumulate) {
  if (N == 0 || OC == 0) return;
  if (IC == 0) {
    if (!accumulate) ATTNRES_CUDA_CHECK(cudaMemset(out, 0, sizeof(float) * N * OC));
    return;
  }
  // out (N,OC) = inp (N,IC) w^T
  gemm_bf16(blas(), false, true, N, OC, IC, inp, IC, w, IC, accumulate ? 1.0f : 0.0f, out, OC);
}

}  // namespace dev
}  // namespace attnres::cuda

namespace attnres {

std::shared_ptr<Backend> make_cuda_backend(int device) {
  std::string why;
  const int n = cuda::device_count(&why);
  if (n == 0) throw Error("device cuda is unavailable: " + why);
  check(device >= 0 && device < n,
        "device cuda:" + std::to_string(device) + " does not exist: " + std::to_string(n) +
            " GPU(s) here (cuda:0 .. cuda:" + std::to_string(n - 1) + ")");
  return std::make_shared<cuda::RowBackend<cuda::CudaExec>>(device);
}

}  // namespace attnres
