// Options shared by `attnres train` and `attnres compare`, and the Ctrl-C handler.
#include "cli/train_options.hpp"

#include "cli/enum_option.hpp"
#include "cli/option_checks.hpp"

#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "attnres/checkpoint.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/safetensors.hpp"
#include "attnres/tokenizer.hpp"
#include "cli/commands.hpp"
#include "train/run_dir.hpp"

namespace attnres::cli {

namespace {
std::atomic<bool> g_stop{false};
std::atomic<bool> g_handling{false};  // a stop handler is installed
// (SIGUSR2 and SIGXCPU: batch schedulers' warnings before a kill, e.g. Grid Engine's qsub
// -notify and a CPU-time limit; fourteenth hostile pass. SIGALRM, a script's alarm, and SIGPWR,
// a UPS's power failure, seventeenth. SIGPROF and SIGVTALRM keep their meaning: profilers time
// with them.)
constexpr int kStopSignals[] = {SIGINT,  SIGTERM, SIGUSR1, SIGHUP,
                                SIGUSR2, SIGXCPU, SIGALRM, SIGPWR};
// Stop signals this soon after the first are echoes of it, not a second request.
constexpr std::chrono::milliseconds kSignalEcho{1000};

// The stop signals this process takes: SIGHUP only when it was not ignored at the start
// (`nohup` ignores it, and a run started so stopped at logout all the same; 23rd hostile pass).
// (The others are taken even then: a shell ignores SIGINT in a script's background jobs, and
// `kill -INT` must still stop such a run with a checkpoint.)
sigset_t stop_signal_set() {
  static const sigset_t set = [] {
    sigset_t s;
    sigemptyset(&s);
    for (int sig : kStopSignals) {
      struct sigaction old {};
      if (sig == SIGHUP && sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) {
        continue;
      }
      sigaddset(&s, sig);
    }
    return s;
  }();
  return set;
}

// The only thread that ever receives the stop signals (see start_signal_thread).
void signal_thread() {
  const sigset_t set = stop_signal_set();
  std::chrono::steady_clock::time_point first_stop;
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (g_handling.load()) {
      // A second stop signal leaves at once, unless it came within kSignalEcho of the first:
      // `timeout` signals the run and then its whole process group, and a closing terminal sends
      // SIGHUP with SIGTERM; those are one request to stop, and the checkpoint must be saved.
      const auto now = std::chrono::steady_clock::now();
      if (g_stop.load() && now - first_stop >= kSignalEcho) std::_Exit(130);
      if (!g_stop.load()) first_stop = now;
      g_stop.store(true);
      continue;
    }
    // No stop handler: the default action (terminate by that signal), from this thread.
    std::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    std::raise(sig);
    std::_Exit(128 + sig);  // not reached for the terminating signals above
  }
}
}  // namespace

void start_signal_thread() {
  // Debian 12's oneDNN sgemm corrupts the heap when a signal handler runs on a thread inside it
  // (reproduced in isolation: dnnl_sgemm in a loop + SIGUSR1 -> glibc "corrupted size vs.
  // prev_size", abort; it turned Ctrl-C during training into a crash). So the stop signals are
  // blocked in every thread -- the mask is set here, before any other thread exists, and
  // inherited by OpenMP's, oneDNN's and MPI's threads -- and one thread takes them with sigwait.
  sigset_t set = stop_signal_set();
  // SIGCONT is blocked too, and taken by no thread but the training one (continue_counter): a
  // blocked SIGCONT still continues the process (POSIX) and stays pending until then.
  sigaddset(&set, SIGCONT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread(signal_thread).detach();
}

TrainArgs::TrainArgs() { cfg.data_path = kDefaultCorpus; }

void TrainArgs::finalize() {
  cfg.model.tied = !untied;
  if (!cfg.tokenizer_model.empty()) cfg.tokenizer_model = absolute_path(cfg.tokenizer_model);
}

const std::atomic<bool>* install_stop_handler() {
  // SIGINT/SIGTERM, and SIGUSR1 (mpirun forwards it to every rank while SIGINT/SIGTERM kill the
  // job after a few seconds: `kill -USR1 <mpirun pid>` stops a multi-process run with a
  // checkpoint) set the flag; a second one (a second or more after the first) exits at once.
  // Delivered by start_signal_thread's thread.
  // SIGHUP too: a closed terminal or SSH session stops the run with a checkpoint. And a closed
  // output pipe (`| head`, a dead tee or SSH) must not kill the run: with SIGPIPE ignored the
  // progress lines are lost and the run goes on to save its work.
  std::signal(SIGPIPE, SIG_IGN);
  g_stop.store(false);
  g_handling.store(true);
  return &g_stop;
}

uint64_t continue_counter() {
  // The SIGCONTs pending since the last call, taken here: the training thread sees a stop in the
  // very step it happened in (a signal thread counting them ran too late when the process had
  // one CPU, and the stopped seconds were timed; 25th hostile pass).
  static uint64_t count = 0;
  sigset_t cont;
  sigemptyset(&cont);
  sigaddset(&cont, SIGCONT);
  const timespec now{0, 0};
  while (sigtimedwait(&cont, nullptr, &now) == SIGCONT) count++;
  return count;
}

void apply_train_args(TrainArgs& a, const std::vector<std::string>& args) {
  CLI::App tmp;
  add_train_options(&tmp, a);
  std::vector<std::string> rev(args.rbegin(), args.rend());  // CLI11 takes them in reverse
  try {
    tmp.parse(rev);
  } catch (const CLI::ParseError& e) {
    std::string joined;
    for (const auto& x : args) joined += (joined.empty() ? "" : " ") + x;
    throw Error("invalid training option '" + joined + "': " + e.what());
  }
}

void remove_stop_handler() { g_handling.store(false); }

namespace {

// The settings in which `given` differs from `saved`, as "key (the run has X; given Y)".
void differing(const nlohmann::json& saved, const nlohmann::json& given, const std::string& at,
               std::string& out) {
  for (const auto& [k, v] : given.items()) {
    const nlohmann::json s = saved.contains(k) ? saved.at(k) : nlohmann::json();
    if (s == v) continue;
    if (v.is_object() && s.is_object()) {
      differing(s, v, at + k + ".", out);
      continue;
    }
    out += (out.empty() ? "" : ", ") + at + k + " (the run has " + s.dump() + "; given " +
           v.dump() + ")";
  }
}

// Every training option given on s (the command line or --config), as "--name=value".
std::vector<std::string> given_train_options(const CLI::App& s) {
  CLI::App names;
  TrainArgs unused;
  add_train_options(&names, unused);
  std::vector<std::string> given;
  for (const CLI::Option* o : names.get_options()) {
    const CLI::Option* mine = s.get_option_no_throw(o->get_name());
    if (mine == nullptr || mine->count() == 0) continue;
    for (const std::string& v : mine->results()) given.push_back(o->get_name() + "=" + v);
  }
  return given;
}

// The configuration of the run in out_dir, as its train_config.json records it; none when the file
// is missing or damaged (the resume itself then says so, naming the file).
// The run's recorded settings; nothing when it has no train_config.json. One that cannot be read
// is an Error: an I/O error here made a bf16 run resume in fp32 as if asked (25th hostile pass).
std::optional<TrainConfig> saved_run_config(const std::string& out_dir) {
  const std::filesystem::path p = std::filesystem::path(out_dir) / "train_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(p, ec))) return std::nullopt;
  return TrainConfig::from_json(
      read_small_file(p.string(), kMaxTrainConfigBytes, "a run's train_config.json"));
}

// Whether the option `name` was given (on the command line or in --config).
bool given_on(const CLI::App& s, const char* name) {
  const CLI::Option* o = s.get_option_no_throw(name);
  return o != nullptr && o->count() > 0;
}

}  // namespace

void apply_init_from_defaults(const CLI::App& s, TrainArgs& a) {
  const std::string& path = a.cfg.init_from;
  const SafetensorsReader r = [&] {
    try {
      return SafetensorsReader::open(path);
    } catch (const Error& e) {
      throw Error(std::string("--init-from: ") + e.what());
    }
  }();
  auto cfg = r.metadata().find("config");
  if (cfg == r.metadata().end()) return;  // (plain weights: the options say what model they fit)
  TrainArgs probe;
  try {
    probe.cfg.model = ModelConfig::from_json(cfg->second);
    probe.cfg.model.validate();
  } catch (const Error& e) {
    throw Error("--init-from '" + path + "': " + e.what());
  }
  probe.untied = !probe.cfg.model.tied;
  if (r.metadata().count("tokenizer") > 0) {
    // (checked as eval loads it: a plain file beside the checkpoint, of its vocabulary, the very
    // tokenizer the checkpoint records)
    const Metadata meta(r.metadata().begin(), r.metadata().end());
    auto t = load_checkpoint_tokenizer(meta, path, probe.cfg.model.vocab_size);
    if (t->model_data().empty()) {
      probe.cfg.tokenizer = TokenizerKind::byte;
    } else {
      probe.cfg.tokenizer = TokenizerKind::bpe;
      probe.cfg.tokenizer_model = checkpoint_tokenizer_file(meta, path);
    }
  }
  const ResidualMode from_mode = probe.cfg.model.residual.mode;
  apply_train_args(probe, given_train_options(s));
  // Another residual mode than the checkpoint's starts with a new run's block size: a Full
  // checkpoint's (1) made `--residual block` a Full run without a word (24th hostile pass).
  if (probe.cfg.model.residual.mode != from_mode && !given_on(s, "--block-size") &&
      !given_on(s, "--block-layers")) {
    probe.cfg.model.residual.block_size = TrainArgs().cfg.model.residual.block_size;
  }
  probe.finalize();
  a.cfg.model = probe.cfg.model;
  a.untied = probe.untied;
  a.cfg.tokenizer = probe.cfg.tokenizer;
  a.cfg.tokenizer_model = probe.cfg.tokenizer_model;
  a.cfg.bpe_vocab = probe.cfg.bpe_vocab;
}

void apply_saved_runtime(const CLI::App& s, TrainArgs& a) {
  const std::optional<TrainConfig> saved = saved_run_config(a.cfg.out_dir);
  if (!saved) return;
  if (!given_on(s, "--device")) a.cfg.device = saved->device;
  if (!given_on(s, "--precision")) a.cfg.precision = saved->precision;
  if (!given_on(s, "--cuda-graphs")) a.cfg.cuda_graphs = saved->cuda_graphs;
}

void adopt_saved_layout(TrainArgs& a, int64_t ranks) {
  if (!a.cfg.resume) return;
  const std::optional<TrainConfig> saved = saved_run_config(a.cfg.out_dir);
  if (!saved || saved->ranks != ranks) return;
  const TrainArgs::LayoutGiven& g = a.layout_given;
  TrainConfig& c = a.cfg;
  if (!g.pipeline) c.pipeline = saved->pipeline;
  if (!g.virtual_stages) c.virtual_stages = saved->virtual_stages;
  if (!g.pipeline_comm) c.pipeline_comm = saved->pipeline_comm;
  if (!g.zero1) c.zero1 = saved->zero1;
  if (!g.grad_bucket) c.grad_bucket_elems = saved->grad_bucket_elems;
  if (c.pipeline <= 1) {  // (--pipeline 1 given: the pipeline's own settings go with it)
    if (!g.virtual_stages) c.virtual_stages = 1;
    if (!g.pipeline_comm) c.pipeline_comm = "cached";
  }
}

void check_resume_options(const CLI::App& s, const std::string& out_dir) {
  const std::string path = (std::filesystem::path(out_dir) / "train_config.json").string();
  const std::optional<TrainConfig> read = saved_run_config(out_dir);
  if (!read) return;
  const TrainConfig& saved = *read;
  TrainArgs probe;
  probe.cfg = saved;
  probe.untied = !saved.model.tied;
  const std::vector<std::string> given = given_train_options(s);
  if (given.empty()) return;
  apply_train_args(probe, given);
  probe.finalize();
  TrainConfig& p = probe.cfg;
  p.data_path = absolute_path(p.data_path);
  p.model.vocab_size = saved.model.vocab_size;  // (resolved as the trainer resolved the saved)
  p.model.max_seq_len = p.seq_len;
  p.model.resolve();
  nlohmann::json had = nlohmann::json::parse(saved.to_json());
  had["data_path"] = absolute_path(saved.data_path);
  nlohmann::json now = nlohmann::json::parse(p.to_json());
  for (const char* k : {"runtime", "parallel"}) {  // (--device, --pipeline, ... may change)
    had.erase(k);
    now.erase(k);
  }
  std::string diff;
  differing(had, now, "", diff);
  check(diff.empty(), "--resume continues the run in '" + out_dir +
                          "' with the settings it started with ('" + path +
                          "'), and these options given now differ from them: " + diff +
                          ". Drop them to continue the run as it started, or start a new run "
                          "from its weights with the new settings: attnres train --init-from " +
                          out_dir + "/checkpoints/<step>/model.safetensors --out <new run> ...");
}

void add_train_options(CLI::App* s, TrainArgs& a) {
  TrainConfig& c = a.cfg;
  s->add_option("--data", c.data_path, "UTF-8 text file or directory of them")
      ->capture_default_str();
  add_enum_option(s, "--tokenizer", c.tokenizer, parse_tokenizer_kind,
                  "byte | bpe (SentencePiece BPE trained on the corpus)", {"byte", "bpe"});
  s->add_option("--vocab-size", c.bpe_vocab, "BPE vocabulary size")->capture_default_str();
  // (implies bpe unless --tokenizer is given too: then validate() refuses byte)
  s->add_option_function<std::string>(
       "--tokenizer-model",
       [&c, s](const std::string& v) {
         c.tokenizer_model = v;
         if (s->get_option("--tokenizer")->count() == 0) c.tokenizer = TokenizerKind::bpe;
       },
       "A SentencePiece model (e.g. a Hugging Face model's tokenizer.model) to use instead of "
       "training one; implies --tokenizer bpe. Default with --init-from: that checkpoint's "
       "tokenizer")
      ->check(CLI::ExistingFile);
  s->add_option("--val-fraction", c.val_fraction, "Held-out fraction of the tokens")
      ->capture_default_str();
  add_enum_option(s, "--device", c.device, parse_device,
                  "Where the model trains: cpu; cuda (an NVIDIA GPU, in a build with "
                  "-DATTNRES_CUDA=ON); cuda-host (the CUDA kernels emulated on the CPU: slow, for "
                  "tests). Not cpu: no --pipeline or --zero1; under mpirun each rank takes one "
                  "GPU and gradients are summed with NCCL",
                  {"cpu", "cuda", "cuda-host"});
  add_enum_option(s, "--precision", c.precision, parse_precision,
                  "Matrix-product precision: fp32, or bf16 (bf16 operands with fp32 sums, fp32 "
                  "master weights, optimizer and loss. CUDA: the linear layers and attention on "
                  "the tensor cores, bf16 copies of the depth-mix sources. CPU: the linear "
                  "layers, fastest with AVX512-BF16 or AMX)",
                  {"fp32", "bf16"});
  s->add_flag("--cuda-graphs", c.cuda_graphs,
              "Capture the training step as CUDA graphs after its first run and replay them "
              "(--device cuda or cuda-host): one launch per micro-batch and one per update instead "
              "of hundreds");
  // model
  s->add_option("--n-layer", c.model.n_layer, "Transformer blocks")->capture_default_str();
  s->add_option("--n-head", c.model.n_head, "Attention heads")->capture_default_str();
  s->add_option("--n-kv-head", c.model.n_kv_head, "Key/value heads (GQA; 0 = n_head)")
      ->capture_default_str();
  s->add_option("--d-model", c.model.d_model, "Model width")->capture_default_str();
  s->add_option("--ffn-hidden", c.model.ffn_hidden, "SwiGLU hidden width (0 = 8/3 d)")
      ->capture_default_str();
  s->add_flag("--untied", a.untied, "Separate LM head instead of the tied embedding");
  s->add_option(
       "--norm-eps", c.model.norm_eps,
       "RMSNorm epsilon of the sublayer input and final norms (and of the AttnRes key norms "
       "unless --attnres-key-eps)")
      ->capture_default_str();
  ResidualConfig& r = c.model.residual;
  add_enum_option(s, "--residual", r.mode, parse_residual_mode,
                  "Residual: prenorm | full | block | static | denseformer",
                  {"prenorm", "full", "block", "static", "denseformer"});
  CLI::Option* block_size =
      s->add_option("--block-size", r.block_size, "block: sublayers per block (S)")
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))  // (0 divided: seventeenth pass)
          ->capture_default_str();
  s->add_option_function<int64_t>(
       "--block-layers", [&r](int64_t n) { r.block_size = 2 * n; },
       "block: Transformer layers per block, the production convention (Kimi K3's "
       "attn_res_block_size): S = 2 x this")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 19))
      ->excludes(block_size);
  add_enum_option(s, "--attnres-gate", r.gate, parse_depth_gate, "full/block: softmax | sigmoid",
                  {"softmax", "sigmoid"});
  add_enum_option(s, "--attnres-key-norm", r.key_norm, parse_key_norm,
                  "full/block: rms | none (RMSNorm on keys)", {"rms", "none"});
  s->add_option("--attnres-heads", r.heads, "full/block: depth-attention heads (split d)")
      ->capture_default_str();
  add_enum_option(s, "--attnres-query", r.query, parse_depth_query,
                  "full/block: static | dynamic (query = w + W * most recent source)",
                  {"static", "dynamic"});
  s->add_option("--attnres-window", r.window,
                "full/block: embedding plus the last K sources only (0 = all)")
      ->capture_default_str();
  s->add_option("--attnres-key-eps", r.key_eps,
                "full/block: epsilon of the key RMSNorm (0 = --norm-eps)")
      ->capture_default_str();
  s->add_option(
       "--attnres-temperature", r.temperature,
       "full/block: score multiplier, s = T q . k (e.g. 0.088 = 1/sqrt(128)); with Adam and "
       "zero-initialised queries it acts like a learning-rate multiplier on the queries")
      ->capture_default_str();
  s->add_option("--attnres-two-phase", r.two_phase,
                "block: two-phase computation (SPEC 4); same function, for comparisons")
      ->capture_default_str();
  // optimisation
  s->add_option("--batch-size", c.batch_size, "Sequences per micro-batch")->capture_default_str();
  s->add_option("--seq-len", c.seq_len, "Tokens per sequence (context length)")
      ->capture_default_str();
  s->add_option("--grad-accum", c.grad_accum, "Micro-batches per step")->capture_default_str();
  s->add_option("--steps", c.steps, "Optimizer steps")->capture_default_str();
  s->add_option("--lr", c.adamw.lr, "Peak learning rate")->capture_default_str();
  s->add_option("--min-lr-ratio", c.schedule.min_lr_ratio, "Final lr / peak lr")
      ->capture_default_str();
  s->add_option("--warmup", c.schedule.warmup_steps, "Linear warm-up steps")->capture_default_str();
  add_enum_option(s, "--schedule", c.schedule.kind, parse_schedule_kind, "cosine | wsd | constant",
                  {"cosine", "wsd", "constant"});
  s->add_option("--decay-fraction", c.schedule.decay_fraction, "WSD: fraction of steps decaying")
      ->capture_default_str();
  s->add_option("--weight-decay", c.adamw.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str();
  s->add_option("--beta1", c.adamw.beta1, "AdamW beta1")->capture_default_str();
  s->add_option("--beta2", c.adamw.beta2, "AdamW beta2")->capture_default_str();
  s->add_option("--router-lr-mult", c.router_lr_mult,
                "Learning-rate multiplier for the residual mode's own tensors (AttnRes queries "
                "and key gains; the baselines' mixing weights)")
      ->capture_default_str();
  s->add_option("--router-warmup", c.router_warmup,
                "Warm-up steps of those tensors (-1 = --warmup)")
      ->capture_default_str();
  s->add_option("--grad-clip", c.grad_clip, "Global grad-norm clip (0 = off)")
      ->capture_default_str();
  s->add_option("--seed", c.seed, "Seed for initialisation and batch order")
      ->check(uint64_value())
      ->capture_default_str();
  // evaluation, checkpoints, output
  s->add_option("--eval-every", c.eval_every, "Evaluate every K steps (0 = at the end)")
      ->capture_default_str();
  s->add_option("--eval-batches", c.eval_batches, "Validation batches per evaluation")
      ->capture_default_str();
  s->add_option("--save-every", c.save_every, "Checkpoint every K steps (0 = at the end)")
      ->capture_default_str();
  s->add_option("--keep-checkpoints", c.keep_checkpoints, "Checkpoints kept")
      ->capture_default_str();
  s->add_option("--log-every", c.log_every, "Metrics line every K steps")->capture_default_str();
}

Corpus read_trained_corpus(const TrainConfig& t, const std::string& run_dir) {
  std::error_code ec;
  // (it said only "corpus ... does not exist; check the data path"; seventeenth pass)
  check(std::filesystem::exists(t.data_path, ec),
        "the corpus the run in '" + run_dir + "' trained on, '" + t.data_path +
            "', is gone (moved or deleted): restore it, or pass --data to measure on another text");
  Corpus c = read_corpus(t.data_path, run_dir);
  const std::string got = hex64(fnv1a64(c.text));
  check(t.corpus_fingerprint.empty() || got == t.corpus_fingerprint,
        "the corpus '" + t.data_path + "' of the run in '" + run_dir +
            "' changed since the run trained on it (fingerprint " + got + ", the run's " +
            t.corpus_fingerprint +
            "): its validation split would no longer be held-out text. Restore the corpus, or "
            "pass --data with other text (`attnres eval --data " +
            shell_word(t.data_path) +
            " --split all` measures the whole text as it is now, not as held-out text)");
  return c;
}

std::optional<TrainConfig> run_config_beside(const std::string& model, const Metadata& meta,
                                             std::string* run_dir) {
  namespace fs = std::filesystem;
  fs::path dir = fs::path(model).parent_path();
  // A step checkpoint (RUN/checkpoints/step_N/model.safetensors): the run is two levels up.
  if (!fs::exists(dir / "train_config.json") && dir.parent_path().filename() == "checkpoints") {
    dir = dir.parent_path().parent_path();
  }
  const fs::path tc = dir / "train_config.json";
  if (!fs::exists(tc)) return std::nullopt;
  if (run_dir) *run_dir = dir.string();
  const std::string text =
      read_small_file(tc.string(), kMaxTrainConfigBytes, "a run's train_config.json");
  TrainConfig t;
  try {
    t = TrainConfig::from_json(text);
  } catch (const Error& e) {
    throw Error("'" + tc.string() + "' (the settings of the run beside '" + model +
                "') is damaged: " + e.what() + "; restore it, or give --data and --val-fraction");
  }
  const auto rec = meta.find(kConfigHashKey);  // (absent: a model of an older build)
  check(rec == meta.end() || train_config_fingerprint_matches(rec->second, text),
        "'" + model + "' was not trained by the run whose '" + tc.string() +
            "' is beside it (the model records other settings): that run's corpus and "
            "validation split say nothing about it. Give --data (and --val-fraction) to measure "
            "it on text you choose");
  return t;
}

}  // namespace attnres::cli
