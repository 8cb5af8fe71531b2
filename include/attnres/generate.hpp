// attnres/generate.hpp — KV-cache decoding and sampling.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "attnres/model.hpp"

namespace attnres {

class DepthRouter;
struct MatmulMemo;  // (src/backend/backend.hpp)

// Incremental inference over one sequence: each feed() runs only the new tokens, attending to the
// cached keys/values of earlier positions. Runs on the model's backend (the cache lives there;
// the logits come back to host memory) with its matmul precision. Reads the model's parameters;
// the model must outlive the decoder and not change while it is used.
class Decoder {
 public:
  // max_len: most positions this sequence may reach (<= the model's max_seq_len).
  Decoder(const Model& model, int64_t max_len);
  ~Decoder();
  // Forgets the sequence (position back to 0).
  void reset();
  // Runs tokens[0..n) (host memory) at positions position()..position()+n-1 (a prompt "prefill"
  // or one decoded token). Returns logits (n, V) in host memory for those positions, valid until
  // the next call. Throws Error if the sequence would exceed max_len.
  const float* feed(const int32_t* tokens, int64_t n);
  int64_t position() const { return pos_; }
  int64_t max_len() const { return max_len_; }

 private:
  const Model& model_;
  Backend& be_;
  int64_t max_len_, pos_ = 0;
  std::unique_ptr<DepthRouter> router_;
  DevBuf<float> kcache_, vcache_;  // (n_layer, max_len, Hkv*hd)
  DevBuf<float> rope_cos_, rope_sin_;
  DevBuf<int32_t> tokens_;
  DevBuf<float> emb_, xn_, qkv_, q_, atty_, h13_, gate_, xf_, logits_;
  std::vector<float> host_logits_;  // where the backend's memory is not the host's
  std::vector<MatmulMemo> wmemo_;   // the weights' bf16 copies (bf16 products), one per weight
};

struct SamplingConfig {
  double temperature = 1.0;  // 0 = greedy (argmax, lowest id on ties)
  int64_t top_k = 0;         // 0 = off
  double top_p = 1.0;        // nucleus; 1 = off
  uint64_t seed = 0;
  void validate() const;  // throws Error
};

// Picks the next token from logits (V) according to cfg; `state` advances the random stream.
int32_t sample_token(const float* logits, int64_t V, const SamplingConfig& cfg, uint64_t& state);

// Feeds the prompt, then samples up to max_new tokens, calling on_token(id) after each (return
// false to stop). Stops early when the context is full. Returns the generated ids.
std::vector<int32_t> generate(const Model& model, const std::vector<int32_t>& prompt,
                              int64_t max_new, const SamplingConfig& cfg,
                              const std::function<bool(int32_t)>& on_token);

}  // namespace attnres
