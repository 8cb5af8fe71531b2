// The profiling backend: a decorator over any backend that times each op as a prof::Scope of
// its family (core/profile.hpp), in the phase the model set. Everything else forwards unchanged,
// so results are bit for bit those of the backend it wraps.
#include <memory>
#include <utility>

#include "backend/backend.hpp"
#include "core/profile.hpp"

namespace attnres {

namespace {

using prof::Op;

class ProfiledBackend final : public Backend {
 public:
  explicit ProfiledBackend(std::shared_ptr<Backend> inner) : in_(std::move(inner)) {
    precision_ = in_->matmul_precision();
  }

  std::string name() const override { return in_->name(); }
  bool is_cpu() const override { return in_->is_cpu(); }
  bool host_memory() const override { return in_->host_memory(); }

  // ---- memory: allocation untimed, transfers as elementwise work ----
  void* alloc(size_t bytes) override { return in_->alloc(bytes); }
  void release(void* p, size_t bytes) noexcept override { in_->release(p, bytes); }
  void upload(void* dst, const void* host, size_t bytes) override {
    const Timed t(prof::kElementwise);
    in_->upload(dst, host, bytes);
  }
  void download(void* host, const void* src, size_t bytes) override {
    const Timed t(prof::kElementwise);
    in_->download(host, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    const Timed t(prof::kElementwise);
    in_->copy(dst, src, bytes);
  }
  void zero(void* p, size_t bytes) override {
    const Timed t(prof::kElementwise);
    in_->zero(p, bytes);
  }
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 int64_t rows) override {
    const Timed t(prof::kElementwise);
    in_->copy_rows(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  }
  void synchronize() override { in_->synchronize(); }
  void set_matmul_precision(MatmulPrecision p) override {
    in_->set_matmul_precision(p);
    precision_ = p;
  }

  // ---- elementwise ----
  void add(float* dst, const float* a, const float* b, int64_t n) override {
    const Timed t(prof::kElementwise);
    in_->add(dst, a, b, n);
  }
  void mul(float* dst, const float* a, const float* b, int64_t n) override {
    const Timed t(prof::kElementwise);
    in_->mul(dst, a, b, n);
  }
  void add_product(float* dst, const float* a, const float* b, int64_t n) override {
    const Timed t(prof::kElementwise);
    in_->add_product(dst, a, b, n);
  }
  void scale(float* x, float s, int64_t n) override {
    const Timed t(prof::kElementwise);
    in_->scale(x, s, n);
  }
  void add_row(float* x, const float* row, int64_t N, int64_t C) override {
    const Timed t(prof::kElementwise);
    in_->add_row(x, row, N, C);
  }
  void mul_row(float* dst, const float* src, const float* row, int64_t N, int64_t C) override {
    const Timed t(prof::kElementwise);
    in_->mul_row(dst, src, row, N, C);
  }
  void column_sum_add(float* dst, const float* x, int64_t N, int64_t C) override {
    const Timed t(prof::kElementwise);
    in_->column_sum_add(dst, x, N, C);
  }
  double sum_squares(const float* x, int64_t n) override {
    const Timed t(prof::kElementwise);
    return in_->sum_squares(x, n);
  }

  // ---- ops ----
  void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N,
                         int64_t C) override {
    const Timed t(prof::kEmbedding);
    in_->embedding_forward(out, ids, wte, N, C);
  }
  void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                          const int32_t* host_ids) override {
    const Timed t(prof::kEmbedding);
    in_->embedding_backward(dwte, dout, ids, N, C, host_ids);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* g, int64_t N,
                       int64_t C, float eps) override {
    const Timed t(prof::kRmsNorm);
    in_->rmsnorm_forward(out, rstd, inp, g, N, C, eps);
  }
  void rmsnorm_backward(float* dinp, float* dg, const float* dout, const float* inp, const float* g,
                        const float* rstd, int64_t N, int64_t C) override {
    const Timed t(prof::kRmsNorm);
    in_->rmsnorm_backward(dinp, dg, dout, inp, g, rstd, N, C);
  }
  void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC,
                      int64_t OC, bool accumulate, MatmulMemo* memo) override {
    const Timed t(prof::kMatmul);
    in_->matmul_forward(out, inp, w, N, IC, OC, accumulate, memo);
  }
  void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                       int64_t N, int64_t IC, int64_t OC, MatmulMemo* memo) override {
    const Timed t(prof::kMatmul);
    in_->matmul_backward(dinp, dw, dout, inp, w, N, IC, OC, memo);
  }
  void rope_forward(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                    int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) override {
    const Timed t(prof::kRope);
    in_->rope_forward(x, cos_t, sin_t, B, T, n_heads, hd, ld, pos0);
  }
  void rope_backward(float* dx, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                     int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0) override {
    const Timed t(prof::kRope);
    in_->rope_backward(dx, cos_t, sin_t, B, T, n_heads, hd, ld, pos0);
  }
  int64_t attention_state_floats(const ops::AttnShape& s) const override {
    return in_->attention_state_floats(s);
  }
  void attention_forward(float* out, float* att, const float* qkv,
                         const ops::AttnShape& s) override {
    const Timed t(prof::kAttention);
    in_->attention_forward(out, att, qkv, s);
  }
  void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                          const float* out, const float* att, const ops::AttnShape& s) override {
    const Timed t(prof::kAttention);
    in_->attention_backward(dqkv, scratch, dout, qkv, out, att, s);
  }
  void scalar_mix_forward(float* out, const float* const* src, const float* w, int64_t S,
                          int64_t n) override {
    const Timed t(prof::kResidual);
    in_->scalar_mix_forward(out, src, w, S, n);
  }
  void scalar_mix_backward(float* const* dsrc, float* da, const float* dout,
                           const float* const* src, const float* w, int64_t S, int64_t n) override {
    const Timed t(prof::kResidual);
    in_->scalar_mix_backward(dsrc, da, dout, src, w, S, n);
  }
  void softmax_small(float* w, const float* z, int64_t S) override {
    const Timed t(prof::kResidual);
    in_->softmax_small(w, z, S);
  }
  void softmax_small_backward(float* dz, const float* a, const float* da, int64_t S) override {
    const Timed t(prof::kResidual);
    in_->softmax_small_backward(dz, a, da, S);
  }
  void attention_decode(float* out, const float* q, const float* kc, const float* vc, int64_t n,
                        int64_t pos0, int64_t H, int64_t Hkv, int64_t hd) override {
    const Timed t(prof::kAttention);
    in_->attention_decode(out, q, kc, vc, n, pos0, H, Hkv, hd);
  }
  void swiglu_forward(float* out, const float* h13, int64_t N, int64_t F) override {
    const Timed t(prof::kSwiglu);
    in_->swiglu_forward(out, h13, N, F);
  }
  void swiglu_backward(float* dh13, const float* dout, const float* h13, int64_t N,
                       int64_t F) override {
    const Timed t(prof::kSwiglu);
    in_->swiglu_backward(dh13, dout, h13, N, F);
  }
  double cross_entropy_forward(float* lse, const float* logits, const int32_t* targets, int64_t N,
                               int64_t V) override {
    const Timed t(prof::kCrossEntropy);
    return in_->cross_entropy_forward(lse, logits, targets, N, V);
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                              const int32_t* targets, int64_t N, int64_t V, float dloss) override {
    const Timed t(prof::kCrossEntropy);
    in_->cross_entropy_backward(dlogits, logits, lse, targets, N, V, dloss);
  }
  // One op on the wrapped backend (a device may fuse it): profiled as matmul, its larger part.
  void head_backward(float* dinp, float* dw, float* logits, const float* lse,
                     const int32_t* targets, int64_t N, int64_t V, float dloss, const float* inp,
                     const float* w, int64_t IC, MatmulMemo* memo) override {
    const Timed t(prof::kMatmul);
    in_->head_backward(dinp, dw, logits, lse, targets, N, V, dloss, inp, w, IC, memo);
  }
  void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H,
                  float eps) override {
    const Timed t(prof::kResidual);
    in_->depth_rstd(rstd, v, N, d, H, eps);
  }
  void depth_mix_forward(float* x, float* lse, const ops::DepthSource* src, int64_t S,
                         const float* qg, int64_t q_ld, const ops::DepthMix& m,
                         int64_t N) override {
    const Timed t(prof::kResidual);
    in_->depth_mix_forward(x, lse, src, S, qg, q_ld, m, N);
  }
  void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                          const ops::DepthSource* src, int64_t S, const float* qg, int64_t q_ld,
                          const ops::DepthMix& m, int64_t N) override {
    const Timed t(prof::kResidual);
    in_->depth_mix_backward(dqg, dx, x, lse, src, S, qg, q_ld, m, N);
  }
  void depth_mix_phase1(float* const* o, float* const* lse, const ops::DepthSource* src, int64_t S,
                        const float* const* qg, int64_t K, const ops::DepthMix& m,
                        int64_t N) override {
    const Timed t(prof::kResidual);
    in_->depth_mix_phase1(o, lse, src, S, qg, K, m, N);
  }
  void depth_mix_phase2(float* x, float* lse, const float* o1, const float* lse1,
                        const ops::DepthSource& p, const float* qg, const ops::DepthMix& m,
                        int64_t N) override {
    const Timed t(prof::kResidual);
    in_->depth_mix_phase2(x, lse, o1, lse1, p, qg, m, N);
  }
  void depth_dx_dot(float* D, const float* dx, const float* x, const ops::DepthMix& m,
                    int64_t N) override {
    const Timed t(prof::kResidual);
    in_->depth_dx_dot(D, dx, x, m, N);
  }
  void depth_source_backward(float* dv, const ops::DepthSource& src, const ops::DepthReader* rd,
                             int64_t K, float* dq, const ops::DepthMix& m, int64_t N) override {
    const Timed t(prof::kResidual);
    in_->depth_source_backward(dv, src, rd, K, dq, m, N);
  }
  void depth_sources_backward(float* const* dv, const ops::DepthSource* src, int64_t G,
                              const ops::DepthReader* rd, int64_t K, float* dq,
                              const ops::DepthMix& m, int64_t N) override {
    const Timed t(prof::kResidual);
    in_->depth_sources_backward(dv, src, G, rd, K, dq, m, N);
  }
  void to_bf16(uint16_t* out, const float* in, int64_t n) override {
    const Timed t(prof::kResidual);  // (bf16 copies of the depth sources)
    in_->to_bf16(out, in, n);
  }
  void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                    const ops::AdamStep& k) override {
    const Timed t(prof::kOptimizer);
    in_->adamw_update(p, g, m, v, n, decay, k);
  }

  // ---- the device step ----
  void cross_entropy_loss_add(float* s, float* lse, const float* logits, const int32_t* targets,
                              int64_t N, int64_t V) override {
    const Timed t(prof::kCrossEntropy);
    in_->cross_entropy_loss_add(s, lse, logits, targets, N, V);
  }
  void grad_norm_clip(float* s, const float* g, int64_t n) override {
    const Timed t(prof::kOptimizer);
    in_->grad_norm_clip(s, g, n);
  }
  void adamw_update_scaled(float* p, const float* g, float* m, float* v, int64_t n, bool decay,
                           const float* s) override {
    const Timed t(prof::kOptimizer);
    in_->adamw_update_scaled(p, g, m, v, n, decay, s);
  }
  void prepare_embedding_backward(const int32_t* ids, const int32_t* host_ids, int64_t N) override {
    const Timed t(prof::kEmbedding);
    in_->prepare_embedding_backward(ids, host_ids, N);
  }

  // ---- capture: forwarded untimed (a profiled step runs uncaptured) ----
  bool can_capture() const override { return in_->can_capture(); }
  void begin_capture() override { in_->begin_capture(); }
  std::unique_ptr<Captured> end_capture() override { return in_->end_capture(); }
  void abort_capture() noexcept override { in_->abort_capture(); }
  uint64_t memory_epoch() const override { return in_->memory_epoch(); }

 private:
  // One op's scope in the current phase.
  struct Timed {
    explicit Timed(Op op) : s(op, prof::phase()) {}
    prof::Scope s;
  };
  std::shared_ptr<Backend> in_;
};

}  // namespace

std::shared_ptr<Backend> make_profiled_backend(std::shared_ptr<Backend> inner) {
  return std::make_shared<ProfiledBackend>(std::move(inner));
}

}  // namespace attnres
