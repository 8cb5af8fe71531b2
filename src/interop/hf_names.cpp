// attnres tensor names <-> Hugging Face Llama names (docs/INTEROP.md "Tensor names").
#include <array>
#include <utility>
#include <vector>

#include "attnres/interop.hpp"

namespace attnres {

namespace {

// Per-layer suffixes: attnres "layers.{i}." + first  <->  HF "model.layers.{i}." + second.
constexpr std::array<std::pair<const char*, const char*>, 13> kLayerNames{{
    {"attention_norm.weight", "input_layernorm.weight"},
    {"attention.wq.weight", "self_attn.q_proj.weight"},
    {"attention.wk.weight", "self_attn.k_proj.weight"},
    {"attention.wv.weight", "self_attn.v_proj.weight"},
    {"attention.wo.weight", "self_attn.o_proj.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
    {"feed_forward.w3.weight", "mlp.up_proj.weight"},
    {"feed_forward.w2.weight", "mlp.down_proj.weight"},
    // AttnRes mixers, in Kimi K3's names: the pseudo-query is the [1, d] score projection, the
    // key-norm gain the RMSNorm weight (score = dot(RMSNorm(v) * norm.w, proj.w)).
    {"attn_res.query", "self_attention_res_proj.weight"},
    {"attn_res.key_norm.weight", "self_attention_res_norm.weight"},
    {"mlp_res.query", "mlp_res_proj.weight"},
    {"mlp_res.key_norm.weight", "mlp_res_norm.weight"},
}};

}  // namespace

std::string hf_tensor_name(const std::string& n) {
  if (n == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (n == "norm.weight") return "model.norm.weight";
  if (n == "output.weight") return "lm_head.weight";
  if (n == "out_res.query") return "model.output_attn_res_proj.weight";
  if (n == "out_res.key_norm.weight") return "model.output_attn_res_norm.weight";
  const std::string layers = "layers.";
  if (n.compare(0, layers.size(), layers) != 0) return "";
  const size_t dot = n.find('.', layers.size());
  if (dot == std::string::npos) return "";
  const std::string suffix = n.substr(dot + 1);
  for (const auto& [ours, theirs] : kLayerNames) {
    if (suffix == ours) return "model." + n.substr(0, dot + 1) + theirs;
  }
  return "";
}

std::vector<int64_t> hf_tensor_shape(const std::string& n, const std::vector<int64_t>& shape) {
  const std::string q = "query";
  const bool query = n.size() >= q.size() && n.compare(n.size() - q.size(), q.size(), q) == 0;
  if (query && shape.size() == 1) return {1, shape[0]};  // (an nn.Linear(d, 1) weight)
  return shape;
}

}  // namespace attnres
