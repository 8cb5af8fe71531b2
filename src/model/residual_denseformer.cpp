// Mode `denseformer` (DenseFormer, Pagliardini et al. 2024; SPEC 6): ordinary PreNorm residuals
// inside each Transformer block, and after block i a depth-weighted average of all block outputs:
//   X_0 = emb;  X_{i+1} = z_i + attn_i(.) + mlp_i(.);  z_{i+1} = sum_{j<=i+1} alpha_{i,j} X_j.
// alpha_{i,i+1} starts at 1 and the rest at 0, so the model starts as the plain residual.
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/backend.hpp"
#include "model/routers.hpp"
#include "ops/ops.hpp"

namespace attnres {

namespace {

class DenseFormerRouter final : public DepthRouter {
 public:
  DenseFormerRouter(const ModelConfig& c, Backend* be)
      : be_(be ? *be : *cpu_backend()), nl_(c.n_layer), d_(c.d_model) {}

  void add_params(ParamLayout& layout) override {
    for (int64_t i = 0; i < nl_; i++) layout.add(name(i), {i + 2}, false);
  }
  void bind(const ParamLayout& layout, float* params, float* grads) override {
    params_ = params;
    grads_ = grads;
    off_.resize(nl_);
    for (int64_t i = 0; i < nl_; i++) off_[i] = layout.find(name(i))->offset;
  }
  void init_params(float* params) const override {
    for (int64_t i = 0; i < nl_; i++) {
      std::fill_n(params + off_[i], i + 2, 0.0f);
      params[off_[i] + i + 1] = 1.0f;
    }
  }

  void begin(const float* emb, int64_t n) override {
    n_ = n;
    const size_t nd = static_cast<size_t>(n * d_);
    for (auto* vv : {&X_, &z_, &dX_}) {
      vv->resize(nl_ + 1);
      for (auto& v : *vv) v.on(&be_).resize(nd);
    }
    h_.resize(nl_);
    for (auto& v : h_) v.on(&be_).resize(nd);
    for (auto* b : {&out_, &dz_, &dh_, &dx_}) b->on(&be_).resize(nd);
    be_.copy(X_[0].data(), emb, sizeof(float) * nd);
    be_.copy(z_[0].data(), emb, sizeof(float) * nd);
    // The weights are the parameters; a copy in the backend's memory, so that the forward's
    // weights serve the backward.
    wd_.resize(nl_);
    for (int64_t i = 0; i < nl_; i++) {
      wd_[i].on(&be_).resize(static_cast<size_t>(i + 2));
      be_.copy(wd_[i].data(), params_ + off_[i], sizeof(float) * (i + 2));
    }
    da_.on(&be_).resize(static_cast<size_t>(nl_ + 1));
  }
  const float* input(int64_t l) override {
    return l % 2 == 0 ? z_[l / 2].data() : h_[l / 2].data();
  }
  float* output_slot(int64_t) override { return out_.data(); }
  void commit_output(int64_t l) override {
    const int64_t i = l / 2, nd = n_ * d_;
    const float* o = out_.data();
    if (l % 2 == 0) {
      be_.add(h_[i].data(), z_[i].data(), o, nd);  // h_i = z_i + attention output
      return;
    }
    be_.add(X_[i + 1].data(), h_[i].data(), o, nd);  // X_{i+1} = h_i + MLP output
    std::vector<const float*> src;
    for (int64_t j = 0; j <= i + 1; j++) src.push_back(X_[j].data());
    be_.scalar_mix_forward(z_[i + 1].data(), src.data(), wd_[i].data(), i + 2, nd);
  }
  const float* final_hidden() override { return z_[nl_].data(); }

  void begin_backward(const float* dh) override {
    for (auto& g : dX_) be_.zero(g.data(), sizeof(float) * n_ * d_);
    be_.copy(dz_.data(), dh, sizeof(float) * n_ * d_);  // d z_{n_layer}
  }
  const float* grad_output(int64_t l) override {
    const int64_t i = l / 2, nd = n_ * d_;
    if (l % 2 == 1) {
      // Backward of z_{i+1} = sum_j alpha_{i,j} X_j; then every reader of X_{i+1} is done.
      std::vector<const float*> src;
      std::vector<float*> dsrc;
      for (int64_t j = 0; j <= i + 1; j++) {
        src.push_back(X_[j].data());
        dsrc.push_back(dX_[j].data());
      }
      be_.scalar_mix_backward(dsrc.data(), da_.data(), dz_.data(), src.data(), wd_[i].data(), i + 2,
                              nd);
      be_.add(grads_ + off_[i], grads_ + off_[i], da_.data(), i + 2);
      be_.copy(dh_.data(), dX_[i + 1].data(), sizeof(float) * nd);  // X_{i+1} = h_i + out
      return dX_[i + 1].data();
    }
    return dh_.data();  // h_i = z_i + out
  }
  float* grad_input_slot(int64_t) override {
    be_.zero(dx_.data(), sizeof(float) * n_ * d_);
    return dx_.data();
  }
  void commit_grad_input(int64_t l) override {
    const int64_t nd = n_ * d_;
    if (l % 2 == 1) {
      be_.add(dh_.data(), dh_.data(), dx_.data(), nd);  // d h_i += through the MLP
    } else {
      be_.add(dz_.data(), dh_.data(), dx_.data(), nd);  // d z_i = d h_i + through attention
    }
  }
  const float* grad_embedding() override {
    be_.add(dX_[0].data(), dX_[0].data(), dz_.data(), n_ * d_);  // emb is both X_0 and z_0
    return dX_[0].data();
  }

  // DenseFormer's weights: row i is the average after block i, column j is block output X_j.
  bool depth_weights(std::vector<std::vector<double>>& w, std::vector<std::string>& rows,
                     std::vector<std::string>& cols) override {
    read_weights();
    cols = {"emb"};
    for (int64_t j = 1; j <= nl_; j++) cols.push_back("X" + std::to_string(j));
    rows.clear();
    w.assign(nl_, std::vector<double>(nl_ + 1, std::nan("")));
    for (int64_t i = 0; i < nl_; i++) {
      rows.push_back("dwa" + std::to_string(i));
      for (int64_t j = 0; j <= i + 1; j++) w[i][j] = w_[i][j];
    }
    return true;
  }

  int64_t activation_bytes(int64_t n) const override {
    return static_cast<int64_t>(sizeof(float)) * n * d_ * (4 * (nl_ + 1) + 4);
  }

 private:
  static std::string name(int64_t i) { return "layers." + std::to_string(i) + ".dwa.weight"; }
  // Host copies of the averaging weights (the parameters may live in device memory).
  void read_weights() {
    w_.resize(nl_);
    for (int64_t i = 0; i < nl_; i++) {
      w_[i].resize(static_cast<size_t>(i + 2));
      be_.download(w_[i].data(), params_ + off_[i], sizeof(float) * (i + 2));
    }
  }

  Backend& be_;
  const int64_t nl_, d_;
  int64_t n_ = 0;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  std::vector<int64_t> off_;
  std::vector<std::vector<float>> w_;  // host copies of the weights (depth_weights)
  std::vector<DevBuf<float>> X_, z_, dX_, h_;
  DevBuf<float> out_, dz_, dh_, dx_;
  std::vector<DevBuf<float>> wd_;  // the forward's weights
  DevBuf<float> da_;               // d loss / d weights of one average
};

}  // namespace

std::unique_ptr<DepthRouter> make_denseformer_router(const ModelConfig& cfg, Backend* be) {
  return std::make_unique<DenseFormerRouter>(cfg, be);
}

}  // namespace attnres
