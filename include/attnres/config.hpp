// attnres/config.hpp — model configuration: the architecture, as saved in checkpoints.
#pragma once

#include <cstdint>
#include <string>

namespace attnres {

// The residual path (SPEC.md), implemented by a DepthRouter (residual.hpp):
//   prenorm      plain sum (SPEC 1)
//   full         Full AttnRes (SPEC 2), including the output mix
//   block        Block AttnRes with block_size sublayers per block (SPEC 3, two-phase SPEC 4)
//   static       input-independent softmax-mixing weights per (sublayer, source) (SPEC 6)
//   denseformer  DenseFormer's depth-weighted average of block outputs, identity at init
// The attnres_* ablations (SPEC 6) apply to full and block.
enum class ResidualMode { prenorm, full, block, static_mix, denseformer };
enum class DepthGate { softmax, sigmoid };
enum class KeyNorm { rms, none };
enum class DepthQuery { static_query, dynamic };

// Each option's name as the CLI and checkpoints spell it ("static" for static_mix and
// static_query), and the parse back; an unknown name is an Error naming it and the choices.
const char* to_string(ResidualMode m);
const char* to_string(DepthGate g);
const char* to_string(KeyNorm k);
const char* to_string(DepthQuery q);
ResidualMode parse_residual_mode(const std::string& s);
DepthGate parse_depth_gate(const std::string& s);
KeyNorm parse_key_norm(const std::string& s);
DepthQuery parse_depth_query(const std::string& s);

struct ResidualConfig {
  ResidualMode mode = ResidualMode::prenorm;
  int64_t block_size = 4;               // block: sublayers per block (full behaves as 1)
  DepthGate gate = DepthGate::softmax;  // softmax | sigmoid
  KeyNorm key_norm = KeyNorm::rms;      // rms | none
  int64_t heads = 1;                    // split d into this many slices, one softmax each
  DepthQuery query =
      DepthQuery::static_query;  // static | dynamic (w + W u, u = most recent source)
  int64_t window = 0;            // > 0: embedding plus the last `window` sources
  double key_eps = 0;            // epsilon of the key RMSNorm; 0 = the model's norm_eps
  double temperature = 1;        // score multiplier: s = temperature * q . k (ablation)
  bool two_phase = true;         // how block mode computes (not part of the model function)

  bool is_attnres() const { return mode == ResidualMode::full || mode == ResidualMode::block; }
  // Sublayers per block as computed: 1 for full.
  int64_t effective_block_size() const { return mode == ResidualMode::full ? 1 : block_size; }
};

// Upper bounds ModelConfig::validate() enforces (far above any model this engine trains).
constexpr int64_t kMaxDModel = int64_t{1} << 16;
constexpr int64_t kMaxFfnHidden = int64_t{1} << 20;
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxSeqLen = int64_t{1} << 20;

struct ModelConfig {
  int64_t n_layer = 4;     // Transformer blocks; L = 2 * n_layer sublayers
  int64_t n_head = 4;      // query heads
  int64_t n_kv_head = 0;   // key/value heads (GQA when < n_head); 0 = auto (n_head)
  int64_t d_model = 128;   // width d
  int64_t ffn_hidden = 0;  // SwiGLU hidden width; 0 = auto (8/3 d rounded up to a multiple of 32)
  int64_t vocab_size = 256;
  int64_t max_seq_len = 256;  // longest context the model is trained/used with
  // RMSNorm epsilon. 1e-10, not Llama's 1e-5: AttnRes normalises averages of many small sources
  // (at init the mean square of Full's input at sublayer l is ~4e-4 / (l+1)^2, 5e-7 at l = 32),
  // which 1e-5 would damp; PreNorm is indifferent (docs/FINDINGS.md).
  double norm_eps = 1e-10;
  double rope_theta = 10000.0;
  bool tied = true;  // LM head shares tok_embeddings.weight
  ResidualConfig residual;

  int64_t head_dim() const { return d_model / n_head; }
  // Epsilon of the AttnRes key norms: residual.key_eps when set, else norm_eps.
  double key_norm_eps() const { return residual.key_eps > 0 ? residual.key_eps : norm_eps; }
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
