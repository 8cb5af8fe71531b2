// The "cuda-host" backend (attnres/backend.hpp): the CUDA backend's RowBackend with its kernels'
// functors run on the host index by index, host memory and the CPU GEMMs. Built everywhere, so the
// device code path of the model is tested on machines without a GPU.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "core/blas.hpp"
#include "cuda/row_backend.hpp"

namespace attnres {

namespace cuda {
namespace {

struct HostExec {
  static const char* name() { return "cuda-host"; }
  static constexpr bool kHostMemory = true;
  // Flash attention's warp kernels run on the host only in tests/test_flash_attention.cpp.
  static constexpr bool kFlashAttention = false;
  bool flash_attention_supported(int64_t) const { return false; }
  // Capture as a CUDA graph does it: the calls are recorded (functors and arguments by value,
  // pointers as they are) and a replay runs them again on the memory as it is then; what a CUDA
  // graph cannot hold throws, so the same step that records here captures on a GPU.
  void* alloc(size_t bytes) {
    refuse_while_capturing("an allocation");
    epoch_++;
    if (bytes == 0) return nullptr;
    void* p = std::calloc(1, bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void release(void* p, size_t) noexcept {
    epoch_++;
    if (rec_) rec_->freed = true;  // the recording may hold p: end_capture refuses it
    std::free(p);
  }
  void upload(void* dst, const void* host, size_t bytes) {
    refuse_while_capturing("an upload");
    if (bytes) std::memcpy(dst, host, bytes);
  }
  void download(void* host, const void* src, size_t bytes) {
    refuse_while_capturing("a download");
    if (bytes) std::memcpy(host, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) {
    run([=] { std::memmove(dst, src, bytes); });
  }
  void zero(void* p, size_t bytes) {
    run([=] { std::memset(p, 0, bytes); });
  }
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 int64_t rows) {
    run([=] {
      for (int64_t r = 0; r < rows; r++) {
        std::memmove(static_cast<char*>(dst) + r * dst_pitch,
                     static_cast<const char*>(src) + r * src_pitch, row_bytes);
      }
    });
  }
  void synchronize() { refuse_while_capturing("a wait for the device"); }
  template <class F>
  void launch(const F& f, int64_t n) {
    run([f, n] { rows::run_rows_host(f, n); });
  }
  void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC,
                      int64_t OC, bool accumulate) {
    run([=] { ops::matmul_forward(out, inp, w, N, IC, OC, accumulate); });
  }
  void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                       int64_t N, int64_t IC, int64_t OC) {
    run([=] { ops::matmul_backward(dinp, dw, dout, inp, w, N, IC, OC); });
  }
  void gemm_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                    const void* const* table, int64_t lda, int64_t ldb, float beta, int64_t ldc,
                    int64_t count) {
    run([=, this] {
      check_distinct_outputs(table, count);
      for (int64_t i = 0; i < count; i++) {
        sgemm(ta, tb, M, N, K, alpha, static_cast<const float*>(table[i]), lda,
              static_cast<const float*>(table[count + i]), ldb, beta, output(table, count, i), ldc);
      }
    });
  }
  void gemm_batched_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                         const void* const* table, int64_t lda, int64_t ldb, float beta,
                         int64_t ldc, int64_t count) {
    run([=, this] {
      check_distinct_outputs(table, count);
      for (int64_t i = 0; i < count; i++) {
        widen(wa_, static_cast<const uint16_t*>(table[i]), ta ? K : M, ta ? M : K, lda);
        widen(wb_, static_cast<const uint16_t*>(table[count + i]), tb ? N : K, tb ? K : N, ldb);
        sgemm(ta, tb, M, N, K, alpha, wa_.data(), lda, wb_.data(), ldb, beta,
              output(table, count, i), ldc);
      }
    });
  }
  // Tensor-core bf16 GEMMs multiply the bf16 values exactly and accumulate in fp32: the CPU sgemm
  // on the values widened back to fp32 computes the same up to the order of the additions.
  void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                 const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    run([=, this] {
      widen(wa_, A, ta ? K : M, ta ? M : K, lda);
      widen(wb_, B, tb ? N : K, tb ? K : N, ldb);
      sgemm(ta, tb, M, N, K, 1.0f, wa_.data(), lda, wb_.data(), ldb, beta, C, ldc);
    });
  }

  uint64_t epoch() const { return epoch_; }
  void begin_capture() {
    refuse_while_capturing("a second capture");
    rec_ = std::make_unique<Recording>();
  }
  std::unique_ptr<Captured> end_capture() {
    check(rec_ != nullptr, "internal: end_capture without begin_capture");
    if (rec_->freed) {
      rec_.reset();
      throw Error("cannot capture the step: memory was freed while capturing");
    }
    return std::move(rec_);
  }
  void abort_capture() noexcept { rec_.reset(); }

 private:
  // On a GPU the products of one batch run concurrently: two writing one matrix would race.
  // Run here one after the other, they would not, so the contract is checked instead.
  static void check_distinct_outputs(const void* const* table, int64_t count) {
    std::vector<const void*> dst(table + 2 * count, table + 3 * count);
    std::sort(dst.begin(), dst.end());
    check(std::adjacent_find(dst.begin(), dst.end()) == dst.end(),
          "internal: a batched GEMM has two products writing the same matrix");
  }
  static float* output(const void* const* table, int64_t count, int64_t i) {
    return static_cast<float*>(const_cast<void*>(table[2 * count + i]));
  }
  // The stored (rows, cols) bf16 matrix with leading dimension ld ((rows - 1) ld + cols elements)
  // widened to fp32 into dst.
  static void widen(std::vector<float>& dst, const uint16_t* src, int64_t rows, int64_t cols,
                    int64_t ld) {
    const int64_t n = (rows - 1) * ld + cols;
    dst.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; i++) dst[i] = rows::bf16_bits_to_float(src[i]);
  }
  std::vector<float> wa_, wb_;

  struct Recording final : Captured {
    std::vector<std::function<void()>> calls;
    bool freed = false;
    void run() override {
      for (auto& c : calls) c();
    }
  };
  // Runs f now, or records it while capturing.
  template <class F>
  void run(F&& f) {
    if (rec_) {
      rec_->calls.emplace_back(std::forward<F>(f));
    } else {
      f();
    }
  }
  void refuse_while_capturing(const char* what) const {
    if (rec_) {
      throw Error(std::string("cannot capture the step: ") + what +
                  " while capturing (a replay could not repeat it)");
    }
  }
  std::unique_ptr<Recording> rec_;
  uint64_t epoch_ = 0;
};

}  // namespace
}  // namespace cuda

std::shared_ptr<Backend> make_cuda_host_backend() {
  return std::make_shared<cuda::RowBackend<cuda::HostExec>>();
}

}  // namespace attnres
