#include "train/step_runner.hpp"

#include <cmath>
#include <optional>

#include "attnres/data.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/model.hpp"
#include "attnres/optim.hpp"
#include "attnres/params.hpp"
#include "attnres/pipeline.hpp"
#include "attnres/train.hpp"
#include "backend/backend.hpp"
#include "train/device_step.hpp"
#include "train/grad_buckets.hpp"

namespace attnres {

namespace {

// Data-parallel copies of the model: the ranks, or the pipelines of pipeline x data parallel.
int64_t replicas_of(const StepContext& c) {
  return c.pipeline ? c.comm.size() / c.pipeline->plan().P : c.comm.size();
}

// This rank's rows of each micro-batch: its replica's slice (pipeline k: ranks [k P, (k+1) P)).
struct Rows {
  int64_t count, first;
};
Rows rows_of(const StepContext& c) {
  const int64_t n = c.cfg.batch_size / replicas_of(c);
  const int64_t replica = c.pipeline ? c.comm.rank() / c.pipeline->plan().P : c.comm.rank();
  return {n, replica * n};
}

// Micro-batches averaged into the step's mean: equal slices and micro-batches, so the global mean
// is the mean of the replicas' micro means (a pipeline's loss comes from its last stage alone).
int64_t parts_of(const StepContext& c) { return c.cfg.grad_accum * replicas_of(c); }

bool overlaps(const StepContext& c) {
  return sums_during_backward(c.cfg.grad_overlap, c.comm.size(), c.pipeline != nullptr,
                              c.model.on_cpu());
}

// ZeRO-1: rank r's shard is [bounds[r], bounds[r + 1]) of the flat parameters; else empty.
std::vector<int64_t> shard_bounds_of(const StepContext& c) {
  std::vector<int64_t> b;
  if (!c.shard_counts || c.comm.size() == 1) return b;
  b.push_back(0);
  for (int64_t n : *c.shard_counts) b.push_back(b.back() + n);
  return b;
}

// Forward and backward on the host's schedule; the gradients summed over the ranks, scaled to
// the mean, measured, and the update applied unless they are not finite.
class HostStep : public StepRunner {
 public:
  explicit HostStep(const StepContext& c)
      : c_(c),
        rows_(rows_of(c)),
        parts_(parts_of(c)),
        shards_(shard_bounds_of(c)),
        buckets_(overlaps(c) || !shards_.empty()
                     ? std::make_unique<GradBuckets>(c.comm, c.model.layout(), c.model.grads(),
                                                     shards_.empty() ? nullptr : &shards_)
                     : nullptr) {}

  Outcome run(int64_t step, Rates rates, bool sublayer_norms) override {
    Model& model = c_.model;
    const int64_t n = model.layout().total();
    // ZeRO-1 reduce-scatters, so a rank's gradients outside its shard stay unsummed: a step
    // that measures every sublayer's gradient all-reduces them instead.
    const bool whole = sublayer_norms && !shards_.empty();
    in_backward_ = buckets_ && !whole && overlaps(c_);
    Outcome o;
    const std::optional<double> summed = forward_backward(step);
    if (!summed) {
      o.ok = false;
      o.abandoned = true;
      return o;
    }
    double loss = *summed;
    if (c_.comm.size() > 1) {
      // Sum of every rank's (sum over micro-batches of) mean-loss gradients, in buckets. A
      // non-finite value on any rank makes the sum non-finite on all, so all skip together.
      // Pipeline: each rank's gradients are those of its stages' parameters (zero elsewhere).
      if (in_backward_) {
        buckets_->finish();  // (sent during the last micro-batch's backward)
      } else if (buckets_ && !whole) {
        buckets_->begin();
        for (const ParamEntry& e : model.layout().entries()) buckets_->ready(e.offset, e.numel);
        buckets_->finish();
      } else {
        c_.reducer->allreduce_sum(model.grads(), n);
      }
      c_.comm.allreduce_sum(&loss, 1);
    }
    o.loss = loss / static_cast<double>(parts_);
    if (c_.loss_hook) o.loss = c_.loss_hook(step + 1, o.loss);
    if (parts_ > 1) model.backend().scale(model.grads(), 1.0f / static_cast<float>(parts_), n);
    if (sublayer_norms && c_.comm.is_root()) {
      o.sublayer_grad_norms = model.sublayer_grad_norms();  // before clipping
    }
    o.grad_norm = std::sqrt(sum_squares(whole));
    o.ok = std::isfinite(o.loss) && std::isfinite(o.grad_norm);
    if (!o.ok) return o;
    c_.opt.step(model.params(), model.grads(), rates.lr, clip_scale(o.grad_norm, c_.cfg.grad_clip),
                rates.router_lr);
    if (c_.shard_counts) c_.comm.allgather(model.params(), *c_.shard_counts);  // ZeRO-1
    return o;
  }

 protected:
  // The sum over the step's micro-batches of their mean losses, gradients accumulated; none when
  // a stop request came between them (one process only: several ranks would have to agree on it,
  // so they stop at the step's end).
  virtual std::optional<double> forward_backward(int64_t step) {
    c_.model.zero_grad();
    double loss = 0.0;
    const bool may_abandon = c_.stop != nullptr && c_.comm.size() == 1;
    for (int64_t micro = 0; micro < c_.cfg.grad_accum; micro++) {
      if (micro > 0 && may_abandon && c_.stop->load()) return std::nullopt;
      c_.train.sample_rows(c_.cfg.seed, step, micro, rows_.first, rows_.count, c_.cfg.seq_len,
                           batch_);
      loss += c_.model.forward(batch_.inputs.data(), batch_.targets.data(), rows_.count,
                               c_.cfg.seq_len);
      if (in_backward_ && micro + 1 == c_.cfg.grad_accum) {
        buckets_->begin();
        c_.model.backward(
            [this](int64_t offset, int64_t count) { buckets_->ready(offset, count); });
      } else {
        c_.model.backward();
      }
    }
    return loss;
  }

  // The squared norm of the summed gradients. Several ranks: the sum of the shards' sums of
  // squares in rank order (ZeRO-1's shards, also when not sharded), so that a ZeRO-1 rank, which
  // holds only its shard summed, finds the replicated run's value bit for bit.
  double sum_squares(bool whole) {
    Backend& be = c_.model.backend();
    const float* g = c_.model.grads();
    const int64_t ranks = c_.comm.size(), n = c_.model.layout().total();
    if (ranks == 1) return be.sum_squares(g, n);
    std::vector<double> part(static_cast<size_t>(ranks), 0.0);
    const std::vector<int64_t> bounds = shards_.empty() ? shard_bounds(n, ranks) : shards_;
    auto bound = [&](int64_t r) { return bounds[static_cast<size_t>(r)]; };
    const bool mine_only = !shards_.empty() && !whole;
    for (int64_t r = 0; r < ranks; r++) {
      if (mine_only && r != c_.comm.rank()) continue;
      part[static_cast<size_t>(r)] = be.sum_squares(g + bound(r), bound(r + 1) - bound(r));
    }
    if (mine_only) c_.comm.allreduce_sum(part.data(), ranks);  // (x + 0 + ... + 0 is exact)
    double s = 0.0;
    for (double p : part) s += p;
    return s;
  }

  const StepContext c_;
  const Rows rows_;
  const int64_t parts_;
  const std::vector<int64_t> shards_;           // ZeRO-1: the ranks' shard bounds; else empty
  const std::unique_ptr<GradBuckets> buckets_;  // bucketed gradient sum (overlap, ZeRO-1) or null
  bool in_backward_ = false;                    // this step's sum runs during the backward
  Batch batch_;
};

// This rank's stages of every micro-batch, in the 1F1B order.
class PipelineStep : public HostStep {
 public:
  explicit PipelineStep(const StepContext& c)
      : HostStep(c), micro_batches_(static_cast<size_t>(c.cfg.grad_accum)) {}

 protected:
  std::optional<double> forward_backward(int64_t step) override {
    c_.model.zero_grad();
    inputs_.clear();
    targets_.clear();
    for (int64_t micro = 0; micro < c_.cfg.grad_accum; micro++) {
      Batch& mb = micro_batches_[static_cast<size_t>(micro)];
      c_.train.sample_rows(c_.cfg.seed, step, micro, rows_.first, rows_.count, c_.cfg.seq_len, mb);
      inputs_.push_back(mb.inputs.data());
      targets_.push_back(mb.targets.data());
    }
    return c_.pipeline->step(inputs_, targets_, rows_.count, c_.cfg.seq_len);
  }

 private:
  std::vector<Batch> micro_batches_;
  std::vector<const int32_t*> inputs_, targets_;
};

// On a device: no wait for the host until the update is queued; the step's scalars stay on the
// device (device_step.hpp). With several ranks the gradients are summed between the
// forward+backward and the update, outside the graphs; the mean over ranks and micro-batches is
// the update's scale.
class DeviceStepRunner : public StepRunner {
 public:
  explicit DeviceStepRunner(const StepContext& c)
      : c_(c),
        rows_(rows_of(c)),
        parts_(parts_of(c)),
        step_(c.model, c.opt, c.cfg.grad_clip, 1.0f / static_cast<float>(parts_), c.cfg.cuda_graphs,
              /*loss_check=*/c.comm.size() == 1) {}

  Outcome run(int64_t step, Rates rates, bool sublayer_norms) override {
    const int64_t ranks = c_.comm.size();
    step_.begin();
    for (int64_t micro = 0; micro < c_.cfg.grad_accum; micro++) {
      c_.train.sample_rows(c_.cfg.seed, step, micro, rows_.first, rows_.count, c_.cfg.seq_len,
                           batch_);
      step_.micro(batch_.inputs.data(), batch_.targets.data(), rows_.count, c_.cfg.seq_len);
    }
    if (ranks > 1) c_.reducer->allreduce_sum(c_.model.grads(), c_.model.layout().total());
    Outcome o;
    if (sublayer_norms && c_.comm.is_root()) {  // (before the scale by 1 / parts, so scaled here)
      o.sublayer_grad_norms = c_.model.sublayer_grad_norms();
      for (double& g : o.sublayer_grad_norms) g /= static_cast<double>(parts_);
    }
    const DeviceStep::Result r = step_.finish(rates.lr);
    double sums[2] = {r.loss_sum, r.ok ? 1.0 : 0.0};
    if (ranks > 1) {
      c_.comm.allreduce_sum(sums, 2);
      // Every rank's verdict comes from the same summed gradients alone (a non-finite loss makes
      // its rank's gradients, so the sum, non-finite): a split verdict would be a bug, and the
      // replicas would drift apart.
      check(sums[1] == 0.0 || sums[1] == static_cast<double>(ranks),
            "internal: the ranks disagree on skipping step " + std::to_string(step + 1));
    }
    o.loss = sums[0] / static_cast<double>(parts_);
    o.grad_norm = r.norm;
    o.ok = r.ok;
    if (!step_.off_reason().empty() && !off_told_) {
      c_.message("note: CUDA graphs turned off: " + step_.off_reason() +
                 "; the steps run uncaptured");
      off_told_ = true;
    }
    return o;
  }

  Graphs graphs() const override { return {step_.captures(), step_.replays(), step_.off_reason()}; }

 private:
  const StepContext c_;
  const Rows rows_;
  const int64_t parts_;
  DeviceStep step_;
  Batch batch_;
  bool off_told_ = false;
};

}  // namespace

std::vector<int64_t> shard_bounds(int64_t n, int64_t ranks) {
  std::vector<int64_t> b(static_cast<size_t>(ranks + 1));
  for (int64_t r = 0; r <= ranks; r++) b[static_cast<size_t>(r)] = n * r / ranks;
  return b;
}

bool sums_during_backward(bool grad_overlap, int64_t ranks, bool piped, bool on_cpu) {
  return grad_overlap && ranks > 1 && !piped && on_cpu;
}

std::unique_ptr<StepRunner> make_step_runner(const StepContext& ctx) {
  // (a test's loss_hook needs the loss on the host before the update: it keeps the host's step)
  if (!ctx.model.on_cpu() && !ctx.pipeline && !ctx.shard_counts && !ctx.loss_hook) {
    return std::make_unique<DeviceStepRunner>(ctx);
  }
  if (ctx.cfg.cuda_graphs) {
    ctx.message(std::string("note: --cuda-graphs is not used ") +
                (ctx.model.on_cpu() ? "on the CPU" : "here") + "; the steps run uncaptured");
  }
  if (ctx.pipeline) return std::make_unique<PipelineStep>(ctx);
  return std::make_unique<HostStep>(ctx);
}

}  // namespace attnres
