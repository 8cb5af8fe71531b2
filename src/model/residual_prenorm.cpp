// Mode `prenorm` (SPEC section 1): x_l = v_0 + ... + v_{l-1}, the only place in the engine where a
// residual is a plain sum.
#include <cstring>
#include <vector>

#include "attnres/error.hpp"
#include "attnres/residual.hpp"
#include "attnres/buffer.hpp"
#include "model/routers.hpp"

namespace attnres {

namespace {

class PrenormRouter final : public DepthRouter {
 public:
  PrenormRouter(int64_t L, int64_t d) : L_(L), d_(d) {}

  void add_params(ParamLayout&) override {}
  void bind(const ParamLayout&, float*, float*) override {}

  void begin(const float* emb, int64_t n) override {
    n_ = n;
    const size_t sz = static_cast<size_t>(n * d_);
    if (xs_.size() < static_cast<size_t>(L_ + 1) * sz) xs_.resize((L_ + 1) * sz);
    if (out_.size() < sz) out_.resize(sz);
    std::memcpy(xs_.data(), emb, sizeof(float) * sz);
  }
  const float* input(int64_t l) override { return x(l); }
  float* output_slot(int64_t) override { return out_.data(); }
  void commit_output(int64_t l) override {
    // x_{l+1} = x_l + v_{l+1}
    const float* a = x(l);
    float* dst = x(l + 1);
    const float* o = out_.data();
    const int64_t m = n_ * d_;
#pragma omp parallel for simd schedule(static) if (m > 65536)
    for (int64_t i = 0; i < m; i++) dst[i] = a[i] + o[i];
  }
  const float* final_hidden() override { return x(L_); }

  void begin_backward(const float* dh) override {
    const size_t sz = static_cast<size_t>(n_ * d_);
    if (g_.size() < sz) g_.resize(sz);
    if (dx_.size() < sz) dx_.resize(sz);
    std::memcpy(g_.data(), dh, sizeof(float) * sz);
  }
  // Every later x_j contains v_{l+1} with weight 1, so its gradient is the running sum.
  const float* grad_output(int64_t) override { return g_.data(); }
  float* grad_input_slot(int64_t) override {
    std::memset(dx_.data(), 0, sizeof(float) * n_ * d_);
    return dx_.data();
  }
  void commit_grad_input(int64_t) override {
    float* g = g_.data();
    const float* dx = dx_.data();
    const int64_t m = n_ * d_;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < m; i++) g[i] += dx[i];
  }
  const float* grad_embedding() override { return g_.data(); }

  int64_t activation_bytes(int64_t n) const override {
    return static_cast<int64_t>(sizeof(float)) * n * d_ * (L_ + 2);
  }

 private:
  float* x(int64_t l) { return xs_.data() + l * n_ * d_; }
  int64_t L_, d_, n_ = 0;
  FloatBuf xs_;   // (L+1, n, d): x_0 = v_0, ..., x_L = final hidden
  FloatBuf out_;  // (n, d) sublayer output scratch
  FloatBuf g_;    // (n, d) running gradient
  FloatBuf dx_;   // (n, d) input-gradient scratch
};

}  // namespace

std::unique_ptr<DepthRouter> make_prenorm_router(const ModelConfig& cfg) {
  return std::make_unique<PrenormRouter>(cfg.n_sublayers(), cfg.d_model);
}

}  // namespace attnres
