// The CUDA backend's logic, once, for two executors (C++17: nvcc compiles it too):
//   CudaExec (backend_cuda.cu)  kernels on the GPU, cuBLAS GEMMs, device memory
//   HostExec (backend_host.cpp) the same kernels' functors called index by index on the host,
//                               host memory and the CPU GEMMs ("cuda-host": tests everywhere)
// An executor provides: name(); alloc (zeroed) / release / upload / download / copy / zero /
// synchronize on bytes; launch(functor, n) calling functor(i) for i in [0, n); matmul_forward /
// matmul_backward with the semantics of src/ops; gemm_batched(ta, tb, M, N, K, alpha, table, lda,
// ldb, beta, ldc, count): for each i < count, C[i] = alpha op(A[i]) op(B[i]) + beta C[i] with the
// row-major contract of attnres::sgemm (src/core/blas.hpp), where the executor-memory table holds
// A[0..count), B[0..count), C[0..count) (void pointers; A, B, C fp32); gemm_batched_bf16, the
// same with A, B bf16 (uint16_t bits), C fp32 and fp32 accumulation; gemm_bf16(ta, tb, M, N, K,
// A, lda, B, ldb, beta, C, ldc): C (fp32) = op(A) op(B) + beta C with A, B bf16, fp32
// accumulation, the same contract; kFlashAttention, and where true flash_attention_supported(hd),
// flash_attention_forward(out, lse, qkv, shape) and flash_attention_backward(dqkv, dout, qkv,
// lse, D, dk_part, dv_part, shape) (flash_attention.cuh). Pointer tables come from a TableCache
// (table_cache.hpp): uploaded once, reused by every later step that passes the same pointers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnres/error.hpp"
#include "backend/backend.hpp"
#include "cuda/row_kernels.hpp"
#include "cuda/table_cache.hpp"

namespace attnres::cuda {

template <class Exec>
class RowBackend final : public Backend {
 public:
  template <class... Args>
  explicit RowBackend(Args&&... args) : x_(std::forward<Args>(args)...) {
    // ATTNRES_FLASH_ATTENTION=0: bf16 attention always as batched GEMMs, =1: always with the
    // flash kernels where they exist (to compare the two, test either, or step around a suspect
    // kernel); auto (the default): see flash().
    if (const char* v = std::getenv("ATTNRES_FLASH_ATTENTION")) {
      const std::string s = v;
      check(s == "0" || s == "1" || s == "auto",
            "ATTNRES_FLASH_ATTENTION must be 0, 1 or auto, got '" + s + "'");
      flash_ = s == "0" ? Flash::never : s == "1" ? Flash::always : Flash::automatic;
    }
  }
  ~RowBackend() override {
    x_.abort_capture();  // (an exception may have left a capture open)
    for (auto* s : {&dq_, &partials_, &losses_, &cols_, &bf_a_, &bf_b_, &bf_c_, &bf_d_, &ids_,
                    &decode_, &gqa_, &step_part_, &dsr_, &widen_, &mix_part_}) {
      if (s->p) x_.release(s->p, s->bytes);
    }
  }
  std::string name() const override { return Exec::name(); }
  bool host_memory() const override { return Exec::kHostMemory; }

  // ---- memory ----
  void* alloc(size_t bytes) override { return x_.alloc(bytes); }
  void release(void* p, size_t bytes) noexcept override { x_.release(p, bytes); }
  void upload(void* dst, const void* host, size_t bytes) override { x_.upload(dst, host, bytes); }
  void download(void* host, const void* src, size_t bytes) override {
    x_.download(host, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes && dst != src) x_.copy(dst, src, bytes);
  }
  void zero(void* p, size_t bytes) override {
    if (bytes) x_.zero(p, bytes);
  }
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 int64_t rows) override {
    if (rows > 0 && row_bytes > 0) x_.copy_rows(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  }
  void synchronize() override { x_.synchronize(); }

  // ---- elementwise ----
  void add(float* dst, const float* a, const float* b, int64_t n) override {
    x_.launch(rows::Add{dst, a, b}, n);
  }
  void mul(float* dst, const float* a, const float* b, int64_t n) override {
    x_.launch(rows::Mul{dst, a, b}, n);
  }
  void add_product(float* dst, const float* a, const float* b, int64_t n) override {
    x_.launch(rows::AddProduct{dst, a, b}, n);
  }
  void scale(float* x, float s, int64_t n) override { x_.launch(rows::Scale{x, s}, n); }
  void add_row(float* x, const float* row, int64_t N, int64_t C) override {
    x_.launch(rows::AddRow{x, row, C}, N * C);
  }
  void mul_row(float* dst, const float* src, const float* row, int64_t N, int64_t C) override {
    x_.launch(rows::MulRow{dst, src, row, C}, N * C);
  }
  // Partial sums of 64-row chunks, then the chunks added in order (deterministic).
  void column_sum_add(float* dst, const float* x, int64_t N, int64_t C) override {
    if (N == 0 || C == 0) return;
    const int64_t K = (N + kRowsPerChunk - 1) / kRowsPerChunk;
    auto* part = static_cast<float*>(scratch(cols_, sizeof(float) * K * C));
    x_.launch(rows::ColumnPartial{part, x, N, C, kRowsPerChunk}, K * C);
    x_.launch(rows::ColumnSumAdd{dst, part, K, C}, C);
  }
  double sum_squares(const float* x, int64_t n) override {
    const int64_t P = std::min<int64_t>(n, int64_t{1} << 16);  // partial sums
    if (P == 0) return 0.0;
    auto* part = static_cast<double*>(scratch(partials_, sizeof(double) * P));
    x_.launch(rows::SumSquares{part, x, n, P}, P);
    double s = 0.0;
    add_partials(&s, part, 1, P);
    return s;
  }

  // ---- ops ----
  void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N,
                         int64_t C) override {
    x_.launch(rows::EmbeddingForward{out, ids, wte, C}, N * C);
  }
  // The rows are grouped by token id on the host, so each (token, channel) sums its rows in order
  // in parallel: deterministic, and no thread loops over all N. The grouping is prepared ahead by
  // prepare_embedding_backward (with the batch, before a captured step) or here: from host_ids,
  // or from the ids read back (N ints) when the caller has no host copy. Its size depends on N
  // only (the group count is read on the device), so a captured launch fits every batch.
  void prepare_embedding_backward(const int32_t* ids, const int32_t* host_ids, int64_t N) override {
    prep_ids_ = nullptr;
    if (N == 0) return;
    std::vector<int32_t>& h = host_ids_;
    h.assign(host_ids, host_ids + N);
    std::vector<int32_t>& perm = host_perm_;
    perm.resize(h.size());
    for (int64_t n = 0; n < N; n++) perm[n] = static_cast<int32_t>(n);
    std::stable_sort(perm.begin(), perm.end(), [&](int32_t a, int32_t b) { return h[a] < h[b]; });
    // start[0..G] then id[0..G): laid out as perm (N), start (N + 1), id (N), G (1)
    std::vector<int32_t>& g = host_groups_;
    g.assign(static_cast<size_t>(2 * N + 2), 0);
    int32_t G = 0;
    for (int64_t k = 0; k < N; k++) {
      if (k == 0 || h[perm[k]] != h[perm[k - 1]]) {
        g[G] = static_cast<int32_t>(k);
        g[N + 1 + G] = h[perm[k]];
        G++;
      }
    }
    g[G] = static_cast<int32_t>(N);
    g[2 * N + 1] = G;
    auto* dev = static_cast<int32_t*>(scratch(ids_, sizeof(int32_t) * (3 * N + 2)));
    x_.upload(dev, perm.data(), sizeof(int32_t) * N);
    x_.upload(dev + N, g.data(), sizeof(int32_t) * g.size());
    prep_ids_ = ids;
  }
  void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                          const int32_t* host_ids) override {
    if (N == 0) return;
    const bool prepared = host_ids && prep_ids_ == ids && host_ids_.size() == size_t(N) &&
                          std::equal(host_ids, host_ids + N, host_ids_.begin());
    if (!prepared) {
      if (host_ids) {
        prepare_embedding_backward(ids, host_ids, N);
      } else {
        std::vector<int32_t> h(static_cast<size_t>(N));
        x_.download(h.data(), ids, sizeof(int32_t) * h.size());
        prepare_embedding_backward(ids, h.data(), N);
      }
    }
    auto* dev = static_cast<int32_t*>(ids_.p);
    x_.launch(rows::EmbeddingBackwardGrouped{dwte, dout, dev, dev + N, dev + 2 * N + 1,
                                             dev + 3 * N + 1, C},
              N * C);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* g, int64_t N,
                       int64_t C, float eps) override {
    x_.launch(rows::RmsNormForward{out, rstd, inp, g, C, eps}, N);
  }
  void rmsnorm_backward(float* dinp, float* dg, const float* dout, const float* inp, const float* g,
                        const float* rstd, int64_t N, int64_t C) override {
    x_.launch(rows::RmsNormBackwardInput{dinp, dout, inp, g, rstd, C}, N);
    const int64_t K = (N + kRowsPerChunk - 1) / kRowsPerChunk;
    auto* part = static_cast<float*>(scratch(cols_, sizeof(float) * K * C));
    x_.launch(rows::RmsNormGainPartial{part, dout, inp, rstd, N, C, kRowsPerChunk}, K * C);
    x_.launch(rows::ColumnSumAdd{dg, part, K, C}, C);
  }
  void set_matmul_precision(MatmulPrecision p) override { precision_ = p; }
  // bf16: both operands rounded into bf16 copies, products accumulated in fp32 into the fp32
  // output (cuBLAS GemmEx on the tensor cores; the host rounds and runs the CPU sgemm). With a
  // memo the forward's copies are kept for the backward, which then rounds only dout.
  void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC,
                      int64_t OC, bool accumulate, MatmulMemo* memo) override {
    if (memo) memo->valid = false;
    if (precision_ == MatmulPrecision::fp32 || N == 0 || IC == 0 || OC == 0) {
      x_.matmul_forward(out, inp, w, N, IC, OC, accumulate);
      return;
    }
    const uint16_t *a, *b;
    if (memo) {
      a = bf16_into(memo->inp, inp, N * IC);
      b = bf16_into(memo->w, w, OC * IC);
      memo->remember(inp, w, N, IC, OC);
    } else {
      a = bf16(bf_a_, inp, N * IC);
      b = bf16(bf_b_, w, OC * IC);
    }
    // out (N,OC) = inp (N,IC) w^T
    x_.gemm_bf16(false, true, N, OC, IC, a, IC, b, IC, accumulate ? 1.0f : 0.0f, out, OC);
  }
  void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                       int64_t N, int64_t IC, int64_t OC, MatmulMemo* memo) override {
    const bool kept = memo && memo->take(inp, w, N, IC, OC);  // (used once)
    if (precision_ == MatmulPrecision::fp32 || N == 0 || IC == 0 || OC == 0) {
      x_.matmul_backward(dinp, dw, dout, inp, w, N, IC, OC);
      return;
    }
    backward_bf16(dinp, dw, bf16(bf_c_, dout, N * OC), inp, w, N, IC, OC, kept ? memo : nullptr);
  }
  // With bf16 products the loss's gradient is rounded to bf16 as it is computed: the fp32
  // dlogits (N,V), the largest activation of a language model, are never written nor read.
  void head_backward(float* dinp, float* dw, float* logits, const float* lse,
                     const int32_t* targets, int64_t N, int64_t V, float dloss, const float* inp,
                     const float* w, int64_t IC, MatmulMemo* memo) override {
    if (precision_ == MatmulPrecision::fp32 || N == 0 || IC == 0 || V == 0) {
      Backend::head_backward(dinp, dw, logits, lse, targets, N, V, dloss, inp, w, IC, memo);
      return;
    }
    const bool kept = memo && memo->take(inp, w, N, IC, V);  // (used once)
    auto* g = static_cast<uint16_t*>(scratch(bf_c_, sizeof(uint16_t) * N * V));
    x_.launch(rows::CrossEntropyBackwardBf16{g, {logits, lse, targets, V, dloss}}, N * V);
    backward_bf16(dinp, dw, g, inp, w, N, IC, V, kept ? memo : nullptr);
  }
  void rope_forward(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                    int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) override {
    x_.launch(rows::Rope{x, cos_t, sin_t, T, n_heads, hd, ld, pos0, 1.0f},
              B * T * n_heads * (hd / 2));
  }
  void rope_backward(float* dx, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                     int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) override {
    x_.launch(rows::Rope{dx, cos_t, sin_t, T, n_heads, hd, ld, pos0, -1.0f},
              B * T * n_heads * (hd / 2));
  }
  // Causal attention. With bf16 matmul precision on an executor with flash attention
  // (flash_attention.cuh; head dimensions 16, 32, 64, 128): fused kernels that keep only the rows'
  // log-sum-exp in att. Otherwise batched GEMMs (one per (b, h), or per (b, kv head) where GQA
  // heads share a destination) around the softmax row kernels (fp32; see row_kernels.hpp), with
  // bf16 precision on bf16 copies of the operands (tensor cores) and fp32 results.
  int64_t attention_state_floats(const ops::AttnShape& s) const override {
    return flash(s) ? s.B * s.H * s.T : s.B * s.H * s.T * s.T;
  }
  void attention_forward(float* out, float* att, const float* qkv,
                         const ops::AttnShape& s) override {
    if constexpr (Exec::kFlashAttention) {
      if (flash(s)) return x_.flash_attention_forward(out, att, qkv, s);
    }
    if (precision_ == MatmulPrecision::bf16)
      return attention_forward_as<uint16_t>(out, att, qkv, s);
    attention_forward_as<float>(out, att, qkv, s);
  }
  void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                          const float* out, const float* att, const ops::AttnShape& s) override {
    if constexpr (Exec::kFlashAttention) {
      if (flash(s)) {  // D = rowsum(dout o out) (B,H,T) into scratch
        x_.launch(rows::AttnRowDot{scratch, out, dout, s.T, s.H, s.hd}, s.B * s.T * s.H);
        if (s.H == s.Hkv) {
          return x_.flash_attention_backward(dqkv, dout, qkv, att, scratch, nullptr, nullptr, s);
        }
        // GQA: dK, dV per query head, then each group's sum (every head a block of its own).
        const int64_t n = s.B * s.H * s.T * s.hd;
        auto* part = static_cast<float*>(this->scratch(gqa_, sizeof(float) * 2 * n));
        x_.flash_attention_backward(dqkv, dout, qkv, att, scratch, part, part + n, s);
        x_.launch(rows::GqaSum{dqkv, part, part + n, s.T, s.H, s.Hkv, s.hd, s.ld()},
                  s.B * s.T * s.Hkv * s.hd);
        return;
      }
    }
    if (precision_ == MatmulPrecision::bf16) {
      return attention_backward_as<uint16_t>(dqkv, scratch, dout, qkv, att, s);
    }
    attention_backward_as<float>(dqkv, scratch, dout, qkv, att, s);
  }
  // In chunks of rows::kMaxMix sources (pointers by value: no table to copy).
  void scalar_mix_forward(float* out, const float* const* src, const float* w, int64_t S,
                          int64_t n) override {
    mix_forward(out, src, w, S, n);
  }
  // The weights' gradients: P partial sums per source (threads stride over the elements, so
  // reads coalesce), added on the device (da).
  void scalar_mix_backward(float* const* dsrc, float* da, const float* dout,
                           const float* const* src, const float* w, int64_t S, int64_t n) override {
    mix_backward(dsrc, da, dout, src, w, S, n);
  }
  void softmax_small(float* w, const float* z, int64_t S) override {
    if (S > 0) x_.launch(rows::SoftmaxSmall{w, z, S}, 1);
  }
  void softmax_small_backward(float* dz, const float* a, const float* da, int64_t S) override {
    if (S > 0) x_.launch(rows::SoftmaxSmallBackward{dz, a, da, S}, 1);
  }
  // Split over chunks of kDecodeKeys cached keys, then merged (row_kernels.hpp); a long prefill
  // in blocks of kDecodeQueries queries, so the partials stay small.
  void attention_decode(float* out, const float* q, const float* kc, const float* vc, int64_t n,
                        int64_t pos0, int64_t H, int64_t Hkv, int64_t hd) override {
    for (int64_t t0 = 0; t0 < n; t0 += kDecodeQueries) {
      const int64_t m = std::min(kDecodeQueries, n - t0), p0 = pos0 + t0;
      const int64_t C = (p0 + m + kDecodeKeys - 1) / kDecodeKeys;
      auto* part = static_cast<float*>(scratch(decode_, sizeof(float) * m * H * C * (hd + 2)));
      x_.launch(
          rows::AttnDecodePartial{part, q + t0 * H * hd, kc, vc, p0, H, Hkv, hd, kDecodeKeys, C},
          m * H * C);
      x_.launch(rows::AttnDecodeMerge{out + t0 * H * hd, part, hd, C}, m * H * hd);
    }
  }
  void swiglu_forward(float* out, const float* h13, int64_t N, int64_t F) override {
    x_.launch(rows::SwigluForward{out, h13, F}, N * F);
  }
  void swiglu_backward(float* dh13, const float* dout, const float* h13, int64_t N,
                       int64_t F) override {
    x_.launch(rows::SwigluBackward{dh13, dout, h13, F}, N * F);
  }
  double cross_entropy_forward(float* lse, const float* logits, const int32_t* targets, int64_t N,
                               int64_t V) override {
    if (N == 0) return 0.0;
    auto* losses = static_cast<float*>(scratch(losses_, sizeof(float) * N));
    x_.launch(rows::CrossEntropyForward{losses, lse, logits, targets, V}, N);
    std::vector<float> h(static_cast<size_t>(N));
    x_.download(h.data(), losses, sizeof(float) * h.size());
    double s = 0.0;
    for (float v : h) s += v;
    return s / static_cast<double>(N);
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                              const int32_t* targets, int64_t N, int64_t V, float dloss) override {
    x_.launch(rows::CrossEntropyBackward{dlogits, {logits, lse, targets, V, dloss}}, N * V);
  }
  void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H,
                  float eps) override {
    x_.launch(rows::DepthRstd{rstd, v, d, H, eps}, N * H);
  }
  void depth_mix_forward(float* x, float* lse, const ops::DepthSource* src, int64_t S,
                         const float* qg, int64_t q_ld, const ops::DepthMix& m,
                         int64_t N) override {
    x_.launch(rows::DepthMixForward{x, lse, sources(src, S), S, qg, q_ld, mix(m)}, N * m.H);
  }
  void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                          const ops::DepthSource* src, int64_t S, const float* qg, int64_t q_ld,
                          const ops::DepthMix& m, int64_t N) override {
    const rows::Source* s = sources(src, S);
    if (q_ld != 0) {  // per-token queries: each (row, head) slice owns its gradient
      x_.launch(rows::DepthMixBackward{dqg, dx, x, lse, s, S, qg, q_ld, mix(m)}, N * m.H);
      return;
    }
    // A shared query: per-row gradients, then reduced over rows in order (deterministic).
    auto* dq = static_cast<float*>(scratch(dq_, sizeof(float) * N * m.d));
    x_.zero(dq, sizeof(float) * N * m.d);
    x_.launch(rows::DepthMixBackward{dq, dx, x, lse, s, S, qg, q_ld, mix(m)}, N * m.H);
    column_sum_add(dqg, dq, N, m.d);
  }
  void depth_mix_phase1(float* const* o, float* const* lse, const ops::DepthSource* src, int64_t S,
                        const float* const* qg, int64_t K, const ops::DepthMix& m,
                        int64_t N) override {
    const rows::Source* s = sources(src, S);
    constexpr int64_t kMax = rows::DepthMixPhase1::kMaxQueries;
    for (int64_t k0 = 0; k0 < K; k0 += kMax) {  // up to kMax queries per launch
      rows::DepthMixPhase1 f{};
      f.K = std::min(kMax, K - k0);
      for (int64_t k = 0; k < f.K; k++) {
        f.o[k] = o[k0 + k];
        f.lse[k] = lse[k0 + k];
        f.q[k] = qg[k0 + k];
      }
      f.src = s;
      f.S = S;
      f.m = mix(m);
      x_.launch(f, N * m.H);
    }
  }
  void depth_mix_phase2(float* x, float* lse, const float* o1, const float* lse1,
                        const ops::DepthSource& p, const float* qg, const ops::DepthMix& m,
                        int64_t N) override {
    const rows::Source ps{p.v, p.rstd, p.dv, p.vb};
    x_.launch(rows::DepthMixPhase2{x, lse, o1, lse1, ps, qg, mix(m)}, N * m.H);
  }
  void depth_dx_dot(float* D, const float* dx, const float* x, const ops::DepthMix& m,
                    int64_t N) override {
    x_.launch(rows::DepthDxDot{D, dx, x, mix(m)}, N * m.H);
  }
  // The source's gradient in one pass over its readers (each reader's dx read once, v and dv held
  // per (token, head) slice), then each head's query gradients of all K readers as one GEMM:
  // dq_k[h] (dh) += sum_n dsr[h][k][n] v_n[h], i.e. (K,dh) += (K,N) (N,dh) with v's rows d apart.
  void depth_source_backward(float* dv, const ops::DepthSource& src, const ops::DepthReader* rd,
                             int64_t K, float* dq, const ops::DepthMix& m, int64_t N) override {
    if (N == 0) return;
    if (K == 0) {
      x_.zero(dv, sizeof(float) * N * m.d);
      return;
    }
    readers_.resize(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; k++) readers_[k] = {rd[k].dx, rd[k].lse, rd[k].D, rd[k].qg};
    const auto* table =
        static_cast<const rows::Reader*>(tables_.get(readers_.data(), sizeof(rows::Reader) * K));
    // (Full AttnRes asks for K = 1, 2, .. L + 1 readers in turn: room for a power of two of them,
    // so the scratch grows a few times, not L)
    int64_t room = 1;
    while (room < K) room *= 2;
    auto* dsr = static_cast<float*>(scratch(dsr_, sizeof(float) * m.H * room * N));
    // The GEMM multiplies by the values the scores used: with a bf16 copy, the kernel writes
    // them out widened on the way.
    float* widened =
        src.vb ? static_cast<float*>(scratch(widen_, sizeof(float) * N * m.d)) : nullptr;
    const rows::Source s{src.v, src.rstd, nullptr, src.vb};
    x_.launch(rows::DepthSourceBackward{dv, dsr, s, table, K, N, mix(m), widened}, N * m.H);
    const int64_t dh = m.dh();
    const float* vq = widened ? widened : src.v;
    Batch& b = batch_;
    b.clear();
    for (int64_t h = 0; h < m.H; h++) b.add(dsr + h * K * N, vq + h * dh, dq + h * dh);
    gemm<float>(b, false, false, K, dh, N, 1.0f, N, m.d, 1.0f, m.d);
  }
  void to_bf16(uint16_t* out, const float* in, int64_t n) override {
    x_.launch(rows::ToBf16{out, in}, n);
  }
  void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                    const ops::AdamStep& k) override {
    x_.launch(rows::AdamW{p, g, m, v, k.b1, k.b2, k.step_size, k.inv_bc2_sqrt, k.eps, k.grad_scale,
                          decay},
              n);
  }

  // ---- a step without waits (core/step_scalars.hpp) ----
  void cross_entropy_loss_add(float* s, float* lse, const float* logits, const int32_t* targets,
                              int64_t N, int64_t V) override {
    if (N == 0) return;
    auto* losses = static_cast<float*>(scratch(losses_, sizeof(float) * N));
    x_.launch(rows::CrossEntropyForward{losses, lse, logits, targets, V}, N);
    const int64_t P = std::min<int64_t>(N, kStepPartials);
    auto* part = static_cast<double*>(scratch(step_part_, sizeof(double) * P));
    x_.launch(rows::SumStrided<float>{part, losses, N, P}, P);
    x_.launch(rows::LossAdd{s, part, P, 1.0 / static_cast<double>(N)}, 1);
  }
  // Partial sums of squares (as sum_squares), their kStepPartials sums, then one thread.
  void grad_norm_clip(float* s, const float* g, int64_t n) override {
    const int64_t P = std::max<int64_t>(1, std::min<int64_t>(n, int64_t{1} << 16));
    const int64_t P2 = std::min<int64_t>(P, kStepPartials);
    auto* part = static_cast<double*>(scratch(partials_, sizeof(double) * (P + P2)));
    x_.launch(rows::SumSquares{part, g, n, P}, P);
    x_.launch(rows::SumStrided<double>{part + P, part, P, P2}, P2);
    x_.launch(rows::NormClip{s, part + P, P2}, 1);
  }
  void adamw_update_scaled(float* p, const float* g, float* m, float* v, int64_t n, bool decay,
                           const float* s) override {
    x_.launch(rows::AdamWScaled{p, g, m, v, s, decay}, n);
  }

  // ---- capture (CUDA graphs; cuda-host records the calls and replays them) ----
  bool can_capture() const override { return true; }
  void begin_capture() override { x_.begin_capture(); }
  std::unique_ptr<Captured> end_capture() override { return x_.end_capture(); }
  void abort_capture() noexcept override { x_.abort_capture(); }
  uint64_t memory_epoch() const override { return x_.epoch(); }

 private:
  struct Scratch {
    void* p = nullptr;
    size_t bytes = 0;
  };
  // A scratch buffer of at least `bytes`, kept for later calls. Growing it waits for queued work
  // (a kernel may still read the old one).
  void* scratch(Scratch& s, size_t bytes) {
    if (bytes > s.bytes) {
      x_.synchronize();
      if (s.p) x_.release(s.p, s.bytes);
      s.p = nullptr;
      s.bytes = 0;
      s.p = x_.alloc(bytes);
      s.bytes = bytes;
    }
    return s.p;
  }
  // The operand pointers of one batched GEMM, gathered on the host.
  struct Batch {
    std::vector<const void*> a, b;
    std::vector<void*> c;
    void clear() { a.clear(), b.clear(), c.clear(); }
    void add(const void* x, const void* y, float* z) {
      a.push_back(x);
      b.push_back(y);
      c.push_back(z);
    }
    int64_t size() const { return static_cast<int64_t>(c.size()); }
  };
  // Runs the batch's products (operands of type E: float or bf16 bits) through the executor with
  // a device table of its pointers, laid out A[0..n) B[0..n) C[0..n); see gemm_batched in the
  // executor contract above.
  template <class E>
  void gemm(const Batch& b, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
            int64_t lda, int64_t ldb, float beta, int64_t ldc) {
    flat_.assign(b.a.begin(), b.a.end());
    flat_.insert(flat_.end(), b.b.begin(), b.b.end());
    flat_.insert(flat_.end(), b.c.begin(), b.c.end());
    const auto* table = static_cast<const void* const*>(
        tables_.get(flat_.data(), sizeof(const void*) * flat_.size()));
    if constexpr (std::is_same_v<E, float>) {
      x_.gemm_batched(ta, tb, M, N, K, alpha, table, lda, ldb, beta, ldc, b.size());
    } else {
      x_.gemm_batched_bf16(ta, tb, M, N, K, alpha, table, lda, ldb, beta, ldc, b.size());
    }
  }
  // Automatically, the flash kernels only where one layer's (B,H,T,T) probabilities would pass
  // kFlashFromScoreFloats: below it the batched bf16 GEMMs ran faster on an H200 (2.4x at B 8,
  // T 512, H 12, hd 64; docs/BENCHMARKS.md), above it the flash kernels save that memory in
  // every layer.
  static constexpr int64_t kFlashFromScoreFloats = int64_t{64} << 20;  // 256 MiB a layer
  bool flash(const ops::AttnShape& s) const {
    if (!Exec::kFlashAttention || flash_ == Flash::never || precision_ != MatmulPrecision::bf16 ||
        !x_.flash_attention_supported(s.hd)) {
      return false;
    }
    return flash_ == Flash::always || s.B * s.H * s.T * s.T > kFlashFromScoreFloats;
  }
  // attention_forward / attention_backward with GEMM operands of type E: float, or uint16_t (bf16
  // bits: each operand rounded into a scratch copy first).
  template <class E>
  void attention_forward_as(float* out, float* att, const float* qkv, const ops::AttnShape& s) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
    const int64_t T = s.T, ld = s.ld(), HD = s.H * s.hd, TT = T * T;
    const E* x = operand<E>(bf_a_, qkv, s.B * T * ld);  // q|k|v (B,T,ld)
    Batch& b = batch_;
    b.clear();
    for (int64_t i = 0; i < s.B; i++) {
      for (int64_t h = 0; h < s.H; h++) {  // att_bh (T,T) = scale q_bh k_bh^T
        b.add(q(x, s, i, h), k(x, s, i, h), att + (i * s.H + h) * TT);
      }
    }
    gemm<E>(b, false, true, T, T, s.hd, scale, ld, ld, 0.0f, T);
    x_.launch(rows::AttnSoftmaxForward{att, T}, s.B * s.H * T);
    const E* p = operand<E>(bf_b_, att, s.B * s.H * TT);  // att (B,H,T,T)
    b.clear();
    for (int64_t i = 0; i < s.B; i++) {
      for (int64_t h = 0; h < s.H; h++) {  // out_bh (T,hd) = att_bh v_bh
        b.add(p + (i * s.H + h) * TT, v(x, s, i, h), out + i * T * HD + h * s.hd);
      }
    }
    gemm<E>(b, false, false, T, s.hd, T, 1.0f, T, ld, 0.0f, HD);
  }
  template <class E>
  void attention_backward_as(float* dqkv, float* scratch, const float* dout, const float* qkv,
                             const float* att, const ops::AttnShape& s) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
    const int64_t T = s.T, ld = s.ld(), HD = s.H * s.hd, G = s.H / s.Hkv, TT = T * T;
    const E* x = operand<E>(bf_a_, qkv, s.B * T * ld);    // q|k|v (B,T,ld)
    const E* go = operand<E>(bf_c_, dout, s.B * T * HD);  // dout (B,T,HD)
    auto dO = [&](int64_t i, int64_t h) { return go + i * T * HD + h * s.hd; };
    Batch& b = batch_;
    b.clear();
    for (int64_t i = 0; i < s.B; i++) {
      for (int64_t h = 0; h < s.H; h++)
        b.add(dO(i, h), v(x, s, i, h), scratch + (i * s.H + h) * TT);
    }
    // dP_bh (T,T) = dout_bh v_bh^T, then dS in place (fp32)
    gemm<E>(b, false, true, T, T, s.hd, 1.0f, HD, ld, 0.0f, T);
    x_.launch(rows::AttnSoftmaxBackward{scratch, att, T, scale}, s.B * s.H * T);
    const E* ds = operand<E>(bf_b_, scratch, s.B * s.H * TT);  // dS (B,H,T,T)
    const E* p = operand<E>(bf_d_, att, s.B * s.H * TT);       // att (B,H,T,T)
    auto dS = [&](int64_t i, int64_t h) { return ds + (i * s.H + h) * TT; };
    auto P = [&](int64_t i, int64_t h) { return p + (i * s.H + h) * TT; };
    b.clear();
    for (int64_t i = 0; i < s.B; i++) {
      for (int64_t h = 0; h < s.H; h++) b.add(dS(i, h), k(x, s, i, h), q(dqkv, s, i, h));
    }
    // dq_bh (T,hd) += dS_bh k_bh
    gemm<E>(b, false, false, T, s.hd, T, 1.0f, T, ld, 1.0f, ld);
    // The query heads of one kv head add into the same dk / dv: one batched call per head of the
    // group, so no call has two products writing one destination.
    for (int64_t g = 0; g < G; g++) {
      b.clear();
      for (int64_t i = 0; i < s.B; i++) {
        for (int64_t kh = 0; kh < s.Hkv; kh++) {
          const int64_t h = kh * G + g;
          b.add(dS(i, h), q(x, s, i, h), k(dqkv, s, i, h));
        }
      }
      // dk (T,hd) += dS_bh^T q_bh
      gemm<E>(b, true, false, T, s.hd, T, 1.0f, T, ld, 1.0f, ld);
      b.clear();
      for (int64_t i = 0; i < s.B; i++) {
        for (int64_t kh = 0; kh < s.Hkv; kh++) {
          const int64_t h = kh * G + g;
          b.add(P(i, h), dO(i, h), v(dqkv, s, i, h));
        }
      }
      // dv (T,hd) += att_bh^T dout_bh
      gemm<E>(b, true, false, T, s.hd, T, 1.0f, T, HD, 1.0f, ld);
    }
  }
  // A GEMM operand of type E for the n floats at x: x itself, or its bf16 copy in scratch s.
  template <class E>
  const E* operand(Scratch& s, const float* x, int64_t n) {
    if constexpr (std::is_same_v<E, float>) {
      (void)s, (void)n;
      return x;
    } else {
      return bf16(s, x, n);
    }
  }
  // The kernels' table of the S depth sources.
  const rows::Source* sources(const ops::DepthSource* src, int64_t S) {
    src_.resize(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; i++) src_[i] = {src[i].v, src[i].rstd, src[i].dv, src[i].vb};
    return static_cast<const rows::Source*>(tables_.get(src_.data(), sizeof(rows::Source) * S));
  }
  // dst[g] += the sum of the P partial sums part[g P .. (g + 1) P) (executor memory), g < G,
  // added on the host in order (deterministic).
  void add_partials(double* dst, const double* part, int64_t G, int64_t P) {
    host_partials_.resize(static_cast<size_t>(G * P));
    x_.download(host_partials_.data(), part, sizeof(double) * host_partials_.size());
    for (int64_t g = 0; g < G; g++) {
      double acc = 0.0;
      for (int64_t p = 0; p < P; p++) acc += host_partials_[g * P + p];
      dst[g] += acc;
    }
  }
  // x (n floats) rounded to bf16 into buffer b (this backend's memory, grown as needed).
  const uint16_t* bf16_into(DevBuf<uint16_t>& b, const float* x, int64_t n) {
    if (b.backend() != this || static_cast<int64_t>(b.size()) < n) {
      b.reset();
      b.on(this).resize(static_cast<size_t>(n));
    }
    x_.launch(rows::ToBf16{b.data(), x}, n);
    return b.data();
  }
  // The scalar mixes with the weights on the host (wh) or in this backend's memory (wd).
  void mix_forward(float* out, const float* const* src, const float* wd, int64_t S, int64_t n) {
    constexpr int64_t kMax = rows::kMaxMix;
    if (S == 0) return zero(out, sizeof(float) * n);
    for (int64_t i0 = 0; i0 < S; i0 += kMax) {
      rows::ScalarMix f{};
      f.out = out;
      f.S = std::min(kMax, S - i0);
      f.accumulate = i0 > 0;
      f.wp = wd + i0;
      for (int64_t i = 0; i < f.S; i++) f.src[i] = src[i0 + i];
      x_.launch(f, n);
    }
  }
  // da (device) = the sums, added on the device (chunks of the partial sums in parallel, then
  // each source's chunks in order).
  void mix_backward(float* const* dsrc, float* da, const float* dout, const float* const* src,
                    const float* wd, int64_t S, int64_t n) {
    constexpr int64_t kMax = rows::kMaxMix, kChunks = 64;
    const int64_t P = std::max<int64_t>(1, std::min<int64_t>(n, 4096));
    for (int64_t i0 = 0; i0 < S; i0 += kMax) {
      const int64_t s = std::min(kMax, S - i0);
      rows::ScalarMixGrad g{};
      rows::ScalarMixDot dot{};
      g.dout = dot.dout = dout;
      g.S = s;
      g.wp = wd + i0;
      dot.n = n;
      dot.P = P;
      for (int64_t i = 0; i < s; i++) {
        g.dsrc[i] = dsrc[i0 + i];
        dot.src[i] = src[i0 + i];
      }
      auto* part = static_cast<double*>(scratch(mix_part_, sizeof(double) * s * (P + kChunks)));
      dot.part = part;
      if (n > 0) {
        x_.launch(dot, s * P);
        x_.launch(g, n);
      } else {
        x_.zero(part, sizeof(double) * s * P);
      }
      x_.launch(rows::ChunkSums{part + s * P, part, P, kChunks}, s * kChunks);
      x_.launch(rows::PartialsToFloat{da + i0, part + s * P, kChunks}, s);
    }
  }
  // matmul_backward's bf16 products from the bf16 gradient g (N,OC); the operands from the memo
  // when it holds them (kept), else rounded here.
  void backward_bf16(float* dinp, float* dw, const uint16_t* g, const float* inp, const float* w,
                     int64_t N, int64_t IC, int64_t OC, const MatmulMemo* kept) {
    if (dinp) {  // dinp (N,IC) += dout (N,OC) w (OC,IC)
      const uint16_t* b = kept ? kept->w.data() : bf16(bf_b_, w, OC * IC);
      x_.gemm_bf16(false, false, N, IC, OC, g, OC, b, IC, 1.0f, dinp, IC);
    }
    if (dw) {  // dw (OC,IC) += dout^T (OC,N) inp (N,IC)
      const uint16_t* a = kept ? kept->inp.data() : bf16(bf_a_, inp, N * IC);
      x_.gemm_bf16(true, false, OC, IC, N, g, OC, a, IC, 1.0f, dw, IC);
    }
  }
  // x (n floats) rounded to bf16 into scratch s.
  const uint16_t* bf16(Scratch& s, const float* x, int64_t n) {
    auto* out = static_cast<uint16_t*>(scratch(s, sizeof(uint16_t) * n));
    x_.launch(rows::ToBf16{out, x}, n);
    return out;
  }
  static rows::Mix mix(const ops::DepthMix& m) {
    rows::Mix r;
    r.d = m.d;
    r.H = m.H;
    r.softmax = m.softmax;
    r.key_norm = m.key_norm;
    return r;
  }

  // Sequence i's head h of q / its kv head's k, v in a (B,T,ld) q|k|v buffer (rows stride ld).
  template <class F>
  static F* q(F* x, const ops::AttnShape& s, int64_t i, int64_t h) {
    return x + i * s.T * s.ld() + h * s.hd;
  }
  template <class F>
  static F* k(F* x, const ops::AttnShape& s, int64_t i, int64_t h) {
    return x + i * s.T * s.ld() + (s.H + h / (s.H / s.Hkv)) * s.hd;
  }
  template <class F>
  static F* v(F* x, const ops::AttnShape& s, int64_t i, int64_t h) {
    return x + i * s.T * s.ld() + (s.H + s.Hkv + h / (s.H / s.Hkv)) * s.hd;
  }

  static constexpr int64_t kRowsPerChunk = 64;   // column sums: rows per partial sum
  static constexpr int64_t kDecodeKeys = 32;     // decode attention: cached keys per chunk
  static constexpr int64_t kDecodeQueries = 16;  // decode attention: queries per launch
  static constexpr int64_t kStepPartials = 256;  // step scalars: partial sums per reduction

  Exec x_;
  enum class Flash { never, always, automatic } flash_ = Flash::automatic;
  TableCache<Exec> tables_{x_};
  std::vector<const void*> flat_;
  std::vector<rows::Source> src_;
  Scratch dq_, partials_, losses_, cols_, bf_a_, bf_b_, bf_c_, bf_d_, ids_, decode_, gqa_,
      step_part_, dsr_, widen_, mix_part_;
  std::vector<rows::Reader> readers_;
  std::vector<int32_t> host_ids_, host_perm_, host_groups_;
  const int32_t* prep_ids_ = nullptr;  // the ids whose grouping ids_ holds (host_ids_ on the host)
  std::vector<double> host_partials_;
  Batch batch_;
};

}  // namespace attnres::cuda
