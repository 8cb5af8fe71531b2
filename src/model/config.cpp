// Model configuration: validation and the JSON form stored in checkpoints.
#include "attnres/config.hpp"

#include <cmath>
#include <nlohmann/json.hpp>

#include "attnres/error.hpp"
#include "core/json_field.hpp"

namespace attnres {

void ModelConfig::resolve() {
  if (n_kv_head == 0) n_kv_head = n_head;
  if (ffn_hidden == 0) {
    int64_t h = (8 * d_model + 2) / 3;  // Llama's 8/3 d, rounded to a multiple of 32
    ffn_hidden = (h + 31) / 32 * 32;
  }
}

void ModelConfig::validate() const {
  auto need = [](bool ok, const std::string& msg) { check(ok, "invalid model config: " + msg); };
  need(n_layer >= 1 && n_layer <= 4096,
       "n_layer must be in [1, 4096], got " + std::to_string(n_layer));
  // Upper bounds keep every size product (vocab x d, F x d, seq x head_dim) far from int64
  // overflow, so a config read from a hostile file cannot wrap a size computation.
  need(
      d_model >= 2 && d_model <= kMaxDModel,
      "d_model must be in [2, " + std::to_string(kMaxDModel) + "], got " + std::to_string(d_model));
  need(n_head >= 1 && d_model % n_head == 0, "d_model (" + std::to_string(d_model) +
                                                 ") must be divisible by n_head (" +
                                                 std::to_string(n_head) + ")");
  need(head_dim() % 2 == 0, "head_dim = d_model / n_head must be even for rotary embeddings, got " +
                                std::to_string(head_dim()));
  need(n_kv_head >= 1 && n_head % n_kv_head == 0, "n_head (" + std::to_string(n_head) +
                                                      ") must be a multiple of n_kv_head (" +
                                                      std::to_string(n_kv_head) + ")");
  need(ffn_hidden >= 1 && ffn_hidden <= kMaxFfnHidden,
       "ffn_hidden must be in [1, " + std::to_string(kMaxFfnHidden) +
           "] (or 0 for automatic), got " + std::to_string(ffn_hidden));
  need(vocab_size >= 2 && vocab_size <= kMaxVocab, "vocab_size must be in [2, " +
                                                       std::to_string(kMaxVocab) + "], got " +
                                                       std::to_string(vocab_size));
  need(max_seq_len >= 1 && max_seq_len <= kMaxSeqLen, "max_seq_len must be in [1, " +
                                                          std::to_string(kMaxSeqLen) + "], got " +
                                                          std::to_string(max_seq_len));
  // The RoPE tables hold max_seq_len x head_dim floats; cap them at 1 GiB.
  need(max_seq_len * head_dim() <= (int64_t{1} << 28),
       "max_seq_len x head_dim = " + std::to_string(max_seq_len) + " x " +
           std::to_string(head_dim()) + " is over 2^28; use a shorter context or more heads");
  // Lower bounds keep the epsilons and the temperature nonzero once rounded to float.
  need(std::isfinite(norm_eps) && norm_eps >= 1e-30 && norm_eps < 1,
       "norm_eps (--norm-eps) must be in [1e-30, 1)");
  need(std::isfinite(rope_theta) && rope_theta > 0, "rope_theta must be a finite number > 0");
  const ResidualConfig& r = residual;
  // Checked in every mode (only full/block use them), so a bad value is never silently kept.
  need(std::isfinite(r.key_eps) && (r.key_eps == 0 || (r.key_eps >= 1e-30 && r.key_eps < 1)),
       "attnres key eps (--attnres-key-eps) must be 0 (= norm_eps) or in [1e-30, 1)");
  need(std::isfinite(r.temperature) && r.temperature >= 1e-6 && r.temperature <= 1000,
       "attnres temperature (--attnres-temperature) must be in [1e-6, 1000]");
  if (r.is_attnres()) {
    need(r.block_size >= 1 && r.block_size <= kMaxSeqLen,
         "block_size must be in [1, " + std::to_string(kMaxSeqLen) + "], got " +
             std::to_string(r.block_size));
    need(r.heads >= 1 && d_model % r.heads == 0, "attnres heads (" + std::to_string(r.heads) +
                                                     ") must divide d_model (" +
                                                     std::to_string(d_model) + ")");
    need(r.window >= 0 && r.window <= kMaxSeqLen,
         "attnres window must be in [0, " + std::to_string(kMaxSeqLen) + "] (0 = off)");
  }
}

std::string ModelConfig::to_json() const {
  nlohmann::json j = {{"n_layer", n_layer},
                      {"n_head", n_head},
                      {"n_kv_head", n_kv_head},
                      {"d_model", d_model},
                      {"ffn_hidden", ffn_hidden},
                      {"vocab_size", vocab_size},
                      {"max_seq_len", max_seq_len},
                      {"norm_eps", norm_eps},
                      {"rope_theta", rope_theta},
                      {"tied", tied},
                      {"residual", to_string(residual.mode)}};
  if (residual.is_attnres()) {
    j["block_size"] = residual.effective_block_size();
    j["attnres_gate"] = to_string(residual.gate);
    j["attnres_key_norm"] = to_string(residual.key_norm);
    j["attnres_heads"] = residual.heads;
    j["attnres_query"] = to_string(residual.query);
    j["attnres_window"] = residual.window;
    if (residual.key_eps > 0) j["attnres_key_eps"] = residual.key_eps;  // absent: norm_eps
    if (residual.temperature != 1) j["attnres_temperature"] = residual.temperature;  // absent: 1
    // Not the function, but its rounding: a resume or a kept comparison run must compute alike.
    if (!residual.two_phase) j["attnres_two_phase"] = false;  // absent: true
  }
  return j.dump();
}

namespace {
// The names of an enum's values, in the enum's order, and the parse of one.
template <class E, size_t K>
E parse_name(const std::string& s, const char* const (&names)[K], const char* what) {
  std::string list;
  for (size_t i = 0; i < K; i++) {
    if (s == names[i]) return static_cast<E>(i);
    list += std::string(i == 0 ? "" : i + 1 == K ? " or " : ", ") + names[i];
  }
  throw Error(std::string(what) + " '" + s + "' is unknown; use " + list);
}
constexpr const char* kModes[] = {"prenorm", "full", "block", "static", "denseformer"};
constexpr const char* kGates[] = {"softmax", "sigmoid"};
constexpr const char* kKeyNorms[] = {"rms", "none"};
constexpr const char* kQueries[] = {"static", "dynamic"};
}  // namespace

const char* to_string(ResidualMode m) { return kModes[static_cast<int>(m)]; }
const char* to_string(DepthGate g) { return kGates[static_cast<int>(g)]; }
const char* to_string(KeyNorm k) { return kKeyNorms[static_cast<int>(k)]; }
const char* to_string(DepthQuery q) { return kQueries[static_cast<int>(q)]; }
ResidualMode parse_residual_mode(const std::string& s) {
  return parse_name<ResidualMode>(s, kModes, "residual mode");
}
DepthGate parse_depth_gate(const std::string& s) {
  return parse_name<DepthGate>(s, kGates, "attnres gate");
}
KeyNorm parse_key_norm(const std::string& s) {
  return parse_name<KeyNorm>(s, kKeyNorms, "attnres key norm");
}
DepthQuery parse_depth_query(const std::string& s) {
  return parse_name<DepthQuery>(s, kQueries, "attnres query");
}

ModelConfig ModelConfig::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = parse_json(text);
  } catch (const std::exception& e) {
    throw Error(std::string("model config is not valid JSON: ") + e.what());
  }
  check(j.is_object(), "model config must be a JSON object");
  ModelConfig c;
  const std::string what = "model config";
  read_json_field(j, "n_layer", c.n_layer, what);
  read_json_field(j, "n_head", c.n_head, what);
  c.n_kv_head = c.n_head;
  read_json_field(j, "n_kv_head", c.n_kv_head, what);
  read_json_field(j, "d_model", c.d_model, what);
  read_json_field(j, "ffn_hidden", c.ffn_hidden, what);
  read_json_field(j, "vocab_size", c.vocab_size, what);
  read_json_field(j, "max_seq_len", c.max_seq_len, what);
  read_json_field(j, "norm_eps", c.norm_eps, what);
  read_json_field(j, "rope_theta", c.rope_theta, what);
  read_json_field(j, "tied", c.tied, what);
  std::string name;
  if (read_json_field(j, "residual", name, what)) c.residual.mode = parse_residual_mode(name);
  read_json_field(j, "block_size", c.residual.block_size, what);
  read_json_field(j, "attnres_heads", c.residual.heads, what);
  read_json_field(j, "attnres_window", c.residual.window, what);
  if (read_json_field(j, "attnres_gate", name, what)) c.residual.gate = parse_depth_gate(name);
  if (read_json_field(j, "attnres_key_norm", name, what))
    c.residual.key_norm = parse_key_norm(name);
  if (read_json_field(j, "attnres_query", name, what)) c.residual.query = parse_depth_query(name);
  read_json_field(j, "attnres_key_eps", c.residual.key_eps, what);
  read_json_field(j, "attnres_temperature", c.residual.temperature, what);
  read_json_field(j, "attnres_two_phase", c.residual.two_phase, what);
  return c;
}

}  // namespace attnres
