// The training loop (attnres/train.hpp) as a driver over named stages: settle the configuration
// (a resumed run's own), prepare the data, build the model and optimizer, restore a checkpoint or
// start, set up the pipeline, then the step loop (one StepRunner for the host, the pipeline or a
// device; evaluation, metrics and checkpoints between steps), then finish. Batches are
// deterministic in (seed, step, micro), so a run resumed from a checkpoint continues exactly where
// it stopped; data parallel over a dist::Communicator (each rank trains on its slice of every
// batch, gradients are all-reduced).
#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>
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
#include "backend/backend.hpp"
#include "core/address_space.hpp"
#include "core/blas.hpp"
#include "core/json_field.hpp"
#include "core/number_text.hpp"
#include "train/evaluate.hpp"
#include "train/run_dir.hpp"
#include "train/step_runner.hpp"

namespace fs = std::filesystem;

namespace attnres {

double train_flops_per_token(const ModelConfig& c, int64_t seq_len) {
  // 6 FLOPs per weight per token (2 forward, 4 backward) over every matmul weight, including the
  // LM head but not the embedding lookup; plus attention's q k^T and a v: 2 * 2 * T * H * hd per
  // token and layer forward, times 3 with backward (the PaLM convention, full T x T).
  const int64_t d = c.d_model, hd = c.head_dim();
  const int64_t per_layer =
      (c.n_head + 2 * c.n_kv_head) * hd * d + d * c.n_head * hd + 3 * c.ffn_hidden * d;
  const double matmul_params = static_cast<double>(per_layer * c.n_layer + c.vocab_size * d);
  const double attn = 12.0 * static_cast<double>(c.n_layer * seq_len * c.n_head * hd);
  return 6.0 * matmul_params + attn;
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string mflops_text(double flops) {
  char b[32];
  std::snprintf(b, sizeof b, flops < 1e7 ? "%.2f" : "%.0f", flops / 1e6);
  return b;
}

std::string format_mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

// FNV-1a 64 of the whole file at `path` and of its first `mark` bytes (when it holds that many),
// in one pass.
struct FileHashes {
  uint64_t whole = kFnv1a64Offset;
  int64_t bytes = 0;
  std::optional<uint64_t> at_mark;
};
FileHashes hash_file(const std::string& path, int64_t mark) {
  FileHashes h;
  if (mark == 0) h.at_mark = h.whole;
  for_each_piece(path, [&](const char* p, size_t n) {
    if (!h.at_mark && mark > 0 && h.bytes + static_cast<int64_t>(n) >= mark) {
      const auto first = static_cast<size_t>(mark - h.bytes);
      h.whole = fnv1a64(std::string_view(p, first), h.whole);
      h.bytes = mark;
      h.at_mark = h.whole;
      p += first;
      n -= first;
    }
    h.whole = fnv1a64(std::string_view(p, n), h.whole);
    h.bytes += static_cast<int64_t>(n);
  });
  return h;
}

// The training wall time the run had logged by `step` (metrics.jsonl's elapsed_s on the last
// line of the latest step <= step; 0 if none): where a resumed run's clock continues, so its
// loss-vs-time curve carries on. (Checkpoints do not hold it: their bytes do not depend on
// timing or on the rank count.) Unreadable lines are skipped.
double logged_seconds_at(const fs::path& metrics, int64_t step) {
  if (!fs::exists(metrics)) return 0.0;
  int64_t best_step = -1;
  double secs = 0.0;
  // Streamed line by line (a huge metrics.jsonl once cost twice its size in memory).
  for_each_line(metrics.string(), kMaxMetricsLine, [&](std::string_view line, int64_t, bool cut) {
    if (cut) return;
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("elapsed_s") || !j["elapsed_s"].is_number() ||
        !j.contains("step") || !j["step"].is_number_integer()) {
      return;
    }
    const int64_t s = j["step"].get<int64_t>();
    if (s <= step && s >= best_step) {
      best_step = s;
      secs = j["elapsed_s"].get<double>();
    }
  });
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
      err = cause_of(e);
      comm.broadcast_string(err.empty() ? "data preparation failed" : err);
      throw;
    }
  }
  err = comm.broadcast_string("");
  comm.set_timeout(timeout);
  if (!err.empty()) throw Error(err);
  return prepare_data(dopt);
}

// Files put back as they were unless disarmed: a new run with --overwrite prepares its tokenizer
// in the old run's directory before it may delete that run (stage 5); if it fails first, the old
// run's tokenizer.model (which its model.safetensors reads) must be the old one again.
class RestoreOnFailure {
 public:
  void save(const std::string& path) {
    std::error_code ec;
    std::optional<std::string> old;
    if (fs::is_regular_file(path, ec)) old = read_file(path);
    saved_.emplace_back(path, std::move(old));
  }
  void disarm() { saved_.clear(); }
  ~RestoreOnFailure() {
    for (const auto& [path, old] : saved_) {
      try {
        if (old) {
          write_file_atomic(path, *old);
        } else {
          std::error_code ec;
          fs::remove(path, ec);
        }
      } catch (const std::exception&) {  // (best effort while another error unwinds)
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// A directory the trainer made, removed with what it holds unless emptied by clear().
class StagingDir {
 public:
  StagingDir& operator=(const std::string& p) {
    path_ = p;
    return *this;
  }
  ~StagingDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  bool empty() const { return path_.empty(); }
  void clear() { path_.clear(); }
  const std::string& str() const { return path_; }

 private:
  std::string path_;
};

class Trainer {
 public:
  Trainer(const TrainConfig& cfg_in, const TrainEvents& ev, dist::Communicator& comm)
      : in_(cfg_in),
        ev_(ev),
        comm_(comm),
        ranks_(comm.size()),
        root_(comm.is_root()),
        zero1_(cfg_in.zero1 && ranks_ > 1) {}

  TrainResult run() {
    settle_config();
    prepare_data_stage();
    build_model();
    build_optimizer();
    setup_pipeline();  // (before stage 5: a refused pipeline or a batch that does not fit
    rehearse();        //  must not cost an --overwrite's old run; sixteenth hostile pass)
    if (root_) {
      run_dir_->check_room_to_save(model_->layout().total(), model_->layout().entries().size(),
                                   cfg_.steps, cfg_.save_every, log_bytes_estimate(),
                                   cfg_.overwrite && !cfg_.resume);
    }
    stop_before_claim();
    restore_or_start();
    describe_run();
    step_loop();
    return finish();
  }

 private:
  void msg(const std::string& m) const {
    if (root_ && ev_.on_message) ev_.on_message(m);
  }
  void log_json(const nlohmann::json& j) {
    if (!root_) return;
    try {
      const std::string line = j.dump() + "\n";
      metrics_.append(line);
      log_hash_ = fnv1a64(line, log_hash_);
      log_bytes_ += static_cast<int64_t>(line.size());
    } catch (const Error& e) {
      const bool saved = fs::exists(fs::path(cfg_.out_dir) / "latest");
      throw Error(std::string(e.what()) + ". Training stopped: its log would lose lines. " +
                  (saved ? "The checkpoints already saved are intact; continue with: attnres "
                           "train --resume --out " +
                               shell_word(cfg_.out_dir)
                         : std::string("No checkpoint had been saved yet; free space and start "
                                       "the run again")));
    }
  }

  // Stage 1: the run's configuration (on --resume, the saved one with this invocation's runtime
  // choices), checked, and the same on every rank.
  void settle_config() {
    check(!(in_.resume && in_.overwrite),
          "invalid training setting: --resume continues the run in --out and --overwrite "
          "replaces it; give one of them");
    check(!(in_.resume && !in_.init_from.empty()),
          "invalid training setting: --init-from starts a new run from a checkpoint's weights "
          "and --resume continues the run in --out; give one of them");
    cfg_ = in_;
    cfg_path_ = fs::path(cfg_.out_dir) / "train_config.json";
    if (!cfg_.resume) cfg_.data_path = absolute_path(cfg_.data_path);
    if (cfg_.resume) {
      check(fs::exists(cfg_path_), "cannot resume: '" + cfg_path_.string() +
                                       "' does not exist; start the run without --resume");
      try {
        cfg_text_ =
            read_small_file(cfg_path_.string(), kMaxTrainConfigBytes, "a run's train_config.json");
        cfg_ = TrainConfig::from_json(cfg_text_);
      } catch (const Error& e) {
        throw Error("cannot resume from '" + cfg_path_.string() + "': " + e.what() +
                    "; restore the file from a backup or start the run again without --resume");
      }
      cfg_.out_dir = in_.out_dir;
      // Where a comparison keeps its shared data: the invocation's (a path recorded relative to
      // the first invocation's working directory, or before the comparison moved, would put a
      // tokenizer and token cache wherever it now points; twelfth hostile pass).
      if (!in_.data_dir.empty()) cfg_.data_dir = in_.data_dir;
      cfg_.resume = true;
      // Runtime choices, not part of the saved run (the saved layout: note_layout_change).
      saved_layout_ = layout_of(cfg_, cfg_.ranks);
      cfg_.zero1 = in_.zero1;
      cfg_.grad_bucket_elems = in_.grad_bucket_elems;
      cfg_.pipeline = in_.pipeline;
      cfg_.virtual_stages = in_.virtual_stages;
      cfg_.pipeline_comm = in_.pipeline_comm;
      cfg_.threads = omp_get_max_threads();
      if (in_.sample_tokens >= 0) {  // (given now: for this call; the record keeps the run's)
        cfg_.sample_tokens = in_.sample_tokens;
        cfg_.prompt = in_.prompt;
      }
      if (cfg_.device != in_.device || cfg_.precision != in_.precision ||
          cfg_.cuda_graphs != in_.cuda_graphs) {
        auto how = [](const TrainConfig& c) {
          return std::string("--device ") + to_string(c.device) + " --precision " +
                 to_string(c.precision) + (c.cuda_graphs ? " --cuda-graphs" : "");
        };
        msg("note: the run trained with " + how(cfg_) + " and continues with " + how(in_) +
            ": its results will differ from an uninterrupted run's");
        record_pending_ = true;
      }
      cfg_.device = in_.device;
      cfg_.precision = in_.precision;
      cfg_.cuda_graphs = in_.cuda_graphs;
      note_layout_change();
    }
    cfg_.ranks = ranks_;
    cfg_.threads = omp_get_max_threads();
    cfg_.schedule.total_steps = cfg_.steps;
    cfg_.validate();
    comm_.set_bucket_elems(cfg_.grad_bucket_elems);  // (compared across the ranks below)
    piped_ = cfg_.pipeline > 1;
    const std::string r = std::to_string(ranks_), b = std::to_string(cfg_.batch_size);
    check(!piped_ || ranks_ % cfg_.pipeline == 0,
          "--pipeline " + std::to_string(cfg_.pipeline) + " makes pipelines of " +
              std::to_string(cfg_.pipeline) + " ranks, but " + r +
              " rank(s) were launched, not a multiple of it: use mpirun -np " +
              std::to_string(cfg_.pipeline) +
              " (one pipeline) or a multiple (data-parallel "
              "pipelines)");
    replicas_ = piped_ ? ranks_ / cfg_.pipeline : ranks_;
    const std::string d = std::to_string(replicas_);
    check(cfg_.batch_size % replicas_ == 0,
          "--batch-size " + b + " is not divisible by the " + d +
              (piped_ ? " data-parallel pipelines: each takes batch-size / " + d
                      : " ranks: every rank takes batch-size / ranks") +
              " sequences of each micro-batch; use a multiple of " + d + " (e.g. " +
              std::to_string((cfg_.batch_size / replicas_ + 1) * replicas_) +
              ") or another rank count");
    comm_.require_same(fnv1a64(rank_options_text()), "training options",
                       "start every rank with the same command line");
    if (!cfg_.resume) check_out_not_in_checkpoints(cfg_.out_dir);  // (nineteenth pass)
    fs::create_directories(cfg_.out_dir);
    if (root_) {
      lock_ = std::make_unique<RunLock>(cfg_.out_dir);
      remove_abandoned_staging(cfg_.out_dir);
      if (!cfg_.resume) {
        claim_out_dir(cfg_.out_dir, cfg_.overwrite, /*check_only=*/true);  // (deleted in stage 5)
        check_init_from_survives_overwrite();
      }
    }
  }

  // The options every rank must share, as text (its hash is compared across the ranks at start):
  // the configuration and the options it does not record.
  std::string rank_options_text() const {
    std::string s = cfg_.to_json();
    s += zero1_ ? "+zero1" : "";
    s += cfg_.grad_overlap ? "+overlap" : "";
    s += cfg_.overwrite ? "+overwrite" : "";
    s += cfg_.resume ? "+resume" : "";
    s += cfg_.cuda_graphs ? "+graphs" : "";
    s += "+bucket" + std::to_string(cfg_.grad_bucket_elems);
    s += "+pipeline" + std::to_string(cfg_.pipeline) + "x" + std::to_string(cfg_.virtual_stages) +
         cfg_.pipeline_comm;
    s += "+device" + std::string(to_string(cfg_.device));
    s += "+precision" + std::string(to_string(cfg_.precision));
    return s;
  }

  // --overwrite deletes the old run's model.safetensors and checkpoints/ in stage 5, after
  // --init-from's weights were read: a start from one of them would lose it for good.
  void check_init_from_survives_overwrite() const {
    if (!cfg_.overwrite || cfg_.init_from.empty()) return;
    std::error_code ec;
    const fs::path from = fs::weakly_canonical(cfg_.init_from, ec);
    const fs::path out = fs::weakly_canonical(cfg_.out_dir, ec);
    const fs::path rel = from.lexically_relative(out);
    const std::string head = rel.empty() ? "" : rel.begin()->string();
    check(head != "model.safetensors" && head != "checkpoints",
          "--init-from '" + cfg_.init_from + "' is a checkpoint of the run in --out '" +
              cfg_.out_dir +
              "', which --overwrite deletes; copy it elsewhere first, or start the new run in "
              "another --out");
  }

  // Stage 5, --overwrite: the staged tokenizer and token cache take the old run's place.
  void move_staged_data() {
    if (staging_.empty()) return;
    for (const char* f : {"tokenizer.model", "tokenizer.model.trainkey", "tokens.bin"}) {
      const fs::path from = fs::path(staging_.str()) / f, to = fs::path(cfg_.out_dir) / f;
      if (::rename(from.c_str(), to.c_str()) != 0 && errno != ENOENT) {
        const int err = errno;
        throw Error("cannot move '" + from.string() + "' to '" + to.string() +
                    "': " + errno_text(err));
      }
    }
    std::error_code ec;
    fs::remove_all(staging_.str(), ec);  // (a directory this run made)
    staging_.clear();
  }

  // Stage 5, --overwrite, every rank: the tokenizer is read from --out from now on.
  void leave_staging() {
    if (staged_in_.empty()) return;
    staged_in_.clear();
    if (!data_.tokenizer_path.empty()) {
      data_.tokenizer_path =
          (fs::path(cfg_.out_dir) / fs::path(data_.tokenizer_path).filename()).string();
    }
  }

  // Stage 2: the tokenizer and token splits (prepared once, by rank 0), the same on every rank.
  void prepare_data_stage() {
    DataOptions dopt;
    dopt.corpus_path = cfg_.data_path;
    dopt.tokenizer = cfg_.tokenizer;
    dopt.vocab_size = cfg_.bpe_vocab;
    dopt.out_dir = cfg_.data_dir.empty() ? cfg_.out_dir : cfg_.data_dir;
    // --overwrite: the new run's tokenizer and token cache are made in a staging directory and
    // moved in at stage 5, once the old run is deleted. Made in --out itself, they would replace
    // the old run's tokenizer.model, and a kill -9 before stage 5 would leave the old run reading
    // its text through the new run's tokenizer. (Several ranks too: rank 0 makes it, the others
    // read from it; mpirun's kill of a job stopped while preparing left the old run with the new
    // tokenizer; seventeenth hostile pass.)
    if (!cfg_.resume && cfg_.overwrite && cfg_.data_dir.empty()) {
      std::string where;
      if (root_) {
        staging_ = make_temp_dir((fs::path(cfg_.out_dir) / ".overwrite.tmp.").string(),
                                 "in --out '" + cfg_.out_dir + "'");
        where = staging_.str();
      }
      staged_in_ = ranks_ > 1 ? comm_.broadcast_string(where) : where;
      dopt.out_dir = staged_in_;
    }
    // A given tokenizer is copied in when the run starts; a resume reads the run's own copy (the
    // original may have moved; the fingerprint check below catches a replaced copy).
    if (!cfg_.tokenizer_model.empty()) {
      dopt.tokenizer_model =
          cfg_.resume ? join_path(dopt.out_dir, "tokenizer.model") : cfg_.tokenizer_model;
    }
    dopt.val_fraction = cfg_.val_fraction;
    if (cfg_.resume) {
      dopt.expect_fingerprint = cfg_.corpus_fingerprint;
      dopt.expect_tokenizer_fingerprint = cfg_.tokenizer_fingerprint;
      std::error_code ec;  // (it said "check the data path", which a resume cannot change)
      check(fs::exists(cfg_.data_path, ec),
            "cannot resume: the corpus the run trained on, '" + cfg_.data_path +
                "', is gone (moved or deleted); a run continues on the very text it started "
                "with: put it back at that path");
    }
    // Not staged (a --data-dir): the old tokenizer files are put back if the run fails first.
    if (root_ && !cfg_.resume && cfg_.overwrite && staged_in_.empty()) {
      for (const char* f : {"tokenizer.model", "tokenizer.model.trainkey"}) {
        restore_.save(join_path(dopt.out_dir, f));
      }
    }
    data_ = prepare_data_once(dopt, comm_);
    const PreparedData& d = data_;
    if (!cfg_.resume) {
      cfg_.corpus_fingerprint = d.fingerprint;
      cfg_.tokenizer_fingerprint = d.tokenizer_fingerprint;
    }
    msg("data: " + std::to_string(d.files.size()) + " file(s), " + std::to_string(d.corpus_bytes) +
        " bytes; tokenizer " + d.tokenizer_ref + " (vocab " +
        std::to_string(d.tokenizer->vocab_size()) + "); " + std::to_string(d.train.size()) +
        " train / " + std::to_string(d.val.size()) + " validation tokens" +
        (d.cache_reused ? " (cached)" : ""));
    if (!d.skipped.empty()) {  // (what a directory walk left out, and why)
      std::string some;
      for (size_t i = 0; i < std::min<size_t>(3, d.skipped.size()); i++) {
        some += (i ? "; " : "") + d.skipped[i];
      }
      const size_t more = d.skipped.size() - std::min<size_t>(3, d.skipped.size());
      msg("data: skipped " + std::to_string(d.skipped.size()) + " entr" +
          (d.skipped.size() == 1 ? "y" : "ies") + ": " + some +
          (more ? "; and " + std::to_string(more) + " more" : ""));
    }
    if (d.replaced_invalid_utf8 > 0) {
      msg("data: replaced " + std::to_string(d.replaced_invalid_utf8) +
          " invalid UTF-8 sequence(s) with U+FFFD");
    }
    check(d.train.size() >= cfg_.seq_len + 1,
          "the training split has " + std::to_string(d.train.size()) +
              " tokens, fewer than seq_len + 1 = " + std::to_string(cfg_.seq_len + 1) +
              "; use a larger corpus or a smaller --seq-len");
    // (checked now: found at the final evaluation, it lost the whole run)
    check(d.val.size() >= cfg_.seq_len + 1,
          "the validation split has " + std::to_string(d.val.size()) +
              " tokens, fewer than seq_len + 1 = " + std::to_string(cfg_.seq_len + 1) +
              ", so no evaluation could run; raise --val-fraction, use a larger corpus or a "
              "smaller --seq-len");
    comm_.require_same(fnv1a64(d.tokenizer->model_data(),
                               fnv1a64(d.tokenizer_ref + ":" + std::to_string(d.train.size()) +
                                       ":" + std::to_string(d.val.size()) + ":" + d.fingerprint)),
                       "corpus text, tokenizer or token counts",
                       "every rank must read the same corpus and run directory (on several "
                       "hosts, put --out, or --data-dir, on a shared file system)");
    if (root_ && !d.tokenizer_path.empty() && !cfg_.data_dir.empty()) {
      // The final model resolves its tokenizer beside itself: keep a copy in the run directory.
      const fs::path copy = fs::path(cfg_.out_dir) / fs::path(d.tokenizer_path).filename();
      if (!fs::exists(copy)) write_file_atomic(copy.string(), read_file(d.tokenizer_path));
    }
    cfg_.model.vocab_size = d.tokenizer->vocab_size();
    cfg_.model.max_seq_len = cfg_.seq_len;
    cfg_.model.resolve();
    cfg_.model.validate();
    if (!cfg_.resume) cfg_text_ = cfg_.to_json() + "\n";  // (final now: written in stage 5)
  }

  // Stage 3: the model on its device, initialised from the seed or --init-from.
  void build_model() {
    // Several ranks on GPUs: each takes the GPU of its index on its host.
    int gpu = 0;
    if (cfg_.device == Device::cuda && ranks_ > 1) {
      const int gpus = cuda::device_count();
      gpu = dist::local_rank();
      check(gpus == 0 || gpu < gpus, "rank " + std::to_string(comm_.rank()) + " is rank " +
                                         std::to_string(gpu) + " on its host, which has " +
                                         std::to_string(gpus) +
                                         " GPU(s): start at most one rank per GPU on each host");
    }
    model_ = std::make_unique<Model>(cfg_.model, make_backend(cfg_.device, cfg_.precision, gpu));
    model_->init_weights(cfg_.seed);
    if (!cfg_.resume && !cfg_.init_from.empty()) {
      std::vector<std::string> changed;
      const int64_t kept = load_initial_weights(*model_, cfg_.init_from, &changed);
      const SafetensorsReader from = SafetensorsReader::open(cfg_.init_from);
      const Metadata from_meta(from.metadata().begin(), from.metadata().end());
      ancestry_ = ancestry_from(from_meta);
      check_val_split_held_out(from_meta);
      msg("initial weights from " + cfg_.init_from +
          (kept > 0 ? " (" + std::to_string(kept) +
                          " tensors of the residual mode not in it: initialised as for a new run)"
                    : std::string()));
      for (const std::string& c : changed) {
        msg("note: this run changes a setting of --init-from's model (same tensors, another "
            "function): " +
            c);
      }
    }
    const std::string gemms =
        cfg_.precision == MatmulPrecision::bf16 ? "; bf16 GEMMs, fp32 master weights" : "";
    if (cfg_.device == Device::cuda) {
      msg("device: cuda:" + std::to_string(gpu) + ", " + cuda::describe_device(gpu) + gemms);
    }
    if (cfg_.device == Device::cuda_host) {
      msg("device: cuda-host (the CUDA kernels emulated on the CPU)" + gemms);
    }
    if (cfg_.device == Device::cpu && !gemms.empty()) {
      msg(std::string("device: cpu, bf16 products of the linear layers (") +
          (cpu_has_bf16() ? "AVX512-BF16" : "widened to fp32: this CPU has no AVX512-BF16") +
          "), fp32 master weights");
    }
  }

  // Stage 4: AdamW (this rank's shard of its state under ZeRO-1), the residual mode's own rate,
  // the run directory, and the gradient reducer of several ranks.
  void build_optimizer() {
    Model& model = *model_;
    bounds_ = shard_bounds(model.layout().total(), zero1_ ? ranks_ : 1);
    for (size_t r = 0; r + 1 < bounds_.size(); r++) {
      shard_counts_.push_back(bounds_[r + 1] - bounds_[r]);
    }
    const size_t shard = zero1_ ? static_cast<size_t>(comm_.rank()) : 0;
    opt_ = std::make_unique<AdamW>(model.layout(), cfg_.adamw, bounds_[shard], bounds_[shard + 1],
                                   &model.backend());
    if (cfg_.router_lr_mult != 1.0 || cfg_.router_warmup >= 0) {
      opt_->set_first_router_entry(model.core_entries());
      router_schedule_ = cfg_.schedule;
      if (cfg_.router_warmup >= 0) router_schedule_->warmup_steps = cfg_.router_warmup;
    }
    // (a staged tokenizer is in --out by the first save: stage 5 moves it there)
    const std::string tok_path =
        staged_in_.empty() || data_.tokenizer_path.empty()
            ? data_.tokenizer_path
            : (fs::path(cfg_.out_dir) / fs::path(data_.tokenizer_path).filename()).string();
    run_dir_.emplace(cfg_.out_dir, cfg_.keep_checkpoints, data_.tokenizer_ref, tok_path,
                     tok_path.empty() ? "" : data_.tokenizer->model_data(),
                     train_config_fingerprint(cfg_text_), data_.tokenizer_fingerprint,
                     runtime_text());
    // Gradients are summed where they live: MPI for host memory, NCCL (or host staging) for GPUs.
    if (ranks_ > 1) {
      std::string note;
      reducer_ = dist::make_device_reducer(comm_, model.backend(), &note);
      if (!note.empty()) msg("note: " + note);
      if (!model.on_cpu()) msg("gradients: summed over the ranks by " + reducer_->method());
    }
  }

  // Stage 5: resume from the latest checkpoint, or save the configuration of a new run; then
  // check that every rank holds the same replica.
  void restore_or_start() {
    if (cfg_.resume) {
      const std::string dir = run_dir_->latest();
      auto r = SafetensorsReader::open(dir + "/model.safetensors");
      resume_dir_ = dir;
      load_weights(*model_, r);
      if (const auto it = r.metadata().find(kAncestryKey); it != r.metadata().end()) {
        ancestry_ = it->second;
      }
      Metadata om;
      if (!opt_->sharded()) {
        om = load_optimizer(dir + "/optimizer.safetensors", *model_, *opt_);
      } else {  // keep this rank's shard of the moments
        AdamW full(model_->layout(), cfg_.adamw);
        om = load_optimizer(dir + "/optimizer.safetensors", *model_, full);
        std::copy(full.m().data() + opt_->begin(), full.m().data() + opt_->end(), opt_->m().data());
        std::copy(full.v().data() + opt_->begin(), full.v().data() + opt_->end(), opt_->v().data());
        opt_->set_steps_taken(full.steps_taken());
      }
      start_ = checkpoint_step(r.metadata(), cfg_.steps, dir + "/model.safetensors");
      restore_recent_loss(r.metadata());
      const auto saved_with = r.metadata().find(kConfigHashKey);  // (absent: an older build's)
      check(saved_with == r.metadata().end() ||
                train_config_fingerprint_matches(saved_with->second, cfg_text_),
            "'" + cfg_path_.string() + "' is not the configuration checkpoint '" + dir +
                "' was trained with: it was edited. --resume continues a run as it started; "
                "restore the file, or start a new run from these weights with --init-from " +
                dir + "/model.safetensors and the settings you want");
      std::string digits = fs::path(dir).filename().string().substr(5);  // step_<digits>
      digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));
      check(digits == std::to_string(start_),
            "checkpoint '" + dir + "' says it was saved at step " + std::to_string(start_) +
                ", not the step its directory is named for; its files were moved or edited "
                "(restore the directory or resume from another checkpoint)");
      // The optimizer state must be the one saved with these weights (another step's or another
      // run's was taken silently, and the resumed run diverged from the uninterrupted one).
      // (kRuntimeKey: the optimizer state of a twin run, the same settings in another precision
      // or on another device, is another trajectory's; fifteenth hostile pass)
      for (const char* key : {"step", kConfigHashKey, kRuntimeKey}) {
        auto value = [key](const Metadata& m) {
          auto it = m.find(key);
          return it == m.end() ? std::string("(none)") : it->second;
        };
        const std::string mv = value(r.metadata()), ov = value(om);
        check(mv == ov, "'" + dir + "/optimizer.safetensors' was not saved with '" + dir +
                            "/model.safetensors' (its " + key + " is " + ov + ", the model's " +
                            mv +
                            "): the files of two checkpoints or runs were mixed; restore the "
                            "directory or resume from another checkpoint");
      }
      check(opt_->steps_taken() <= start_,
            "optimizer state in '" + dir + "' has taken " + std::to_string(opt_->steps_taken()) +
                " steps, more than the checkpoint's step " + std::to_string(start_) +
                "; the two files are not of one checkpoint (restore the directory or resume from "
                "an earlier checkpoint)");
      if (root_) run_dir_->check_later_saves_clear(start_, cfg_.steps);
      prior_seconds_ = logged_seconds_at(fs::path(cfg_.out_dir) / "metrics.jsonl", start_);
      msg("resumed from " + dir + " at step " + std::to_string(start_));
    } else if (root_) {
      // The new run's data, model and initial weights are good: only now is an old run deleted.
      const std::string note = claim_out_dir(cfg_.out_dir, cfg_.overwrite);
      restore_.disarm();  // (the old run is gone: the new tokenizer is the run's)
      move_staged_data();
      if (!note.empty()) msg(note);
      write_file_atomic(cfg_path_.string(), cfg_text_);
    }
    leave_staging();
    comm_.require_same(replica_hash(*model_, *opt_),
                       cfg_.resume ? "resumed weights and optimizer state" : "initial weights",
                       "every rank must run the same attnres build and read the same run "
                       "directory (on several hosts, --out must be on a shared file system)");
  }

  // Where and how the run computes, as its files record it (kRuntimeKey): e.g. "cpu bf16".
  std::string runtime_text() const {
    return std::string(to_string(cfg_.device)) + " " + to_string(cfg_.precision) +
           (cfg_.cuda_graphs ? " graphs" : "");
  }

  // How the ranks share the work: what decides the order of the gradient sums (ranks, pipeline
  // stages, the scheme that sends the sources) and ZeRO-1 (the same sums: kept, not compared).
  // And the threads of each rank (the CPU's kernels split rows, and sum partials, by thread;
  // a resume on all cores of a run trained on one differed without a word; nineteenth pass).
  struct Layout {
    int64_t ranks = 0;  // 0: not recorded
    int64_t pipeline = 1, virtual_stages = 1;
    std::string comm = "cached";
    bool zero1 = false;
    int64_t threads = 0;  // 0: not recorded
    int64_t bucket = int64_t{1} << 22;
    // (on 2 ranks every sum is a + b, whatever the buckets and collectives; on 3 or more MPI may
    // add in another order in other buckets, or in a reduce-scatter: 27th hostile pass)
    bool same_sums(const Layout& o) const {
      return ranks == o.ranks && pipeline == o.pipeline && virtual_stages == o.virtual_stages &&
             (pipeline == 1 || comm == o.comm) &&
             (threads == 0 || o.threads == 0 || threads == o.threads) &&
             (ranks <= 2 || (bucket == o.bucket && zero1 == o.zero1));
    }
  };
  static Layout layout_of(const TrainConfig& c, int64_t ranks) {
    return {ranks,   c.pipeline, c.virtual_stages,   c.pipeline_comm,
            c.zero1, c.threads,  c.grad_bucket_elems};
  }
  // "0.01" for --grad-bucket-mib (enough digits to give the same bucket back).
  static std::string bucket_mib_text(int64_t elems) {
    char b[40];
    std::snprintf(b, sizeof b, "%.10g", static_cast<double>(elems) * 4.0 / (1 << 20));
    return b;
  }

  // In words: "a pipeline of 2 ranks x 2 virtual stages (naive)", "data-parallel on 4 ranks".
  static std::string layout_words(const Layout& l) {
    const std::string r = std::to_string(l.ranks);
    if (l.pipeline > 1) {
      const std::string what = l.ranks > l.pipeline
                                   ? std::to_string(l.ranks / l.pipeline) + " pipelines of " +
                                         std::to_string(l.pipeline) + " ranks"
                                   : "a pipeline of " + r + " ranks";
      return what +
             (l.virtual_stages > 1 ? " x " + std::to_string(l.virtual_stages) + " virtual stages"
                                   : "") +
             (l.comm != "cached" ? " (" + l.comm + " communication)" : "");
    }
    const std::string t =
        l.threads > 0 ? " of " + std::to_string(l.threads) +
                            (l.threads == 1 ? std::string(" thread") : std::string(" threads"))
                      : std::string();
    return l.ranks == 1 ? "1 process" + t
                        : "data-parallel on " + r + " ranks" + t + (l.zero1 ? ", ZeRO-1" : "") +
                              ", gradient buckets of " + bucket_mib_text(l.bucket) + " MiB";
  }

  // The command that continues a run of layout l as it ran.
  std::string resume_command(const Layout& l) const {
    std::string how = (l.ranks > 1 ? "mpirun -np " + std::to_string(l.ranks) + " " : "") +
                      "attnres " +
                      (l.threads > 0 ? "--threads " + std::to_string(l.threads) + " " : "") +
                      "train --resume --out " + shell_word(cfg_.out_dir);
    if (l.pipeline > 1) how += " --pipeline " + std::to_string(l.pipeline);
    if (l.virtual_stages > 1) how += " --virtual-stages " + std::to_string(l.virtual_stages);
    if (l.pipeline > 1 && l.comm != "cached") how += " --pipeline-comm " + l.comm;
    if (l.zero1) how += " --zero1";
    if (l.bucket != (int64_t{1} << 22)) how += " --grad-bucket-mib " + bucket_mib_text(l.bucket);
    return how;
  }

  // A resume on another layout than the run's recorded one sums the same gradients in another
  // order: noted, and the new layout recorded with its first checkpoint (a pipeline run resumed
  // as data-parallel differed in the last bits without a word; fifteenth hostile pass).
  void note_layout_change() {
    const Layout now = layout_of(cfg_, ranks_);
    if (saved_layout_.ranks == 0) {  // (not recorded: recorded from now on)
      record_pending_ = true;
      return;
    }
    if (saved_layout_.same_sums(now)) {
      record_pending_ =
          record_pending_ || saved_layout_.zero1 != now.zero1 || saved_layout_.bucket != now.bucket;
      return;
    }
    msg("note: the run trained as " + layout_words(saved_layout_) + " and continues as " +
        layout_words(now) +
        ": the same sums in another order, so its results will differ from an uninterrupted "
        "run's in the last bits (" +
        resume_command(saved_layout_) + " continues it exactly)");
    record_pending_ = true;
  }

  // A resume that changed the device, precision or layout records it in train_config.json, so
  // that the next plain --resume continues as this one (it went back to the run's first runtime,
  // silently; fifteenth hostile pass). Only with its first checkpoint: a resume refused or killed
  // before it leaves the record of the checkpoints there (it rewrote it at the start, and the next
  // plain resume adopted a layout no checkpoint was made in, or one that could not run; sixteenth
  // hostile pass). The fingerprint leaves the runtime out: checkpoints still match.
  void record_runtime() {
    nlohmann::json j = parse_json(cfg_text_);
    const nlohmann::json now = parse_json(cfg_.to_json());
    for (const char* k : {"runtime", "parallel"}) {
      if (now.contains(k)) {
        j[k] = now[k];
      } else {
        j.erase(k);
      }
    }
    cfg_text_ = j.dump(2);
    write_file_atomic(cfg_path_.string(), cfg_text_);
  }

  // Stage 6: the pipeline of all the ranks (--pipeline N).
  void setup_pipeline() {
    if (!piped_) return;
    // Pipeline x data parallel: ranks [k P, (k + 1) P) form pipeline k, stage s on rank k P + s.
    if (replicas_ > 1) {
      pipe_comm_ = comm_.split(static_cast<int>(comm_.rank() / cfg_.pipeline),
                               static_cast<int>(comm_.rank() % cfg_.pipeline));
    }
    pipeline_ = std::make_unique<pipe::Pipeline>(
        *model_, pipe_comm_ ? *pipe_comm_ : comm_,
        pipe::make_plan(*model_, cfg_.pipeline, cfg_.virtual_stages, cfg_.grad_accum),
        pipe::parse_scheme(cfg_.pipeline_comm));
    const pipe::Plan& pl = pipeline_->plan();
    const int64_t rows = cfg_.batch_size / replicas_ * cfg_.seq_len;
    char bub[32];
    std::snprintf(bub, sizeof bub, "%.0f%%", 100.0 * pipeline_->schedule().bubble);
    msg("pipeline: " + std::to_string(pl.P) + " ranks x " + std::to_string(pl.V) +
        " virtual stage(s), sublayers " + pl.describe() + "; " + std::to_string(pl.M) +
        " micro-batch(es) per step (--grad-accum), 1F1B schedule (bubble " + bub + "); " +
        cfg_.pipeline_comm + " block communication: " +
        format_mib(
            pipe::planned_bytes_per_step(pl, pipeline_->scheme(), rows, cfg_.model.d_model)) +
        " per step" +
        (replicas_ > 1
             ? " per pipeline; " + std::to_string(replicas_) + " data-parallel pipelines of " +
                   std::to_string(cfg_.batch_size / replicas_) + " sequences each"
             : std::string()));
  }

  // Stage 4b: a rehearsal of what the run allocates, on zero tokens, before stage 5 writes or
  // deletes anything: one training step's forward and backward (no update), an evaluation
  // batch, and rank 0's diagnostics batch. A batch that does not fit is refused here, with the
  // old run of an --overwrite still there and no step trained in vain (the first step, a
  // router's buffers or the first evaluation ran out of memory after the old run was deleted,
  // or after steps that no checkpoint held; sixteenth and seventeenth hostile passes). It
  // changes nothing the run computes: the gradients are zeroed, the weights are not touched.
  void rehearse() {
    const int64_t B = cfg_.batch_size, T = cfg_.seq_len, slice = B / replicas_;
    const std::vector<int32_t> zeros(static_cast<size_t>(B * T), 0);
    if (pipeline_) pipeline_->release_memory();
    // (evaluations run the whole model: a pipeline's on whole batches, data parallel on a
    // slice; rank 0's diagnostics on a whole batch)
    model_->forward(zeros.data(), zeros.data(), slice, T);
    if (root_) model_->forward(zeros.data(), zeros.data(), B, T);
    const size_t eval_bytes = static_cast<size_t>(model_->activation_bytes());
    if (pipeline_) {
      model_->release_activations();
      const std::vector<const int32_t*> micro(static_cast<size_t>(cfg_.grad_accum), zeros.data());
      pipeline_->step(micro, micro, slice, T);
      pipeline_->reset_traffic();
    } else {
      model_->forward(zeros.data(), zeros.data(), slice, T);
      model_->backward();
    }
    // ZeRO-1: the whole optimizer state rank 0 gathers at each save, beside the activations
    // (the first save ran out of memory after an --overwrite deleted the old run; 18th pass).
    if (root_ && opt_->sharded()) (void)whole_state();
    model_->zero_grad();
    // An --overwrite deletes the old run next. A run that fits with nothing to spare ran out of
    // memory later all the same, now and then (the heap grows as it fragments: a pipeline's
    // evaluation after the last step, 7 of 24 runs in a 35 MB band; nineteenth hostile pass), so
    // it must leave free an eighth of what it holds, and in a pipeline no less than its
    // evaluation's activations (which a pipeline frees and takes again around each evaluation).
    if (cfg_.overwrite && !cfg_.resume) {
      const size_t held = address_space_bytes();
      const size_t spare = std::max({size_t{32} << 20, held / 8, pipeline_ ? eval_bytes : 0});
      if (!address_space_spare(spare)) {
        throw out_of_memory(
            "the margin a run keeps before --overwrite deletes the old one (an eighth of the " +
                std::to_string(held >> 20) + " MiB it holds" +
                (pipeline_ ? std::string(", or a pipeline's evaluation activations") : "") + ")",
            static_cast<double>(spare),
            "nothing was deleted; lower --batch-size, --seq-len, --d-model or --n-layer");
      }
    }
    // A rank that failed ends the job (cmd_train aborts it) while the others wait here: rank 0
    // never goes on to stage 5 unless every rank rehearsed.
    if (ranks_ > 1) comm_.barrier();
  }

  // A stop request (Ctrl-C) while an --overwrite run prepared its data ends it here, before
  // stage 5 deletes the old run (it was honoured after: the old run was deleted, and an empty
  // checkpoint of step 0 saved in its place; seventeenth hostile pass).
  void stop_before_claim() {
    if (cfg_.resume || !cfg_.overwrite) return;
    bool stop = ev_.stop && ev_.stop->load();
    if (ranks_ > 1) stop = comm_.any(stop);
    check(!stop, "interrupted before the new run started: nothing was deleted, the run in '" +
                     cfg_.out_dir + "' is as it was");
  }

  // ", gradients summed in 3 buckets of 16 MiB during the backward pass" (data parallel).
  std::string buckets_text() const {
    if (ranks_ == 1 || piped_) return "";
    const int64_t elems = comm_.bucket_elems(), n = model_->layout().total();
    char mib[32];
    std::snprintf(mib, sizeof mib, "%.3g", static_cast<double>(elems) * 4.0 / (1 << 20));
    const bool overlap = sums_during_backward(cfg_.grad_overlap, ranks_, piped_, model_->on_cpu());
    return ", gradients summed in " + std::to_string((n + elems - 1) / elems) + " bucket(s) of " +
           mib + " MiB " + (overlap ? "during" : "after") + " the backward pass";
  }

  // Stage 7: what is about to run, the metrics file, the first batch's fingerprint, the runner.
  void describe_run() {
    if (cfg_.schedule.warmup_steps >= cfg_.steps && start_ == 0) {  // (17th pass: no word)
      msg("note: the warm-up (--warmup " + std::to_string(cfg_.schedule.warmup_steps) +
          ") is not shorter than the run (--steps " + std::to_string(cfg_.steps) +
          "): the learning rate never reaches --lr");
    }
    flops_tok_ = train_flops_per_token(cfg_.model, cfg_.seq_len);
    tokens_per_step_ = cfg_.batch_size * cfg_.seq_len * cfg_.grad_accum;
    const std::string ranks_text =
        ranks_ == 1
            ? std::string("1 rank")
            : std::to_string(ranks_) + " ranks (" + comm_.backend() + "), " +
                  (piped_ ? (replicas_ > 1 ? std::to_string(replicas_) + " data-parallel pipelines"
                                           : std::string("pipeline parallel"))
                          : std::to_string(cfg_.batch_size / ranks_) +
                                " sequences per rank per micro-batch") +
                  (zero1_ ? ", AdamW state sharded (ZeRO-1)" : "") + buckets_text();
    msg("model: " + std::to_string(model_->num_params()) + " parameters, residual " +
        to_string(cfg_.model.residual.mode) + ", " + std::to_string(cfg_.model.n_layer) +
        " layers, d " + std::to_string(cfg_.model.d_model) + "; " +
        std::to_string(tokens_per_step_) + " tokens/step, " + mflops_text(flops_tok_) +
        " MFLOP/token; " + ranks_text);
    if (root_) {
      const std::string path = (fs::path(cfg_.out_dir) / "metrics.jsonl").string();
      const int64_t torn = metrics_.open(path);
      if (torn > 0) {
        msg("metrics.jsonl: dropped a torn last line (" + std::to_string(torn) +
            " bytes, cut by a kill or a full disk)");
      }
      // (what the resumed checkpoint recorded of the log, and the log now, in one read)
      const LogRecord rec = cfg_.resume ? read_log_record() : LogRecord{};
      const FileHashes h = hash_file(path, rec.bytes);
      log_hash_ = h.whole;
      log_bytes_ = h.bytes;
      if (cfg_.resume) check_log_intact(path, rec, h);
    }
    res_.num_params = model_->num_params();
    res_.flops_per_token = flops_tok_;
    if (!cfg_.resume) res_.init_hash = model_->shared_weights_hash();
    data_.train.sample_batch(cfg_.seed, 0, 0, cfg_.batch_size, cfg_.seq_len, batch_);
    res_.batch_hash = fnv1a64(std::string_view(reinterpret_cast<const char*>(batch_.inputs.data()),
                                               batch_.inputs.size() * sizeof(int32_t)));
    t0_ = Clock::now();
    runner_ = make_step_runner(StepContext{*model_, *opt_, comm_, reducer_.get(), data_.train, cfg_,
                                           pipeline_.get(), zero1_ ? &shard_counts_ : nullptr,
                                           ev_.loss_hook, [this](const std::string& m) { msg(m); },
                                           ev_.stop});
  }

  // Replicas must not drift: checked before each checkpoint (which only rank 0 writes).
  void save_checkpoint(int64_t at_step) {
    comm_.require_same(replica_hash(*model_, *opt_),
                       "weights or optimizer state at step " + std::to_string(at_step),
                       "the ranks' replicas diverged, which is a bug: please report it with the "
                       "command line");
    if (root_) lock_->check_in_place();
    if (!opt_->sharded()) {
      if (root_) run_dir_->save(*model_, *opt_, at_step, recent_loss_record(), log_record());
      record_if_pending();
      return;
    }
    // ZeRO-1: rank 0 collects the moment shards into a whole optimizer state and writes it.
    if (!root_) {
      comm_.send(opt_->m().data(), static_cast<int64_t>(opt_->m().size()), 0, 1);
      comm_.send(opt_->v().data(), static_cast<int64_t>(opt_->v().size()), 0, 2);
      return;
    }
    AdamW full = whole_state();
    std::copy(opt_->m().data(), opt_->m().data() + opt_->m().size(), full.m().data());
    std::copy(opt_->v().data(), opt_->v().data() + opt_->v().size(), full.v().data());
    for (int r = 1; r < ranks_; r++) {
      const int64_t b = bounds_[static_cast<size_t>(r)], n = shard_counts_[static_cast<size_t>(r)];
      comm_.recv(full.m().data() + b, n, r, 1);
      comm_.recv(full.v().data() + b, n, r, 2);
    }
    full.set_steps_taken(opt_->steps_taken());
    run_dir_->save(*model_, full, at_step, recent_loss_record(), log_record());
    record_if_pending();
  }

  // ZeRO-1: the two moments of every parameter, which rank 0 gathers at each save.
  AdamW whole_state() const {
    try {
      return AdamW(model_->layout(), cfg_.adamw);
    } catch (const Error&) {  // (AdamW's own hint would be --zero1, which is on)
      throw out_of_memory("the AdamW moments rank 0 gathers to save a --zero1 run",
                          8.0 * static_cast<double>(model_->layout().total()),
                          "lower --d-model, --n-layer or --vocab-size");
    }
  }

  // The training losses since the last evaluation, which the next one reports as its mean: kept
  // with each checkpoint (exact, as a hex float), so a resumed run reports the uninterrupted
  // run's mean (it averaged only the steps since the resume; sixteenth hostile pass).
  Metadata recent_loss_record() const {
    char sum[64];
    std::snprintf(sum, sizeof sum, "%a", recent_loss_);
    Metadata m = data_record();
    m.insert({{kRecentLossKey, sum}, {kRecentStepsKey, std::to_string(recent_n_)}});
    return m;
  }
  std::string log_record() const {
    return nlohmann::json{{"bytes", log_bytes_}, {"fnv1a64", hex64(log_hash_)}}.dump() + "\n";
  }
  // A resumed run's metrics.jsonl must begin with what the run had logged at its checkpoint;
  // otherwise its earlier lines are not the run's measurements (compare took an edited log's
  // speed, curve and diagnostics for a kept run's; 21st hostile pass).
  // What the checkpoint being resumed recorded of the log (kLogRecordFile); bytes -1: nothing.
  struct LogRecord {
    int64_t bytes = -1;
    std::string fnv1a64;
  };
  LogRecord read_log_record() const {
    const fs::path record = fs::path(resume_dir_) / kLogRecordFile;
    LogRecord r;
    std::error_code ec;
    if (fs::is_regular_file(record, ec)) {
      const auto j = nlohmann::json::parse(read_small_file(record.string(), 4096, "a log record"),
                                           nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("bytes") && j["bytes"].is_number_integer() &&
          j.contains("fnv1a64") && j["fnv1a64"].is_string()) {
        r.bytes = j["bytes"].get<int64_t>();
        r.fnv1a64 = j["fnv1a64"].get<std::string>();
      }
    }
    return r;
  }
  void check_log_intact(const std::string& path, const LogRecord& rec, const FileHashes& h) {
    res_.log_intact = rec.bytes >= 0 && h.at_mark && hex64(*h.at_mark) == rec.fnv1a64;
    if (res_.log_intact) {
      res_.log_skip_from = rec.bytes;
      res_.log_skip_to = log_bytes_;  // (the file's size when this call opened it)
    }
    if (!res_.log_intact && rec.bytes >= 0) {
      msg("note: " + path + " does not begin with what the run had logged when its checkpoint " +
          "was saved (edited or replaced since): its earlier lines are kept as they are, but " +
          "are not this run's measurements");
    }
  }
  // How large metrics.jsonl grows, generously: a step line (about 170 bytes) every --log-every
  // steps, and at each evaluation its line and the diagnostics (per sublayer, and the depth
  // weights: about 20 bytes a pair of sublayers).
  double log_bytes_estimate() const {
    const double steps = static_cast<double>(cfg_.steps - start_);
    const double lines = steps / static_cast<double>(std::max<int64_t>(cfg_.log_every, 1)) + 1;
    const double evals =
        (cfg_.eval_every > 0 ? steps / static_cast<double>(cfg_.eval_every) : 0) + 1;
    const auto S = static_cast<double>(cfg_.model.n_sublayers() + 1);
    return lines * 256 + evals * (512 + 128 * S + 24 * S * S);
  }
  // A run from --init-from weights that trained on this very corpus (the model's, or one of its
  // ancestors') validates on held-out text only if its val split is within the share those
  // held out: a larger one reported their training text as a val loss (25th hostile pass).
  void check_val_split_held_out(const Metadata& from) const {
    const std::vector<TrainedOn> shares = trained_on(from);
    const TrainedOn* other =
        share_of_another_tokenizer(shares, data_.fingerprint, data_.tokenizer_fingerprint);
    check(!other,
          "--init-from's weights (or those they started from) trained on this corpus with "
          "another tokenizer (fingerprint " +
              (other ? other->tokenizer : std::string()) + ", this run's " +
              data_.tokenizer_fingerprint +
              "): the share they held out was counted in that tokenizer's tokens, which cut "
              "the text elsewhere, so this run's val split may hold text they trained on; "
              "train with their tokenizer (--tokenizer-model), or on other text");
    for (const TrainedOn& t : shares) {
      const std::string vf = exact_text(cfg_.val_fraction), held = exact_text(t.val_fraction);
      check(t.fingerprint != data_.fingerprint || cfg_.val_fraction <= t.val_fraction,
            "--val-fraction " + vf + " is larger than the share (" + held +
                ") of this corpus held out when --init-from's weights (or those they started "
                "from) trained on it: this run's val split would include text its initial "
                "weights trained on; give --val-fraction " +
                held + " or less, or train on other text");
    }
  }
  // What a saved model says of its data: which corpus, and the share held out (kCorpusHashKey).
  Metadata data_record() const {
    char vf[64];
    std::snprintf(vf, sizeof vf, "%.17g", cfg_.val_fraction);
    Metadata m{{kCorpusHashKey, data_.fingerprint},
               {kValFractionKey, vf},
               {kValTokenizerKey, data_.tokenizer_fingerprint}};
    if (!ancestry_.empty()) m[kAncestryKey] = ancestry_;  // (what its initial weights trained on)
    return m;
  }
  void restore_recent_loss(const Metadata& meta) {
    const auto s = meta.find(kRecentLossKey), n = meta.find(kRecentStepsKey);
    if (s == meta.end() || n == meta.end()) return;  // (an older build's checkpoint)
    char* end = nullptr;
    const double sum = std::strtod(s->second.c_str(), &end);
    const bool sum_ok = end != s->second.c_str() && *end == '\0' && std::isfinite(sum);
    int64_t steps = -1;
    try {
      size_t used = 0;
      steps = std::stoll(n->second, &used);
      if (used != n->second.size()) steps = -1;
    } catch (const std::exception&) {
    }
    if (!sum_ok || steps < 0 || steps > start_) return;  // (damaged: the mean since the resume)
    recent_loss_ = sum;
    recent_n_ = steps;
  }

  void record_if_pending() {
    if (!root_ || !record_pending_) return;
    record_runtime();
    record_pending_ = false;
  }

  // A step whose loss or gradient is not finite: skipped, counted, and fatal past the limit.
  void skip_step(int64_t step, double loss) {
    res_.skipped_steps++;
    msg("step " + std::to_string(step + 1) + ": non-finite loss or gradient, update skipped (" +
        std::to_string(res_.skipped_steps) + "/" + std::to_string(cfg_.max_bad_steps) + ")");
    log_json({{"step", step + 1},
              {"skipped", true},
              {"loss", std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json(nullptr)}});
    if (res_.skipped_steps > cfg_.max_bad_steps) {
      throw DivergedError("training diverged: " + std::to_string(res_.skipped_steps) +
                          " steps had a non-finite loss or gradient; lower --lr or raise "
                          "--warmup" +
                          run_dir_->last_checkpoint_note());
    }
  }

  uint64_t continued_count() const { return ev_.continued ? ev_.continued() : 0; }

  // After step `step` (0-based): the progress event and the metrics line.
  void report_step(int64_t step, const StepRunner::Outcome& o, double lr, double dt, bool last) {
    StepInfo si;
    si.step = step + 1;
    si.total_steps = cfg_.steps;
    si.loss = o.loss;
    si.lr = lr;
    si.grad_norm = o.grad_norm;
    const double per_step = timed_steps_ > 0 ? timed_s_ / static_cast<double>(timed_steps_) : dt;
    if (timed_steps_ > 0) si.tokens_per_s = static_cast<double>(tokens_per_step_) / per_step;
    si.elapsed_s = prior_seconds_ + seconds_since(t0_);
    si.eta_s = per_step * static_cast<double>(cfg_.steps - step - 1);
    if (root_ && ev_.on_step) ev_.on_step(si);
    if ((step + 1) % cfg_.log_every == 0 || last) {
      // (null until a step of this call was timed: the first one's time holds the warm-up, a
      // stopped one's the stop; readers such as compare took it for the speed, 26th pass)
      log_json({{"step", step + 1},
                {"loss", o.loss},
                {"lr", lr},
                {"grad_norm", o.grad_norm},
                {"tokens_per_s",
                 si.tokens_per_s ? nlohmann::json(*si.tokens_per_s) : nlohmann::json(nullptr)},
                {"elapsed_s", si.elapsed_s},
                {"tokens", (step + 1) * tokens_per_step_}});
    }
  }

  // The validation loss after step `step`, logged with the diagnostics of the first validation
  // batch (magnitudes and depth weights, SPEC 6) and the step's per-sublayer gradient norms.
  void evaluate_now(int64_t step, double train_loss, const std::vector<double>& grad_norms) {
    if (pipeline_) pipeline_->release_memory();  // evaluation runs the whole model on each rank
    EvalInfo ei;
    ei.step = step + 1;
    ei.val_loss = validation_loss(*model_, data_.val, cfg_.batch_size, cfg_.seq_len,
                                  cfg_.eval_batches, comm_, piped_);
    ei.train_loss = recent_loss_ / static_cast<double>(std::max<int64_t>(1, recent_n_));
    recent_loss_ = 0.0;
    recent_n_ = 0;
    if (!std::isfinite(ei.val_loss)) {
      throw DivergedError("training diverged: the validation loss at step " +
                          std::to_string(step + 1) + " is not finite (training loss " +
                          std::to_string(train_loss) + "); lower --lr or raise --warmup" +
                          run_dir_->last_checkpoint_note());
    }
    res_.final_val_loss = ei.val_loss;
    log_json({{"step", step + 1},
              {"val_loss", ei.val_loss},
              {"train_loss", ei.train_loss},
              {"tokens", (step + 1) * tokens_per_step_},
              {"elapsed_s", prior_seconds_ + seconds_since(t0_)}});
    if (root_) {
      data_.val.window_batch(0, cfg_.batch_size, cfg_.seq_len, batch_);
      Diagnostics dg =
          measure_diagnostics(*model_, batch_.inputs.data(), cfg_.batch_size, cfg_.seq_len);
      dg.grad_norm = grad_norms;
      auto dj = nlohmann::json::parse(diagnostics_to_json(dg));
      dj["step"] = step + 1;
      dj["kind"] = "diagnostics";
      log_json(dj);
      if (ev_.on_eval) ev_.on_eval(ei);
    }
    if (pipeline_) model_->release_activations();  // training runs stage passes
  }

  // Stage 8: the optimizer steps, until the last or a stop request.
  void step_loop() {
    step_ = start_;
    for (; step_ < cfg_.steps; step_++) {
      const int64_t step = step_;
      bool stop = ev_.stop && ev_.stop->load();
      if (ranks_ > 1) stop = comm_.any(stop);  // a stop request on any rank stops all, at one step
      if (stop) {
        res_.interrupted = true;
        msg("interrupted: saving a checkpoint at step " + std::to_string(step));
        break;
      }
      const auto ts = Clock::now();
      const uint64_t continued = continued_count();
      const bool last = step + 1 == cfg_.steps;
      const bool eval_now = (cfg_.eval_every > 0 && (step + 1) % cfg_.eval_every == 0) || last;
      StepRunner::Rates rates;
      rates.lr = lr_at(cfg_.schedule, cfg_.adamw.lr, step);
      if (router_schedule_) {
        rates.router_lr = cfg_.router_lr_mult * lr_at(*router_schedule_, cfg_.adamw.lr, step);
      }
      const StepRunner::Outcome o = runner_->run(step, rates, eval_now);
      if (o.abandoned) {  // (the weights are those after step `step`: the update never ran)
        res_.interrupted = true;
        msg("interrupted inside step " + std::to_string(step + 1) +
            ": its gradients are dropped; saving a checkpoint at step " + std::to_string(step));
        break;
      }
      if (!o.ok) {
        skip_step(step, o.loss);
        continue;
      }
      const double dt = seconds_since(ts);
      // (the first step allocates and warms up; a step the process was stopped in, by Ctrl-Z or
      // SIGSTOP, holds the time it stood still: neither is timed)
      if (step > start_ && continued_count() == continued) {
        timed_s_ += dt;
        timed_steps_++;
      }
      recent_loss_ += o.loss;
      recent_n_++;
      res_.final_train_loss = o.loss;
      report_step(step, o, rates.lr, dt, last);
      if (eval_now) evaluate_now(step, o.loss, o.sublayer_grad_norms);
      if (cfg_.save_every > 0 && (step + 1) % cfg_.save_every == 0 && !last) {
        save_checkpoint(step + 1);
      }
    }
  }

  // Stage 9: the last checkpoint and the final model, the measured throughput and traffic.
  TrainResult finish() {
    res_.resume_command = resume_command(layout_of(cfg_, ranks_));
    res_.sample_tokens = cfg_.sample_tokens;
    res_.prompt = cfg_.prompt;
    const int64_t step = step_;
    res_.steps_done = step;
    res_.first_step = start_;
    const StepRunner::Graphs g = runner_->graphs();
    res_.graph_captures = g.captures;
    res_.graph_replays = g.replays;
    res_.graphs_off_reason = g.off_reason;
    if (cfg_.cuda_graphs && g.captures > 0) {
      msg("CUDA graphs: " + std::to_string(g.captures) + " captured, " + std::to_string(g.replays) +
          " replays (forward+backward per micro-batch, the update per step)");
    }
    // A resumed run stopped before its first step has nothing new: re-saving step_N would
    // replace the very checkpoint `latest` names, opening a window in which a kill leaves none.
    // (The condition is the same on every rank.)
    if (!(cfg_.resume && step == start_)) save_checkpoint(step);
    // A run resumed after its last step ran no evaluation here: measure its final weights once
    // (not logged: metrics.jsonl already has that step's evaluation).
    if (!res_.interrupted && step == start_ && step == cfg_.steps) {
      if (pipeline_) pipeline_->release_memory();
      res_.final_val_loss = validation_loss(*model_, data_.val, cfg_.batch_size, cfg_.seq_len,
                                            cfg_.eval_batches, comm_, piped_);
    }
    res_.seconds = seconds_since(t0_);
    res_.run_seconds = prior_seconds_ + res_.seconds;
    if (timed_steps_ > 0) {
      res_.tokens_per_s = static_cast<double>(tokens_per_step_ * timed_steps_) / timed_s_;
      res_.model_gflops = *res_.tokens_per_s * flops_tok_ / 1e9;
    }
    if (pipeline_) pipeline_traffic(step);
    if (!res_.interrupted) {
      res_.model_path = (fs::path(cfg_.out_dir) / "model.safetensors").string();
      if (root_) {
        lock_->check_in_place();
        Metadata meta = data_record();
        meta.insert({{"tokenizer", data_.tokenizer_ref},
                     {"step", std::to_string(step)},
                     {kConfigHashKey, train_config_fingerprint(cfg_text_)},
                     {kTokenizerHashKey, data_.tokenizer_fingerprint},
                     {kRuntimeKey, runtime_text()}});
        save_model(res_.model_path, *model_, meta);
      }
    }
    comm_.barrier();  // on return, rank 0's files are complete on every rank
    return res_;
  }

  // What the pipeline sent per step, against what the other communication scheme would send.
  void pipeline_traffic(int64_t step) {
    const pipe::Traffic& t = pipeline_->traffic();
    double sent = static_cast<double>(t.forward_bytes + t.backward_bytes);
    comm_.allreduce_sum(&sent, 1);
    const int64_t steps_run = std::max<int64_t>(1, step - start_);
    res_.pipeline_bytes_per_step = static_cast<int64_t>(sent) / steps_run;
    const pipe::Scheme other =
        pipeline_->scheme() == pipe::Scheme::cached ? pipe::Scheme::naive : pipe::Scheme::cached;
    res_.pipeline_other_scheme_bytes_per_step = pipe::planned_bytes_per_step(
        pipeline_->plan(), other, cfg_.batch_size * cfg_.seq_len, cfg_.model.d_model);
    res_.pipeline_bubble = pipeline_->schedule().bubble;
    if (step > start_) {
      msg("pipeline: sent " + format_mib(res_.pipeline_bytes_per_step) +
          " per step between stages (" + cfg_.pipeline_comm + "); the " + pipe::scheme_name(other) +
          " scheme would send " + format_mib(res_.pipeline_other_scheme_bytes_per_step));
    }
  }

  // The invocation and its environment.
  const TrainConfig& in_;
  const TrainEvents& ev_;
  dist::Communicator& comm_;
  const int64_t ranks_;
  const bool root_, zero1_;
  // Built by the stages, in this order.
  TrainConfig cfg_;
  fs::path cfg_path_;
  Layout saved_layout_;  // the resumed run's recorded one
  // Device, precision or layout changed at --resume: recorded with the first checkpoint.
  bool record_pending_ = false;  // --resume with another --device / --precision / --cuda-graphs
  bool piped_ = false;
  int64_t replicas_ = 1;  // data-parallel copies of the model: ranks / pipeline
  std::unique_ptr<dist::Communicator> pipe_comm_;  // pipeline x data parallel: this pipeline's
  PreparedData data_;
  std::unique_ptr<Model> model_;
  std::vector<int64_t> bounds_, shard_counts_;
  std::unique_ptr<AdamW> opt_;
  std::optional<ScheduleConfig> router_schedule_;
  std::string cfg_text_;  // train_config.json as read (resume) or to be written (new run)
  std::optional<RunDir> run_dir_;
  std::unique_ptr<dist::DeviceReducer> reducer_;
  int64_t start_ = 0;
  double prior_seconds_ = 0.0;  // training wall time of the invocations before this one
  std::unique_ptr<pipe::Pipeline> pipeline_;
  double flops_tok_ = 0.0;
  int64_t tokens_per_step_ = 0;
  AppendFile metrics_;
  uint64_t log_hash_ = kFnv1a64Offset;  // metrics.jsonl's fingerprint and size so far (rank 0)
  int64_t log_bytes_ = 0;
  std::string resume_dir_;  // the checkpoint a resume continues from
  std::string ancestry_;    // kAncestryKey: the corpora of the --init-from model and its ancestors
  std::unique_ptr<RunLock> lock_;  // (rank 0) held while this run trains
  std::string staged_in_;     // --overwrite: where every rank's data was prepared (until stage 5)
  RestoreOnFailure restore_;  // (destroyed before lock_ is released)
  StagingDir staging_;        // --overwrite: the new run's data until stage 5 (see stage 2)
  TrainResult res_;
  Batch batch_;
  Clock::time_point t0_;
  std::unique_ptr<StepRunner> runner_;
  // The step loop's state.
  int64_t step_ = 0;
  double timed_s_ = 0.0;  // excludes the first step (allocation, warm-up)
  int64_t timed_steps_ = 0;
  double recent_loss_ = 0.0;  // training losses since the last evaluation
  int64_t recent_n_ = 0;
};

}  // namespace

TrainResult train(const TrainConfig& cfg_in, const TrainEvents& ev) {
  dist::SingleCommunicator single;
  return train(cfg_in, ev, single);
}

TrainResult train(const TrainConfig& cfg_in, const TrainEvents& ev, dist::Communicator& comm) {
  return Trainer(cfg_in, ev, comm).run();
}

}  // namespace attnres
