// Model configuration: validation and the JSON form stored in checkpoints.
#include "attnres/config.hpp"

#include <nlohmann/json.hpp>

#include "attnres/error.hpp"

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
  need(n_layer >= 1 && n_layer <= 4096, "n_layer must be in [1, 4096], got " + std::to_string(n_layer));
  need(d_model >= 2, "d_model must be >= 2, got " + std::to_string(d_model));
  need(n_head >= 1 && d_model % n_head == 0,
       "d_model (" + std::to_string(d_model) + ") must be divisible by n_head (" +
           std::to_string(n_head) + ")");
  need(head_dim() % 2 == 0, "head_dim = d_model / n_head must be even for rotary embeddings, got " +
                                std::to_string(head_dim()));
  need(n_kv_head >= 1 && n_head % n_kv_head == 0,
       "n_head (" + std::to_string(n_head) + ") must be a multiple of n_kv_head (" +
           std::to_string(n_kv_head) + ")");
  need(ffn_hidden >= 1, "ffn_hidden must be >= 1 (or 0 for automatic)");
  need(vocab_size >= 2, "vocab_size must be >= 2, got " + std::to_string(vocab_size));
  need(max_seq_len >= 1, "max_seq_len must be >= 1, got " + std::to_string(max_seq_len));
  need(norm_eps > 0, "norm_eps must be > 0");
  need(rope_theta > 0, "rope_theta must be > 0");
  const ResidualConfig& r = residual;
  need(r.mode == "prenorm" || r.mode == "full" || r.mode == "block" || r.mode == "static" ||
           r.mode == "denseformer",
       "residual mode '" + r.mode + "' is unknown; use prenorm, full, block, static or denseformer");
  if (r.is_attnres()) {
    need(r.block_size >= 1, "block_size must be >= 1, got " + std::to_string(r.block_size));
    need(r.gate == "softmax" || r.gate == "sigmoid",
         "attnres gate '" + r.gate + "' is unknown; use softmax or sigmoid");
    need(r.key_norm == "rms" || r.key_norm == "none",
         "attnres key norm '" + r.key_norm + "' is unknown; use rms or none");
    need(r.heads >= 1 && d_model % r.heads == 0,
         "attnres heads (" + std::to_string(r.heads) + ") must divide d_model (" +
             std::to_string(d_model) + ")");
    need(r.query == "static" || r.query == "dynamic",
         "attnres query '" + r.query + "' is unknown; use static or dynamic");
    need(r.window >= 0, "attnres window must be >= 0 (0 = off)");
  }
}

std::string ModelConfig::to_json() const {
  nlohmann::json j = {{"n_layer", n_layer},       {"n_head", n_head},
                      {"n_kv_head", n_kv_head},   {"d_model", d_model},
                      {"ffn_hidden", ffn_hidden}, {"vocab_size", vocab_size},
                      {"max_seq_len", max_seq_len}, {"norm_eps", norm_eps},
                      {"rope_theta", rope_theta}, {"tied", tied},
                      {"residual", residual.mode}};
  if (residual.is_attnres()) {
    j["block_size"] = residual.effective_block_size();
    j["attnres_gate"] = residual.gate;
    j["attnres_key_norm"] = residual.key_norm;
    j["attnres_heads"] = residual.heads;
    j["attnres_query"] = residual.query;
    j["attnres_window"] = residual.window;
  }
  return j.dump();
}

ModelConfig ModelConfig::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw Error(std::string("model config is not valid JSON: ") + e.what());
  }
  check(j.is_object(), "model config must be a JSON object");
  ModelConfig c;
  try {
    auto get_i = [&](const char* k, int64_t& dst) {
      if (j.contains(k)) dst = j.at(k).get<int64_t>();
    };
    get_i("n_layer", c.n_layer);
    get_i("n_head", c.n_head);
    c.n_kv_head = c.n_head;
    get_i("n_kv_head", c.n_kv_head);
    get_i("d_model", c.d_model);
    get_i("ffn_hidden", c.ffn_hidden);
    get_i("vocab_size", c.vocab_size);
    get_i("max_seq_len", c.max_seq_len);
    if (j.contains("norm_eps")) c.norm_eps = j.at("norm_eps").get<double>();
    if (j.contains("rope_theta")) c.rope_theta = j.at("rope_theta").get<double>();
    if (j.contains("tied")) c.tied = j.at("tied").get<bool>();
    if (j.contains("residual")) c.residual.mode = j.at("residual").get<std::string>();
    get_i("block_size", c.residual.block_size);
    get_i("attnres_heads", c.residual.heads);
    get_i("attnres_window", c.residual.window);
    if (j.contains("attnres_gate")) c.residual.gate = j.at("attnres_gate").get<std::string>();
    if (j.contains("attnres_key_norm")) {
      c.residual.key_norm = j.at("attnres_key_norm").get<std::string>();
    }
    if (j.contains("attnres_query")) c.residual.query = j.at("attnres_query").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("model config has a field of the wrong type: ") + e.what());
  }
  return c;
}

}  // namespace attnres
