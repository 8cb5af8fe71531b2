// The "cuda-host" backend (attnres/backend.hpp): the CUDA backend's RowBackend with its kernels'
// functors run on the host index by index, host memory and the CPU GEMMs. Built everywhere, so the
// device code path of the model is tested on machines without a GPU.
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "cuda/row_backend.hpp"

namespace attnres {

namespace cuda {
namespace {

struct HostExec {
  static const char* name() { return "cuda-host"; }
  void* alloc(size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = std::calloc(1, bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void release(void* p, size_t) noexcept { std::free(p); }
  void upload(void* dst, const void* host, size_t bytes) {
    if (bytes) std::memcpy(dst, host, bytes);
  }
  void download(void* host, const void* src, size_t bytes) {
    if (bytes) std::memcpy(host, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) { std::memmove(dst, src, bytes); }
  void zero(void* p, size_t bytes) { std::memset(p, 0, bytes); }
  void synchronize() {}
  template <class F>
  void launch(const F& f, int64_t n) {
    rows::run_rows_host(f, n);
  }
  void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC,
                      int64_t OC, bool accumulate) {
    ops::matmul_forward(out, inp, w, N, IC, OC, accumulate);
  }
  void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp,
                       const float* w, int64_t N, int64_t IC, int64_t OC) {
    ops::matmul_backward(dinp, dw, dout, inp, w, N, IC, OC);
  }
  const rows::Source* sources(const ops::DepthSource* src, int64_t S) {
    table_.resize(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; i++) table_[i] = {src[i].v, src[i].rstd, src[i].dv};
    return table_.data();
  }
  std::vector<rows::Source> table_;
};

}  // namespace
}  // namespace cuda

std::shared_ptr<Backend> make_cuda_host_backend() {
  return std::make_shared<cuda::RowBackend<cuda::HostExec>>();
}

}  // namespace attnres
