// The README's "use the depth router in your own Transformer" example, compiled and checked: a toy
// model whose sublayers are y = tanh(x W_l), wired through a DepthRouter, trained by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "attnres/config.hpp"
#include "attnres/params.hpp"
#include "attnres/residual.hpp"

using namespace attnres;

TEST(RouterApi, ReadmeExampleRunsAndLearnsDepthWeights) {
  // --- README example begins ---
  ModelConfig cfg;  // only n_layer, d_model, norm_eps and residual are used
  cfg.n_layer = 2;  // L = 4 sublayers
  cfg.d_model = 8;
  cfg.residual.mode = ResidualMode::block;
  cfg.residual.block_size = 2;
  auto router = make_router(cfg);

  ParamLayout layout;  // the router adds its parameters to your layout
  router->add_params(layout);
  std::vector<float> params(layout.total()), grads(layout.total());
  router->bind(layout, params.data(), grads.data());
  router->init_params(params.data());  // pseudo-queries 0, key-norm gains 1 (SPEC 2)

  const int64_t n = 4, d = 8, L = 4;  // n token rows of width d
  std::vector<float> emb(n * d, 0.5f), W(L * d * d, 0.1f);
  auto f = [&](int64_t l, const float* x, float* y) {  // your sublayer: y = tanh(x W_l)
    for (int64_t r = 0; r < n; r++)
      for (int64_t j = 0; j < d; j++) {
        float s = 0;
        for (int64_t k = 0; k < d; k++) s += x[r * d + k] * W[(l * d + k) * d + j];
        y[r * d + j] = std::tanh(s);
      }
  };
  router->begin(emb.data(), n);
  for (int64_t l = 0; l < L; l++) {
    f(l, router->input(l), router->output_slot(l));
    router->commit_output(l);
  }
  const float* h = router->final_hidden();  // feed your final norm / head with h

  std::vector<float> dh(n * d, 1.0f);  // dLoss/dh from your head
  router->begin_backward(dh.data());
  for (int64_t l = L - 1; l >= 0; l--) {
    const float* dy = router->grad_output(l);  // dLoss/d(output of sublayer l)
    float* dx = router->grad_input_slot(l);    // accumulate dLoss/d(input of sublayer l) here
    const float* x = router->input(l);
    std::vector<float> y(n * d);
    f(l, x, y.data());
    for (int64_t r = 0; r < n; r++)  // backward of tanh(x W_l)
      for (int64_t j = 0; j < d; j++) {
        const float g = dy[r * d + j] * (1 - y[r * d + j] * y[r * d + j]);
        for (int64_t k = 0; k < d; k++) dx[r * d + k] += g * W[(l * d + k) * d + j];
      }
    router->commit_grad_input(l);
  }
  const float* demb = router->grad_embedding();  // dLoss/d(embedding); grads holds the router's
  // --- README example ends ---

  // Sanity: the output is finite, the gradient reached the embedding and the router's queries.
  for (int64_t i = 0; i < n * d; i++) {
    ASSERT_TRUE(std::isfinite(h[i]));
    ASSERT_TRUE(std::isfinite(demb[i]));
  }
  double gq = 0;
  for (const ParamEntry& e : layout.entries()) {
    if (e.name.ends_with("query")) {
      for (int64_t i = 0; i < e.numel; i++) gq += std::abs(grads[e.offset + i]);
    }
  }
  EXPECT_GT(gq, 0.0);
  EXPECT_NE(layout.find("layers.1.mlp_res.query"), nullptr);
}
