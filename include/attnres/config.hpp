// attnres/config.hpp — model configuration: the architecture, as saved in checkpoints.
#pragma once

#include <cstdint>
#include <string>

namespace attnres {

// The residual path (see SPEC.md). Only `prenorm` exists so far; AttnRes modes plug in through
// DepthRouter (residual.hpp).
struct ResidualConfig {
  std::string mode = "prenorm";
};

struct ModelConfig {
  int64_t n_layer = 4;      // Transformer blocks; L = 2 * n_layer sublayers
  int64_t n_head = 4;       // query heads
  int64_t n_kv_head = 0;    // key/value heads (GQA when < n_head); 0 = auto (n_head)
  int64_t d_model = 128;    // width d
  int64_t ffn_hidden = 0;   // SwiGLU hidden width; 0 = auto (8/3 d rounded up to a multiple of 32)
  int64_t vocab_size = 256;
  int64_t max_seq_len = 256;  // longest context the model is trained/used with
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tied = true;          // LM head shares tok_embeddings.weight
  ResidualConfig residual;

  int64_t head_dim() const { return d_model / n_head; }
  int64_t n_sublayers() const { return 2 * n_layer; }
  // Replaces the automatic values (ffn_hidden = 0, n_kv_head = 0) by what they stand for.
  void resolve();
  // Throws Error naming the first invalid field and a valid choice.
  void validate() const;
  // JSON object text with every field (the checkpoint's __metadata__["config"]).
  std::string to_json() const;
  // Parses to_json() output; unknown keys are ignored, missing keys keep defaults. Throws Error.
  static ModelConfig from_json(const std::string& text);
};

}  // namespace attnres
