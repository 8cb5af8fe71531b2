// KV-cache inference: the same math as Model::forward, for a chunk of new positions of one
// sequence. The residual path again goes through a DepthRouter (rows are tokens; every mode's mix
// is per token, so a chunk is independent of the rows before it except through attention).
#include <algorithm>
#include <cstring>

#include "attnres/error.hpp"
#include "attnres/generate.hpp"
#include "attnres/residual.hpp"
#include "model/layer_views.hpp"
#include "ops/ops.hpp"

namespace attnres {

Decoder::Decoder(const Model& model, int64_t max_len) : model_(model), max_len_(max_len) {
  const ModelConfig& c = model.config();
  check(model.on_cpu(), "generation runs on the CPU (for now): load the model with --device cpu");
  check(max_len >= 1 && max_len <= c.max_seq_len,
        "decoder length " + std::to_string(max_len) + " must be in [1, max_seq_len = " +
            std::to_string(c.max_seq_len) + "]");
  router_ = make_router(c);
  // The router only reads its parameters during forward; no gradients here.
  router_->bind(model.layout(), const_cast<float*>(model.params()), nullptr);
  const int64_t kv = c.n_kv_head * c.head_dim();
  kcache_.assign(c.n_layer * max_len * kv, 0.0f);
  vcache_.assign(c.n_layer * max_len * kv, 0.0f);
  const int64_t half = c.head_dim() / 2;
  rope_cos_.resize(max_len * half);
  rope_sin_.resize(max_len * half);
  ops::rope_table(rope_cos_.data(), rope_sin_.data(), max_len, c.head_dim(), c.rope_theta);
}

Decoder::~Decoder() = default;

void Decoder::reset() { pos_ = 0; }

const float* Decoder::feed(const int32_t* tokens, int64_t n) {
  const ModelConfig& c = model_.config();
  check(n >= 1, "feed needs at least one token");
  check(pos_ + n <= max_len_, "context is full: " + std::to_string(pos_ + n) +
                                  " positions exceed the decoder length " +
                                  std::to_string(max_len_));
  const int64_t d = c.d_model, V = c.vocab_size, H = c.n_head, Hkv = c.n_kv_head;
  const int64_t hd = c.head_dim(), HD = H * hd, KV = Hkv * hd, QKV = HD + 2 * KV;
  const int64_t F = c.ffn_hidden;
  const float eps = static_cast<float>(c.norm_eps);
  for (int64_t t = 0; t < n; t++) {
    check(tokens[t] >= 0 && tokens[t] < V,
          "token id " + std::to_string(tokens[t]) + " is outside the vocabulary");
  }
  emb_.resize(n * d);
  xn_.resize(n * d);
  qkv_.resize(n * QKV);
  q_.resize(n * HD);
  atty_.resize(n * HD);
  h13_.resize(n * 2 * F);
  gate_.resize(n * F);
  xf_.resize(n * d);
  logits_.resize(n * V);

  const float* wte = model_.param("tok_embeddings.weight");
  ops::embedding_forward(emb_.data(), tokens, wte, n, d);
  router_->begin(emb_.data(), n);
  for (int64_t i = 0; i < c.n_layer; i++) {
    const LayerViews w = layer_views(model_.layout(), model_.params(), i);
    ops::rmsnorm_forward(xn_.data(), nullptr, router_->input(2 * i), w.attn_norm, n, d, eps);
    ops::matmul_forward(qkv_.data(), xn_.data(), w.wqkv, n, d, QKV);
    ops::rope_forward(qkv_.data(), rope_cos_.data(), rope_sin_.data(), 1, n, H, hd, QKV, pos_);
    ops::rope_forward(qkv_.data() + HD, rope_cos_.data(), rope_sin_.data(), 1, n, Hkv, hd, QKV,
                      pos_);
    float* kc = kcache_.data() + i * max_len_ * KV;
    float* vc = vcache_.data() + i * max_len_ * KV;
    for (int64_t t = 0; t < n; t++) {
      const float* row = qkv_.data() + t * QKV;
      std::memcpy(q_.data() + t * HD, row, sizeof(float) * HD);
      std::memcpy(kc + (pos_ + t) * KV, row + HD, sizeof(float) * KV);
      std::memcpy(vc + (pos_ + t) * KV, row + HD + KV, sizeof(float) * KV);
    }
    ops::attention_decode(atty_.data(), q_.data(), kc, vc, n, pos_, H, Hkv, hd);
    ops::matmul_forward(router_->output_slot(2 * i), atty_.data(), w.wo, n, HD, d);
    router_->commit_output(2 * i);

    ops::rmsnorm_forward(xn_.data(), nullptr, router_->input(2 * i + 1), w.ffn_norm, n, d, eps);
    ops::matmul_forward(h13_.data(), xn_.data(), w.w13, n, d, 2 * F);
    ops::swiglu_forward(gate_.data(), h13_.data(), n, F);
    ops::matmul_forward(router_->output_slot(2 * i + 1), gate_.data(), w.w2, n, F, d);
    router_->commit_output(2 * i + 1);
  }
  ops::rmsnorm_forward(xf_.data(), nullptr, router_->final_hidden(), model_.param("norm.weight"),
                       n, d, eps);
  const float* wout = c.tied ? wte : model_.param("output.weight");
  ops::matmul_forward(logits_.data(), xf_.data(), wout, n, d, V);
  pos_ += n;
  return logits_.data();
}

}  // namespace attnres
