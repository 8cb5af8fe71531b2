// One optimizer step, three ways (train/trainer.cpp picks one per run): on the host (one process
// or data parallel), through a pipeline of ranks (SPEC 5), or on a device without waiting for the
// host before the update (train/device_step.hpp). Each samples the step's micro-batches, runs
// forward and backward, sums the gradients over the ranks, takes the mean loss and the gradient
// norm, decides whether the step is finite, and applies AdamW unless it is not: all three return
// the same Outcome, so the training loop has one path.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace attnres {

class AdamW;
class Model;
class TokenSpan;
struct TrainConfig;
namespace dist {
class Communicator;
class DeviceReducer;
}  // namespace dist
namespace pipe {
class Pipeline;
}

// What a runner works with (copied into it; what it refers to outlives the runner).
struct StepContext {
  Model& model;
  AdamW& opt;
  dist::Communicator& comm;
  dist::DeviceReducer* reducer;  // several ranks: sums the gradients where they live
  const TokenSpan& train;        // batches are drawn from (seed, step, micro)
  const TrainConfig& cfg;
  pipe::Pipeline* pipeline;                  // non-null: a pipeline of all the ranks
  const std::vector<int64_t>* shard_counts;  // non-null: ZeRO-1, elements of each rank's shard
  std::function<double(int64_t, double)> loss_hook;  // tests: replaces the mean loss (host only)
  std::function<void(const std::string&)> message;   // notes for the user (rank 0 prints them)
  // Set (e.g. on SIGTERM) to abandon a one-process host step between its micro-batches: a long
  // step (a large --grad-accum) must not keep a stop request waiting. Null: never.
  const std::atomic<bool>* stop = nullptr;
};

class StepRunner {
 public:
  struct Rates {
    double lr = 0.0;
    double router_lr = -1.0;  // the residual mode's tensors (-1: lr)
  };
  struct Outcome {
    double loss = 0.0;       // mean training loss over the step's tokens, all ranks
    double grad_norm = 0.0;  // global gradient norm before clipping
    bool ok = true;          // false: a non-finite loss or gradient; the update was skipped
    bool abandoned = false;  // a stop request came between micro-batches: no update, no loss
    std::vector<double> sublayer_grad_norms;  // when asked for: per sublayer, before clipping
  };
  struct Graphs {  // CUDA graphs of a device runner (zeros and "" elsewhere)
    int64_t captures = 0, replays = 0;
    std::string off_reason;
  };

  virtual ~StepRunner() = default;
  // Optimizer step `step` (0-based); sublayer_norms (the same on every rank): rank 0 also
  // measures the per-sublayer gradient norms.
  virtual Outcome run(int64_t step, Rates rates, bool sublayer_norms) = 0;
  virtual Graphs graphs() const { return {}; }
};

// ZeRO-1's shards of n flat parameters over `ranks`: rank r owns [bounds[r], bounds[r + 1]).
std::vector<int64_t> shard_bounds(int64_t n, int64_t ranks);

// Whether data parallel sums the gradients during the backward pass (train/grad_buckets.hpp):
// asked for, several ranks, no pipeline, the model on the host.
bool sums_during_backward(bool grad_overlap, int64_t ranks, bool piped, bool on_cpu);

// The pipeline runner when ctx.pipeline is set; else the device runner on a device backend, unless
// ZeRO-1 or a loss hook needs the host's; else the host runner. Says (through ctx.message) when
// --cuda-graphs cannot be used.
std::unique_ptr<StepRunner> make_step_runner(const StepContext& ctx);

}  // namespace attnres
