// bf16 GEMMs on the CPU: oneDNN's matmul primitive (AMX or AVX512-BF16 where the CPU has them),
// one primitive per shape, created once; elsewhere the operands widened to fp32 and multiplied by
// sgemm, which gives the same products (a bf16 times a bf16 is exact in fp32). Products of a few
// rows by a transposed weight (decoding) stream the bf16 weight through a loop of our own.
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "attnres/error.hpp"
#include "core/bf16.hpp"
#include "core/blas.hpp"
#include "core/simd.hpp"

namespace attnres {

void to_bf16_host(uint16_t* out, const float* in, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16_bits(in[i]);
}

void from_bf16_host(float* out, const uint16_t* in, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; i++) out[i] = bf16_bits_to_float(in[i]);
}

bool cpu_has_bf16() {
  static const bool has = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    constexpr auto kBf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (isa & kBf16) == kBf16;  // (oneDNN's ISA values are nested bit sets)
  }();
  return has;
}

namespace {

// (ta, tb, M, N, K, lda, ldb, ldc, accumulate)
using Shape = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;

// A product's primitive and its operands' layouts.
struct Matmul {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c, scratch;
};

// Shapes seen (a run uses a few dozen) and their primitives; cleared if it ever grows past kMax.
class PrimitiveCache {
 public:
  Matmul get(const Shape& s) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(s);
    if (it != cache_.end()) return it->second;
    if (cache_.size() >= kMax) cache_.clear();
    // (oneDNN's code generation crashed, not failed, when it got no memory; 18th hostile pass)
    require_kernel_headroom();
    return cache_.emplace(s, make(s)).first->second;
  }
  const dnnl::engine& engine() const { return engine_; }

 private:
  static constexpr size_t kMax = 512;
  Matmul make(const Shape& s) const {
    const auto [ta, tb, M, N, K, lda, ldb, ldc, acc] = s;
    using dt = dnnl::memory::data_type;
    // Row-major A (M,K) and B (K,N); a transposed operand is the stored matrix read by columns.
    const dnnl::memory::desc a({M, K}, dt::bf16,
                               ta ? dnnl::memory::dims{1, lda} : dnnl::memory::dims{lda, 1});
    const dnnl::memory::desc b({K, N}, dt::bf16,
                               tb ? dnnl::memory::dims{1, ldb} : dnnl::memory::dims{ldb, 1});
    const dnnl::memory::desc c({M, N}, dt::f32, dnnl::memory::dims{ldc, 1});
    dnnl::primitive_attr attr;
    // The caller's scratchpad: the library's is shared by every primitive of the process, and
    // two products running at once (ranks as threads, a parallel region) would share it.
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (acc) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, engine_);
    return {dnnl::matmul(pd), a, b, c, pd.scratchpad_desc()};
  }
  std::mutex mu_;
  std::map<Shape, Matmul> cache_;
  dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
};

PrimitiveCache& primitives() {
  static auto* cache = new PrimitiveCache();  // (never destroyed: used until exit)
  return *cache;
}

[[noreturn]] void out_of_memory(int64_t M, int64_t N, int64_t K) {
  throw Error("out of memory in a bf16 matrix product (" + std::to_string(M) + "x" +
              std::to_string(K) + " by " + std::to_string(K) + "x" + std::to_string(N) +
              "): oneDNN could not allocate its work space; raise the memory limit (ulimit -v) "
              "or use a smaller --batch-size / --seq-len / model");
}

void gemm_bf16_onednn(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                      int64_t lda, const uint16_t* B, int64_t ldb, bool acc, float* C,
                      int64_t ldc) {
  try {
    PrimitiveCache& cache = primitives();
    const Matmul mm = cache.get({ta, tb, M, N, K, lda, ldb, ldc, acc});
    // (oneDNN takes non-const handles; it only reads the operands)
    dnnl::memory am(mm.a, cache.engine(), const_cast<uint16_t*>(A));
    dnnl::memory bm(mm.b, cache.engine(), const_cast<uint16_t*>(B));
    dnnl::memory cm(mm.c, cache.engine(), C);
    thread_local dnnl::stream s(cache.engine());
    thread_local std::vector<uint8_t> pad;  // this thread's scratchpad
    if (pad.size() < mm.scratch.get_size()) pad.resize(mm.scratch.get_size());
    dnnl::memory sm(mm.scratch, cache.engine(), pad.data());
    mm.prim.execute(s, {{DNNL_ARG_SRC, am},
                        {DNNL_ARG_WEIGHTS, bm},
                        {DNNL_ARG_DST, cm},
                        {DNNL_ARG_SCRATCHPAD, sm}});
    s.wait();
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_out_of_memory) out_of_memory(M, N, K);
    throw std::logic_error(std::string("oneDNN bf16 matmul failed: ") + e.what());
  }
}

// A few rows times a transposed weight, C (M,N) = A (M,K) B^T (B stored (N,K)), M <= kGemvRows:
// decoding, where reading the weight is the whole cost. Each B row is widened 16 at a time as it
// streams by and multiplied with every A row (widened once); threads split B's rows.
constexpr int64_t kGemvRows = 4;
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

[[gnu::always_inline]] inline simd::f16v widen16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  simd::f16v f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

void gemv_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
               int64_t ldb, bool acc, float* C, int64_t ldc) {
  thread_local std::vector<float> wa;
  wa.resize(static_cast<size_t>(M * K));
  for (int64_t i = 0; i < M; i++) from_bf16_host(wa.data() + i * K, A + i * lda, K);
  const float* a = wa.data();
#pragma omp parallel for schedule(static) if (N * K > 65536)
  for (int64_t j = 0; j < N; j++) {
    const uint16_t* b = B + j * ldb;
    simd::f16v s[kGemvRows] = {};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const simd::f16v w = widen16(b + k);
      for (int64_t i = 0; i < M; i++) s[i] += simd::load(a + i * K + k) * w;
    }
    for (int64_t i = 0; i < M; i++) {
      float t = simd::hsum(s[i]);
      for (int64_t r = k; r < K; r++) t += a[i * K + r] * bf16_bits_to_float(b[r]);
      C[i * ldc + j] = acc ? C[i * ldc + j] + t : t;
    }
  }
}

}  // namespace

void gemm_bf16_widened(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                       int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
                       int64_t ldc) {
  thread_local std::vector<float> wa, wb;
  const int64_t na = (ta ? K - 1 : M - 1) * lda + (ta ? M : K);  // stored elements
  const int64_t nb = (tb ? N - 1 : K - 1) * ldb + (tb ? K : N);
  wa.resize(static_cast<size_t>(na));
  wb.resize(static_cast<size_t>(nb));
  from_bf16_host(wa.data(), A, na);
  from_bf16_host(wb.data(), B, nb);
  sgemm(ta, tb, M, N, K, 1.0f, wa.data(), lda, wb.data(), ldb, beta, C, ldc);
}

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
               const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (beta != 0.0f && beta != 1.0f) {
    throw std::logic_error("gemm_bf16: beta must be 0 or 1");
  }
  if (K == 0) {  // (an empty inner dimension: C = beta C)
    if (beta == 0.0f) {
      for (int64_t i = 0; i < M; i++) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    }
    return;
  }
  if (!ta && tb && M <= kGemvRows) return gemv_bf16(M, N, K, A, lda, B, ldb, beta != 0.0f, C, ldc);
  if (!cpu_has_bf16()) return gemm_bf16_widened(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  gemm_bf16_onednn(ta, tb, M, N, K, A, lda, B, ldb, beta != 0.0f, C, ldc);
}

void gemm_bf16_reference(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                         int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
                         int64_t ldc) {
  for (int64_t i = 0; i < M; i++) {
    for (int64_t j = 0; j < N; j++) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; k++) {
        const float a = bf16_bits_to_float(ta ? A[k * lda + i] : A[i * lda + k]);
        const float b = bf16_bits_to_float(tb ? B[j * ldb + k] : B[k * ldb + j]);
        acc += static_cast<double>(a) * b;
      }
      const float prev = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
      C[i * ldc + j] = static_cast<float>(acc) + prev;
    }
  }
}

}  // namespace attnres
