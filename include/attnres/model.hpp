// attnres/model.hpp — a Llama-style decoder-only language model (SPEC section 1) with a pluggable
// residual path (residual.hpp).
//
// Per block i (sublayers 2i and 2i+1):
//   attention: RMSNorm -> [wq; wk; wv] -> RoPE -> causal softmax(q k^T / sqrt(hd)) v -> wo
//   MLP:       RMSNorm -> [w1; w3] -> silu(h1) * h3 -> w2
// then final RMSNorm and the LM head (output.weight, or tok_embeddings.weight when tied).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "attnres/backend.hpp"
#include "attnres/config.hpp"
#include "attnres/params.hpp"

namespace attnres {

class DepthRouter;
struct SourceStore;

class Model {
 public:
  // Validates cfg (throws Error) and allocates parameters and gradients, all zero, on backend
  // `be` (attnres/backend.hpp; null: the CPU). Error when the residual mode or an option does
  // not run on that backend yet.
  explicit Model(ModelConfig cfg, std::shared_ptr<Backend> be = nullptr);
  ~Model();
  // The parameter layout (names, shapes, offsets) a model of cfg has, without allocating it: lets
  // a loader check a file's tensors against a config before trusting the config's sizes.
  static ParamLayout layout_for(ModelConfig cfg);
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  Backend& backend() const { return *be_; }
  const std::shared_ptr<Backend>& backend_ptr() const { return be_; }
  // True when params(), grads() and logits() are host memory (the CPU backend).
  bool on_cpu() const;
  // The flat parameters and gradients, in the backend's memory.
  float* params() { return params_.data(); }
  const float* params() const { return params_.data(); }
  float* grads() { return grads_.data(); }
  const float* grads() const { return grads_.data(); }
  int64_t num_params() const { return layout_.count(); }
  // The layout entries every residual mode has (embedding, blocks, final norm, head) come first;
  // entries from this index on are the residual mode's own (e.g. AttnRes queries and key gains).
  size_t core_entries() const { return n_core_entries_; }
  // Start of the named tensor in params(); throws std::out_of_range for an unknown name.
  float* param(const std::string& name);
  const float* param(const std::string& name) const;
  // Host copies of the parameters / gradients (any backend), and the parameters set from host
  // memory (layout().total() floats).
  std::vector<float> params_to_host() const;
  std::vector<float> grads_to_host() const;
  void params_from_host(const float* host);
  // The parameters on the host without a copy where the backend's memory is the host's
  // (DevBuf::host_view / host_stage): read them while `scratch` lives; or write them all, then
  // commit_params(scratch).
  const float* params_on_host(std::vector<float>& scratch) const {
    return params_.host_view(scratch);
  }
  float* params_stage(std::vector<float>& scratch) { return params_.host_stage(scratch); }
  void commit_params(const std::vector<float>& scratch) { params_.commit_host(scratch); }

  // Deterministic initialisation from seed: linear weights N(0, 0.02), output projections (wo, w2)
  // scaled by 1/sqrt(2 n_layer), embeddings N(0, 0.02), norm gains 1; the residual mode's own
  // parameters as its router defines (SPEC 2: pseudo-queries 0, key-norm gains 1). The shared
  // weights do not depend on the residual mode, so runs in different modes start alike.
  void init_weights(uint64_t seed);

  // Forward over tokens (B,T), T <= max_seq_len. With targets (B,T) returns the mean
  // cross-entropy; with targets == nullptr returns 0 and only computes logits.
  // Keeps the activations backward() needs.
  double forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T);
  // The same forward in two halves, for a step that never waits for the host (attnres train on
  // a device, src/train/device_step.cpp): stage_batch checks and uploads the tokens (and prepares
  // what the backward needs from them on the host); forward_staged then runs on the device
  // alone: with targets it adds the mean cross-entropy into step_scalars[step::kLoss] (the
  // backend's memory, core/step_scalars.hpp) instead of returning it, so it can be captured
  // (Backend::begin_capture) and replayed for every later batch staged the same way.
  void stage_batch(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T);
  void forward_staged(float* step_scalars);
  // (B,T,V) logits of the last forward, in the backend's memory. backward() may overwrite them
  // (with their gradient): read them before it.
  const float* logits() const;
  // Sets all gradients to zero.
  void zero_grad();
  // Called during backward() as tensors' gradients become final for it: (offset, count) of one
  // layout entry in grads(). Each entry is reported exactly once per backward(), in an order that
  // depends only on the configuration (the head, then each layer from the last, then the rest),
  // so ranks may start summing a tensor while the backward goes on (data parallel overlap).
  using GradReady = std::function<void(int64_t offset, int64_t count)>;
  // Accumulates d(mean loss)/d(params) of the last forward (which must have had targets); reports
  // finished tensors to `ready` when given.
  void backward(const GradReady& ready = nullptr);

  // Frees the activations forward() keeps (allocated again by the next forward), e.g. after an
  // evaluation in a pipeline run, whose training uses stage passes instead.
  void release_activations();

  // Bytes of activation memory currently allocated (for reports).
  int64_t activation_bytes() const;

  // --- diagnostics (the SPEC 6 analyses); none of this is on the training path ---
  struct SublayerStats {
    std::vector<double> input_rms, output_rms;  // (L): RMS over tokens and channels
  };
  // With recording on, forward() also measures each sublayer's input and output RMS.
  void set_record_stats(bool on) { record_stats_ = on; }
  const SublayerStats& sublayer_stats() const { return stats_; }
  // L2 norm of the current gradient of each sublayer's own weights (its RMSNorm gain and
  // projections), (L) values.
  std::vector<double> sublayer_grad_norms() const;
  // Hash of the parameters every residual mode has (all but the router's own): equal across
  // modes when they were initialised from one seed.
  uint64_t shared_weights_hash() const;
  // The residual path (e.g. for its depth_weights() after a forward).
  DepthRouter& router() { return *main_->router; }

  // --- pipeline stages (SPEC 5; attnres/pipeline.hpp drives them) ---
  struct Acts;
  // One micro-batch's pass through the sublayers [first, last) of a pipeline stage: the
  // activations its backward needs and its own router. Reused by the stage's later micro-batches.
  struct StagePass {
    StagePass();
    ~StagePass();
    int64_t first = 0, last = 0;
    std::unique_ptr<Acts> acts;
    std::unique_ptr<DepthRouter> router;
  };
  // Error unless the residual mode runs as stages (block, full) and first and last lie on layer
  // and block boundaries (stage_unit() sublayers).
  std::unique_ptr<StagePass> make_stage_pass(int64_t first, int64_t last);
  // Stage boundaries are multiples of this many sublayers (layer and block aligned); 0 when the
  // residual mode cannot be split into stages.
  int64_t stage_unit() const;
  // Depth sources that exist before sublayer l (a stage boundary): the embedding and the blocks.
  int64_t boundary_sources(int64_t l) const;
  // Forward of one micro-batch of (B,T) tokens through the stage, reading the depth sources
  // before `first` from `store` and adding the ones it forms. The first stage embeds `tokens`;
  // the last returns the mean cross-entropy over `targets` (every other stage returns 0).
  double stage_forward(StagePass& p, SourceStore& store, const int32_t* tokens,
                       const int32_t* targets, int64_t B, int64_t T);
  // Backward of the pass's forward: accumulates its parameters' gradients into grads() and its
  // reads of earlier sources into the store's gradients. Before it, the store's gradients of the
  // sources this stage formed must hold everything later stages added.
  void stage_backward(StagePass& p);

 private:
  void build_layout();
  void ensure_acts(StagePass& p, int64_t B, int64_t T);
  double run_forward(StagePass& p, const int32_t* tokens, const int32_t* targets, int64_t B,
                     int64_t T);
  void stage_inputs(StagePass& p, const int32_t* tokens, const int32_t* targets, int64_t B,
                    int64_t T);
  // The forward of the staged inputs; with targets the mean loss: returned, or added into
  // step_scalars[step::kLoss] when that is given (then 0 is returned).
  double run_staged(StagePass& p, float* step_scalars);
  void run_backward(StagePass& p, const GradReady& ready = nullptr);

  ModelConfig cfg_;
  ParamLayout layout_;
  size_t n_core_entries_ = 0;                       // layout entries before the router's own
  std::vector<std::vector<size_t>> layer_entries_;  // per layer: its core entries (GradReady)
  bool record_stats_ = false;
  SublayerStats stats_;
  std::shared_ptr<Backend> be_;
  DevBuf<float> params_, grads_;       // (CPU: on huge pages where available)
  DevBuf<float> rope_cos_, rope_sin_;  // (max_seq_len, hd/2)
  std::unique_ptr<StagePass>
      main_;  // forward()/backward(): all sublayers, the router's own sources
};

}  // namespace attnres
