// attnres/pipeline.hpp — pipeline-parallel training of AttnRes models with cache-based
// communication of the block representations (SPEC section 5).
//
// P ranks each run V virtual stages: the L sublayers are cut into P*V stages on layer and block
// boundaries, stage k running on rank k % P (interleaved). A training step pushes M micro-batches
// through them in a 1F1B order. Between stages a micro-batch carries its depth sources: the
// embedding and the block representations formed so far. Two ways to send them:
//   naive   every transition sends every source so far: up to 1 + (PV-1)*b blocks per message
//           (b blocks per stage), O(P V);
//   cached  each rank keeps the sources it has received or formed for a micro-batch (SourceStore,
//           one copy per rank), so a transition sends only the sources formed since the receiving
//           rank last held the micro-batch: at most 1 + (P-1)*b blocks, O(P).
// The backward mirrors the forward: a transition's gradients travel back over the same link with
// the same sizes; a rank adds what it receives to its own gradients of those sources and hands
// the sum back once, when its backward reaches the stage that received them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnres/model.hpp"
#include "attnres/residual.hpp"

namespace attnres {

namespace dist {
class Communicator;
}

namespace pipe {

enum class Scheme { cached, naive };
// "cached" or "naive"; Error naming the option otherwise.
Scheme parse_scheme(const std::string& name);
const char* scheme_name(Scheme s);

// How a step is laid out: P ranks x V virtual stages, M micro-batches.
struct Plan {
  int64_t P = 1, V = 1, M = 1;
  std::vector<int64_t> bounds;   // (PV+1) sublayer boundaries: stage k is [bounds[k], bounds[k+1])
  std::vector<int64_t> sources;  // (PV+1) depth sources that exist at each boundary
  int64_t stages() const { return P * V; }
  int rank_of(int64_t k) const { return static_cast<int>(k % P); }
  // "[0,4) [4,8) ..." for messages.
  std::string describe() const;
};

// Splits the model's sublayers into P*V stages of whole layers and blocks (model.stage_unit()),
// as even as possible (earlier stages take the remainder; the last one also runs the LM head).
// Error with the fix when the mode cannot be split, there are fewer units than stages, or (V > 1)
// M is not a multiple of P.
Plan make_plan(const Model& model, int64_t P, int64_t V, int64_t M);

// Source ids [first, second) that the forward transition from stage k to stage k+1 sends (and
// whose gradients the backward transition returns).
std::pair<int64_t, int64_t> transition_sources(const Plan& plan, int64_t k, Scheme scheme);

// Bytes one step sends between stages under `scheme`, forward and backward, all ranks: each
// transition's sources for each of plan.M micro-batches of `rows` tokens of width d (float32).
int64_t planned_bytes_per_step(const Plan& plan, Scheme scheme, int64_t rows, int64_t d);

// One unit of work on a rank: the forward or backward of micro-batch `mb` through stage `stage`.
struct Op {
  bool backward = false;
  int64_t mb = 0, stage = 0;
};

struct Schedule {
  std::vector<std::vector<Op>> ops;    // (P): each rank's operations, in order
  std::vector<int64_t> max_in_flight;  // (P): most forwards awaiting their backward at once
  double bubble = 0;                   // idle fraction of the ranks (backward = 2 forwards)
};

// 1F1B in Megatron-LM's order (interleaved over the virtual stages when V > 1, which needs M to
// be a multiple of P): rank r runs a warm-up of P - r - 1 forwards (2 (P - r - 1) + (V - 1) P
// interleaved), then alternates one forward and one backward, then drains the backwards; so at
// most P - r forwards (warm-up + 1 interleaved) are in flight. The bubble is (P - 1) / (V M + P -
// 1) when P divides M. The ranks' orders are checked on a simulated clock (a backward costing two
// forwards): each op's inputs are done before its rank reaches it, so with non-blocking sends the
// real run cannot deadlock.
Schedule make_schedule(const Plan& plan);

// What a rank sent: block representations forward, their gradients backward.
struct Traffic {
  int64_t forward_bytes = 0, backward_bytes = 0, messages = 0;
  int64_t peak_transition_bytes = 0;  // largest single transition (one direction)
};

// Runs steps of one rank of the pipeline. Every rank holds the whole model (weights, gradients);
// a rank touches only its stages' parameters, so the sum of the ranks' gradients is the gradient.
class Pipeline {
 public:
  Pipeline(Model& model, dist::Communicator& comm, Plan plan, Scheme scheme);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // Forward and backward of plan.M micro-batches of (B,T) tokens; micro-batch m reads inputs[m]
  // and targets[m] (every rank passes all of them). Adds this rank's stages' gradients of the sum
  // of the micro-batches' mean losses to the model's gradients; returns that sum on the rank of the
  // last stage and 0 on the others.
  double step(const std::vector<const int32_t*>& inputs, const std::vector<const int32_t*>& targets,
              int64_t B, int64_t T);

  // Frees the buffers kept between steps (stage activations, sources, send buffers), e.g. before
  // an evaluation; the next step allocates them again.
  void release_memory();

  const Plan& plan() const { return plan_; }
  const Schedule& schedule() const { return sched_; }
  Scheme scheme() const { return scheme_; }
  // This rank's sends since construction or reset_traffic().
  const Traffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = Traffic{}; }

 private:
  struct Impl;
  Model& model_;
  dist::Communicator& comm_;
  Plan plan_;
  Scheme scheme_;
  Schedule sched_;
  Traffic traffic_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pipe
}  // namespace attnres
