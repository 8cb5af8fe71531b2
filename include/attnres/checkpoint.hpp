// attnres/checkpoint.hpp — model and optimizer checkpoints as safetensors files.
//
// model.safetensors: every parameter as F32 under its contract name (README "Checkpoints"), and
// __metadata__ {"format": "attnres-model/1", "config": ModelConfig JSON, "tokenizer": ref, ...}.
// optimizer.safetensors: "m.<name>" and "v.<name>" moments and metadata {"format":
// "attnres-optim/1", "adam_steps": t, ...}. Every write is atomic (temp file, fsync, rename).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attnres/model.hpp"
#include "attnres/optim.hpp"
#include "attnres/safetensors.hpp"
#include "attnres/tokenizer.hpp"

namespace attnres {

using Metadata = std::map<std::string, std::string>;

// Writes the model's weights with its config and `meta` (e.g. "tokenizer", "step").
void save_model(const std::string& path, const Model& model, const Metadata& meta);

// Whether `path` is a regular file (not a link) holding an attnres model checkpoint (its
// safetensors metadata "format" is attnres-model/N): what --overwrite may replace.
bool is_attnres_checkpoint(const std::string& path);
// The same from the header alone (the tensors neither read nor checked): cheap enough for every
// checkpoint of a run at each save's pruning.
bool has_attnres_model_header(const std::string& path);

// Reads the config from `path`'s metadata, builds the model and loads its weights. Optionally
// returns the metadata; max_seq_len > 0 overrides the saved context length (RoPE is relative, so
// a longer context only costs memory). The model lives on backend `be` (null: the CPU). Throws
// Error naming the file and the problem.
std::unique_ptr<Model> load_model(const std::string& path, Metadata* meta = nullptr,
                                  int64_t max_seq_len = 0, std::shared_ptr<Backend> be = nullptr);

// Copies every parameter of `model` from `r`, checking names, dtypes and shapes. With
// allow_extra = false, a tensor in the file that the model does not have is an error too (it means
// the file is from a different configuration).
void load_weights(Model& model, const SafetensorsReader& r, bool allow_extra = false);

// The weights a new training run starts from (`train --init-from`): every tensor the model's
// core needs must be in `path` with its shape; the residual mode's own tensors are taken from the
// file when present and otherwise keep the model's initialisation (so a PreNorm checkpoint starts
// an AttnRes run, computing the same function: SPEC 2). A tensor the model does not have, or a
// non-finite value, is an Error naming the file, and so is an invalid config in its metadata.
// Returns the number of the mode's tensors kept. `changed` (when given) receives one line per
// setting that changes the function without changing a shape (e.g. "norm_eps 1e-05 -> 1e-10"),
// the checkpoint's value first.
int64_t load_initial_weights(Model& model, const std::string& path,
                             std::vector<std::string>* changed = nullptr);

void save_optimizer(const std::string& path, const Model& model, AdamW& opt, const Metadata& meta);
// Loads moments and the step count into opt; returns the file's metadata. Non-finite moments
// (or a negative second moment) and a step count that is not a count are an Error naming the
// file.
Metadata load_optimizer(const std::string& path, const Model& model, AdamW& opt);

// Throws Error "<what>: tensor 'T' holds N of M non-finite values (NaN or Inf); <fix>" for the
// first tensor of the model's weights with a NaN or Inf (the trainer, before each save).
void check_weights_finite(const Model& model, const std::string& what, const std::string& fix);

// Metadata key of the fingerprint (hex FNV-1a 64 of the model file) of the tokenizer a
// checkpoint was saved with.
inline constexpr const char* kTokenizerHashKey = "tokenizer_fnv1a64";

// Metadata keys of the corpus a model trained on (hex FNV-1a 64 of its text) and of the share of
// it held out for validation (%.17g): eval refuses a val split of that corpus that would reach
// into the training text, also for a model copied out of its run (21st hostile pass).
inline constexpr const char* kCorpusHashKey = "corpus_fnv1a64";
inline constexpr const char* kValFractionKey = "val_fraction";
// Metadata key of the tokenizer (fingerprint) that share was counted in: kept with the share
// through export-hf and import-hf, whose tokenizer file may be another (29th hostile pass).
inline constexpr const char* kValTokenizerKey = "val_tokenizer_fnv1a64";
// Metadata key of the corpora the model's initial weights had trained on: its --init-from model's
// corpus and that model's own ancestors (a fine-tune of a model trained on X holds what X's
// model learned; it recorded only its own corpus: 24th hostile pass). A JSON array of
// {"corpus_fnv1a64": hex, "val_fraction": x, "tokenizer_fnv1a64": hex}; export-hf and import-hf
// carry it, and the keys above.
inline constexpr const char* kAncestryKey = "trained_before";

// A corpus a model's weights trained on (hex FNV-1a 64 of its text), the share of it held out, and
// the tokenizer that share was counted in ("": not recorded, by older builds).
struct TrainedOn {
  std::string fingerprint;
  double val_fraction = 0;
  std::string tokenizer;
};
// Every corpus a model's metadata records: its own (kCorpusHashKey, kValFractionKey, and
// kValTokenizerKey or else kTokenizerHashKey) and its ancestors' (kAncestryKey). Entries that do
// not parse (or a share outside (0, 1)) are skipped.
std::vector<TrainedOn> trained_on(const Metadata& meta);
// Whether t's held-out share says which text a split of the same corpus tokenised by `tokenizer`
// (its fingerprint) holds out. A share is a fraction of tokens, and two tokenizers cut the same
// text at different bytes: t's tokenizer must be this one (28th hostile pass: a fine-tune with
// another tokenizer validated on text its initial weights trained on). Unrecorded: assumed.
bool share_counts_alike(const TrainedOn& t, const std::string& tokenizer);
// The first of `shares` held out of the corpus `corpus` (its fingerprint) that was counted in
// another tokenizer than `tokenizer` (share_counts_alike false); nullptr when none.
const TrainedOn* share_of_another_tokenizer(const std::vector<TrainedOn>& shares,
                                            const std::string& corpus,
                                            const std::string& tokenizer);
// The kAncestryKey value for a model whose weights start from a model with metadata `from`: every
// corpus `from` records; "" when it records none.
std::string ancestry_from(const Metadata& from);
// The metadata of `meta` that says what its weights trained on (the keys above), to carry along
// with the weights (export-hf, import-hf).
Metadata training_record(const Metadata& meta);

// The file of the tokenizer a checkpoint at `path` records ("sentencepiece:<file>", resolved
// beside the checkpoint); "" for the byte tokenizer (no "tokenizer" key, or "byte").
std::string checkpoint_tokenizer_file(const Metadata& meta, const std::string& path);

// The tokenizer of a checkpoint at `path` with metadata `meta`: its "tokenizer" reference
// ("byte" when absent) resolved beside the checkpoint, of the model's vocabulary, and, when the
// metadata records its fingerprint, that very tokenizer (another run's tokenizer.model of the
// same vocabulary read the text as other tokens). Error naming the file and the fix.
std::unique_ptr<Tokenizer> load_checkpoint_tokenizer(const Metadata& meta, const std::string& path,
                                                     int64_t vocab_size);

// The training step a checkpoint's metadata records (key "step"): decimal digits in
// [0, max_step], else an Error naming `path`.
int64_t checkpoint_step(const Metadata& meta, int64_t max_step, const std::string& path);

}  // namespace attnres
