// KV-cache inference: the same math as Model::forward, for a chunk of new positions of one
// sequence. The residual path again goes through a DepthRouter (rows are tokens; every mode's mix
// is per token, so a chunk is independent of the rows before it except through attention).
#include <algorithm>
#include <cstring>

#include "attnres/error.hpp"
#include "attnres/generate.hpp"
#include "attnres/residual.hpp"
#include "backend/backend.hpp"
#include "model/layer_views.hpp"
#include "ops/ops.hpp"

namespace attnres {

Decoder::Decoder(const Model& model, int64_t max_len)
    : model_(model), be_(model.backend()), max_len_(max_len) {
  const ModelConfig& c = model.config();
  check(max_len >= 1 && max_len <= c.max_seq_len,
        "decoder length " + std::to_string(max_len) +
            " must be in [1, max_seq_len = " + std::to_string(c.max_seq_len) + "]");
  router_ = make_router(c, &be_);
  // The router only reads its parameters during forward; no gradients here.
  router_->bind(model.layout(), const_cast<float*>(model.params()), nullptr);
  for (DevBuf<float>* b : {&kcache_, &vcache_, &rope_cos_, &rope_sin_, &emb_, &xn_, &qkv_, &q_,
                           &atty_, &h13_, &gate_, &xf_, &logits_}) {
    b->on(&be_);
  }
  tokens_.on(&be_);
  // One memo per weight (4 a layer, then the head): with bf16 products, each weight is rounded
  // once for the decoder's life (the model does not change under it), not once per token.
  wmemo_.resize(static_cast<size_t>(4 * c.n_layer + 1));
  for (MatmulMemo& m : wmemo_) m.fixed_w = true;
  const int64_t kv = c.n_kv_head * c.head_dim();
  kcache_.resize(static_cast<size_t>(c.n_layer * max_len * kv));
  vcache_.resize(static_cast<size_t>(c.n_layer * max_len * kv));
  const int64_t half = c.head_dim() / 2;
  std::vector<float> cos_t(max_len * half), sin_t(max_len * half);
  ops::rope_table(cos_t.data(), sin_t.data(), max_len, c.head_dim(), c.rope_theta);
  rope_cos_.upload(cos_t.data(), cos_t.size());
  rope_sin_.upload(sin_t.data(), sin_t.size());
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
  auto fit = [](DevBuf<float>& b, int64_t size) {
    if (static_cast<int64_t>(b.size()) < size) b.resize(static_cast<size_t>(size));
  };
  fit(emb_, n * d);
  fit(xn_, n * d);
  fit(qkv_, n * QKV);
  fit(q_, n * HD);
  fit(atty_, n * HD);
  fit(h13_, n * 2 * F);
  fit(gate_, n * F);
  fit(xf_, n * d);
  fit(logits_, n * V);
  tokens_.upload(tokens, static_cast<size_t>(n));
  Backend& be = be_;
  const size_t f = sizeof(float);

  const float* wte = model_.param("tok_embeddings.weight");
  be.embedding_forward(emb_.data(), tokens_.data(), wte, n, d);
  router_->begin(emb_.data(), n);
  for (int64_t i = 0; i < c.n_layer; i++) {
    const LayerViews w = layer_views(model_.layout(), model_.params(), i);
    float* qkv = qkv_.data();
    be.rmsnorm_forward(xn_.data(), nullptr, router_->input(2 * i), w.attn_norm, n, d, eps);
    be.matmul_forward(qkv, xn_.data(), w.wqkv, n, d, QKV, false, &wmemo_[4 * i]);
    be.rope_forward(qkv, rope_cos_.data(), rope_sin_.data(), 1, n, H, hd, QKV, pos_);
    be.rope_forward(qkv + HD, rope_cos_.data(), rope_sin_.data(), 1, n, Hkv, hd, QKV, pos_);
    // q (n,HD) and the cache rows of positions pos_.. (KV each) from the q|k|v rows (n,QKV).
    float* kc = kcache_.data() + i * max_len_ * KV;
    float* vc = vcache_.data() + i * max_len_ * KV;
    be.copy_rows(q_.data(), f * HD, qkv, f * QKV, f * HD, n);
    be.copy_rows(kc + pos_ * KV, f * KV, qkv + HD, f * QKV, f * KV, n);
    be.copy_rows(vc + pos_ * KV, f * KV, qkv + HD + KV, f * QKV, f * KV, n);
    be.attention_decode(atty_.data(), q_.data(), kc, vc, n, pos_, H, Hkv, hd);
    be.matmul_forward(router_->output_slot(2 * i), atty_.data(), w.wo, n, HD, d, false,
                      &wmemo_[4 * i + 1]);
    router_->commit_output(2 * i);

    be.rmsnorm_forward(xn_.data(), nullptr, router_->input(2 * i + 1), w.ffn_norm, n, d, eps);
    be.matmul_forward(h13_.data(), xn_.data(), w.w13, n, d, 2 * F, false, &wmemo_[4 * i + 2]);
    be.swiglu_forward(gate_.data(), h13_.data(), n, F);
    be.matmul_forward(router_->output_slot(2 * i + 1), gate_.data(), w.w2, n, F, d, false,
                      &wmemo_[4 * i + 3]);
    router_->commit_output(2 * i + 1);
  }
  be.rmsnorm_forward(xf_.data(), nullptr, router_->final_hidden(), model_.param("norm.weight"), n,
                     d, eps);
  const float* wout = c.tied ? wte : model_.param("output.weight");
  be.matmul_forward(logits_.data(), xf_.data(), wout, n, d, V, false, &wmemo_.back());
  pos_ += n;
  if (be.host_memory()) return logits_.data();
  host_logits_.resize(static_cast<size_t>(n * V));
  be.download(host_logits_.data(), logits_.data(), f * host_logits_.size());
  return host_logits_.data();
}

}  // namespace attnres
