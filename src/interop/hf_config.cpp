// A Hugging Face Llama-family config.json as an attnres ModelConfig, refusing every setting the
// engine would not compute exactly (docs/INTEROP.md "What is refused").
#include <nlohmann/json.hpp>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "core/json_field.hpp"
#include "interop/hf_internal.hpp"

namespace attnres::hf {

namespace {

// The model types whose modeling code is Llama's when the checks below pass.
bool is_llama_family(const std::string& t) { return t == "llama" || t == "mistral"; }

void refuse(const std::string& path, const std::string& key, const std::string& why) {
  throw Error("'" + path + "': " + key + " " + why +
              "; attnres imports plain Llama-family models only (docs/INTEROP.md)");
}

// A key that must be absent, null, false or the given default for the model to be plain Llama.
void require_plain(const nlohmann::json& j, const std::string& path, const char* key,
                   const char* why) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null() || (it->is_boolean() && !it->get<bool>())) return;
  refuse(path, std::string("'") + key + "' is " + it->dump(), why);
}

// rope_theta from transformers 4's top-level `rope_theta` / `rope_scaling` or transformers 5's
// `rope_parameters` {"rope_theta", "rope_type"}; any scaling is refused.
double rope_theta(const nlohmann::json& j, const std::string& path) {
  const std::string what = "'" + path + "'";
  double theta = 10000.0;
  read_json_field(j, "rope_theta", theta, what);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_object()) refuse(path, std::string("'") + key + "'", "is not an object");
    std::string type = "default";
    read_json_field(*it, "rope_type", type, what + " " + key);
    read_json_field(*it, "type", type, what + " " + key);
    if (type != "default") {
      refuse(path, std::string("'") + key + "' has rope_type '" + type + "',",
             "(rope scaling) is not supported");
    }
    read_json_field(*it, "rope_theta", theta, what + " " + key);
  }
  return theta;
}

int64_t required_int(const nlohmann::json& j, const char* key, const std::string& path) {
  int64_t v = 0;
  if (!read_json_field(j, key, v, "'" + path + "'")) {
    throw Error("'" + path + "' has no '" + key + "'; it is not a Llama config.json");
  }
  return v;
}

// The depth mix of an AttnRes config.json (export-hf's keys): attnres_residual full|block,
// attnres_block_size (sublayers per block), attnres_key_norm_eps.
ResidualConfig attnres_residual(const nlohmann::json& j, const std::string& path) {
  const std::string what = "'" + path + "'";
  std::string mode;
  read_json_field(j, "attnres_residual", mode, what);
  if (mode != "full" && mode != "block") {
    refuse(path, "attnres_residual '" + mode + "'", "is not full or block");
  }
  ResidualConfig r;
  r.mode = mode == "full" ? ResidualMode::full : ResidualMode::block;
  if (r.mode == ResidualMode::block) {
    check(read_json_field(j, "attnres_block_size", r.block_size, what),
          what + " has no 'attnres_block_size' (sublayers per block) for its block AttnRes");
  }
  read_json_field(j, "attnres_key_norm_eps", r.key_eps, what);
  return r;
}

}  // namespace

ModelConfig parse_config(const std::string& path) {
  nlohmann::json j;
  try {
    j = parse_json(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + path + "' is not valid JSON (" + e.what() + ")");
  }
  check(j.is_object(), "'" + path + "' is not a JSON object; it is not a config.json");
  const std::string what = "'" + path + "'";
  std::string type;
  read_json_field(j, "model_type", type, what);
  const bool attnres = type == "attnres";  // (an AttnRes model export-hf wrote)
  if (!is_llama_family(type) && !attnres) {
    refuse(path, "model_type '" + type + "'",
           "is not supported (llama and mistral are, and attnres as export-hf writes it)");
  }
  if (auto a = j.find("architectures"); a != j.end() && !a->is_null()) {
    const nlohmann::json list = a->is_array() ? *a : nlohmann::json::array({*a});
    for (const auto& arch : list) {
      const std::string s = arch.is_string() ? arch.get<std::string>() : arch.dump();
      if (attnres ? s != "AttnResForCausalLM"
                  : s != "LlamaForCausalLM" && s != "MistralForCausalLM") {
        refuse(path, "architecture '" + s + "'", "is not supported (LlamaForCausalLM is)");
      }
    }
  }
  require_plain(j, path, "attention_bias", "(biases) is not supported");
  require_plain(j, path, "mlp_bias", "(biases) is not supported");
  require_plain(j, path, "sliding_window", "(sliding-window attention) is not supported");
  require_plain(j, path, "quantization_config", "(a quantized model) is not supported");
  for (const char* moe : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    require_plain(j, path, moe, "(mixture of experts) is not supported");
  }
  std::string act = "silu";
  read_json_field(j, "hidden_act", act, what);
  if (act != "silu") refuse(path, "hidden_act '" + act + "'", "is not supported (silu is)");

  ModelConfig c;
  c.d_model = required_int(j, "hidden_size", path);
  c.ffn_hidden = required_int(j, "intermediate_size", path);
  c.n_layer = required_int(j, "num_hidden_layers", path);
  c.n_head = required_int(j, "num_attention_heads", path);
  c.vocab_size = required_int(j, "vocab_size", path);
  c.n_kv_head = c.n_head;  // (absent or null: as many as the query heads, as transformers reads it)
  if (auto kv = j.find("num_key_value_heads"); kv != j.end() && !kv->is_null()) {
    read_json_field(j, "num_key_value_heads", c.n_kv_head, what);
  }
  c.max_seq_len = 2048;
  read_json_field(j, "max_position_embeddings", c.max_seq_len, what);
  c.norm_eps = 1e-6;
  read_json_field(j, "rms_norm_eps", c.norm_eps, what);
  c.rope_theta = rope_theta(j, path);
  // (a partial rotary was imported as a full one, another function; seventeenth hostile pass)
  for (const char* key : {"partial_rotary_factor", "rotary_pct"}) {
    double f = 1.0;
    if (auto it = j.find(key); it != j.end() && !it->is_null()) read_json_field(j, key, f, what);
    if (f != 1.0) {
      refuse(path, std::string("'") + key + "' is " + nlohmann::json(f).dump(),
             "(rotary embeddings on part of each head) is not supported");
    }
  }
  c.tied = false;
  read_json_field(j, "tie_word_embeddings", c.tied, what);
  if (c.n_head > 0 && c.d_model % c.n_head == 0) {
    int64_t hd = c.d_model / c.n_head;
    if (auto it = j.find("head_dim"); it != j.end() && !it->is_null()) {
      read_json_field(j, "head_dim", hd, what);
    }
    if (hd != c.d_model / c.n_head) {
      refuse(path, "head_dim " + std::to_string(hd),
             "is not hidden_size / num_attention_heads = " + std::to_string(c.d_model / c.n_head) +
                 ", which attnres requires");
    }
  }
  if (!attnres && j.contains("attn_res_block_size") && !j["attn_res_block_size"].is_null()) {
    // A Llama with Kimi K3's Block AttnRes (its tensor names; blocks of N layers: S = 2N).
    int64_t n = 0;
    read_json_field(j, "attn_res_block_size", n, what);
    if (n < 1) refuse(path, "attn_res_block_size " + std::to_string(n), "is not a layer count");
    c.residual.mode = ResidualMode::block;
    c.residual.block_size = 2 * n;
  }
  if (attnres) {
    c.residual = attnres_residual(j, path);
    if (c.residual.key_eps == c.norm_eps) c.residual.key_eps = 0;  // (0: the model's norm_eps)
  }
  try {
    c.resolve();
    c.validate();
  } catch (const Error& e) {
    throw Error("'" + path + "': " + e.what());
  }
  return c;
}

}  // namespace attnres::hf
