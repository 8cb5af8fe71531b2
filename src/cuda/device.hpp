// Device memory and the bf16 kernels of the CUDA backend (src/cuda/backend_cuda.cu), callable
// from plain C++ (no CUDA header needed); the model's ops are the Backend "cuda"
// (attnres/backend.hpp). Every function throws attnres::Error naming the failing CUDA call when
// the device reports an error. Work is queued on the default stream; download() waits for it.
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

// bf16 (as uint16_t bits, round to nearest even) <-> fp32, n elements.
void to_bf16(uint16_t* out, const float* in, int64_t n);
void from_bf16(float* out, const uint16_t* in, int64_t n);
// Mixed precision: out (N,OC) fp32 = inp (N,IC) bf16 @ w^T (w (OC,IC) bf16), fp32 accumulation
// on the tensor cores (cublasGemmEx).
void matmul_forward_bf16(float* out, const uint16_t* inp, const uint16_t* w, int64_t N, int64_t IC,
                         int64_t OC, bool accumulate = false);

}  // namespace dev
}  // namespace attnres::cuda
