// Mode `static`: input-independent scalar mixing (the paper's ablation, SPEC 6). Mixer m (m < L
// feeds sublayer m, m == L gives the final hidden state) owns logits z_m over sources v_0..v_m;
// a = softmax(z_m) is the same for every token and x = sum_i a_i v_i. Logits start at zero, so the
// mix is a uniform average, which after the sublayer's RMSNorm equals the PreNorm input.
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/backend.hpp"
#include "model/routers.hpp"
#include "ops/ops.hpp"

namespace attnres {

namespace {

class StaticRouter final : public DepthRouter {
 public:
  StaticRouter(const ModelConfig& c, Backend* be)
      : be_(be ? *be : *cpu_backend()), L_(c.n_sublayers()), d_(c.d_model) {}

  void add_params(ParamLayout& layout) override {
    for (int64_t m = 0; m <= L_; m++) layout.add(mixer_prefix(m, L_) + "logits", {m + 1}, false);
  }
  void bind(const ParamLayout& layout, float* params, float* grads) override {
    params_ = params;
    grads_ = grads;
    off_.resize(L_ + 1);
    for (int64_t m = 0; m <= L_; m++) off_[m] = layout.find(mixer_prefix(m, L_) + "logits")->offset;
  }
  void init_params(float* params) const override {
    for (int64_t m = 0; m <= L_; m++) std::fill_n(params + off_[m], m + 1, 0.0f);
  }

  void begin(const float* emb, int64_t n) override {
    n_ = n;
    const size_t nd = static_cast<size_t>(n * d_);
    for (auto* bufs : {&v_, &g_, &x_}) {
      bufs->resize(L_ + 1);
      for (auto& b : *bufs) b.on(&be_).resize(nd);
    }
    dx_.on(&be_).resize(nd);
    be_.copy(v_[0].data(), emb, sizeof(float) * nd);
    // The weights in the backend's memory (no round trip through the host); the parameters stay
    // put until the next forward, so the backward reuses them.
    w_.resize(L_ + 1);
    da_.on(&be_).resize(static_cast<size_t>(L_ + 1));
    for (int64_t m = 0; m <= L_; m++) {
      w_[m].on(&be_).resize(static_cast<size_t>(m + 1));
      be_.softmax_small(w_[m].data(), params_ + off_[m], m + 1);
    }
    mix(0);
  }
  const float* input(int64_t l) override { return x_[l].data(); }
  float* output_slot(int64_t l) override { return v_[l + 1].data(); }
  void commit_output(int64_t l) override { mix(l + 1); }
  const float* final_hidden() override { return x_[L_].data(); }

  void begin_backward(const float* dh) override {
    for (auto& g : g_) be_.zero(g.data(), sizeof(float) * n_ * d_);
    mix_backward(L_, dh);
  }
  const float* grad_output(int64_t l) override { return g_[l + 1].data(); }
  float* grad_input_slot(int64_t) override {
    be_.zero(dx_.data(), sizeof(float) * n_ * d_);
    return dx_.data();
  }
  void commit_grad_input(int64_t l) override { mix_backward(l, dx_.data()); }
  const float* grad_embedding() override { return g_[0].data(); }

  bool depth_weights(std::vector<std::vector<double>>& w, std::vector<std::string>& rows,
                     std::vector<std::string>& cols) override {
    read_logits();
    cols = {"emb"};
    for (int64_t j = 0; j < L_; j++) cols.push_back(mixer_label(j, L_));
    rows.clear();
    w.assign(L_ + 1, std::vector<double>(L_ + 1, std::nan("")));
    for (int64_t m = 0; m <= L_; m++) {
      rows.push_back(mixer_label(m, L_));
      const auto a = weights(m);
      for (int64_t i = 0; i <= m; i++) w[m][i] = a[i];
    }
    return true;
  }

  int64_t activation_bytes(int64_t n) const override {
    return static_cast<int64_t>(sizeof(float)) * n * d_ * (3 * (L_ + 1) + 1);
  }

 private:
  // Host copies of every mixer's logits (the parameters may live in device memory).
  void read_logits() {
    z_.resize(L_ + 1);
    for (int64_t m = 0; m <= L_; m++) {
      z_[m].resize(static_cast<size_t>(m + 1));
      be_.download(z_[m].data(), params_ + off_[m], sizeof(float) * (m + 1));
    }
  }
  std::vector<double> weights(int64_t m) const {
    const float* z = z_[m].data();
    double mx = z[0];
    for (int64_t i = 1; i <= m; i++) mx = std::max(mx, double(z[i]));
    std::vector<double> a(m + 1);
    double sum = 0;
    for (int64_t i = 0; i <= m; i++) sum += (a[i] = std::exp(double(z[i]) - mx));
    for (auto& x : a) x /= sum;
    return a;
  }

  // x_m = sum_{i<=m} a_i v_i
  void mix(int64_t m) {
    std::vector<const float*> src;
    for (int64_t i = 0; i <= m; i++) src.push_back(v_[i].data());
    be_.scalar_mix_forward(x_[m].data(), src.data(), w_[m].data(), m + 1, n_ * d_);
  }

  // dv_i += a_i dx; dz_i = a_i (da_i - sum_j a_j da_j) with da_i = sum(dx * v_i) (softmax).
  void mix_backward(int64_t m, const float* dx) {
    std::vector<const float*> src;
    std::vector<float*> dsrc;
    for (int64_t i = 0; i <= m; i++) {
      src.push_back(v_[i].data());
      dsrc.push_back(g_[i].data());
    }
    // the forward's weights (the parameters have not changed since)
    be_.scalar_mix_backward(dsrc.data(), da_.data(), dx, src.data(), w_[m].data(), m + 1, n_ * d_);
    be_.softmax_small_backward(grads_ + off_[m], w_[m].data(), da_.data(), m + 1);
  }

  Backend& be_;
  const int64_t L_, d_;
  int64_t n_ = 0;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  std::vector<int64_t> off_;
  std::vector<std::vector<float>> z_;     // host copies of the logits (depth_weights)
  std::vector<DevBuf<float>> w_;          // each mixer's softmax weights
  DevBuf<float> da_;                      // d loss / d weights of one mixer
  std::vector<DevBuf<float>> v_, g_, x_;  // sources, their gradients, mixer outputs
  DevBuf<float> dx_;
};

}  // namespace

std::unique_ptr<DepthRouter> make_static_router(const ModelConfig& cfg, Backend* be) {
  return std::make_unique<StaticRouter>(cfg, be);
}

}  // namespace attnres
