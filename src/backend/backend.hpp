// The backend interface (attnres/backend.hpp says which exist): memory, a few elementwise helpers
// and the model's ops, with the shapes and semantics of src/ops/ops.hpp (read the comments there).
// Every pointer is the backend's own memory; every backward ACCUMULATES (+=). Work may run
// asynchronously: download() and the functions returning host values wait for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "attnres/backend.hpp"
#include "ops/ops.hpp"

namespace attnres {

// What a backend derives from a matmul's operands in matmul_forward (with bf16 precision: their
// bf16 copies), kept for the matmul_backward of the same product. A caller passes the same memo
// to both only where the input and the weight stay unchanged in between (a training step's stored
// activations and its weights); the backward uses the memo once, when it matches its operands.
struct MatmulMemo {
  DevBuf<uint16_t> inp, w;
  const float* inp_src = nullptr;
  const float* w_src = nullptr;
  int64_t N = 0, IC = 0, OC = 0;
  bool valid = false;
  // Set by a caller whose weight stays unchanged while the memo lives (a decoder): the bf16 copy
  // of w is made on the first product and reused by every later one of the same w (a backend
  // may ignore it and round again); such a memo keeps nothing for a backward.
  bool fixed_w = false;

  // After a forward filled inp and w from these operands: valid for their backward.
  void remember(const float* i, const float* wt, int64_t n, int64_t ic, int64_t oc) {
    inp_src = i, w_src = wt, N = n, IC = ic, OC = oc;
    valid = true;
  }
  // Whether it holds the bf16 copies of exactly these operands (then marked used: used once).
  bool take(const float* i, const float* wt, int64_t n, int64_t ic, int64_t oc) {
    const bool held = valid && inp_src == i && w_src == wt && N == n && IC == ic && OC == oc;
    valid = false;
    return held;
  }
};

// Work recorded by Backend::begin_capture / end_capture (a CUDA graph): run() queues it again,
// with the same launches on the same pointers, reading the memory as it is then.
class Captured {
 public:
  virtual ~Captured() = default;
  virtual void run() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // The CPU backend: its memory is host memory, and a training step runs on it without the
  // device-only step ops below (src/train picks the host step for it).
  virtual bool is_cpu() const { return false; }
  // Its pointers are host memory (cpu, cuda-host), which host code such as MPI may read and write.
  virtual bool host_memory() const = 0;

  // ---- memory (bytes) ----
  virtual void* alloc(size_t bytes) = 0;  // zeroed
  virtual void release(void* p, size_t bytes) noexcept = 0;
  virtual void upload(void* dst, const void* host, size_t bytes) = 0;
  virtual void download(void* host, const void* src, size_t bytes) = 0;  // waits for queued work
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  // rows rows of row_bytes bytes each, from src (rows src_pitch bytes apart) to dst (dst_pitch).
  virtual void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                         size_t row_bytes, int64_t rows) = 0;
  virtual void synchronize() {}
  // The precision of matmul_forward / matmul_backward (attnres/backend.hpp). Error when the
  // backend does not offer it (the CPU: fp32 only).
  virtual void set_matmul_precision(MatmulPrecision p);
  MatmulPrecision matmul_precision() const { return precision_; }

  // ---- elementwise, n floats ----
  virtual void add(float* dst, const float* a, const float* b, int64_t n) = 0;  // dst = a + b
  virtual void mul(float* dst, const float* a, const float* b, int64_t n) = 0;  // dst = a * b
  virtual void add_product(float* dst, const float* a, const float* b, int64_t n) = 0;  // += a*b
  virtual void scale(float* x, float s, int64_t n) = 0;                                 // x *= s
  // Row vectors broadcast over the N rows of (N,C): x += row; dst = src * row (dst may be src).
  virtual void add_row(float* x, const float* row, int64_t N, int64_t C) = 0;
  virtual void mul_row(float* dst, const float* src, const float* row, int64_t N, int64_t C) = 0;
  // dst (C) += the column sums of x (N,C) (fp32; deterministic).
  virtual void column_sum_add(float* dst, const float* x, int64_t N, int64_t C) = 0;
  // sum of x^2, accumulated in double (gradient norms).
  virtual double sum_squares(const float* x, int64_t n) = 0;

  // ---- ops (src/ops/ops.hpp) ----
  virtual void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N,
                                 int64_t C) = 0;
  // host_ids: the same N ids in host memory where the caller has them (a device backend then
  // reads no ids back: no wait for the device), else null.
  virtual void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N,
                                  int64_t C, const int32_t* host_ids = nullptr) = 0;
  virtual void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* g, int64_t N,
                               int64_t C, float eps) = 0;
  virtual void rmsnorm_backward(float* dinp, float* dg, const float* dout, const float* inp,
                                const float* g, const float* rstd, int64_t N, int64_t C) = 0;
  // memo: see MatmulMemo (null: none).
  virtual void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC,
                              int64_t OC, bool accumulate = false, MatmulMemo* memo = nullptr) = 0;
  virtual void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp,
                               const float* w, int64_t N, int64_t IC, int64_t OC,
                               MatmulMemo* memo = nullptr) = 0;
  virtual void rope_forward(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                            int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) = 0;
  virtual void rope_backward(float* dx, const float* cos_t, const float* sin_t, int64_t B,
                             int64_t T, int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) = 0;
  // Causal attention: out (B,T,H*hd) from qkv (B,T,ld); att keeps what the backward needs, in
  // attention_state_floats(s) floats: the probabilities (B,H,T,T), or less where the backend
  // recomputes them (flash attention keeps the rows' log-sum-exp, (B,H,T)). The backward adds
  // into dqkv (B,T,ld) from dout and the forward's out; scratch has as many floats as att.
  virtual int64_t attention_state_floats(const ops::AttnShape& s) const {
    return s.B * s.H * s.T * s.T;
  }
  virtual void attention_forward(float* out, float* att, const float* qkv,
                                 const ops::AttnShape& s) = 0;
  virtual void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                                  const float* out, const float* att, const ops::AttnShape& s) = 0;
  // Scalar mixes (static and DenseFormer residuals): out (n) = sum_{i<S} w[i] src[i] (n each),
  // the S weights in this backend's memory (no host round trip, so a step can be captured); the
  // backward adds w[i] dout into dsrc[i] (null: skipped) and writes da (S, this backend's memory,
  // OVERWRITTEN) = sum_k dout[k] src[i][k] (summed in double in a fixed order).
  virtual void scalar_mix_forward(float* out, const float* const* src, const float* w, int64_t S,
                                  int64_t n) = 0;
  virtual void scalar_mix_backward(float* const* dsrc, float* da, const float* dout,
                                   const float* const* src, const float* w, int64_t S,
                                   int64_t n) = 0;
  // w (S) = softmax(z (S)); dz (S) += its backward a_i (da_i - sum_j a_j da_j) (in double).
  virtual void softmax_small(float* w, const float* z, int64_t S) = 0;
  virtual void softmax_small_backward(float* dz, const float* a, const float* da, int64_t S) = 0;
  // KV-cache decoding: out (n,H*hd) for the n new queries q (n,H*hd) at positions pos0.. against
  // the cached keys and values kc, vc (rows of Hkv*hd; query t sees positions [0, pos0 + t]).
  virtual void attention_decode(float* out, const float* q, const float* kc, const float* vc,
                                int64_t n, int64_t pos0, int64_t H, int64_t Hkv, int64_t hd) = 0;
  virtual void swiglu_forward(float* out, const float* h13, int64_t N, int64_t F) = 0;
  virtual void swiglu_backward(float* dh13, const float* dout, const float* h13, int64_t N,
                               int64_t F) = 0;
  // Writes lse (N); returns the mean loss over the N rows.
  virtual double cross_entropy_forward(float* lse, const float* logits, const int32_t* targets,
                                       int64_t N, int64_t V) = 0;
  virtual void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                                      const int32_t* targets, int64_t N, int64_t V,
                                      float dloss) = 0;
  // The language-model head's backward from the loss: cross_entropy_backward into logits (N,V)
  // (OVERWRITTEN), then matmul_backward of out (N,V) = inp (N,IC) w^T with them (memo as
  // there). A backend may instead keep the gradient only in the form its products read (a
  // device with bf16 products: bf16; logits then keep their values).
  virtual void head_backward(float* dinp, float* dw, float* logits, const float* lse,
                             const int32_t* targets, int64_t N, int64_t V, float dloss,
                             const float* inp, const float* w, int64_t IC, MatmulMemo* memo) {
    cross_entropy_backward(logits, logits, lse, targets, N, V, dloss);
    matmul_backward(dinp, dw, logits, inp, w, N, IC, V, memo);
  }
  virtual void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H,
                          float eps) = 0;
  // src: a HOST array of S sources whose pointers are this backend's memory.
  virtual void depth_mix_forward(float* x, float* lse, const ops::DepthSource* src, int64_t S,
                                 const float* qg, int64_t q_ld, const ops::DepthMix& m,
                                 int64_t N) = 0;
  virtual void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                                  const ops::DepthSource* src, int64_t S, const float* qg,
                                  int64_t q_ld, const ops::DepthMix& m, int64_t N) = 0;
  // Two-phase Block AttnRes and grouped Full AttnRes (ops::depth_mix_phase1 / phase2; phase2
  // also in place); o, lse, qg: host arrays of K pointers into this backend's memory.
  virtual void depth_mix_phase1(float* const* o, float* const* lse, const ops::DepthSource* src,
                                int64_t S, const float* const* qg, int64_t K,
                                const ops::DepthMix& m, int64_t N) = 0;
  virtual void depth_mix_phase2(float* x, float* lse, const float* o1, const float* lse1,
                                const ops::DepthSource& p, const float* qg, const ops::DepthMix& m,
                                int64_t N) = 0;
  // By-source backward of Full AttnRes with static queries (as ops::depth_dx_dot and
  // ops::depth_source_backward): D (N,H) = dx . x per head slice; dv (N,d) = the source's
  // gradient through its K readers (a HOST array, pointers in this backend's memory; dq_offset
  // unused) (OVERWRITTEN), and dq + k d (d) += reader k's query gradient from this source.
  virtual void depth_dx_dot(float* D, const float* dx, const float* x, const ops::DepthMix& m,
                            int64_t N) = 0;
  virtual void depth_source_backward(float* dv, const ops::DepthSource& src,
                                     const ops::DepthReader* rd, int64_t K, float* dq,
                                     const ops::DepthMix& m, int64_t N) = 0;
  // The same for G sources every reader reads (dv: G HOST pointers): one pass over the readers'
  // dx for all of them where the backend fuses it (the CPU's); else source by source.
  virtual void depth_sources_backward(float* const* dv, const ops::DepthSource* src, int64_t G,
                                      const ops::DepthReader* rd, int64_t K, float* dq,
                                      const ops::DepthMix& m, int64_t N) {
    for (int64_t g = 0; g < G; g++) depth_source_backward(dv[g], src[g], rd, K, dq, m, N);
  }
  // out (n) = in rounded to bf16 (uint16_t bits; device backends only: bf16 storage).
  virtual void to_bf16(uint16_t* out, const float* in, int64_t n);
  // One tensor's AdamW update of n elements.
  virtual void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                            const ops::AdamStep& k) = 0;

  // ---- a training step without waits for the host (src/train/device_step.cpp) ----
  // s: the step's scalars (core/step_scalars.hpp), step::kCount floats in this backend's memory.
  // Only device backends offer these (the default throws).
  // s[kLoss] += the mean over the N rows of the cross-entropy; lse (N) as cross_entropy_forward.
  virtual void cross_entropy_loss_add(float* s, float* lse, const float* logits,
                                      const int32_t* targets, int64_t N, int64_t V);
  // From the gradients g (n): s[kNorm] = their L2 norm, s[kClip] = clip_scale(norm,
  // s[kMaxNorm]), s[kOk] = 1 when the norm (and, if s[kLossCheck], s[kLoss]) is finite, else 0.
  virtual void grad_norm_clip(float* s, const float* g, int64_t n);
  // adamw_update with the factors from s (kBeta1 .. kEps, kDecay when decay, kClip as the
  // gradient scale); nothing changes when s[kOk] is 0.
  virtual void adamw_update_scaled(float* p, const float* g, float* m, float* v, int64_t n,
                                   bool decay, const float* s);
  // Work that embedding_backward(.., ids, N, .., host_ids) can do ahead, where ids and host_ids
  // hold the same N ids (a device backend groups them on the host and uploads the grouping, which
  // a captured step cannot do). Optional: embedding_backward does it when not done.
  virtual void prepare_embedding_backward(const int32_t* ids, const int32_t* host_ids, int64_t N);

  // ---- capture (CUDA graphs) ----
  // Between begin_capture and end_capture the ops are recorded, not run; end_capture returns
  // them as one Captured. Recording refuses (throws Error, after which the caller must call
  // abort_capture) what a replay could not repeat: allocations and frees, uploads and downloads,
  // waits for the device. A Captured stays valid while memory_epoch() is unchanged (it counts
  // this backend's allocations and frees): the pointers it holds are then still live.
  virtual bool can_capture() const { return false; }
  virtual void begin_capture();
  virtual std::unique_ptr<Captured> end_capture();
  virtual void abort_capture() noexcept {}
  virtual uint64_t memory_epoch() const { return 0; }

 protected:
  MatmulPrecision precision_ = MatmulPrecision::fp32;
};

// The backends (src/backend/backend_cpu.cpp, src/cuda/backend_host.cpp, src/cuda/backend_cuda.cu or
// cuda_stub.cpp).
std::shared_ptr<Backend> make_cpu_backend();
std::shared_ptr<Backend> make_cuda_host_backend();
// GPU `device` (0-based); throws Error with the reason when unavailable.
std::shared_ptr<Backend> make_cuda_backend(int device = 0);
// `inner` with each op timed by the op profiler (core/profile.hpp;
// src/backend/backend_profiled.cpp).
std::shared_ptr<Backend> make_profiled_backend(std::shared_ptr<Backend> inner);

}  // namespace attnres
