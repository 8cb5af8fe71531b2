// The training loop (attnres/train.hpp): deterministic batches from (seed, step, micro), so a run
// resumed from a checkpoint continues exactly where it stopped; data parallel over a
// dist::Communicator (each rank trains on its slice of every batch, gradients are all-reduced).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "attnres/checkpoint.hpp"
#include "attnres/cuda.hpp"
#include "attnres/data.hpp"
#include "attnres/diagnostics.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/model.hpp"
#include "attnres/pipeline.hpp"
#include "attnres/train.hpp"
#include "core/backend.hpp"
#include "train/device_step.hpp"

namespace fs = std::filesystem;

namespace attnres {

double train_flops_per_token(const ModelConfig& c, int64_t seq_len) {
  // 6 FLOPs per weight per token (2 forward, 4 backward) over every matmul weight, including the
  // LM head but not the embedding lookup; plus attention's q k^T and a v: 2 * 2 * T * H * hd per
  // token and layer forward, times 3 with backward (the PaLM convention, full T x T).
  const int64_t d = c.d_model, hd = c.head_dim();
  const int64_t per_layer = (c.n_head + 2 * c.n_kv_head) * hd * d + d * c.n_head * hd +
                            3 * c.ffn_hidden * d;
  const double matmul_params = static_cast<double>(per_layer * c.n_layer + c.vocab_size * d);
  const double attn = 12.0 * static_cast<double>(c.n_layer * seq_len * c.n_head * hd);
  return 6.0 * matmul_params + attn;
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Mean loss over up to max_batches validation batches of consecutive windows. Data parallel: each
// rank evaluates its slice of every batch. Pipeline (every rank holds all the weights): each rank
// evaluates whole batches, every ranks-th one.
double evaluate(Model& model, const TokenSpan& val, int64_t B, int64_t T, int64_t max_batches,
                dist::Communicator& comm, bool whole_batches) {
  const int64_t windows = val.num_windows(T);
  check(windows >= 1, "validation split has " + std::to_string(val.size()) +
                          " tokens, fewer than seq_len + 1; use a larger corpus, a larger "
                          "--val-fraction or a smaller --seq-len");
  const int64_t batches = std::min(max_batches, (windows + B - 1) / B);
  const int64_t ranks = comm.size();
  Batch batch;
  double total = 0.0;
  if (whole_batches) {
    for (int64_t i = comm.rank(); i < batches; i += ranks) {
      val.window_batch(i * B, B, T, batch);
      total += model.forward(batch.inputs.data(), batch.targets.data(), B, T);
    }
    if (ranks > 1) comm.allreduce_sum(&total, 1);
    return total / static_cast<double>(batches);
  }
  const int64_t rows = B / ranks, row0 = comm.rank() * rows;
  for (int64_t i = 0; i < batches; i++) {
    val.window_batch(i * B + row0, rows, T, batch);
    total += model.forward(batch.inputs.data(), batch.targets.data(), rows, T);
  }
  if (ranks > 1) {
    comm.allreduce_sum(&total, 1);  // equal slices: the batch mean is the mean of the rank means
    total /= static_cast<double>(ranks);
  }
  return total / static_cast<double>(batches);
}

std::string mflops_text(double flops) {
  char b[32];
  std::snprintf(b, sizeof b, flops < 1e7 ? "%.2f" : "%.0f", flops / 1e6);
  return b;
}

// The training wall time the run had logged by `step` (metrics.jsonl's elapsed_s on the last
// line of the latest step <= step; 0 if none): where a resumed run's clock continues, so its
// loss-vs-time curve carries on. (Checkpoints do not hold it: their bytes do not depend on
// timing or on the rank count.) Unreadable lines are skipped.
double logged_seconds_at(const fs::path& metrics, int64_t step) {
  std::ifstream f(metrics);
  std::string line;
  int64_t best_step = -1;
  double secs = 0.0;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("elapsed_s") || !j["elapsed_s"].is_number() ||
        !j.contains("step") || !j["step"].is_number_integer()) {
      continue;
    }
    const int64_t s = j["step"].get<int64_t>();
    if (s <= step && s >= best_step) {
      best_step = s;
      secs = j["elapsed_s"].get<double>();
    }
  }
  return std::max(0.0, secs);
}

// Fingerprint of everything that must be identical on every rank: weights, the AdamW step count
// and (unless sharded, ZeRO-1) the AdamW moments.
uint64_t replica_hash(const Model& model, AdamW& opt) {
  auto bytes = [](const float* p, int64_t n) {
    return std::string_view(reinterpret_cast<const char*>(p), static_cast<size_t>(n) * 4);
  };
  const int64_t n = model.layout().total();
  if (!model.on_cpu()) {  // host copies of a device's state
    const std::vector<float> p = model.params_to_host(), m = opt.m().download(),
                             v = opt.v().download();
    const uint64_t h = fnv1a64(bytes(p.data(), n), fnv1a64(std::to_string(opt.steps_taken())));
    return fnv1a64(bytes(v.data(), n), fnv1a64(bytes(m.data(), n), h));
  }
  uint64_t h = fnv1a64(bytes(model.params(), n), fnv1a64(std::to_string(opt.steps_taken())));
  if (opt.sharded()) return h;
  h = fnv1a64(bytes(opt.m().data(), n), h);
  return fnv1a64(bytes(opt.v().data(), n), h);
}

// ZeRO-1: rank r owns the flat parameter range [bounds[r], bounds[r + 1]).
std::vector<int64_t> shard_bounds(int64_t n, int64_t ranks) {
  std::vector<int64_t> b(static_cast<size_t>(ranks + 1));
  for (int64_t r = 0; r <= ranks; r++) b[static_cast<size_t>(r)] = n * r / ranks;
  return b;
}

// Rank 0 prepares the data (trains the tokenizer, writes the token cache); the others wait, then
// prepare_data reuses what rank 0 wrote. An error on rank 0 is raised on every rank.
PreparedData prepare_data_once(const DataOptions& dopt, dist::Communicator& comm) {
  if (comm.size() == 1) return prepare_data(dopt);
  const double timeout = comm.timeout();
  comm.set_timeout(0);  // tokenizer training on a large corpus may take longer than a step
  std::string err;
  if (comm.is_root()) {
    try {
      PreparedData d = prepare_data(dopt);
      comm.broadcast_string("");
      comm.set_timeout(timeout);
      return d;
    } catch (const std::exception& e) {
      err = e.what();
      comm.broadcast_string(err.empty() ? "data preparation failed" : err);
      throw;
    }
  }
  err = comm.broadcast_string("");
  comm.set_timeout(timeout);
  if (!err.empty()) throw Error(err);
  return prepare_data(dopt);
}

std::string format_mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return buf;
}

void fsync_dir(const std::string& dir) {
  FILE* f = std::fopen(dir.c_str(), "r");
  if (f) {
    ::fsync(fileno(f));
    std::fclose(f);
  }
}

class RunDir {
 public:
  RunDir(const TrainConfig& cfg, const PreparedData& data) : cfg_(cfg), data_(data) {}

  std::string ckpt_root() const { return (fs::path(cfg_.out_dir) / "checkpoints").string(); }

  // Writes checkpoints/step_N into a temporary directory, renames it into place, then points
  // `latest` at it: a crash at any moment leaves the previous checkpoint complete and current.
  // On failure (e.g. a full disk) throws Error and leaves `latest` and the checkpoint it names
  // untouched; the partial step_N.tmp directory is removed.
  void save(const Model& model, AdamW& opt, int64_t step) {
    const fs::path root = ckpt_root();
    const std::string name = step_dir_name(step);
    const fs::path dir = root / name, tmp = root / (name + ".tmp");
    std::error_code ec;
    try {
      fs::create_directories(root);
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp);
      const Metadata meta = {{"tokenizer", data_.tokenizer_ref}, {"step", std::to_string(step)}};
      save_model((tmp / "model.safetensors").string(), model, meta);
      save_optimizer((tmp / "optimizer.safetensors").string(), model, opt, meta);
      if (!data_.tokenizer_path.empty()) {
        write_file_atomic((tmp / fs::path(data_.tokenizer_path).filename()).string(),
                          read_file(data_.tokenizer_path));
      }
      fsync_dir(tmp.string());
      fs::remove_all(dir, ec);
      fs::rename(tmp, dir);
      fsync_dir(root.string());
    } catch (const std::exception& e) {  // attnres::Error or std::filesystem::filesystem_error
      fs::remove_all(tmp, ec);
      throw Error("saving the checkpoint of step " + std::to_string(step) + " failed: " +
                  e.what() + ". The previous checkpoint (named in '" +
                  (fs::path(cfg_.out_dir) / "latest").string() +
                  "') is intact; fix the cause and continue with `attnres train --resume --out " +
                  cfg_.out_dir + "`");
    }
    write_file_atomic((fs::path(cfg_.out_dir) / "latest").string(), name + "\n");
    prune(name);
  }

  // Path of the newest complete checkpoint directory; Error if there is none.
  std::string latest() const {
    const fs::path p = fs::path(cfg_.out_dir) / "latest";
    check(fs::exists(p), "nothing to resume in '" + cfg_.out_dir +
                             "': it has no 'latest' checkpoint; start the run without --resume");
    std::string name = read_file(p.string());
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    const fs::path dir = fs::path(ckpt_root()) / name;
    if (name.empty() || !fs::is_directory(dir)) {
      std::string m = "'";  // built piecewise: GCC 12 warns falsely (-Wrestrict) on one long +
      m += p.string();
      m += "' names checkpoint '";
      m += name;
      m += "', which does not exist; resume from another run or start without --resume";
      throw Error(m);
    }
    return dir.string();
  }

 private:
  void prune(const std::string& keep_name) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(ckpt_root())) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step_", 0) == 0 && n.find(".tmp") == std::string::npos) {
        names.push_back(n);
      }
    }
    std::sort(names.begin(), names.end());
    const int64_t excess = static_cast<int64_t>(names.size()) - cfg_.keep_checkpoints;
    for (int64_t i = 0; i < excess; i++) {
      if (names[i] == keep_name) continue;
      std::error_code ec;
      fs::remove_all(fs::path(ckpt_root()) / names[i], ec);
    }
  }

  const TrainConfig& cfg_;
  const PreparedData& data_;
};

}  // namespace

TrainResult train(const TrainConfig& cfg_in, const TrainEvents& ev) {
  dist::SingleCommunicator single;
  return train(cfg_in, ev, single);
}

TrainResult train(const TrainConfig& cfg_in, const TrainEvents& ev, dist::Communicator& comm) {
  const int64_t ranks = comm.size();
  const bool root = comm.is_root();
  auto msg = [&](const std::string& m) {
    if (root && ev.on_message) ev.on_message(m);
  };
  TrainConfig cfg = cfg_in;
  const bool zero1 = cfg_in.zero1 && ranks > 1;
  const fs::path cfg_path = fs::path(cfg.out_dir) / "train_config.json";
  if (cfg.resume) {
    check(fs::exists(cfg_path), "cannot resume: '" + cfg_path.string() +
                                    "' does not exist; start the run without --resume");
    const std::string out = cfg.out_dir;
    try {
      cfg = TrainConfig::from_json(read_file(cfg_path.string()));
    } catch (const Error& e) {
      throw Error("cannot resume from '" + cfg_path.string() + "': " + e.what() +
                  "; restore the file from a backup or start the run again without --resume");
    }
    cfg.out_dir = out;
    cfg.resume = true;
    // Runtime choices, not part of the saved run.
    cfg.zero1 = cfg_in.zero1;
    cfg.pipeline = cfg_in.pipeline;
    cfg.virtual_stages = cfg_in.virtual_stages;
    cfg.pipeline_comm = cfg_in.pipeline_comm;
    cfg.device = cfg_in.device;
    cfg.precision = cfg_in.precision;
  }
  cfg.schedule.total_steps = cfg.steps;
  cfg.validate();
  const bool piped = cfg.pipeline > 1;
  check(!piped || cfg.pipeline == ranks,
        "--pipeline " + std::to_string(cfg.pipeline) + " makes one pipeline of all the ranks, but " +
            std::to_string(ranks) + " rank(s) were launched: use mpirun -np " +
            std::to_string(cfg.pipeline) + " (pipeline and data parallelism together are not "
            "supported yet)");
  check(piped || cfg.batch_size % ranks == 0,
        "--batch-size " + std::to_string(cfg.batch_size) + " is not divisible by the " +
            std::to_string(ranks) + " ranks: every rank takes batch-size / ranks sequences of each "
            "micro-batch; use a multiple of " + std::to_string(ranks) + " (e.g. " +
            std::to_string((cfg.batch_size / ranks + 1) * ranks) + ") or another rank count");
  comm.require_same(fnv1a64(cfg.to_json() + (zero1 ? "+zero1" : "") + "+pipeline" +
                            std::to_string(cfg.pipeline) + "x" +
                            std::to_string(cfg.virtual_stages) + cfg.pipeline_comm + "+device" +
                            cfg.device + "+precision" + cfg.precision),
                    "training options",
                    "start every rank with the same command line");
  fs::create_directories(cfg.out_dir);

  DataOptions dopt;
  dopt.corpus_path = cfg.data_path;
  dopt.tokenizer = cfg.tokenizer;
  dopt.vocab_size = cfg.bpe_vocab;
  dopt.out_dir = cfg.data_dir.empty() ? cfg.out_dir : cfg.data_dir;
  dopt.val_fraction = cfg.val_fraction;
  PreparedData data = prepare_data_once(dopt, comm);
  msg("data: " + std::to_string(data.files.size()) + " file(s), " +
      std::to_string(data.corpus_bytes) + " bytes; tokenizer " + data.tokenizer_ref +
      " (vocab " + std::to_string(data.tokenizer->vocab_size()) + "); " +
      std::to_string(data.train.size()) + " train / " + std::to_string(data.val.size()) +
      " validation tokens" + (data.cache_reused ? " (cached)" : ""));
  if (data.replaced_invalid_utf8 > 0) {
    msg("data: replaced " + std::to_string(data.replaced_invalid_utf8) +
        " invalid UTF-8 sequence(s) with U+FFFD");
  }
  check(data.train.size() >= cfg.seq_len + 1,
        "the training split has " + std::to_string(data.train.size()) +
            " tokens, fewer than seq_len + 1 = " + std::to_string(cfg.seq_len + 1) +
            "; use a larger corpus or a smaller --seq-len");

  comm.require_same(fnv1a64(data.tokenizer->model_data(),
                            fnv1a64(data.tokenizer_ref + ":" + std::to_string(data.train.size()) +
                                    ":" + std::to_string(data.val.size()))),
                    "tokenizer or token counts",
                    "every rank must read the same corpus and run directory (on several hosts, "
                    "put --out, or --data-dir, on a shared file system)");
  if (root && !data.tokenizer_path.empty() && !cfg.data_dir.empty()) {
    // The final model resolves its tokenizer beside itself: keep a copy in the run directory.
    const fs::path copy = fs::path(cfg.out_dir) / fs::path(data.tokenizer_path).filename();
    if (!fs::exists(copy)) write_file_atomic(copy.string(), read_file(data.tokenizer_path));
  }
  cfg.model.vocab_size = data.tokenizer->vocab_size();
  cfg.model.max_seq_len = cfg.seq_len;
  cfg.model.resolve();
  cfg.model.validate();
  // Several ranks on GPUs: each takes the GPU of its index on its host.
  std::string device = cfg.device;
  int gpu = 0;
  if (device == "cuda" && ranks > 1) {
    const int gpus = cuda::device_count();
    gpu = dist::local_rank();
    check(gpus == 0 || gpu < gpus,
          "rank " + std::to_string(comm.rank()) + " is rank " + std::to_string(gpu) +
              " on its host, which has " + std::to_string(gpus) +
              " GPU(s): start at most one rank per GPU on each host");
    device = "cuda:" + std::to_string(gpu);
  }
  Model model(cfg.model, make_backend(device));
  model.backend().set_matmul_precision(parse_precision(cfg.precision));
  model.init_weights(cfg.seed);
  if (!cfg.resume && !cfg.init_from.empty()) {
    std::vector<std::string> changed;
    const int64_t kept = load_initial_weights(model, cfg.init_from, &changed);
    msg("initial weights from " + cfg.init_from +
        (kept > 0 ? " (" + std::to_string(kept) + " tensors of the residual mode not in it: "
                    "initialised as for a new run)"
                  : std::string()));
    for (const std::string& c : changed) {
      msg("note: this run changes a setting of --init-from's model (same tensors, another "
          "function): " + c);
    }
  }
  const std::string gemms = cfg.precision == "bf16" ? "; bf16 GEMMs, fp32 master weights" : "";
  if (cfg.device == "cuda") msg("device: " + device + ", " + cuda::describe_device(gpu) + gemms);
  if (cfg.device == "cuda-host") {
    msg("device: cuda-host (the CUDA kernels emulated on the CPU)" + gemms);
  }
  const int64_t nparams = model.layout().total();
  const std::vector<int64_t> bounds = shard_bounds(nparams, zero1 ? ranks : 1);
  std::vector<int64_t> shard_counts;  // elements per rank's shard
  for (size_t r = 0; r + 1 < bounds.size(); r++) shard_counts.push_back(bounds[r + 1] - bounds[r]);
  const int64_t shard = zero1 ? comm.rank() : 0;
  AdamW opt(model.layout(), cfg.adamw, bounds[static_cast<size_t>(shard)],
            bounds[static_cast<size_t>(shard) + 1], &model.backend());
  // The residual mode's tensors: their own learning-rate multiplier and warm-up, if set.
  std::optional<ScheduleConfig> router_schedule;
  if (cfg.router_lr_mult != 1.0 || cfg.router_warmup >= 0) {
    opt.set_first_router_entry(model.core_entries());
    router_schedule = cfg.schedule;
    if (cfg.router_warmup >= 0) router_schedule->warmup_steps = cfg.router_warmup;
  }
  RunDir run(cfg, data);
  // Gradients are summed where they live: MPI for host memory, NCCL (or host staging) for GPUs.
  std::unique_ptr<dist::DeviceReducer> reducer;
  if (ranks > 1) {
    std::string note;
    reducer = dist::make_device_reducer(comm, model.backend(), &note);
    if (!note.empty()) msg("note: " + note);
    if (!model.on_cpu()) msg("gradients: summed over the ranks by " + reducer->method());
  }

  int64_t start = 0;
  double prior_seconds = 0.0;  // training wall time of the invocations before this one
  if (cfg.resume) {
    const std::string dir = run.latest();
    auto r = SafetensorsReader::open(dir + "/model.safetensors");
    load_weights(model, r);
    if (!opt.sharded()) {
      load_optimizer(dir + "/optimizer.safetensors", model, opt);
    } else {  // keep this rank's shard of the moments
      AdamW full(model.layout(), cfg.adamw);
      load_optimizer(dir + "/optimizer.safetensors", model, full);
      std::copy(full.m().data() + opt.begin(), full.m().data() + opt.end(), opt.m().data());
      std::copy(full.v().data() + opt.begin(), full.v().data() + opt.end(), opt.v().data());
      opt.set_steps_taken(full.steps_taken());
    }
    start = std::stoll(r.metadata().at("step"));
    prior_seconds = logged_seconds_at(fs::path(cfg.out_dir) / "metrics.jsonl", start);
    msg("resumed from " + dir + " at step " + std::to_string(start));
  } else if (root) {
    write_file_atomic(cfg_path.string(), cfg.to_json() + "\n");
  }
  comm.require_same(replica_hash(model, opt),
                    cfg.resume ? "resumed weights and optimizer state" : "initial weights",
                    "every rank must run the same attnres build and read the same run directory "
                    "(on several hosts, --out must be on a shared file system)");

  std::unique_ptr<pipe::Pipeline> pipeline;
  if (piped) {
    pipeline = std::make_unique<pipe::Pipeline>(
        model, comm, pipe::make_plan(model, cfg.pipeline, cfg.virtual_stages, cfg.grad_accum),
        pipe::parse_scheme(cfg.pipeline_comm));
    const pipe::Plan& pl = pipeline->plan();
    const int64_t rows = cfg.batch_size * cfg.seq_len;
    char bub[32];
    std::snprintf(bub, sizeof bub, "%.0f%%", 100.0 * pipeline->schedule().bubble);
    msg("pipeline: " + std::to_string(pl.P) + " ranks x " + std::to_string(pl.V) +
        " virtual stage(s), sublayers " + pl.describe() + "; " + std::to_string(pl.M) +
        " micro-batch(es) per step (--grad-accum), 1F1B schedule (bubble " + bub + "); " +
        cfg.pipeline_comm + " block communication: " +
        format_mib(pipe::planned_bytes_per_step(pl, pipeline->scheme(), rows, cfg.model.d_model)) +
        " per step");
  }
  const double flops_tok = train_flops_per_token(cfg.model, cfg.seq_len);
  const int64_t tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum;
  msg("model: " + std::to_string(model.num_params()) + " parameters, residual " +
      cfg.model.residual.mode + ", " + std::to_string(cfg.model.n_layer) + " layers, d " +
      std::to_string(cfg.model.d_model) + "; " + std::to_string(tokens_per_step) +
      " tokens/step, " + mflops_text(flops_tok) + " MFLOP/token; " +
      (ranks == 1 ? std::string("1 rank")
                  : std::to_string(ranks) + " ranks (" + comm.backend() + "), " +
                        (piped ? std::string("pipeline parallel")
                               : std::to_string(cfg.batch_size / ranks) +
                                     " sequences per rank per micro-batch") +
                        (zero1 ? ", AdamW state sharded (ZeRO-1)" : "")));

  std::ofstream metrics;
  if (root) {
    metrics.open(fs::path(cfg.out_dir) / "metrics.jsonl", std::ios::app);
    check(metrics.good(), "cannot write metrics to '" + cfg.out_dir + "/metrics.jsonl'");
  }
  auto log_json = [&](const nlohmann::json& j) {
    if (!root) return;
    metrics << j.dump() << "\n";
    metrics.flush();
  };

  TrainResult res;
  res.num_params = model.num_params();
  res.flops_per_token = flops_tok;
  Batch batch;
  if (!cfg.resume) res.init_hash = model.shared_weights_hash();
  data.train.sample_batch(cfg.seed, 0, 0, cfg.batch_size, cfg.seq_len, batch);
  res.batch_hash = fnv1a64(std::string_view(reinterpret_cast<const char*>(batch.inputs.data()),
                                            batch.inputs.size() * sizeof(int32_t)));
  const auto t0 = Clock::now();
  auto last_checkpoint_note = [&]() -> std::string {
    const fs::path latest = fs::path(cfg.out_dir) / "latest";
    if (!fs::exists(latest)) return " (no checkpoint was saved before it)";
    return ". The last good checkpoint is named in '" + latest.string() + "'";
  };
  // Replicas must not drift: check before each checkpoint (which only rank 0 writes).
  auto save_checkpoint = [&](int64_t at_step) {
    comm.require_same(replica_hash(model, opt), "weights or optimizer state at step " +
                          std::to_string(at_step),
                      "the ranks' replicas diverged, which is a bug: please report it with the "
                      "command line");
    if (!opt.sharded()) {
      if (root) run.save(model, opt, at_step);
      return;
    }
    // ZeRO-1: rank 0 collects the moment shards into a whole optimizer state and writes it.
    if (!root) {
      comm.send(opt.m().data(), static_cast<int64_t>(opt.m().size()), 0, 1);
      comm.send(opt.v().data(), static_cast<int64_t>(opt.v().size()), 0, 2);
      return;
    }
    AdamW full(model.layout(), cfg.adamw);
    std::copy(opt.m().data(), opt.m().data() + opt.m().size(), full.m().data());
    std::copy(opt.v().data(), opt.v().data() + opt.v().size(), full.v().data());
    for (int r = 1; r < ranks; r++) {
      const int64_t b = bounds[static_cast<size_t>(r)], n = shard_counts[static_cast<size_t>(r)];
      comm.recv(full.m().data() + b, n, r, 1);
      comm.recv(full.v().data() + b, n, r, 2);
    }
    full.set_steps_taken(opt.steps_taken());
    run.save(model, full, at_step);
  };
  double timed_s = 0.0;  // excludes the first step (allocation, warm-up)
  int64_t timed_steps = 0;
  double recent_loss = 0.0;
  int64_t recent_n = 0;
  // Data parallel: this rank's slice of each micro-batch. Pipeline: every rank reads whole ones.
  const int64_t rows = piped ? cfg.batch_size : cfg.batch_size / ranks;
  const int64_t row0 = piped ? 0 : comm.rank() * rows;
  std::vector<Batch> micro_batches(piped ? cfg.grad_accum : 0);
  // On a device the step's scalars stay on the device (device_step.hpp). (A test's loss_hook
  // needs the loss on the host before the update: it keeps the host path.)
  std::unique_ptr<DeviceStep> dstep;
  bool graphs_off_told = false;
  if (!model.on_cpu() && !piped && !zero1 && !ev.loss_hook) {
    // (with several ranks the gradients are summed between the forward+backward and the update:
    // outside the graphs; the mean over ranks and micro-batches is the update's scale)
    dstep = std::make_unique<DeviceStep>(
        model, opt, cfg.grad_clip, 1.0f / static_cast<float>(cfg.grad_accum * ranks),
        cfg.cuda_graphs, /*loss_check=*/ranks == 1);
  } else if (cfg.cuda_graphs) {
    msg(std::string("note: --cuda-graphs is not used ") +
        (model.on_cpu() ? "on the CPU" : "here") + "; the steps run uncaptured");
  }
  std::vector<const int32_t*> mb_inputs, mb_targets;
  int64_t step = start;
  for (; step < cfg.steps; step++) {
    bool stop = ev.stop && ev.stop->load();
    if (ranks > 1) stop = comm.any(stop);  // a stop request on any rank stops all, at one step
    if (stop) {
      res.interrupted = true;
      msg("interrupted: saving a checkpoint at step " + std::to_string(step));
      break;
    }
    const auto ts = Clock::now();
    double loss = 0.0;
    if (dstep) {  // on a device: no wait for the host until the update is queued
      dstep->begin();
      for (int64_t micro = 0; micro < cfg.grad_accum; micro++) {
        data.train.sample_rows(cfg.seed, step, micro, row0, rows, cfg.seq_len, batch);
        dstep->micro(batch.inputs.data(), batch.targets.data(), rows, cfg.seq_len);
      }
    } else if (pipeline) {  // this rank's stages of every micro-batch, in the 1F1B order
      model.zero_grad();
      mb_inputs.clear();
      mb_targets.clear();
      for (int64_t micro = 0; micro < cfg.grad_accum; micro++) {
        Batch& mb = micro_batches[static_cast<size_t>(micro)];
        data.train.sample_rows(cfg.seed, step, micro, row0, rows, cfg.seq_len, mb);
        mb_inputs.push_back(mb.inputs.data());
        mb_targets.push_back(mb.targets.data());
      }
      loss = pipeline->step(mb_inputs, mb_targets, rows, cfg.seq_len);
    } else {
      model.zero_grad();
      for (int64_t micro = 0; micro < cfg.grad_accum; micro++) {
        data.train.sample_rows(cfg.seed, step, micro, row0, rows, cfg.seq_len, batch);
        loss += model.forward(batch.inputs.data(), batch.targets.data(), rows, cfg.seq_len);
        model.backward();
      }
    }
    if (ranks > 1) {
      // Sum of every rank's (sum over micro-batches of) mean-loss gradients, in buckets. A
      // non-finite value on any rank makes the sum non-finite on all, so all skip together below.
      // Pipeline: each rank's gradients are those of its stages' parameters (zero elsewhere);
      // the loss comes from the last stage's rank alone.
      reducer->allreduce_sum(model.grads(), nparams);
      if (!dstep) comm.allreduce_sum(&loss, 1);  // (the device step's loss comes after its update)
    }
    // Equal slices and micro-batches: the global mean is the mean of the ranks' micro means.
    const int64_t parts = cfg.grad_accum * (piped ? 1 : ranks);
    const bool last = step + 1 == cfg.steps;
    const bool eval_now = (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || last;
    std::vector<double> grad_norms;
    const double lr = lr_at(cfg.schedule, cfg.adamw.lr, step);
    const double router_lr = router_schedule
                                 ? cfg.router_lr_mult * lr_at(*router_schedule, cfg.adamw.lr, step)
                                 : -1.0;
    double gnorm = 0.0;
    bool finite = true;
    if (dstep) {
      // (the per-sublayer norms: before the scale by 1/parts, so scaled here)
      if (eval_now && root) {
        grad_norms = model.sublayer_grad_norms();
        for (double& g : grad_norms) g /= static_cast<double>(parts);
      }
      const DeviceStep::Result r = dstep->finish(lr);
      double sums[2] = {r.loss_sum, r.ok ? 1.0 : 0.0};
      if (ranks > 1) {
        comm.allreduce_sum(sums, 2);
        // Every rank's verdict comes from the same summed gradients alone (a non-finite loss
        // makes its rank's gradients, so the sum, non-finite): a split verdict would be a bug,
        // and the replicas would drift apart.
        check(sums[1] == 0.0 || sums[1] == static_cast<double>(ranks),
              "internal: the ranks disagree on skipping step " + std::to_string(step + 1));
      }
      loss = sums[0] / static_cast<double>(parts);
      gnorm = r.norm;
      finite = r.ok;
      if (!dstep->off_reason().empty() && !graphs_off_told) {
        msg("note: CUDA graphs turned off: " + dstep->off_reason() + "; the steps run uncaptured");
        graphs_off_told = true;
      }
    } else {
      loss /= static_cast<double>(parts);
      if (ev.loss_hook) loss = ev.loss_hook(step + 1, loss);
      if (parts > 1) model.backend().scale(model.grads(), 1.0f / static_cast<float>(parts), nparams);
      if (eval_now && root) grad_norms = model.sublayer_grad_norms();  // before clipping
      gnorm = std::sqrt(model.backend().sum_squares(model.grads(), nparams));
      finite = std::isfinite(loss) && std::isfinite(gnorm);
    }
    if (!finite) {
      res.skipped_steps++;
      msg("step " + std::to_string(step + 1) + ": non-finite loss or gradient, update skipped (" +
          std::to_string(res.skipped_steps) + "/" + std::to_string(cfg.max_bad_steps) + ")");
      log_json({{"step", step + 1},
                {"skipped", true},
                {"loss", std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json(nullptr)}});
      if (res.skipped_steps > cfg.max_bad_steps)
        throw DivergedError("training diverged: " + std::to_string(res.skipped_steps) +
                            " steps had a non-finite loss or gradient; lower --lr or raise "
                            "--warmup" + last_checkpoint_note());
      continue;
    }
    if (!dstep) {
      opt.step(model.params(), model.grads(), lr, clip_scale(gnorm, cfg.grad_clip), router_lr);
    }
    if (zero1) comm.allgather(model.params(), shard_counts);  // every rank's updated shard
    const double dt = seconds_since(ts);
    if (step > start) {
      timed_s += dt;
      timed_steps++;
    }
    recent_loss += loss;
    recent_n++;
    res.final_train_loss = loss;

    StepInfo si;
    si.step = step + 1;
    si.total_steps = cfg.steps;
    si.loss = loss;
    si.lr = lr;
    si.grad_norm = gnorm;
    const double per_step = timed_steps > 0 ? timed_s / static_cast<double>(timed_steps) : dt;
    si.tokens_per_s = static_cast<double>(tokens_per_step) / per_step;
    si.elapsed_s = prior_seconds + seconds_since(t0);
    si.eta_s = per_step * static_cast<double>(cfg.steps - step - 1);
    if (root && ev.on_step) ev.on_step(si);
    if ((step + 1) % cfg.log_every == 0 || last) {
      log_json({{"step", step + 1}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm},
                {"tokens_per_s", si.tokens_per_s}, {"elapsed_s", si.elapsed_s},
                {"tokens", (step + 1) * tokens_per_step}});
    }
    if (eval_now) {
      if (pipeline) pipeline->release_memory();  // evaluation runs the whole model on each rank
      EvalInfo ei;
      ei.step = step + 1;
      ei.val_loss =
          evaluate(model, data.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, comm, piped);
      ei.train_loss = recent_loss / static_cast<double>(std::max<int64_t>(1, recent_n));
      recent_loss = 0.0;
      recent_n = 0;
      if (!std::isfinite(ei.val_loss)) {
        throw DivergedError("training diverged: the validation loss at step " +
                            std::to_string(step + 1) + " is not finite (training loss " +
                            std::to_string(loss) + "); lower --lr or raise --warmup" +
                            last_checkpoint_note());
      }
      res.final_val_loss = ei.val_loss;
      log_json({{"step", step + 1}, {"val_loss", ei.val_loss}, {"train_loss", ei.train_loss},
                {"tokens", (step + 1) * tokens_per_step},
                {"elapsed_s", prior_seconds + seconds_since(t0)}});
      if (root) {
        // Magnitudes and depth weights on the first validation batch (SPEC 6 analyses).
        data.val.window_batch(0, cfg.batch_size, cfg.seq_len, batch);
        Diagnostics dg =
            measure_diagnostics(model, batch.inputs.data(), cfg.batch_size, cfg.seq_len);
        dg.grad_norm = grad_norms;
        auto dj = nlohmann::json::parse(diagnostics_to_json(dg));
        dj["step"] = step + 1;
        dj["kind"] = "diagnostics";
        log_json(dj);
        if (ev.on_eval) ev.on_eval(ei);
      }
      if (pipeline) model.release_activations();  // training runs stage passes
    }
    if (cfg.save_every > 0 && (step + 1) % cfg.save_every == 0 && !last) {
      save_checkpoint(step + 1);
    }
  }
  res.steps_done = step;
  if (dstep) {
    res.graph_captures = dstep->captures();
    res.graph_replays = dstep->replays();
    res.graphs_off_reason = dstep->off_reason();
    if (cfg.cuda_graphs && res.graph_captures > 0) {
      msg("CUDA graphs: " + std::to_string(res.graph_captures) + " captured, " +
          std::to_string(res.graph_replays) + " replays (forward+backward per micro-batch, "
          "the update per step)");
    }
  }
  // A resumed run stopped before its first step has nothing new: re-saving step_N would replace
  // the very checkpoint `latest` names, opening a window in which a kill leaves none. (The
  // condition is the same on every rank.)
  if (!(cfg.resume && step == start)) save_checkpoint(step);
  // A run resumed after its last step ran no evaluation here: measure its final weights once
  // (not logged: metrics.jsonl already has that step's evaluation).
  if (!res.interrupted && step == start && step == cfg.steps) {
    if (pipeline) pipeline->release_memory();
    res.final_val_loss =
        evaluate(model, data.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, comm, piped);
  }
  res.seconds = seconds_since(t0);
  if (timed_steps > 0) {
    res.tokens_per_s = static_cast<double>(tokens_per_step * timed_steps) / timed_s;
    res.model_gflops = *res.tokens_per_s * flops_tok / 1e9;
  }
  if (pipeline) {
    const pipe::Traffic& t = pipeline->traffic();
    double sent = static_cast<double>(t.forward_bytes + t.backward_bytes);
    comm.allreduce_sum(&sent, 1);
    const int64_t steps_run = std::max<int64_t>(1, step - start);
    res.pipeline_bytes_per_step = static_cast<int64_t>(sent) / steps_run;
    const pipe::Scheme other = pipeline->scheme() == pipe::Scheme::cached ? pipe::Scheme::naive
                                                                          : pipe::Scheme::cached;
    res.pipeline_other_scheme_bytes_per_step = pipe::planned_bytes_per_step(
        pipeline->plan(), other, rows * cfg.seq_len, cfg.model.d_model);
    res.pipeline_bubble = pipeline->schedule().bubble;
    if (step > start) {
      msg("pipeline: sent " + format_mib(res.pipeline_bytes_per_step) + " per step between "
          "stages (" + cfg.pipeline_comm + "); the " + pipe::scheme_name(other) +
          " scheme would send " + format_mib(res.pipeline_other_scheme_bytes_per_step));
    }
  }
  if (!res.interrupted) {
    res.model_path = (fs::path(cfg.out_dir) / "model.safetensors").string();
    if (root) {
      save_model(res.model_path, model,
                 {{"tokenizer", data.tokenizer_ref}, {"step", std::to_string(step)}});
    }
  }
  comm.barrier();  // on return, rank 0's files are complete on every rank
  return res;
}

}  // namespace attnres
