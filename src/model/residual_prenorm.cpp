// Mode `prenorm` (SPEC section 1): x_l = v_0 + ... + v_{l-1}, the only place in the engine where a
// residual is a plain sum.
#include "attnres/error.hpp"
#include "attnres/residual.hpp"
#include "backend/backend.hpp"
#include "model/routers.hpp"

namespace attnres {

namespace {

class PrenormRouter final : public DepthRouter {
 public:
  PrenormRouter(int64_t L, int64_t d, Backend* be) : be_(be ? *be : *cpu_backend()), L_(L), d_(d) {
    for (auto* b : {&xs_, &out_, &g_, &dx_}) b->on(&be_);
  }

  void add_params(ParamLayout&) override {}
  void bind(const ParamLayout&, float*, float*) override {}

  void begin(const float* emb, int64_t n) override {
    n_ = n;
    const size_t sz = static_cast<size_t>(n * d_);
    if (xs_.size() < static_cast<size_t>(L_ + 1) * sz) xs_.resize((L_ + 1) * sz);
    if (out_.size() < sz) out_.resize(sz);
    be_.copy(xs_.data(), emb, sizeof(float) * sz);
  }
  const float* input(int64_t l) override { return x(l); }
  float* output_slot(int64_t) override { return out_.data(); }
  void commit_output(int64_t l) override {
    be_.add(x(l + 1), x(l), out_.data(), n_ * d_);  // x_{l+1} = x_l + v_{l+1}
  }
  const float* final_hidden() override { return x(L_); }

  void begin_backward(const float* dh) override {
    const size_t sz = static_cast<size_t>(n_ * d_);
    if (g_.size() < sz) g_.resize(sz);
    if (dx_.size() < sz) dx_.resize(sz);
    be_.copy(g_.data(), dh, sizeof(float) * sz);
  }
  // Every later x_j contains v_{l+1} with weight 1, so its gradient is the running sum.
  const float* grad_output(int64_t) override { return g_.data(); }
  float* grad_input_slot(int64_t) override {
    be_.zero(dx_.data(), sizeof(float) * n_ * d_);
    return dx_.data();
  }
  void commit_grad_input(int64_t) override { be_.add(g_.data(), g_.data(), dx_.data(), n_ * d_); }
  const float* grad_embedding() override { return g_.data(); }

  int64_t activation_bytes(int64_t n) const override {
    return static_cast<int64_t>(sizeof(float)) * n * d_ * (L_ + 2);
  }

 private:
  float* x(int64_t l) { return xs_.data() + l * n_ * d_; }
  Backend& be_;
  int64_t L_, d_, n_ = 0;
  DevBuf<float> xs_;   // (L+1, n, d): x_0 = v_0, ..., x_L = final hidden
  DevBuf<float> out_;  // (n, d) sublayer output scratch
  DevBuf<float> g_;    // (n, d) running gradient
  DevBuf<float> dx_;   // (n, d) input-gradient scratch
};

}  // namespace

std::unique_ptr<DepthRouter> make_prenorm_router(const ModelConfig& cfg, Backend* be) {
  return std::make_unique<PrenormRouter>(cfg.n_sublayers(), cfg.d_model, be);
}

}  // namespace attnres
