// Backend selection and DevBuf (attnres/backend.hpp).
#include "backend/backend.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "attnres/error.hpp"
#include "core/blas.hpp"

namespace attnres {

const std::shared_ptr<Backend>& cpu_backend() {
  // Never destroyed: a CPU DevBuf in a static object may be released after any other static.
  static const auto* be = new std::shared_ptr<Backend>(make_cpu_backend());
  return *be;
}

const char* to_string(MatmulPrecision p) { return p == MatmulPrecision::bf16 ? "bf16" : "fp32"; }

const char* to_string(Device d) {
  switch (d) {
    case Device::cuda:
      return "cuda";
    case Device::cuda_host:
      return "cuda-host";
    case Device::cpu:
      break;
  }
  return "cpu";
}

Device parse_device(const std::string& s) {
  for (Device d : {Device::cpu, Device::cuda, Device::cuda_host}) {
    if (s == to_string(d)) return d;
  }
  throw Error("unknown device '" + s + "'; use cpu, cuda or cuda-host");
}

namespace {
// Once per process: bf16 products on a CPU without AVX512-BF16 are widened to fp32 (the same
// results, at fp32's speed or a little below), which a user asking for speed should know.
void note_cpu_bf16_emulation() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (cpu_has_bf16()) return;
    std::fprintf(stderr,
                 "note: this CPU has no AVX512-BF16, so --precision bf16 products are computed by "
                 "widening the bf16 operands to fp32: the same results as on a bf16 CPU, but no "
                 "faster than --precision fp32 (use it here)\n");
  });
}
}  // namespace

std::shared_ptr<Backend> make_backend(Device d, MatmulPrecision p, int gpu) {
  // (the shared CPU backend stays fp32: a bf16 CPU backend is a backend of its own)
  std::shared_ptr<Backend> be =
      d == Device::cpu         ? (p == MatmulPrecision::fp32 ? cpu_backend() : make_cpu_backend())
      : d == Device::cuda_host ? make_cuda_host_backend()
                               : make_cuda_backend(gpu);
  be->set_matmul_precision(p);
  if (d == Device::cpu && p == MatmulPrecision::bf16) note_cpu_bf16_emulation();
  return be;
}

std::shared_ptr<Backend> make_backend(const std::string& name) {
  if (name.rfind("cuda:", 0) == 0) {  // cuda:N, the N-th GPU
    const std::string k = name.substr(5);
    check(!k.empty() && k.size() < 6 && k.find_first_not_of("0123456789") == std::string::npos,
          "unknown device '" + name + "'; use cuda:N with N a GPU index");
    return make_cuda_backend(std::stoi(k));
  }
  for (Device d : {Device::cpu, Device::cuda, Device::cuda_host}) {
    if (name == to_string(d)) return make_backend(d);
  }
  throw Error("unknown device '" + name + "'; use cpu, cuda, cuda:N or cuda-host");
}

std::string backend_name(const Backend& be) { return be.name(); }

MatmulPrecision parse_precision(const std::string& s) {
  for (MatmulPrecision p : {MatmulPrecision::fp32, MatmulPrecision::bf16}) {
    if (s == to_string(p)) return p;
  }
  throw Error("unknown precision '" + s + "'; use fp32 or bf16");
}

void Backend::set_matmul_precision(MatmulPrecision p) {
  if (p == MatmulPrecision::fp32) {
    if (precision_ != p) precision_ = p;  // no write to the shared CPU backend when unchanged
    return;
  }
  throw Error("bf16 matmuls are not available on device " + name() +
              " (yet); use --device cuda (or cuda-host, its emulation) or --precision fp32");
}

namespace {
[[noreturn]] void no_device_step(const Backend& be, const char* what) {
  throw Error(std::string("internal: ") + what + " is a device-backend op; backend " + be.name() +
              " does not offer it");
}
}  // namespace

void Backend::cross_entropy_loss_add(float*, float*, const float*, const int32_t*, int64_t,
                                     int64_t) {
  no_device_step(*this, "cross_entropy_loss_add");
}
void Backend::grad_norm_clip(float*, const float*, int64_t) {
  no_device_step(*this, "grad_norm_clip");
}
void Backend::adamw_update_scaled(float*, const float*, float*, float*, int64_t, bool,
                                  const float*) {
  no_device_step(*this, "adamw_update_scaled");
}
void Backend::to_bf16(uint16_t*, const float*, int64_t) { no_device_step(*this, "to_bf16"); }
void Backend::prepare_embedding_backward(const int32_t*, const int32_t*, int64_t) {}
void Backend::begin_capture() { no_device_step(*this, "begin_capture"); }
std::unique_ptr<Captured> Backend::end_capture() { no_device_step(*this, "end_capture"); }

namespace {
Backend& or_cpu(Backend* be) { return be ? *be : *cpu_backend(); }
}  // namespace

template <class T>
DevBuf<T>& DevBuf<T>::on(Backend* be) {
  if (be == cpu_backend().get()) be = nullptr;
  if (be != be_) {
    reset();
    be_ = be;
  }
  return *this;
}

template <class T>
void DevBuf<T>::reset() {
  if (p_) or_cpu(be_).release(p_, cap_ * sizeof(T));
  p_ = nullptr;
  n_ = cap_ = 0;
}

template <class T>
void DevBuf<T>::resize(size_t n) {
  Backend& be = or_cpu(be_);
  if (n <= cap_) {
    if (n > n_) be.zero(p_ + n_, (n - n_) * sizeof(T));
    n_ = n;
    return;
  }
  T* p = static_cast<T*>(be.alloc(n * sizeof(T)));  // zeroed
  if (p_) {
    be.copy(p, p_, n_ * sizeof(T));
    be.release(p_, cap_ * sizeof(T));
  }
  p_ = p;
  n_ = cap_ = n;
}

template <class T>
void DevBuf<T>::assign_zero(size_t n) {
  if (n > cap_) {
    reset();
    resize(n);  // fresh memory is zeroed
    return;
  }
  n_ = n;
  if (n_ > 0) or_cpu(be_).zero(p_, n_ * sizeof(T));
}

template <class T>
void DevBuf<T>::upload(const T* host, size_t n) {
  if (n > cap_) reset();
  resize(n);
  if (n > 0) or_cpu(be_).upload(p_, host, n * sizeof(T));
}

template <class T>
std::vector<T> DevBuf<T>::download() const {
  std::vector<T> h(n_);
  if (n_ > 0) or_cpu(be_).download(h.data(), p_, n_ * sizeof(T));
  return h;
}

template <class T>
const T* DevBuf<T>::host_view(std::vector<T>& scratch) const {
  Backend& be = or_cpu(be_);
  if (be.host_memory()) {
    be.synchronize();
    return p_;
  }
  scratch = download();
  return scratch.data();
}

template <class T>
T* DevBuf<T>::host_stage(std::vector<T>& scratch) {
  Backend& be = or_cpu(be_);
  if (be.host_memory()) {
    be.synchronize();
    return p_;
  }
  scratch.assign(n_, T{});
  return scratch.data();
}

template <class T>
void DevBuf<T>::commit_host(const std::vector<T>& scratch) {
  Backend& be = or_cpu(be_);
  if (!be.host_memory() && n_ > 0) be.upload(p_, scratch.data(), n_ * sizeof(T));
}

template class DevBuf<float>;
template class DevBuf<int32_t>;
template class DevBuf<uint16_t>;

}  // namespace attnres
