// attnres/params.hpp — the flat parameter layout.
//
// All parameters live in ONE float buffer; gradients and optimizer moments mirror it. Each tensor
// is a named view (name, shape, offset), so zeroing, clipping, the optimizer and checkpointing are
// single loops over one allocation. Names are the checkpoint contract (README "Checkpoints").
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace attnres {

// What a tensor is, for the code that treats kinds of tensors differently (initialisation,
// per-sublayer statistics, reports), so that none of it matches names:
//   embedding  the token embedding       norm      an RMSNorm gain (initialised to 1)
//   linear     a linear layer's weight   out_proj  a linear layer writing a sublayer's output
//   lm_head    the untied LM head        other     the residual mode's own tensors
enum class ParamRole { other, embedding, norm, linear, out_proj, lm_head };

// A tensor's role and the sublayer it belongs to (2 i: layer i's attention, its norm included;
// 2 i + 1: its MLP; -1: none).
struct ParamTag {
  ParamRole role = ParamRole::other;
  int64_t sublayer = -1;
};

struct ParamEntry {
  std::string name;            // checkpoint name, e.g. "layers.0.attention.wq.weight"
  std::vector<int64_t> shape;  // (out_features, in_features) for linear weights
  int64_t offset = 0;          // in floats, into the flat buffer
  int64_t numel = 0;
  bool decay = false;  // AdamW weight decay applies (2-D matrices except embeddings)
  ParamTag tag;
};

class ParamLayout {
 public:
  // Appends a tensor; returns its offset. Offsets are aligned to 16 floats (64 bytes), unless
  // `contiguous` asks to start right where the previous tensor ends (so e.g. wq|wk|wv form one
  // stacked matrix that a single GEMM can use).
  int64_t add(const std::string& name, std::vector<int64_t> shape, bool decay,
              bool contiguous = false, ParamTag tag = {});
  const std::vector<ParamEntry>& entries() const { return entries_; }
  int64_t total() const { return total_; }
  // Null when absent.
  const ParamEntry* find(const std::string& name) const;
  // Sum of numel over all tensors (without alignment padding).
  int64_t count() const;

 private:
  std::vector<ParamEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
  int64_t total_ = 0;
};

}  // namespace attnres
