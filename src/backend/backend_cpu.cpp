// The CPU backend: src/ops on host memory (large buffers on transparent huge pages).
#include <omp.h>

#include <cstring>
#include <vector>

#include "attnres/buffer.hpp"
#include "backend/backend.hpp"
#include "core/bf16.hpp"

namespace attnres {

namespace {

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  bool is_cpu() const override { return true; }
  bool host_memory() const override { return true; }

  void* alloc(size_t bytes) override {
    if (bytes == 0) return nullptr;
    const size_t n = (bytes + sizeof(float) - 1) / sizeof(float);
    float* p = LargePageAllocator<float>().allocate(n);
    std::memset(p, 0, bytes);
    return p;
  }
  void release(void* p, size_t bytes) noexcept override {
    if (!p) return;
    LargePageAllocator<float>().deallocate(static_cast<float*>(p),
                                           (bytes + sizeof(float) - 1) / sizeof(float));
  }
  void upload(void* dst, const void* host, size_t bytes) override {
    if (bytes) std::memcpy(dst, host, bytes);
  }
  void download(void* host, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(host, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }
  void zero(void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
  }
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 int64_t rows) override {
    for (int64_t r = 0; r < rows; r++) {
      std::memcpy(static_cast<char*>(dst) + r * dst_pitch,
                  static_cast<const char*>(src) + r * src_pitch, row_bytes);
    }
  }

  void add(float* dst, const float* a, const float* b, int64_t n) override {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) dst[i] = a[i] + b[i];
  }
  void mul(float* dst, const float* a, const float* b, int64_t n) override {
    for (int64_t i = 0; i < n; i++) dst[i] = a[i] * b[i];
  }
  void add_product(float* dst, const float* a, const float* b, int64_t n) override {
    for (int64_t i = 0; i < n; i++) dst[i] += a[i] * b[i];
  }
  void scale(float* x, float s, int64_t n) override {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] *= s;
  }
  void add_row(float* x, const float* row, int64_t N, int64_t C) override {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) {
      for (int64_t c = 0; c < C; c++) x[r * C + c] += row[c];
    }
  }
  void mul_row(float* dst, const float* src, const float* row, int64_t N, int64_t C) override {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) {
      for (int64_t c = 0; c < C; c++) dst[r * C + c] = src[r * C + c] * row[c];
    }
  }
  // Each column summed over the rows in order from zero, then added (threads split columns).
  void column_sum_add(float* dst, const float* x, int64_t N, int64_t C) override {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; c++) {
      float s = 0.0f;
      for (int64_t r = 0; r < N; r++) s += x[r * C + c];
      dst[c] += s;
    }
  }
  double sum_squares(const float* x, int64_t n) override { return ops::sum_squares(x, n); }

  void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N,
                         int64_t C) override {
    ops::embedding_forward(out, ids, wte, N, C);
  }
  void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                          const int32_t* /*host_ids: ids are host memory*/) override {
    ops::embedding_backward(dwte, dout, ids, N, C);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* g, int64_t N,
                       int64_t C, float eps) override {
    ops::rmsnorm_forward(out, rstd, inp, g, N, C, eps);
  }
  void rmsnorm_backward(float* dinp, float* dg, const float* dout, const float* inp, const float* g,
                        const float* rstd, int64_t N, int64_t C) override {
    ops::rmsnorm_backward(dinp, dg, dout, inp, g, rstd, N, C);
  }
  // bf16 (a backend of its own: make_backend never changes the shared one): both operands
  // rounded into bf16 copies, products summed in fp32 into the fp32 output. With a memo the
  // forward's copies are kept for the backward, which then rounds only dout. fp32: memos unused.
  void set_matmul_precision(MatmulPrecision p) override {
    if (p == precision_) return;
    if (this == cpu_backend().get()) Backend::set_matmul_precision(p);  // (refuses bf16)
    precision_ = p;
  }
  void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC,
                      int64_t OC, bool accumulate, MatmulMemo* memo) override {
    if (memo) memo->valid = false;
    if (precision_ == MatmulPrecision::fp32 || N == 0 || IC == 0 || OC == 0) {
      ops::matmul_forward(out, inp, w, N, IC, OC, accumulate);
      return;
    }
    const uint16_t *a, *b;
    if (memo && memo->fixed_w) {  // (rounded once: the caller's weights do not change)
      const bool have = memo->w_src == w && memo->IC == IC && memo->OC == OC && !memo->w.empty();
      b = have ? memo->w.data() : bf16_into(memo->w, w, OC * IC);
      memo->w_src = w;
      memo->IC = IC, memo->OC = OC;
      a = bf16(bf_a_, inp, N * IC);
    } else if (memo) {
      a = bf16_into(memo->inp, inp, N * IC);
      b = bf16_into(memo->w, w, OC * IC);
      memo->remember(inp, w, N, IC, OC);
    } else {
      a = bf16(bf_a_, inp, N * IC);
      b = bf16(bf_b_, w, OC * IC);
    }
    ops::matmul_forward_bf16(out, a, b, N, IC, OC, accumulate);
  }
  void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                       int64_t N, int64_t IC, int64_t OC, MatmulMemo* memo) override {
    const bool kept = memo && memo->take(inp, w, N, IC, OC);  // (used once)
    if (precision_ == MatmulPrecision::fp32 || N == 0 || IC == 0 || OC == 0) {
      ops::matmul_backward(dinp, dw, dout, inp, w, N, IC, OC);
      return;
    }
    const uint16_t* g = bf16(bf_c_, dout, N * OC);
    const uint16_t* a = !dw ? nullptr : kept ? memo->inp.data() : bf16(bf_a_, inp, N * IC);
    const uint16_t* b = !dinp ? nullptr : kept ? memo->w.data() : bf16(bf_b_, w, OC * IC);
    ops::matmul_backward_bf16(dinp, dw, g, a, b, N, IC, OC);
  }
  void to_bf16(uint16_t* out, const float* in, int64_t n) override { to_bf16_host(out, in, n); }
  void rope_forward(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                    int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) override {
    ops::rope_forward(x, cos_t, sin_t, B, T, n_heads, hd, ld, pos0);
  }
  void rope_backward(float* dx, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                     int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) override {
    ops::rope_backward(dx, cos_t, sin_t, B, T, n_heads, hd, ld, pos0);
  }
  void attention_forward(float* out, float* att, const float* qkv,
                         const ops::AttnShape& s) override {
    ops::attention_forward(out, att, qkv, s);
  }
  void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                          const float* /*out*/, const float* att,
                          const ops::AttnShape& s) override {
    ops::attention_backward(dqkv, scratch, dout, qkv, att, s);
  }
  void scalar_mix_forward(float* out, const float* const* src, const float* w, int64_t S,
                          int64_t n) override {
    ops::scalar_mix_forward(out, src, w, S, n);
  }
  void scalar_mix_backward(float* const* dsrc, float* da, const float* dout,
                           const float* const* src, const float* w, int64_t S, int64_t n) override {
    std::vector<double> dw(static_cast<size_t>(S), 0.0);
    ops::scalar_mix_backward(dsrc, dw.data(), dout, src, w, S, n);
    for (int64_t i = 0; i < S; i++) da[i] = static_cast<float>(dw[i]);
  }
  void softmax_small(float* w, const float* z, int64_t S) override { ops::softmax_small(w, z, S); }
  void softmax_small_backward(float* dz, const float* a, const float* da, int64_t S) override {
    ops::softmax_small_backward(dz, a, da, S);
  }
  void attention_decode(float* out, const float* q, const float* kc, const float* vc, int64_t n,
                        int64_t pos0, int64_t H, int64_t Hkv, int64_t hd) override {
    ops::attention_decode(out, q, kc, vc, n, pos0, H, Hkv, hd);
  }
  void swiglu_forward(float* out, const float* h13, int64_t N, int64_t F) override {
    ops::swiglu_forward(out, h13, N, F);
  }
  void swiglu_backward(float* dh13, const float* dout, const float* h13, int64_t N,
                       int64_t F) override {
    ops::swiglu_backward(dh13, dout, h13, N, F);
  }
  double cross_entropy_forward(float* lse, const float* logits, const int32_t* targets, int64_t N,
                               int64_t V) override {
    return ops::cross_entropy_forward(nullptr, lse, logits, targets, N, V);
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                              const int32_t* targets, int64_t N, int64_t V, float dloss) override {
    ops::cross_entropy_backward(dlogits, logits, lse, targets, N, V, dloss);
  }
  void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H,
                  float eps) override {
    ops::depth_rstd(rstd, v, N, d, H, eps);
  }
  void depth_mix_forward(float* x, float* lse, const ops::DepthSource* src, int64_t S,
                         const float* qg, int64_t q_ld, const ops::DepthMix& m,
                         int64_t N) override {
    ops::depth_mix_forward(x, lse, src, S, qg, q_ld, m, N);
  }
  void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                          const ops::DepthSource* src, int64_t S, const float* qg, int64_t q_ld,
                          const ops::DepthMix& m, int64_t N) override {
    ops::depth_mix_backward(dqg, dx, x, lse, src, S, qg, q_ld, m, N);
  }
  void depth_mix_phase1(float* const* o, float* const* lse, const ops::DepthSource* src, int64_t S,
                        const float* const* qg, int64_t K, const ops::DepthMix& m,
                        int64_t N) override {
    ops::depth_mix_phase1(o, lse, src, S, qg, K, m, N);
  }
  void depth_mix_phase2(float* x, float* lse, const float* o1, const float* lse1,
                        const ops::DepthSource& p, const float* qg, const ops::DepthMix& m,
                        int64_t N) override {
    ops::depth_mix_phase2(x, lse, o1, lse1, p, qg, m, N);
  }
  void depth_dx_dot(float* D, const float* dx, const float* x, const ops::DepthMix& m,
                    int64_t N) override {
    ops::depth_dx_dot(D, dx, x, m, N);
  }
  // Each thread's query-gradient partials (the rows a thread handles depend only on N and the
  // thread count), then combined in thread order: deterministic.
  void depth_source_backward(float* dv, const ops::DepthSource& src, const ops::DepthReader* rd,
                             int64_t K, float* dq, const ops::DepthMix& m, int64_t N) override {
    depth_sources_backward(&dv, &src, 1, rd, K, dq, m, N);
  }
  void depth_sources_backward(float* const* dv, const ops::DepthSource* src, int64_t G,
                              const ops::DepthReader* rd, int64_t K, float* dq,
                              const ops::DepthMix& m, int64_t N) override {
    const int nthr = omp_get_max_threads();
    const int64_t d = m.d;
    // Scratch of the calling thread: the fp32 CPU backend is one object shared by every model in
    // the process, and models trained on several threads at once (ranks as threads) raced on
    // members here: corrupted readers, a crash or "double free or corruption" now and then.
    thread_local std::vector<ops::DepthReader> readers;
    thread_local std::vector<float> dq_part;
    readers.assign(rd, rd + K);
    for (int64_t k = 0; k < K; k++) readers[k].dq_offset = k * d;
    dq_part.assign(static_cast<size_t>(nthr * K * d), 0.0f);
    ops::depth_sources_backward(dv, src, G, readers.data(), K, dq_part.data(), K * d, nthr, m, N);
    for (int t = 0; t < nthr; t++) {
      const float* p = dq_part.data() + static_cast<int64_t>(t) * K * d;
      for (int64_t j = 0; j < K * d; j++) dq[j] += p[j];
    }
  }
  void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                    const ops::AdamStep& k) override {
#pragma omp parallel
    ops::adamw_update_in_parallel(p, g, m, v, n, decay, k);
  }

 private:
  // x (n floats) rounded to bf16 into memo buffer b (grown as needed).
  const uint16_t* bf16_into(DevBuf<uint16_t>& b, const float* x, int64_t n) {
    if (b.backend() != this || static_cast<int64_t>(b.size()) < n) {
      b.reset();
      b.on(this).resize(static_cast<size_t>(n));
    }
    to_bf16_host(b.data(), x, n);
    return b.data();
  }
  // x (n floats) rounded to bf16 into scratch s.
  static const uint16_t* bf16(std::vector<uint16_t>& s, const float* x, int64_t n) {
    if (static_cast<int64_t>(s.size()) < n) s.resize(static_cast<size_t>(n));
    to_bf16_host(s.data(), x, n);
    return s.data();
  }

  // bf16 operands without a memo (a bf16 backend is its model's own: make_backend)
  std::vector<uint16_t> bf_a_, bf_b_, bf_c_;
};

}  // namespace

std::shared_ptr<Backend> make_cpu_backend() { return std::make_shared<CpuBackend>(); }

}  // namespace attnres
