// attnres/train.hpp — the training loop: data, model, AdamW, evaluation, checkpoints, metrics.
//
// A run directory holds everything a run produces:
//   train_config.json          the TrainConfig (with the model config) the run started with
//   tokenizer.model, tokens.bin  the BPE model (if any) and the token cache
//   metrics.jsonl              one JSON object per logged step / evaluation (appended on resume)
//   checkpoints/step_XXXXXXXX/ model.safetensors, optimizer.safetensors (+ tokenizer copy)
//   latest                     name of the newest complete checkpoint directory
//   model.safetensors          the final model (and a copy of the tokenizer beside it)
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "attnres/backend.hpp"
#include "attnres/config.hpp"
#include "attnres/optim.hpp"
#include "attnres/tokenizer.hpp"

namespace attnres {

namespace dist {
class Communicator;
}

// The largest train_config.json a run writes could be (a few KiB; paths of up to 4 KiB each):
// a larger file in its place is not one, and is not read whole.
constexpr size_t kMaxTrainConfigBytes = size_t{1} << 20;

struct TrainConfig {
  // data
  std::string data_path;  // UTF-8 text file or directory of them
  TokenizerKind tokenizer = TokenizerKind::byte;
  int32_t bpe_vocab = 4096;
  // bpe: a SentencePiece model used instead of training one on the corpus (absolute path;
  // `train --tokenizer-model`, or the tokenizer of an --init-from checkpoint). "" = train one.
  std::string tokenizer_model;
  double val_fraction = 0.1;
  // model (vocab_size and max_seq_len are filled in from the tokenizer and seq_len)
  ModelConfig model;
  // optimisation
  int64_t batch_size = 8;  // sequences per micro-batch (the global batch: all ranks together)
  int64_t seq_len = 128;
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  int64_t steps = 1000;
  AdamWConfig adamw;
  ScheduleConfig schedule;  // total_steps is set to `steps`
  // The residual mode's own tensors (AttnRes queries and key gains, the baselines' mixing
  // weights) train with learning rate router_lr_mult x the schedule's, and a warm-up of their own
  // (router_warmup steps; -1 = the schedule's warm-up). CPU only for now.
  double router_lr_mult = 1.0;
  int64_t router_warmup = -1;
  double grad_clip = 1.0;
  // evaluation, checkpoints, logging
  int64_t eval_every = 100;  // 0 = only at the end
  int64_t eval_batches = 16;
  int64_t save_every = 0;  // 0 = only at the end (and on interruption)
  int64_t keep_checkpoints = 2;
  int64_t log_every = 10;
  int64_t max_bad_steps = 10;  // non-finite loss/gradient steps skipped before giving up
  uint64_t seed = 1337;
  // A checkpoint whose weights a new run starts from instead of the seed's (checkpoint.hpp
  // load_initial_weights); "" = initialise from the seed. Ignored on resume.
  std::string init_from;
  std::string out_dir = "runs/default";
  std::string
      data_dir;  // where the tokenizer and token cache live; "" = out_dir (compare shares one)
  // The corpus text's fingerprint (PreparedData::fingerprint), recorded when a run starts: a
  // resume refuses another corpus. "" = not recorded (runs of older builds).
  std::string corpus_fingerprint;
  // Its tokenizer's (PreparedData::tokenizer_fingerprint): a resume refuses another tokenizer.model
  // of the same vocabulary. "" = not recorded.
  std::string tokenizer_fingerprint;
  bool resume = false;
  // A new run into an out_dir that already holds a run (its train_config.json, latest,
  // checkpoints, metrics or model) replaces that run's files only with overwrite; without it, and
  // without resume, that is an Error. Not saved.
  bool overwrite = false;
  // Multi-process runs: shard the AdamW moments over the ranks (ZeRO stage 1) instead of keeping
  // a full copy on each. A runtime choice like the rank count: not saved, and checkpoints are the
  // same either way.
  bool zero1 = false;
  // Data parallel on the CPU: each bucket of gradients is summed over the ranks as soon as the
  // backward pass has finished it, while the pass goes on (false: after it). Bit-identical either
  // way; a runtime choice, not saved.
  bool grad_overlap = true;
  // Values per gradient bucket of the sums over the ranks (--grad-bucket-mib). On 3 or more
  // ranks the order in which MPI adds the ranks' values may depend on it: recorded in "parallel"
  // beside zero1, adopted by a resume that does not give it, and compared by every rank.
  int64_t grad_bucket_elems = int64_t{1} << 22;  // 16 MiB of floats
  // Pipeline parallelism (SPEC 5; attnres/pipeline.hpp), also runtime choices: the `pipeline`
  // ranks (all of them) each run `virtual_stages` stages of the model; each step's grad_accum
  // micro-batches of batch_size sequences flow through them in a 1F1B order, the block
  // representations sent between stages by `pipeline_comm` (cached | naive). 1 = data parallel.
  int64_t pipeline = 1;
  int64_t virtual_stages = 1;
  std::string pipeline_comm = "cached";
  // The processes the run trains on: set by train() (the communicator's size) and recorded with
  // zero1 and the pipeline layout in train_config.json "parallel", so that a resume on another
  // layout says its sums run in another order, and a plain --resume on as many ranks continues
  // the pipeline it ran. 0: not recorded (runs of earlier versions).
  int64_t ranks = 0;
  // The OpenMP threads of each rank (set by train(), recorded beside ranks): the CPU's sums run
  // in an order that depends on them, so a resume on another count is noted. 0: not recorded.
  int64_t threads = 0;
  // The closing sample of the CLI (--sample-tokens, --prompt): recorded in train_config.json
  // "sample", outside the run's settings, so that a plain --resume samples as the run started
  // (it sampled 200 tokens after a run started with --sample-tokens 0). -1: none recorded.
  int64_t sample_tokens = -1;
  std::string prompt;
  // Where the model trains (attnres/backend.hpp): cpu, cuda or cuda-host. A runtime choice too;
  // other than cpu: data parallel only (no pipeline, no ZeRO-1); with several ranks on GPUs each
  // rank takes the GPU of its index on its host and gradients are summed with NCCL.
  Device device = Device::cpu;
  // The linear layers' GEMM precision (attnres/backend.hpp MatmulPrecision): fp32 or bf16 (bf16
  // inputs, fp32 accumulation, fp32 master weights; cuda and cuda-host). A runtime choice.
  MatmulPrecision precision = MatmulPrecision::fp32;
  // Capture the training step as CUDA graphs and replay it (src/train/device_step.hpp): cuda (and
  // cuda-host, which records and replays the calls). A runtime choice.
  bool cuda_graphs = false;

  void validate() const;  // throws Error naming the field
  std::string to_json() const;
  static TrainConfig from_json(const std::string& text);
};

// A train_config.json's fingerprint (of its text), recorded in every checkpoint and final model
// of the run: of its settings, not of where the run lives (out_dir, data_dir, runtime) or how the
// file is laid out, so runs in other directories (other rank counts) write identical checkpoints
// and a moved run resumes.
std::string train_config_fingerprint(const std::string& json_text);
// Whether a checkpoint's recorded fingerprint is that of json_text (by this build's rule, or the
// earlier one that also covered data_dir).
bool train_config_fingerprint_matches(const std::string& recorded, const std::string& json_text);

struct StepInfo {
  int64_t step = 0, total_steps = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  // None until a step of this call was timed (the first one's time holds the warm-up).
  std::optional<double> tokens_per_s;
  double elapsed_s = 0, eta_s = 0;
};

struct EvalInfo {
  int64_t step = 0;
  double val_loss = 0, train_loss = 0;
};

struct TrainResult {
  int64_t steps_done = 0;
  int64_t first_step = 0;  // where this call started (a resume: its checkpoint's step)
  bool interrupted = false;
  // Only what was measured: the validation loss of the final weights (the run's last evaluation;
  // a run resumed after its last step evaluates its final weights once), absent when the run was
  // interrupted before its end; the last optimizer step's training loss and the throughput, absent
  // when this call ran no step (then look in metrics.jsonl for earlier calls' figures).
  std::optional<double> final_val_loss;
  std::optional<double> final_train_loss;
  std::optional<double> tokens_per_s, model_gflops;
  // False when a resumed run's metrics.jsonl does not begin with what the run had logged when its
  // checkpoint was saved (edited or replaced since, or a checkpoint of an older build that
  // recorded none): its earlier lines are not this run's measurements.
  bool log_intact = true;
  // Bytes [log_skip_from, log_skip_to) of metrics.jsonl: what a resume found past its checkpoint's
  // record, an earlier call's lines, neither checked nor written by this call (readers of the
  // run's figures skip them: appended lines were taken as measured; 22nd hostile pass).
  int64_t log_skip_from = 0, log_skip_to = 0;
  double seconds = 0;      // wall time of this call
  double run_seconds = 0;  // training wall time of the run: this call's and, on a resume, the
                           // earlier calls' up to the checkpoint it continued from
  int64_t num_params = 0;
  int64_t skipped_steps = 0;
  std::string model_path;   // final model.safetensors
  uint64_t init_hash = 0;   // hash of the initial weights every residual mode shares
  uint64_t batch_hash = 0;  // hash of the first training batch (the batch order's fingerprint)
  double flops_per_token = 0;
  // Pipeline runs: bytes of block representations and their gradients sent between stages per
  // step (all ranks), measured, and what the other scheme would have sent for the same plan.
  int64_t pipeline_bytes_per_step = 0, pipeline_other_scheme_bytes_per_step = 0;
  double pipeline_bubble = 0;  // idle fraction of the schedule (backward = 2 forwards)
  // --cuda-graphs: graphs captured and replays run (forward+backward per micro-batch, update per
  // step), and why graphs were turned off during the run (empty if they were not).
  int64_t graph_captures = 0, graph_replays = 0;
  std::string graphs_off_reason;
  // The command that continues the run as it ran (e.g. "mpirun -np 2 attnres train --resume
  // --out runs/a --pipeline 2"), for the stop message.
  std::string resume_command;
  // The closing sample the run records (TrainConfig::sample_tokens, prompt; -1: none).
  int64_t sample_tokens = -1;
  std::string prompt;
};

// What the library tells the caller while training (the CLI draws the progress bar).
struct TrainEvents {
  std::function<void(const std::string&)> on_message;
  std::function<void(const StepInfo&)> on_step;  // every step
  std::function<void(const EvalInfo&)> on_eval;
  const std::atomic<bool>* stop = nullptr;  // set (e.g. on SIGINT) to save and return early
  // Counts the times the process was continued after a stop (SIGCONT after Ctrl-Z or SIGSTOP),
  // called by the training thread after each step: a step during which it changes spent time
  // stopped, and is left out of the tokens/s.
  std::function<uint64_t()> continued;
  // Fault injection for tests: sees each step's mean loss (1-based step, before the non-finite
  // check) and returns the loss to use, e.g. NaN to exercise the skip counter and its limit.
  std::function<double(int64_t step, double loss)> loss_hook;
};

// Trains according to cfg. Throws DivergedError when more than cfg.max_bad_steps steps had a
// non-finite loss or gradient, or an evaluation gave a non-finite loss. With cfg.resume, continues
// the run in cfg.out_dir from its latest checkpoint, reproducing the uninterrupted run's losses
// exactly (same thread count).
TrainResult train(const TrainConfig& cfg, const TrainEvents& events);

// Data-parallel training: every rank of `comm` calls this with the same cfg. Each micro-batch's
// batch_size rows (the same rows for any rank count) are split into comm.size() equal slices, one
// per rank; gradients and losses are summed over ranks, so every rank holds the same weights and
// optimizer state, and losses, checkpoints and the final model match a one-process run with the
// same batch_size up to float summation order. Rank 0 alone prepares the data (the others wait,
// then read its token cache), writes checkpoints, metrics and train_config.json, and fires
// `events`; a stop request on any rank stops all. Error (on every rank) if batch_size is not
// divisible by the rank count, or the ranks' options or initial weights differ.
TrainResult train(const TrainConfig& cfg, const TrainEvents& events, dist::Communicator& comm);

// Pipeline-parallel training is the same call with cfg.pipeline = comm.size(): every rank holds
// the whole model but computes only its stages; the ranks' gradients are summed, so losses and
// weights match a one-process run with the same batch_size and grad_accum (to float summation
// order), and checkpoints are the same as ever (resume on any number of ranks, in either mode).

// Model FLOPs per trained token (forward + backward = 6N + attention), for throughput reports.
double train_flops_per_token(const ModelConfig& c, int64_t seq_len);

}  // namespace attnres
