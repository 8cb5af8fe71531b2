// attnres/interop.hpp — models from and to other tools: Hugging Face Llama-family directories.
//
// import_hf reads a Hugging Face `LlamaForCausalLM` directory (config.json, model.safetensors or
// shards named by model.safetensors.index.json, F32/F16/BF16 weights, tokenizer.model) into an
// attnres model. The model's function is Llama's: rotate-half RoPE, RMSNorm computed in float32,
// SwiGLU (gate_proj = w1, up_proj = w3, down_proj = w2), GQA. Imported as Full or Block AttnRes
// (zero pseudo-queries, unit key gains), it computes the PreNorm function (SPEC 2) up to the
// RMSNorm epsilon: the uniform mix is the sum over n sources divided by n, and
// RMSNorm(h / n; eps) = RMSNorm(h; n^2 eps). docs/INTEROP.md has the name map.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attnres/config.hpp"
#include "attnres/model.hpp"

namespace attnres {

struct HfImportOptions {
  ResidualConfig residual;      // prenorm (the HF model itself), full or block
  bool residual_given = false;  // residual named by the user (an AttnRes export then must match)
  int64_t max_seq_len = 0;      // 0 = config.json's max_position_embeddings
};

// What a Hugging Face directory holds, read and checked without loading any weight.
struct HfSource {
  std::string dir;
  ModelConfig config;               // the PreNorm model it describes
  std::vector<std::string> shards;  // weight files, in order (paths)
  std::string weights_dtype;        // "F32", "BF16", "F16" or "mixed"
  std::string tokenizer_model;      // path of its SentencePiece tokenizer.model; "" = the byte
                                    // tokenizer (config.json "attnres_tokenizer": "byte")
  int64_t tokenizer_pieces = 0;     // the tokenizer's vocabulary (0 = none)
  bool unread_tied_head = false;    // tie_word_embeddings, yet the files hold an lm_head.weight,
                                    // which is not read (the embedding is the head)
  // The metadata of the weight files (every shard's, the first shard's winning), e.g. what an
  // attnres export recorded of the corpora its weights trained on.
  std::map<std::string, std::string> weights_metadata;
};

// Reads and checks config.json, the index and every shard's header, and the tokenizer. Error
// naming the file and key for anything this engine cannot compute exactly: another model_type or
// architecture, biases, sliding-window attention, rope scaling, another activation, a head_dim
// that is not hidden_size / num_attention_heads, a missing shard, a tensor whose shape disagrees
// with config.json, a tokenizer whose vocabulary is not the model's, or a byte-level BPE
// tokenizer.json without tokenizer.model.
HfSource inspect_hf(const std::string& dir, int64_t max_seq_len = 0);

struct HfImport {
  HfSource source;
  std::unique_ptr<Model> model;
  // Full/Block imports: the largest |logit| difference from the PreNorm import on a probe of
  // fixed tokens, and the largest |logit| of the PreNorm import there (measured by import_hf);
  // negative for a PreNorm import.
  double probe_max_diff = -1, probe_max_logit = -1;
  int64_t probe_tokens = 0;
};

// Builds the model of `dir` in `opt.residual`'s mode and loads its weights (the mode's own
// tensors as a new AttnRes model starts them). A Full/Block AttnRes directory export_hf wrote is
// read as the model it is (opt.residual prenorm, or the same mode; else an Error). Nothing is
// written.
HfImport import_hf(const std::string& dir, const HfImportOptions& opt);

// Writes `model` as a Hugging Face directory `out_dir`: a PreNorm model as `LlamaForCausalLM`, a
// Full/Block AttnRes model (the paper's variant; others are an Error) as `AttnResForCausalLM`
// with Kimi K3's mixer names and modeling_attnres.py. config.json, model.safetensors (float32, HF
// names), and, when `tokenizer_model` (a SentencePiece file) is given, tokenizer.model and a
// tokenizer_config.json; without one, config.json records "attnres_tokenizer": "byte". The
// directory is built under a temporary name and renamed into place; an existing `out_dir` is an
// Error unless `overwrite` (and it holds an earlier export only). `weights_metadata` goes into
// model.safetensors' metadata (e.g. what the weights trained on, for import_hf to carry back).
void export_hf(const Model& model, const std::string& tokenizer_model, const std::string& out_dir,
               bool overwrite, const std::map<std::string, std::string>& weights_metadata = {});

// The Hugging Face name of an attnres tensor ("layers.0.attention.wq.weight" ->
// "model.layers.0.self_attn.q_proj.weight"; an AttnRes mixer's query and key-norm gain ->
// Kimi K3's "...self_attention_res_proj.weight" / "..._res_norm.weight"); "" for a tensor with no
// Hugging Face name (the other residual modes' and variants' tensors).
std::string hf_tensor_name(const std::string& attnres_name);

// The shape a tensor has under its Hugging Face name: a mixer's query (d) is a [1, d] projection
// there; every other tensor keeps its shape.
std::vector<int64_t> hf_tensor_shape(const std::string& attnres_name,
                                     const std::vector<int64_t>& shape);

}  // namespace attnres
