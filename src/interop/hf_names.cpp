// attnres tensor names <-> Hugging Face Llama names (docs/INTEROP.md "Tensor names").
#include <array>
#include <utility>

#include "attnres/interop.hpp"

namespace attnres {

namespace {

// Per-layer suffixes: attnres "layers.{i}." + first  <->  HF "model.layers.{i}." + second.
constexpr std::array<std::pair<const char*, const char*>, 9> kLayerNames{{
    {"attention_norm.weight", "input_layernorm.weight"},
    {"attention.wq.weight", "self_attn.q_proj.weight"},
    {"attention.wk.weight", "self_attn.k_proj.weight"},
    {"attention.wv.weight", "self_attn.v_proj.weight"},
    {"attention.wo.weight", "self_attn.o_proj.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
    {"feed_forward.w3.weight", "mlp.up_proj.weight"},
    {"feed_forward.w2.weight", "mlp.down_proj.weight"},
}};

}  // namespace

std::string hf_tensor_name(const std::string& n) {
  if (n == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (n == "norm.weight") return "model.norm.weight";
  if (n == "output.weight") return "lm_head.weight";
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

}  // namespace attnres
