// attnres/backend.hpp — where a model's tensors live and how its ops run there.
//
//   cpu        the default: src/ops on host memory (oneDNN / BLAS GEMMs, AVX-512 kernels)
//   cuda       an NVIDIA GPU: cuBLAS GEMMs and the kernels of src/cuda (-DATTNRES_CUDA=ON)
//   cuda-host  the CUDA backend's own kernels run on the host, one kernel index after the other,
//              with host memory: slow, but it runs the whole device code path (the same kernels,
//              the same calls, the same order) on any machine, so the tests check it everywhere
//
// Model code never dereferences a tensor pointer itself: it allocates through DevBuf and passes
// pointers to the backend's ops (src/backend/backend.hpp), so the same model code runs on each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace attnres {

class Backend;  // src/backend/backend.hpp

// How the matrix products compute. fp32: fp32 inputs and products. bf16: both inputs rounded
// to bf16 (tensor cores on a GPU), products accumulated and stored in fp32, and on a device the
// AttnRes depth mix reads bf16 copies of its sources (fp32 accumulation); the weights, their
// gradients and the optimizer stay fp32 (the master copy), and so does every other op.
enum class MatmulPrecision { fp32, bf16 };
// Where a model's tensors live and its ops run (the table above).
enum class Device { cpu, cuda, cuda_host };

// Each choice's name as the CLI spells it ("fp32", "bf16"; "cpu", "cuda", "cuda-host"), and the
// parse back; anything else is an Error naming it and the choices.
const char* to_string(MatmulPrecision p);
const char* to_string(Device d);
MatmulPrecision parse_precision(const std::string& s);
Device parse_device(const std::string& s);

// The backend of device d (for cuda: GPU number `gpu`) computing its matrix products at
// precision p. Throws Error naming the fix when it is unavailable here (built without CUDA, no
// GPU) or cannot compute at p (bf16 on the CPU).
std::shared_ptr<Backend> make_backend(Device d, MatmulPrecision p = MatmulPrecision::fp32,
                                      int gpu = 0);
// The backend named `name` (cpu, cuda = cuda:0, cuda:N = the N-th GPU, cuda-host), at fp32.
std::shared_ptr<Backend> make_backend(const std::string& name);
// The process-wide CPU backend (what a Model uses unless told otherwise).
const std::shared_ptr<Backend>& cpu_backend();
// The backend's name as make_backend takes it.
std::string backend_name(const Backend& be);

// n elements of T in a backend's memory, zero-initialised, freed on destruction; resize keeps the
// contents like std::vector. data() is a pointer only that backend's ops may dereference.
template <class T>
class DevBuf {
 public:
  DevBuf() = default;
  ~DevBuf() { reset(); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  // A moved-from buffer is empty and stays on its backend.
  DevBuf(DevBuf&& o) noexcept {
    swap(o);
    o.be_ = be_;
  }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
      o.be_ = be_;
    }
    return *this;
  }
  // Moves the buffer to backend `be` (nullptr: the CPU), dropping its contents if it changes.
  DevBuf& on(Backend* be);
  Backend* backend() const { return be_; }
  void resize(size_t n);       // keeps the first min(n, size()) elements; new ones are zero
  void assign_zero(size_t n);  // n zeros
  void reset();                // frees the memory
  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  // Host copies, for setup, checks and reports (not for hot paths).
  void upload(const T* host, size_t n);  // resizes to n
  std::vector<T> download() const;
  // The contents readable on the host while `scratch` lives: the memory itself where the
  // backend's memory is the host's (once queued work is done), else a copy into scratch.
  const T* host_view(std::vector<T>& scratch) const;
  // Where to write all size() elements on the host: the memory itself, or scratch (resized);
  // commit_host(scratch) then uploads them where the memory is not the host's.
  T* host_stage(std::vector<T>& scratch);
  void commit_host(const std::vector<T>& scratch);

 private:
  void swap(DevBuf& o) noexcept {
    std::swap(be_, o.be_);
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(cap_, o.cap_);
  }
  Backend* be_ = nullptr;  // null: the CPU backend
  T* p_ = nullptr;
  size_t n_ = 0, cap_ = 0;
};

extern template class DevBuf<float>;
extern template class DevBuf<int32_t>;
extern template class DevBuf<uint16_t>;

}  // namespace attnres
