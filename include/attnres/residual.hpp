// attnres/residual.hpp — the depth router: the part of the model that owns the residual path.
//
// A Transformer with L sublayers (0-based l = 0..L-1: 2i is block i's attention, 2i+1 its MLP)
// never adds residuals itself. It asks the router for each sublayer's input x_l, hands it each
// sublayer's output v_{l+1}, and finally asks for the hidden state that feeds the final norm. The
// backward pass mirrors this in reverse. Modes differ only here: `prenorm` is the plain sum
// (SPEC section 1); AttnRes modes mix earlier outputs with learned depth attention (SPEC 2-4).
//
// Usage, forward then backward on n rows of width d:
//   router.begin(emb, n);
//   for l in 0..L-1: { x = router.input(l); y = router.output_slot(l); f_l(x) -> y;
//                      router.commit_output(l); }
//   h = router.final_hidden();
//   router.begin_backward(dh);
//   for l in L-1..0: { dy = router.grad_output(l); dx = router.grad_input_slot(l);
//                      f_l backward: dx += ...; router.commit_grad_input(l); }
//   demb = router.grad_embedding();
// Pointers returned stay valid until the next begin() (inputs are kept for backward).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attnres/backend.hpp"
#include "attnres/config.hpp"
#include "attnres/params.hpp"

namespace attnres {

// The depth sources of one micro-batch on one pipeline rank (SPEC 5): id 0 is the embedding v_0,
// id 1 + b the representation of block b. Each holds its value (n,d), per-token inverse RMS (n,H)
// and a gradient accumulator (n,d). All of a rank's virtual stages read and write the one store
// of a micro-batch, so each block is stored once per rank; the pipeline fills it with the
// sources it receives and the stages add the ones they form.
struct SourceStore {
  struct Entry {
    DevBuf<float> v, r, g;  // in the backend's memory
    DevBuf<uint16_t> vb;    // v in bf16, for depth mixes that read bf16 sources (--precision bf16)
    bool present = false;   // v holds this micro-batch's value
    bool has_rstd = false;  // r is computed from v
    bool has_bf16 = false;  // vb is rounded from v
  };
  std::vector<Entry> e;
  Backend* be = nullptr;  // where the entries live (null: the CPU)

  // Entry id sized for n rows of width d and H heads; a newly present entry gets a zero gradient.
  Entry& ensure(int64_t id, int64_t n, int64_t d, int64_t H) {
    if (static_cast<int64_t>(e.size()) <= id) e.resize(static_cast<size_t>(id + 1));
    Entry& x = e[static_cast<size_t>(id)];
    if (!x.present) {
      x.v.on(be).resize(static_cast<size_t>(n * d));
      x.r.on(be).resize(static_cast<size_t>(n * H));
      x.g.on(be).assign_zero(static_cast<size_t>(n * d));
      x.present = true;
      x.has_rstd = x.has_bf16 = false;
    }
    return x;
  }
  bool has(int64_t id) const {
    return id < static_cast<int64_t>(e.size()) && e[static_cast<size_t>(id)].present;
  }
  // Forgets every source (keeps the memory for the next micro-batch).
  void clear() {
    for (auto& x : e) x.present = x.has_rstd = x.has_bf16 = false;
  }
};

class DepthRouter {
 public:
  virtual ~DepthRouter() = default;

  // Adds the router's own parameters (if any) to the layout. Called once, before bind().
  virtual void add_params(ParamLayout& layout) = 0;
  // Points the router at the flat parameter and gradient buffers (after layout is final). grads
  // may be null for inference-only use.
  virtual void bind(const ParamLayout& layout, float* params, float* grads) = 0;
  // Writes the mode's initial values of its own parameters into params (SPEC 2: pseudo-queries
  // zero, key-norm gains one; DenseFormer: identity weights; static: uniform logits).
  virtual void init_params(float* params) const {}

  // --- forward ---
  // Starts a pass over n rows; emb (n,d) is v_0 (copied).
  virtual void begin(const float* emb, int64_t n) = 0;
  // x_l (n,d): the input of sublayer l (before its own RMSNorm).
  virtual const float* input(int64_t l) = 0;
  // (n,d) buffer the sublayer writes its output v_{l+1} into; then call commit_output(l).
  virtual float* output_slot(int64_t l) = 0;
  virtual void commit_output(int64_t l) = 0;
  // (n,d): the hidden state after all L sublayers, input of the final RMSNorm.
  virtual const float* final_hidden() = 0;

  // --- backward (call after a forward over the same rows) ---
  // dh (n,d): gradient w.r.t. final_hidden() (copied).
  virtual void begin_backward(const float* dh) = 0;
  // (n,d): total gradient w.r.t. v_{l+1}, the output of sublayer l. Valid once every sublayer
  // after l has committed its input gradient.
  virtual const float* grad_output(int64_t l) = 0;
  // (n,d) zeroed buffer the sublayer ACCUMULATES dL/dx_l into; then commit_grad_input(l).
  virtual float* grad_input_slot(int64_t l) = 0;
  virtual void commit_grad_input(int64_t l) = 0;
  // (n,d): gradient w.r.t. the embedding v_0, once every sublayer has committed.
  virtual const float* grad_embedding() = 0;

  // Diagnostics of the last forward pass: the mean depth-attention weights (averaged over tokens
  // and heads), one row per mixing point (`rows` labels, e.g. "L0.attn", ..., "out"), one column
  // per source (`cols` labels, e.g. "emb", "L0.attn" or "block0", ..., "partial"); a source a
  // row cannot see is NaN. Returns false for modes without learned depth weights (prenorm).
  // Not on the training path.
  virtual bool depth_weights(std::vector<std::vector<double>>& w, std::vector<std::string>& rows,
                             std::vector<std::string>& cols) {
    return false;
  }

  // Bytes of activations held for n rows (for memory reports).
  virtual int64_t activation_bytes(int64_t n) const = 0;

  // --- pipeline stages (SPEC 5) ---
  // A stage is a range of sublayers [first, last) whose ends lie on block boundaries. Modes that
  // return true here run as stages: their state between stages is the list of depth sources
  // (SourceStore), of which boundary_sources(l) exist before sublayer l.
  virtual bool supports_stages() const { return false; }
  virtual int64_t boundary_sources(int64_t l) const { return 0; }
  // Block size S of the sources (stage boundaries must be multiples of it).
  virtual int64_t source_block_size() const { return 1; }
  // Restricts the router to sublayers [first, last) and makes it read and write its depth sources
  // in *store (which must outlive the pass; rebind per micro-batch). The forward of a stage with
  // first == 0 starts with begin(emb, n); a later one with begin_stage(n), after the store got the
  // boundary_sources(first) sources. The backward of a stage with last == L starts with
  // begin_backward(dh); an earlier one with begin_backward_stage(), after the store's gradients of
  // the sources the stage formed hold everything later stages added.
  virtual void set_stage(int64_t first, int64_t last) {}
  virtual void bind_store(SourceStore* store) {}
  virtual void begin_stage(int64_t n) {}
  virtual void begin_backward_stage() {}
};

// Builds the router for cfg.residual.mode (prenorm, full, block, static, denseformer) whose
// buffers and ops live on backend `be` (null: the CPU). Throws Error on an unknown mode, or one
// that does not run on that backend yet.
std::unique_ptr<DepthRouter> make_router(const ModelConfig& cfg, Backend* be = nullptr);

}  // namespace attnres
