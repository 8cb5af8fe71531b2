// Pipeline parallelism with cache-based block communication (attnres/pipeline.hpp, SPEC 5): the
// stage plan, the 1F1B schedule (built by simulation) and the per-rank executor that moves depth
// sources and their gradients between stages.
#include "attnres/pipeline.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "attnres/buffer.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"

namespace attnres::pipe {

Scheme parse_scheme(const std::string& name) {
  if (name == "cached") return Scheme::cached;
  if (name == "naive") return Scheme::naive;
  throw Error("unknown pipeline communication scheme '" + name +
              "' (--pipeline-comm): use cached (SPEC 5) or naive");
}

const char* scheme_name(Scheme s) { return s == Scheme::cached ? "cached" : "naive"; }

std::string Plan::describe() const {
  std::string s;
  for (int64_t k = 0; k < stages(); k++) {
    s += (k ? " " : "") + std::string("[") + std::to_string(bounds[k]) + "," +
         std::to_string(bounds[k + 1]) + ")";
  }
  return s;
}

namespace {
// Message tags: ZeRO-1 uses 1 and 2; MPI guarantees tags up to 32767.
constexpr int64_t kTagBase = 100, kTagMax = 32767;

int tag_of(const Plan& p, bool backward, int64_t transition, int64_t mb) {
  return static_cast<int>(kTagBase + ((backward ? p.stages() : 0) + transition) * p.M + mb);
}
}  // namespace

Plan make_plan(const Model& model, int64_t P, int64_t V, int64_t M) {
  const ModelConfig& c = model.config();
  check(P >= 1 && V >= 1 && M >= 1,
        "pipeline: ranks, virtual stages and micro-batches must be >= 1");
  const int64_t u = model.stage_unit();
  check(u > 0,
        "pipeline parallelism needs the depth sources of Attention Residuals between "
        "stages; residual mode '" +
            std::string(to_string(c.residual.mode)) +
            "' is not supported: use --residual block or full (or train it data-parallel)");
  const int64_t L = c.n_sublayers(), units = (L + u - 1) / u, PV = P * V;
  check(PV <= units,
        "pipeline: " + std::to_string(P) + " ranks x " + std::to_string(V) +
            " virtual stages need " + std::to_string(PV) + " stages, but the model has only " +
            std::to_string(units) + " pieces of " + std::to_string(u) +
            " sublayers (whole layers and whole blocks) to split; use fewer ranks or virtual "
            "stages, more layers, or a smaller --block-size");
  check(V == 1 || P >= 2, "pipeline: virtual stages need at least 2 ranks");
  check(V == 1 || M % P == 0,
        "pipeline: with " + std::to_string(V) + " virtual stages per rank, the " +
            std::to_string(M) + " micro-batches (--grad-accum) must be a multiple of the " +
            std::to_string(P) + " ranks (the interleaved 1F1B schedule runs them in groups of " +
            std::to_string(P) + "); use --grad-accum " + std::to_string((M + P - 1) / P * P) +
            " or --virtual-stages 1");
  check(kTagBase + 2 * PV * M <= kTagMax,
        "pipeline: " + std::to_string(PV) + " stages x " + std::to_string(M) +
            " micro-batches exceed the message tags MPI guarantees; use fewer micro-batches "
            "(--grad-accum) or stages");
  Plan p;
  p.P = P;
  p.V = V;
  p.M = M;
  p.bounds.push_back(0);
  for (int64_t k = 0; k < PV; k++) {
    const int64_t n = units / PV + (k < units % PV ? 1 : 0);
    p.bounds.push_back(std::min(L, p.bounds.back() + n * u));
  }
  for (int64_t b : p.bounds) p.sources.push_back(model.boundary_sources(b));
  return p;
}

std::pair<int64_t, int64_t> transition_sources(const Plan& p, int64_t k, Scheme scheme) {
  const int64_t hi = p.sources[k + 1];
  if (scheme == Scheme::naive) return {0, hi};
  // The receiving rank last held this micro-batch at stage k + 1 - P, whose end it has seen.
  const int64_t prev = k + 1 - p.P;
  return {prev >= 0 ? p.sources[prev + 1] : 0, hi};
}

int64_t planned_bytes_per_step(const Plan& p, Scheme scheme, int64_t rows, int64_t d) {
  int64_t sources = 0;
  for (int64_t k = 0; k + 1 < p.stages(); k++) {
    const auto [lo, hi] = transition_sources(p, k, scheme);
    sources += hi - lo;
  }
  return 2 * p.M * sources * rows * d * static_cast<int64_t>(sizeof(float));
}

namespace {

constexpr int64_t kF = 1, kB = 2;  // simulated durations: a backward costs two forwards
constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

// Megatron-LM's per-rank order. Virtual micro-batch j enumerates micro-batches in groups of P and,
// within a group, the rank's stages (ascending for forwards, descending for backwards). A rank
// runs `warmup` forwards, then alternates one forward and one backward, then the remaining
// backwards: warm-up P - r - 1 without interleaving, 2 (P - r - 1) + (V - 1) P with it.
std::vector<Op> megatron_order(const Plan& p, int64_t r) {
  const int64_t P = p.P, V = p.V, M = p.M, groups = (M + P - 1) / P;
  std::vector<Op> f, b;
  for (int64_t j = 0; j < groups * P * V; j++) {
    const int64_t g = j / (P * V), in = j % (P * V), mb = g * P + in % P;
    if (mb >= M) continue;  // the last group may be partial
    const int64_t chunk = in / P;
    f.push_back({false, mb, chunk * P + r});
    b.push_back({true, mb, (V - 1 - chunk) * P + r});
  }
  const int64_t n = M * V;
  const int64_t warmup = std::min(n, V == 1 ? P - r - 1 : 2 * (P - r - 1) + (V - 1) * P);
  std::vector<Op> order(f.begin(), f.begin() + warmup);
  for (int64_t i = 0; i < n - warmup; i++) {
    order.push_back(f[warmup + i]);
    order.push_back(b[i]);
  }
  for (int64_t i = n - warmup; i < n; i++) order.push_back(b[i]);
  return order;
}

// Runs the ranks' fixed orders on a simulated clock: each op starts when its rank is free and its
// inputs are done. Fills s.bubble and s.max_in_flight; false if the orders deadlock.
bool simulate(const Plan& p, Schedule& s) {
  const int64_t P = p.P, PV = p.stages();
  std::vector<int64_t> fdone(p.M * PV, kNever), bdone(p.M * PV, kNever), busy(P, 0), in(P, 0);
  std::vector<size_t> next(P, 0);
  s.max_in_flight.assign(P, 0);
  size_t left = 0;
  for (const auto& o : s.ops) left += o.size();
  int64_t t = 0;
  while (left > 0) {
    for (int64_t r = 0; r < P; r++) {
      if (busy[r] > t || next[r] == s.ops[r].size()) continue;
      const Op& o = s.ops[r][next[r]];
      const int64_t i = o.mb * PV + o.stage;
      const bool ready = o.backward ? fdone[i] <= t && (o.stage == PV - 1 || bdone[i + 1] <= t)
                                    : o.stage == 0 || fdone[i - 1] <= t;
      if (!ready) continue;
      busy[r] = t + (o.backward ? kB : kF);
      (o.backward ? bdone : fdone)[i] = busy[r];
      in[r] += o.backward ? -1 : 1;
      s.max_in_flight[r] = std::max(s.max_in_flight[r], in[r]);
      next[r]++;
      left--;
    }
    int64_t soon = kNever;
    for (int64_t r = 0; r < P; r++) {
      if (busy[r] > t) soon = std::min(soon, busy[r]);
    }
    if (soon == kNever && left > 0) return false;  // nobody busy, nobody can start
    if (soon != kNever) t = soon;
  }
  int64_t end = 0;
  for (int64_t r = 0; r < P; r++) end = std::max(end, busy[r]);
  s.bubble = 1.0 - static_cast<double>(p.M * p.V * (kF + kB)) / static_cast<double>(end);
  return true;
}

}  // namespace

Schedule make_schedule(const Plan& p) {
  check(p.V == 1 || p.M % p.P == 0,
        "internal: the interleaved schedule needs the micro-batches in whole groups of P");
  Schedule s;
  for (int64_t r = 0; r < p.P; r++) s.ops.push_back(megatron_order(p, r));
  check(simulate(p, s), "internal: the pipeline schedule deadlocks on the simulated clock");
  return s;
}

// ------------------------------------------------------------------------------------ executor

struct Pipeline::Impl {
  // The sources of the micro-batches this rank holds, from a micro-batch's first forward here to
  // its last backward here (so about as many as are in flight), with the tickets of the sends
  // that read them.
  struct Store {
    SourceStore sources;
    std::vector<int64_t> sends;
  };
  std::vector<std::unique_ptr<Store>> free_stores;
  std::vector<std::unique_ptr<Store>> store_of;                      // (M)
  std::vector<std::vector<std::unique_ptr<Model::StagePass>>> idle;  // (PV) reusable passes
  std::vector<std::unique_ptr<Model::StagePass>> live;               // (M*PV) awaiting backward
  // Gradients handed back: a buffer is reused once its send has completed.
  struct Pack {
    FloatBuf buf;
    int64_t ticket = -1;
  };
  std::vector<Pack> packs;
  FloatBuf scratch;

  Pack& free_pack(dist::Communicator& comm) {
    for (Pack& p : packs) {
      if (p.ticket < 0 || comm.test_send(p.ticket)) return p;
    }
    return packs.emplace_back();
  }
};

Pipeline::Pipeline(Model& model, dist::Communicator& comm, Plan plan, Scheme scheme)
    : model_(model),
      comm_(comm),
      plan_(std::move(plan)),
      scheme_(scheme),
      impl_(std::make_unique<Impl>()) {
  check(comm.size() == plan_.P, "pipeline of " + std::to_string(plan_.P) + " ranks run by " +
                                    std::to_string(comm.size()) + " processes; launch with " +
                                    "mpirun -np " + std::to_string(plan_.P));
  sched_ = make_schedule(plan_);
  impl_->store_of.resize(plan_.M);
  impl_->idle.resize(plan_.stages());
  impl_->live.resize(plan_.M * plan_.stages());
}

Pipeline::~Pipeline() {
  comm_.wait_sends();  // no send may read freed memory
}

void Pipeline::release_memory() {
  comm_.wait_sends();
  Impl& im = *impl_;
  im.free_stores.clear();
  for (auto& v : im.idle) v.clear();
  im.packs.clear();
  im.scratch = FloatBuf();
}

double Pipeline::step(const std::vector<const int32_t*>& inputs,
                      const std::vector<const int32_t*>& targets, int64_t B, int64_t T) {
  const ModelConfig& c = model_.config();
  const int64_t PV = plan_.stages(), n = B * T, d = c.d_model, nd = n * d;
  const int64_t H = c.residual.heads;
  check(static_cast<int64_t>(inputs.size()) == plan_.M &&
            static_cast<int64_t>(targets.size()) == plan_.M,
        "internal: pipeline step needs one batch per micro-batch");
  Impl& im = *impl_;
  const int me = comm_.rank();
  auto recv_into_scratch = [&](int64_t count, int from, int tag) {
    if (static_cast<int64_t>(im.scratch.size()) < count) im.scratch.resize(count);
    comm_.recv(im.scratch.data(), count, from, tag);
    return im.scratch.data();
  };
  double loss = 0.0;
  for (const Op& op : sched_.ops[static_cast<size_t>(me)]) {
    const int64_t k = op.stage, mb = op.mb;
    std::unique_ptr<Impl::Store>& held = im.store_of[static_cast<size_t>(mb)];
    if (!held) {  // the micro-batch's first forward on this rank
      if (im.free_stores.empty()) {
        held = std::make_unique<Impl::Store>();
        // Host memory either way; the model's own backend (the CPU's bf16 one is not the shared
        // fp32 instance a null backend means), so the routers accept the store.
        if (model_.on_cpu()) held->sources.be = &model_.backend();
      } else {
        held = std::move(im.free_stores.back());
        im.free_stores.pop_back();
      }
    }
    SourceStore& st = held->sources;
    std::unique_ptr<Model::StagePass>& slot = im.live[static_cast<size_t>(mb * PV + k)];
    if (!op.backward) {
      if (k > 0) {  // the sources of transition k-1 -> k
        const auto [lo, hi] = transition_sources(plan_, k - 1, scheme_);
        const int from = plan_.rank_of(k - 1), tag = tag_of(plan_, false, k - 1, mb);
        for (int64_t id = lo; id < hi; id++) {
          if (st.has(id)) {
            recv_into_scratch(nd, from, tag);  // the naive scheme re-sends what we hold: drop
          } else {
            comm_.recv(st.ensure(id, n, d, H).v.data(), nd, from, tag);
          }
        }
      }
      auto& idle = im.idle[static_cast<size_t>(k)];
      if (idle.empty()) {
        slot = model_.make_stage_pass(plan_.bounds[k], plan_.bounds[k + 1]);
      } else {
        slot = std::move(idle.back());
        idle.pop_back();
      }
      loss += model_.stage_forward(*slot, st, inputs[static_cast<size_t>(mb)],
                                   targets[static_cast<size_t>(mb)], B, T);
      if (k + 1 < PV) {
        const auto [lo, hi] = transition_sources(plan_, k, scheme_);
        const int to = plan_.rank_of(k + 1), tag = tag_of(plan_, false, k, mb);
        for (int64_t id = lo; id < hi; id++) {
          held->sends.push_back(comm_.isend(st.e[static_cast<size_t>(id)].v.data(), nd, to, tag));
          traffic_.messages++;
        }
        const int64_t bytes = (hi - lo) * nd * static_cast<int64_t>(sizeof(float));
        traffic_.forward_bytes += bytes;
        traffic_.peak_transition_bytes = std::max(traffic_.peak_transition_bytes, bytes);
      }
      continue;
    }
    check(slot != nullptr, "internal: pipeline backward before its forward");
    if (k + 1 < PV) {  // gradients of the sources sent on transition k -> k+1, one message
      const auto [lo, hi] = transition_sources(plan_, k, scheme_);
      const float* x =
          recv_into_scratch((hi - lo) * nd, plan_.rank_of(k + 1), tag_of(plan_, true, k, mb));
      for (int64_t id = lo; id < hi; id++, x += nd) {
        float* g = st.e[static_cast<size_t>(id)].g.data();
#pragma omp parallel for simd schedule(static) if (nd > 65536)
        for (int64_t i = 0; i < nd; i++) g[i] += x[i];
      }
    }
    model_.stage_backward(*slot);
    im.idle[static_cast<size_t>(k)].push_back(std::move(slot));
    if (k > 0) {  // hand back the gradients of what transition k-1 -> k brought, once
      const auto [lo, hi] = transition_sources(plan_, k - 1, scheme_);
      Impl::Pack& pack = im.free_pack(comm_);
      pack.buf.resize(static_cast<size_t>((hi - lo) * nd));
      for (int64_t id = lo; id < hi; id++) {
        DevBuf<float>& g = st.e[static_cast<size_t>(id)].g;
        std::memcpy(pack.buf.data() + (id - lo) * nd, g.data(), sizeof(float) * g.size());
        std::memset(g.data(), 0, sizeof(float) * g.size());  // handed off: never counted twice
      }
      pack.ticket = comm_.isend(pack.buf.data(), (hi - lo) * nd, plan_.rank_of(k - 1),
                                tag_of(plan_, true, k - 1, mb));
      traffic_.messages++;
      const int64_t bytes = (hi - lo) * nd * static_cast<int64_t>(sizeof(float));
      traffic_.backward_bytes += bytes;
      traffic_.peak_transition_bytes = std::max(traffic_.peak_transition_bytes, bytes);
    }
    if (k == me) {  // the micro-batch's last operation on this rank (its first stage here)
      // Its forward sends were received before the backward that just ran could start, so these
      // waits return at once; they make the store safe to reuse.
      for (int64_t t : held->sends) comm_.wait_send(t);
      held->sends.clear();
      st.clear();
      im.free_stores.push_back(std::move(held));
    }
  }
  comm_.wait_sends();
  return loss;
}

}  // namespace attnres::pipe
