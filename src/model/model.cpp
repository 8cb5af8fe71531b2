// The model's forward and backward passes: top to bottom like the math, ops from the backend
// (src/backend/backend.hpp: src/ops on the CPU, src/cuda on a GPU), the residual path delegated to
// the DepthRouter (no `x + f(x)` here). Tensors live in the backend's memory; only token ids
// (validated here) and diagnostics pass through the host.
#include "attnres/model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "attnres/error.hpp"
#include "attnres/residual.hpp"
#include "backend/backend.hpp"
#include "core/profile.hpp"
#include "core/rng.hpp"
#include "model/layer_views.hpp"
#include "ops/ops.hpp"

namespace attnres {

// Activations of one forward pass through layers [i0, i0 + nl), kept for backward. Sized for
// (B,T); regrown when larger. Layer buffers are indexed by i - i0.
struct Model::Acts {
  int64_t i0 = 0, nl = 0;
  bool first = true, head = true;  // embeds the tokens / ends with the LM head and the loss
  int64_t B = 0, T = 0, cap_rows = 0, cap_att = 0;
  bool have_targets = false;
  using Buf = DevBuf<float>;
  DevBuf<int32_t> tokens, targets;   // (N)
  std::vector<int32_t> host_tokens;  // (N) the tokens' host copy (the embedding backward's)
  Buf emb;                           // (N,d)
  Buf xn_att, rstd_att;              // (nl,N,d), (nl,N)
  Buf qkv;                           // (nl,N,QKV) q|k|v after RoPE
  Buf att;                           // (nl,B,H,T,T) attention probabilities
  Buf atty;                          // (nl,N,H*hd) attention output before wo
  Buf xn_mlp, rstd_mlp;              // (nl,N,d), (nl,N)
  Buf h13;                           // (nl,N,2F) [w1 x | w3 x]
  Buf gate;                          // (nl,N,F) silu(h1) * h3
  Buf xf, rstd_f;                    // (N,d), (N) final norm
  Buf logits, lse;                   // (N,V), (N)
  // backward scratch, reused by every layer
  Buf d_a, d_b, d_c, d_att;
  // The backend's keepsakes of each GEMM between forward and backward (MatmulMemo): per layer
  // one per Gemm, then the LM head.
  enum Gemm { qkv_proj, out_proj, mlp_in, mlp_out, kGemmsPerLayer };  // wqkv, wo, w13, w2
  std::vector<MatmulMemo> memo;
  MatmulMemo* mm(int64_t j, Gemm g) { return &memo[static_cast<size_t>(kGemmsPerLayer * j + g)]; }
  MatmulMemo* head_mm() { return &memo.back(); }
  // The GEMM-only inputs xn_att, xn_mlp and gate (read by nothing but their GEMMs) are kept per
  // layer, or, with bf16 products on a device, whose memos keep their bf16 copies for the
  // backward, stored in bf16 only: one layer's fp32 buffers then serve every layer.
  bool shared_inputs = false;
  int64_t in_j(int64_t j) const { return shared_inputs ? 0 : j; }
};

namespace {
// Layer j's input of its GEMM g (n floats per layer) for that GEMM's backward. When one
// layer's buffer serves all, only the memo's bf16 copy still holds layer j's values: the backend
// must use it (it does while the memo is valid, which a forward and its backward keep).
const float* gemm_input(Model::Acts& a, const DevBuf<float>& buf, int64_t j, Model::Acts::Gemm g,
                        int64_t n) {
  check(!a.shared_inputs || a.mm(j, g)->valid,
        "internal: a layer's GEMM input is kept only in bf16, but its copy is gone");
  return buf.data() + a.in_j(j) * n;
}
}  // namespace

Model::StagePass::StagePass() = default;
Model::StagePass::~StagePass() = default;

Model::Model(ModelConfig cfg, std::shared_ptr<Backend> be)
    : cfg_(cfg), be_(be ? be : cpu_backend()) {
  cfg_.resolve();
  cfg_.validate();
  main_ = std::make_unique<StagePass>();
  main_->router = make_router(cfg_, be_.get());
  build_layout();
  try {
    params_.on(be_.get()).assign_zero(layout_.total());
    grads_.on(be_.get()).assign_zero(layout_.total());
  } catch (const std::bad_alloc&) {
    throw out_of_memory(
        "the model's " + std::to_string(layout_.total()) + " parameters and their gradients",
        8.0 * static_cast<double>(layout_.total()), "lower --d-model, --n-layer or --vocab-size");
  }
  main_->router->bind(layout_, params_.data(), grads_.data());
  main_->first = 0;
  main_->last = cfg_.n_sublayers();
  main_->acts = std::make_unique<Acts>();
  main_->acts->nl = cfg_.n_layer;
  const int64_t half = cfg_.head_dim() / 2;
  std::vector<float> cos_t(cfg_.max_seq_len * half), sin_t(cfg_.max_seq_len * half);
  ops::rope_table(cos_t.data(), sin_t.data(), cfg_.max_seq_len, cfg_.head_dim(), cfg_.rope_theta);
  rope_cos_.on(be_.get()).upload(cos_t.data(), cos_t.size());
  rope_sin_.on(be_.get()).upload(sin_t.data(), sin_t.size());
}

bool Model::on_cpu() const { return be_->is_cpu(); }

std::vector<float> Model::params_to_host() const { return params_.download(); }
std::vector<float> Model::grads_to_host() const { return grads_.download(); }
void Model::params_from_host(const float* host) {
  be_->upload(params_.data(), host, sizeof(float) * params_.size());
}

Model::~Model() = default;

void Model::release_activations() {
  main_->acts = std::make_unique<Acts>();
  main_->acts->nl = cfg_.n_layer;
  main_->router = make_router(cfg_, be_.get());
  main_->router->bind(layout_, params_.data(), grads_.data());
}

int64_t Model::stage_unit() const {
  if (!main_->router->supports_stages()) return 0;
  const int64_t S = main_->router->source_block_size();
  return std::lcm(int64_t{2}, S);  // whole layers (attention + MLP) and whole blocks
}

int64_t Model::boundary_sources(int64_t l) const { return main_->router->boundary_sources(l); }

std::unique_ptr<Model::StagePass> Model::make_stage_pass(int64_t first, int64_t last) {
  const int64_t L = cfg_.n_sublayers(), u = stage_unit();
  check(u > 0, "residual mode '" + std::string(to_string(cfg_.residual.mode)) +
                   "' cannot be split into pipeline stages; use --residual block or full");
  check(first >= 0 && first < last && last <= L && first % u == 0 && (last % u == 0 || last == L),
        "pipeline stage [" + std::to_string(first) + ", " + std::to_string(last) + ") of " +
            std::to_string(L) + " sublayers does not start and end on a multiple of " +
            std::to_string(u) + " sublayers (whole layers and whole blocks)");
  check(on_cpu(), "pipeline stages run on the CPU only (for now), not on " + be_->name());
  auto p = std::make_unique<StagePass>();
  p->first = first;
  p->last = last;
  p->router = make_router(cfg_, be_.get());
  p->router->bind(layout_, params_.data(), grads_.data());
  p->router->set_stage(first, last);
  p->acts = std::make_unique<Acts>();
  p->acts->i0 = first / 2;
  p->acts->nl = (last - first) / 2;
  p->acts->first = first == 0;
  p->acts->head = last == L;
  return p;
}

double Model::stage_forward(StagePass& p, SourceStore& store, const int32_t* tokens,
                            const int32_t* targets, int64_t B, int64_t T) {
  check(!p.acts->head || targets != nullptr, "internal: the last pipeline stage needs targets");
  p.router->bind_store(&store);
  return run_forward(p, tokens, p.acts->head ? targets : nullptr, B, T);
}

void Model::stage_backward(StagePass& p) { run_backward(p); }

namespace {

// The parameters every residual mode has, in checkpoint order.
void add_core_params(const ModelConfig& c, ParamLayout& layout) {
  const int64_t d = c.d_model, hd = c.head_dim(), F = c.ffn_hidden;
  using R = ParamRole;
  // Matrices decay, vectors and the embedding do not; `next` continues the previous tensor.
  auto add = [&](const std::string& name, std::vector<int64_t> shape, ParamTag tag,
                 bool next = false) {
    const bool decay = tag.role != R::norm && tag.role != R::embedding;
    layout.add(name, std::move(shape), decay, next, tag);
  };
  add("tok_embeddings.weight", {c.vocab_size, d}, {R::embedding});
  for (int64_t i = 0; i < c.n_layer; i++) {
    const std::string p = "layers." + std::to_string(i) + ".";
    const int64_t att = 2 * i, mlp = 2 * i + 1;  // the sublayers
    add(p + "attention_norm.weight", {d}, {R::norm, att});
    // wq|wk|wv contiguous: one stacked ((H+2Hkv)hd, d) matrix, one GEMM.
    add(p + "attention.wq.weight", {c.n_head * hd, d}, {R::linear, att});
    add(p + "attention.wk.weight", {c.n_kv_head * hd, d}, {R::linear, att}, true);
    add(p + "attention.wv.weight", {c.n_kv_head * hd, d}, {R::linear, att}, true);
    add(p + "attention.wo.weight", {d, c.n_head * hd}, {R::out_proj, att});
    add(p + "ffn_norm.weight", {d}, {R::norm, mlp});
    // w1|w3 contiguous: one stacked (2F, d) matrix.
    add(p + "feed_forward.w1.weight", {F, d}, {R::linear, mlp});
    add(p + "feed_forward.w3.weight", {F, d}, {R::linear, mlp}, true);
    add(p + "feed_forward.w2.weight", {d, F}, {R::out_proj, mlp});
  }
  add("norm.weight", {d}, {R::norm});
  if (!c.tied) add("output.weight", {c.vocab_size, d}, {R::lm_head});
}

}  // namespace

ParamLayout Model::layout_for(ModelConfig cfg) {
  cfg.resolve();
  cfg.validate();
  ParamLayout layout;
  add_core_params(cfg, layout);
  make_router(cfg)->add_params(layout);
  return layout;
}

void Model::build_layout() {
  add_core_params(cfg_, layout_);
  n_core_entries_ = layout_.entries().size();
  main_->router->add_params(layout_);  // the residual mode's own parameters come last
  layer_entries_.assign(static_cast<size_t>(cfg_.n_layer), {});
  for (size_t k = 0; k < n_core_entries_; k++) {
    const int64_t l = layout_.entries()[k].tag.sublayer;
    if (l >= 0) layer_entries_[static_cast<size_t>(l / 2)].push_back(k);
  }
}

float* Model::param(const std::string& name) {
  const ParamEntry* e = layout_.find(name);
  if (!e) throw std::out_of_range("no parameter named " + name);
  return params_.data() + e->offset;
}
const float* Model::param(const std::string& name) const {
  return const_cast<Model*>(this)->param(name);
}

void Model::init_weights(uint64_t seed) {
  const double std_w = 0.02, std_out = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg_.n_layer));
  // Initialised in place in host memory; on a device on the host, then uploaded.
  std::vector<float> host;
  float* P = params_.host_stage(host);
  std::fill(P, P + layout_.total(), 0.0f);
  for (size_t k = 0; k < layout_.entries().size(); k++) {
    const ParamEntry& e = layout_.entries()[k];
    float* w = P + e.offset;
    // Each tensor gets its own stream derived from (seed, index), so adding a tensor later never
    // changes the others' values.
    Rng rng(splitmix64(seed) ^ splitmix64(0x5EED0000ull + k));
    if (k >= n_core_entries_) continue;  // the router initialises its own parameters below
    if (e.tag.role == ParamRole::norm) {
      for (int64_t i = 0; i < e.numel; i++) w[i] = 1.0f;
      continue;
    }
    const double sd = e.tag.role == ParamRole::out_proj ? std_out : std_w;
    for (int64_t i = 0; i < e.numel; i++) w[i] = static_cast<float>(sd * rng.normal());
  }
  main_->router->init_params(P);
  params_.commit_host(host);
}

void Model::ensure_acts(StagePass& p, int64_t B, int64_t T) {
  check(T >= 1 && T <= cfg_.max_seq_len,
        "sequence length " + std::to_string(T) +
            " is outside [1, max_seq_len = " + std::to_string(cfg_.max_seq_len) + "]");
  check(B >= 1, "batch size must be >= 1");
  Acts& a = *p.acts;
  a.B = B;
  a.T = T;
  const int64_t N = B * T, nl = a.nl, d = cfg_.d_model, V = cfg_.vocab_size;
  const int64_t H = cfg_.n_head, hd = cfg_.head_dim(), F = cfg_.ffn_hidden;
  const int64_t QKV = (H + 2 * cfg_.n_kv_head) * hd;
  const int64_t att = be_->attention_state_floats({B, T, H, cfg_.n_kv_head, hd});
  const auto n_memo = static_cast<size_t>(Acts::kGemmsPerLayer * nl + 1);
  if (a.memo.size() != n_memo) a.memo.resize(n_memo);
  const bool shared = be_->matmul_precision() == MatmulPrecision::bf16;
  if (N <= a.cap_rows && att <= a.cap_att && shared == a.shared_inputs) return;
  a.shared_inputs = shared;
  const int64_t in_layers = shared ? std::min<int64_t>(nl, 1) : nl;
  a.cap_rows = std::max(a.cap_rows, N);
  a.cap_att = std::max(a.cap_att, att);
  const int64_t R = a.cap_rows, AT = a.cap_att;
  Backend* be = be_.get();
  // Every buffer, once to count its elements (each of 4 bytes) and once to grow it.
  auto each = [&](auto&& grow) {
    grow(a.tokens, R);
    grow(a.targets, R);
    if (a.first) grow(a.emb, R * d);
    grow(a.xn_att, in_layers * R * d);
    grow(a.rstd_att, nl * R);
    grow(a.qkv, nl * R * QKV);
    grow(a.att, nl * AT);
    grow(a.atty, nl * R * H * hd);
    grow(a.xn_mlp, in_layers * R * d);
    grow(a.rstd_mlp, nl * R);
    grow(a.h13, nl * R * 2 * F);
    grow(a.gate, in_layers * R * F);
    if (a.head) {
      grow(a.xf, R * d);
      grow(a.rstd_f, R);
      grow(a.logits, R * V);
      grow(a.lse, R);
    }
    const int64_t widest = std::max({d, QKV, 2 * F, H * hd});
    grow(a.d_a, R * widest);
    grow(a.d_b, R * widest);
    grow(a.d_c, R * widest);
    grow(a.d_att, AT);
  };
  double elements = 0;
  each([&](auto&, int64_t n) { elements += static_cast<double>(n); });
  try {
    each([be](auto& buf, int64_t n) { buf.on(be).resize(static_cast<size_t>(n)); });
  } catch (const std::bad_alloc&) {
    a.cap_rows = a.cap_att = 0;  // (partly grown: never taken as big enough)
    throw out_of_memory("the activations of a micro-batch of " + std::to_string(B) + " x " +
                            std::to_string(T) + " tokens",
                        4.0 * elements,
                        "lower --batch-size or --seq-len (raise --grad-accum to keep the tokens "
                        "per step)");
  }
}

double Model::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T) {
  return run_forward(*main_, tokens, targets, B, T);
}

void Model::stage_batch(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T) {
  stage_inputs(*main_, tokens, targets, B, T);
}

void Model::forward_staged(float* step_scalars) { run_staged(*main_, step_scalars); }

double Model::run_forward(StagePass& p, const int32_t* tokens, const int32_t* targets, int64_t B,
                          int64_t T) {
  stage_inputs(p, tokens, targets, B, T);
  return run_staged(p, nullptr);
}

// Checks the ids and puts them where the stage's forward and backward read them.
void Model::stage_inputs(StagePass& p, const int32_t* tokens, const int32_t* targets, int64_t B,
                         int64_t T) {
  ensure_acts(p, B, T);
  Acts& a = *p.acts;
  Backend& be = *be_;
  const int64_t N = B * T, V = cfg_.vocab_size;
  for (int64_t n = 0; n < N; n++) {  // (later stages may pass no tokens: only the first reads them)
    if (a.first && (tokens[n] < 0 || tokens[n] >= V)) {
      throw Error("token id " + std::to_string(tokens[n]) + " is outside the vocabulary [0, " +
                  std::to_string(V) + ")");
    }
    if (targets && (targets[n] < 0 || targets[n] >= V)) {
      throw Error("target id " + std::to_string(targets[n]) + " is outside the vocabulary");
    }
  }
  if (a.first) {
    be.upload(a.tokens.data(), tokens, sizeof(int32_t) * N);
    a.host_tokens.assign(tokens, tokens + N);
  }
  a.have_targets = targets != nullptr;
  if (targets) be.upload(a.targets.data(), targets, sizeof(int32_t) * N);
  // (training: the embedding's backward follows)
  if (a.first && targets) be.prepare_embedding_backward(a.tokens.data(), tokens, N);
}

// The stage's part of the forward: embedding (first stage), its layers, the head (last stage).
double Model::run_staged(StagePass& p, float* step_scalars) {
  Acts& a = *p.acts;
  DepthRouter& router = *p.router;
  Backend& be = *be_;
  const bool record_stats = record_stats_ && &p == main_.get();
  const int64_t B = a.B, T = a.T;
  const int64_t N = B * T, d = cfg_.d_model, V = cfg_.vocab_size, F = cfg_.ffn_hidden;
  const ops::AttnShape as{B, T, cfg_.n_head, cfg_.n_kv_head, cfg_.head_dim()};
  const int64_t QKV = as.ld(), HD = as.H * as.hd;
  const float eps = static_cast<float>(cfg_.norm_eps);

  const prof::PhaseScope phase(prof::kForward);  // (a profiling backend times each op)
  const float* wte = param("tok_embeddings.weight");
  if (a.first) {
    be.embedding_forward(a.emb.data(), a.tokens.data(), wte, N, d);
    const prof::Region pr(prof::kResidual);
    router.begin(a.emb.data(), N);
  } else {
    const prof::Region pr(prof::kResidual);
    router.begin_stage(N);
  }
  if (record_stats) {
    stats_.input_rms.assign(cfg_.n_sublayers(), 0.0);
    stats_.output_rms.assign(cfg_.n_sublayers(), 0.0);
  }
  auto rms = [&](const float* x) { return std::sqrt(be.sum_squares(x, N * d) / double(N * d)); };
  auto record = [&](int64_t l) {  // before commit_output(l): the slot holds the output
    if (!record_stats) return;
    stats_.input_rms[l] = rms(router.input(l));
    stats_.output_rms[l] = rms(router.output_slot(l));
  };

  for (int64_t i = a.i0; i < a.i0 + a.nl; i++) {
    const LayerViews w = layer_views(layout_, params_.data(), i);
    const int64_t j = i - a.i0;  // index into this pass's layer buffers
    // --- attention sublayer (l = 2i) ---
    float* xn = a.xn_att.data() + a.in_j(j) * N * d;
    float* qkv = a.qkv.data() + j * N * QKV;
    float* att = a.att.data() + j * a.cap_att;
    float* atty = a.atty.data() + j * N * HD;
    be.rmsnorm_forward(xn, a.rstd_att.data() + j * N, router.input(2 * i), w.attn_norm, N, d, eps);
    be.matmul_forward(qkv, xn, w.wqkv, N, d, QKV, false, a.mm(j, Acts::qkv_proj));
    be.rope_forward(qkv, rope_cos_.data(), rope_sin_.data(), B, T, as.H, as.hd, QKV, 0);
    be.rope_forward(qkv + HD, rope_cos_.data(), rope_sin_.data(), B, T, as.Hkv, as.hd, QKV, 0);
    be.attention_forward(atty, att, qkv, as);
    be.matmul_forward(router.output_slot(2 * i), atty, w.wo, N, HD, d, false,
                      a.mm(j, Acts::out_proj));
    record(2 * i);
    {
      const prof::Region pr(prof::kResidual);
      router.commit_output(2 * i);
    }
    // --- MLP sublayer (l = 2i+1) ---
    float* xm = a.xn_mlp.data() + a.in_j(j) * N * d;
    float* h13 = a.h13.data() + j * N * 2 * F;
    float* gate = a.gate.data() + a.in_j(j) * N * F;
    be.rmsnorm_forward(xm, a.rstd_mlp.data() + j * N, router.input(2 * i + 1), w.ffn_norm, N, d,
                       eps);
    be.matmul_forward(h13, xm, w.w13, N, d, 2 * F, false, a.mm(j, Acts::mlp_in));
    be.swiglu_forward(gate, h13, N, F);
    be.matmul_forward(router.output_slot(2 * i + 1), gate, w.w2, N, F, d, false,
                      a.mm(j, Acts::mlp_out));
    record(2 * i + 1);
    {
      const prof::Region pr(prof::kResidual);
      router.commit_output(2 * i + 1);
    }
  }

  if (!a.head) return 0.0;
  be.rmsnorm_forward(a.xf.data(), a.rstd_f.data(), router.final_hidden(), param("norm.weight"), N,
                     d, eps);
  const float* wout = cfg_.tied ? wte : param("output.weight");
  be.matmul_forward(a.logits.data(), a.xf.data(), wout, N, d, V, false, a.head_mm());
  if (!a.have_targets) return 0.0;
  if (step_scalars) {
    be.cross_entropy_loss_add(step_scalars, a.lse.data(), a.logits.data(), a.targets.data(), N, V);
    return 0.0;
  }
  return be.cross_entropy_forward(a.lse.data(), a.logits.data(), a.targets.data(), N, V);
}

const float* Model::logits() const { return main_->acts->logits.data(); }

void Model::zero_grad() { be_->zero(grads_.data(), sizeof(float) * grads_.size()); }

void Model::backward(const GradReady& ready) { run_backward(*main_, ready); }

// The stage's part of the backward, in reverse: head (last stage), layers, embedding (first).
void Model::run_backward(StagePass& p, const GradReady& ready) {
  Acts& a = *p.acts;
  // Reports a tensor's gradient as final, once.
  std::vector<char> told(ready ? layout_.entries().size() : 0, 0);
  auto tell = [&](size_t k) {
    if (!ready || told[k]) return;
    told[k] = 1;
    ready(layout_.entries()[k].offset, layout_.entries()[k].numel);
  };
  auto tell_name = [&](const char* name) {
    tell(static_cast<size_t>(layout_.find(name) - layout_.entries().data()));
  };
  DepthRouter& router = *p.router;
  if (a.head && !a.have_targets) {
    throw std::logic_error("Model::backward needs a forward with targets");
  }
  const int64_t B = a.B, T = a.T, N = B * T, d = cfg_.d_model, V = cfg_.vocab_size;
  const int64_t F = cfg_.ffn_hidden;
  const ops::AttnShape as{B, T, cfg_.n_head, cfg_.n_kv_head, cfg_.head_dim()};
  const int64_t QKV = as.ld(), HD = as.H * as.hd;
  Backend& be = *be_;
  float* G = grads_.data();
  auto grad_of = [&](const float* w) { return G + (w - params_.data()); };
  auto zeroed = [&](DevBuf<float>& v, int64_t n) {
    be.zero(v.data(), sizeof(float) * n);
    return v.data();
  };

  const prof::PhaseScope phase(prof::kBackward);  // (a profiling backend times each op)
  const float* wte = param("tok_embeddings.weight");
  if (a.head) {
    // LM head and final norm. dlogits overwrite the logits (dead after the loss).
    float* dlogits = a.logits.data();
    const float* wout = cfg_.tied ? wte : param("output.weight");
    float* dxf = zeroed(a.d_a, N * d);
    const float dloss = 1.0f / static_cast<float>(N);
    // (one op: a device may round the gradient as it forms it)
    be.head_backward(dxf, grad_of(wout), dlogits, a.lse.data(), a.targets.data(), N, V, dloss,
                     a.xf.data(), wout, d, a.head_mm());
    float* dh = zeroed(a.d_b, N * d);
    const float* gnorm = param("norm.weight");
    be.rmsnorm_backward(dh, grad_of(gnorm), dxf, router.final_hidden(), gnorm, a.rstd_f.data(), N,
                        d);
    if (ready) {
      tell_name("norm.weight");
      if (!cfg_.tied) tell_name("output.weight");
    }
    {
      const prof::Region pr(prof::kResidual);
      router.begin_backward(dh);
    }
  } else {
    const prof::Region pr(prof::kResidual);
    router.begin_backward_stage();
  }

  for (int64_t i = a.i0 + a.nl - 1; i >= a.i0; i--) {
    const LayerViews w = layer_views(layout_, params_.data(), i);
    const int64_t j = i - a.i0;
    // --- MLP sublayer (l = 2i+1) ---
    {
      const int64_t l = 2 * i + 1;
      const float* dy;
      {
        const prof::Region pr(prof::kResidual);
        dy = router.grad_output(l);
      }
      float* dgate = zeroed(a.d_a, N * F);
      be.matmul_backward(dgate, grad_of(w.w2), dy, gemm_input(a, a.gate, j, Acts::mlp_out, N * F),
                         w.w2, N, F, d, a.mm(j, Acts::mlp_out));
      float* dh13 = zeroed(a.d_b, N * 2 * F);
      be.swiglu_backward(dh13, dgate, a.h13.data() + j * N * 2 * F, N, F);
      float* dxn = zeroed(a.d_c, N * d);
      be.matmul_backward(dxn, grad_of(w.w13), dh13, gemm_input(a, a.xn_mlp, j, Acts::mlp_in, N * d),
                         w.w13, N, d, 2 * F, a.mm(j, Acts::mlp_in));
      float* dx = router.grad_input_slot(l);
      be.rmsnorm_backward(dx, grad_of(w.ffn_norm), dxn, router.input(l), w.ffn_norm,
                          a.rstd_mlp.data() + j * N, N, d);
      {
        const prof::Region pr(prof::kResidual);
        router.commit_grad_input(l);
      }
    }
    // --- attention sublayer (l = 2i) ---
    {
      const int64_t l = 2 * i;
      const float* dy;
      {
        const prof::Region pr(prof::kResidual);
        dy = router.grad_output(l);
      }
      float* datty = zeroed(a.d_a, N * HD);
      be.matmul_backward(datty, grad_of(w.wo), dy, a.atty.data() + j * N * HD, w.wo, N, HD, d,
                         a.mm(j, Acts::out_proj));
      float* dqkv = zeroed(a.d_b, N * QKV);
      be.attention_backward(dqkv, a.d_att.data(), datty, a.qkv.data() + j * N * QKV,
                            a.atty.data() + j * N * HD, a.att.data() + j * a.cap_att, as);
      be.rope_backward(dqkv, rope_cos_.data(), rope_sin_.data(), B, T, as.H, as.hd, QKV, 0);
      be.rope_backward(dqkv + HD, rope_cos_.data(), rope_sin_.data(), B, T, as.Hkv, as.hd, QKV, 0);
      float* dxn = zeroed(a.d_c, N * d);
      be.matmul_backward(dxn, grad_of(w.wqkv), dqkv,
                         gemm_input(a, a.xn_att, j, Acts::qkv_proj, N * d), w.wqkv, N, d, QKV,
                         a.mm(j, Acts::qkv_proj));
      float* dx = router.grad_input_slot(l);
      be.rmsnorm_backward(dx, grad_of(w.attn_norm), dxn, router.input(l), w.attn_norm,
                          a.rstd_att.data() + j * N, N, d);
      {
        const prof::Region pr(prof::kResidual);
        router.commit_grad_input(l);
      }
    }
    if (ready) {
      for (size_t k : layer_entries_[static_cast<size_t>(i)]) tell(k);
    }
  }
  if (a.first) {
    const float* demb;
    {
      const prof::Region pr(prof::kResidual);
      demb = router.grad_embedding();
    }
    be.embedding_backward(grad_of(wte), demb, a.tokens.data(), N, d, a.host_tokens.data());
  }
  for (size_t k = 0; k < told.size(); k++) tell(k);  // the embedding and the router's own
}

uint64_t Model::shared_weights_hash() const {
  std::vector<float> host;
  const float* P = params_.host_view(host);
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over names and bytes
  for (size_t k = 0; k < n_core_entries_; k++) {
    const ParamEntry& e = layout_.entries()[k];
    auto mix = [&](const void* p, size_t n) {
      const auto* b = static_cast<const unsigned char*>(p);
      for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    };
    mix(e.name.data(), e.name.size());
    mix(P + e.offset, sizeof(float) * e.numel);
  }
  return h;
}

std::vector<double> Model::sublayer_grad_norms() const {
  std::vector<float> host;
  const float* G = grads_.host_view(host);
  std::vector<double> ss(cfg_.n_sublayers(), 0.0);
  for (size_t k = 0; k < n_core_entries_; k++) {
    const ParamEntry& e = layout_.entries()[k];
    if (e.tag.sublayer < 0) continue;
    const float* g = G + e.offset;
    double s = 0;
    for (int64_t j = 0; j < e.numel; j++) s += double(g[j]) * g[j];
    ss[static_cast<size_t>(e.tag.sublayer)] += s;
  }
  for (auto& v : ss) v = std::sqrt(v);
  return ss;
}

int64_t Model::activation_bytes() const {
  const Acts& a = *main_->acts;
  int64_t n = 0;
  for (const auto* v :
       {&a.emb, &a.xn_att, &a.rstd_att, &a.qkv, &a.att, &a.atty, &a.xn_mlp, &a.rstd_mlp, &a.h13,
        &a.gate, &a.xf, &a.rstd_f, &a.logits, &a.lse, &a.d_a, &a.d_b, &a.d_c, &a.d_att}) {
    n += static_cast<int64_t>(v->size() * sizeof(float));
  }
  for (const MatmulMemo& m : a.memo) {
    n += static_cast<int64_t>((m.inp.size() + m.w.size()) * sizeof(uint16_t));
  }
  return n + main_->router->activation_bytes(a.cap_rows);
}

}  // namespace attnres
