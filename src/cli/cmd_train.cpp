// `attnres train`: train a model on a text corpus, with a progress bar, evaluation and a sample;
// data parallel over MPI when launched with `mpirun -np N` (see attnres/dist.hpp).
#include <omp.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <new>
#include <thread>
#include <vector>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/generate.hpp"
#include "attnres/train.hpp"
#include "cli/commands.hpp"
#include "cli/inert_options.hpp"
#include "cli/progress.hpp"
#include "cli/train_options.hpp"
#include "report/stats.hpp"

namespace attnres::cli {

namespace {

struct DistArgs {
  double timeout_s = 300;
  double bucket_mib = 16;
};

// Ranks sharing a host split its cores: mpirun may bind each rank to its own cores (then OpenMP
// already sees only those), else each rank takes cores / ranks-on-this-host threads. An explicit
// --threads or OMP_NUM_THREADS wins.
void set_rank_threads(const dist::Communicator& comm) {
  if (comm.size() == 1 || requested_threads() > 0 || std::getenv("OMP_NUM_THREADS")) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  int allowed = std::min(static_cast<int>(online), omp_get_thread_limit());  // oneDNN: main.cpp
  if (::sched_getaffinity(0, sizeof set, &set) == 0) allowed = std::min(allowed, CPU_COUNT(&set));
  if (allowed < online) {
    omp_set_num_threads(std::max(1, allowed));  // bound by the launcher
    return;
  }
  int local = comm.size();
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(v));
  omp_set_num_threads(std::max(1, allowed / local));
}

void train_ranks(TrainArgs& a, dist::Communicator& comm) {
  TrainConfig& cfg = a.cfg;
  const bool root = comm.is_root();
  Progress bar(cfg.log_every);
  TrainEvents ev;
  ev.on_message = [&](const std::string& m) { bar.message(m); };
  ev.on_step = [&](const StepInfo& s) {
    char f[160];
    std::snprintf(f, sizeof f, "loss %.4f | lr %.2e | %s", s.loss, s.lr,
                  speed_text(s.tokens_per_s).c_str());
    bar.update(s.step, s.total_steps, f, s.eta_s);
  };
  ev.on_eval = [&](const EvalInfo& e) {
    char f[160];
    std::snprintf(f, sizeof f, "step %lld: val loss %.4f (train %.4f)",
                  static_cast<long long>(e.step), e.val_loss, e.train_loss);
    bar.message(f);
  };
  ev.stop = install_stop_handler();
  ev.continued = continue_counter;
  if (root && comm.size() > 1) {
    bar.message("ranks: " + std::to_string(comm.size()) + " (" + comm.backend() + "), " +
                std::to_string(omp_get_max_threads()) + " thread(s) each");
  }
  adopt_saved_layout(a, comm.size());
  const TrainResult r = train(cfg, ev, comm);
  remove_stop_handler();
  // Peak memory of every rank (they differ: pipeline stages hold different activations).
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  std::vector<double> peak_mib(static_cast<size_t>(comm.size()), 0.0);
  peak_mib[static_cast<size_t>(comm.rank())] = static_cast<double>(ru.ru_maxrss) / 1024.0;
  comm.allreduce_sum(peak_mib.data(), comm.size());
  if (!root) return;  // rank 0 alone reports and samples
  bar.finish();
  if (r.interrupted) {
    std::printf("stopped at step %lld; continue with: %s\n", static_cast<long long>(r.steps_done),
                r.resume_command.c_str());
    return;
  }
  std::string memory;  // "355" or "rank 0 413 / rank 1 380"
  for (size_t k = 0; k < peak_mib.size(); k++) {
    char buf[48];
    if (peak_mib.size() == 1) {
      std::snprintf(buf, sizeof buf, "%.0f", peak_mib[k]);
    } else {
      std::snprintf(buf, sizeof buf, "%srank %zu %.0f", k ? " / " : "", k, peak_mib[k]);
    }
    memory += buf;
  }
  // Only measured figures: a run resumed after its last step took no step here, so it has no
  // throughput of its own (its final weights were evaluated).
  std::string val = "no evaluation";
  char speed[96] = "no steps timed in this call";
  if (r.final_val_loss) {
    char loss[32];
    std::snprintf(loss, sizeof loss, "%.4f", *r.final_val_loss);
    val = std::string(loss) + " (ppl " + stats::perplexity_text(*r.final_val_loss, 2) + ")";
  }
  if (r.tokens_per_s && r.model_gflops) {
    std::snprintf(speed, sizeof speed, "%s tok/s, %.1f GFLOP/s model FLOPs",
                  format_count(*r.tokens_per_s).c_str(), *r.model_gflops);
  }
  // (a resumed run's time is this call's: "1500 steps in 00:02" counted 691 of them; 17th pass)
  const std::string steps =
      std::to_string(r.steps_done) + " steps" +
      (r.first_step > 0 ? " (" + std::to_string(r.steps_done - r.first_step) + " in this call)"
                        : std::string());
  std::printf(
      "done: %s in %s | final val loss %s | %s | %lld params | peak memory %s MiB\nmodel: %s\n",
      steps.c_str(), format_duration(r.seconds).c_str(), val.c_str(), speed,
      static_cast<long long>(r.num_params), memory.c_str(), r.model_path.c_str());
  // The closing sample the run records (a plain --resume samples as the run started).
  const int64_t sample_tokens = r.sample_tokens >= 0 ? r.sample_tokens : a.sample_tokens;
  const std::string& prompt_text = r.sample_tokens >= 0 ? r.prompt : a.prompt;
  if (sample_tokens > 0) {
    Metadata meta;
    auto model = load_model(r.model_path, &meta);
    auto tok = load_checkpoint_tokenizer(meta, r.model_path, model->config().vocab_size);
    SamplingConfig sc;
    sc.temperature = 0.8;
    sc.top_k = 40;
    sc.seed = cfg.seed;
    auto prompt = tok->encode(prompt_text);
    if (prompt.empty()) prompt.push_back(0);
    // The model is saved by now: a --prompt longer than the context is cut from the left (a
    // failed exit here would make a script retry and throw the trained model away).
    const int64_t ctx = model->config().max_seq_len, keep = std::max<int64_t>(1, ctx / 2);
    if (static_cast<int64_t>(prompt.size()) >= ctx) {
      std::printf(
          "note: --prompt is %zu tokens, the context %lld: the sample starts from its "
          "last %lld\n",
          prompt.size(), static_cast<long long>(ctx), static_cast<long long>(keep));
      prompt.erase(prompt.begin(), prompt.end() - keep);
    }
    auto out = generate(*model, prompt, sample_tokens, sc, nullptr);
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), out.begin(), out.end());
    const bool cut = static_cast<int64_t>(out.size()) < sample_tokens;  // the context is full
    // (written whole: a NUL byte in it, token 0 of the byte tokenizer, ended a %s early)
    const std::string text = tok->decode(all);
    std::printf(
        "sample (temperature 0.8, top-k 40%s):\n----\n",
        cut ? (", " + std::to_string(out.size()) + " tokens: the context is full").c_str() : "");
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n----\n");
  }
}

void run_train(TrainArgs& a, const DistArgs& d) {
  a.finalize();
  std::unique_ptr<dist::Communicator> comm = dist::init_world();
  comm->set_timeout(d.timeout_s);
  set_rank_threads(*comm);
  if (comm->size() == 1) {
    train_ranks(a, *comm);
    return;
  }
  // A rank that fails must take the others down with it, or they would wait for it in the next
  // collective until the --dist-timeout watchdog fires.
  try {
    train_ranks(a, *comm);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    if (comm->is_root()) {
      std::fprintf(stderr, "\nerror: %s\n", cause_of(e).c_str());
    } else {
      // Most errors (bad options, unreadable data) are raised on every rank alike: give rank 0
      // a moment to report and end the job (mpirun's SIGTERM now ends this process), so the
      // message appears once.
      remove_stop_handler();
      std::this_thread::sleep_for(std::chrono::seconds(2));
      std::fprintf(stderr, "\nerror (rank %d): %s\n", comm->rank(), cause_of(e).c_str());
    }
    comm->abort(dynamic_cast<const Error*>(&e) || dynamic_cast<const std::bad_alloc*>(&e) ? 1 : 2);
  }
}

}  // namespace

void add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  auto d = std::make_shared<DistArgs>();
  CLI::App* s = app.add_subcommand("train", "Train a model on a text corpus");
  add_train_options(s, *a);
  s->add_option("--out", a->cfg.out_dir, "Run directory (checkpoints, metrics, final model)")
      ->capture_default_str();
  s->add_flag("--resume", a->cfg.resume, "Continue the run in --out from its latest checkpoint");
  s->add_flag("--overwrite", a->cfg.overwrite,
              "Start a new run in an --out that holds one, deleting that run's checkpoints, log "
              "and model (without it, that is an error)");
  s->add_option("--init-from", a->cfg.init_from,
                "Start from this checkpoint's weights instead of the seed's (same model size; "
                "AttnRes tensors missing from it start as in a new run)")
      ->check(CLI::ExistingPath);  // (a directory: the loader says which file it holds)
  s->add_option("--sample-tokens", a->sample_tokens, "Tokens sampled after training (0 = none)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))  // (-1 was taken; 22nd hostile pass)
      ->capture_default_str();
  s->add_option("--prompt", a->prompt, "Prompt of the final sample")->capture_default_str();
  s->add_flag("--zero1", a->cfg.zero1,
              "Multi-process runs: shard the AdamW moments over the ranks (ZeRO-1): each of N "
              "ranks keeps 1/N of them; results are bit-identical");
  s->add_option("--pipeline", a->cfg.pipeline,
                "Multi-process runs: pipelines of N ranks, each running consecutive sublayers "
                "(N = the rank count: one pipeline; a divisor of it: data-parallel pipelines); "
                "block or full AttnRes only")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
      ->capture_default_str();
  s->add_option("--virtual-stages", a->cfg.virtual_stages,
                "Pipeline: stages per rank, interleaved (stage k on rank k mod N); shrinks the "
                "bubble and is where cached block communication saves bytes")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
      ->capture_default_str();
  s->add_option("--pipeline-comm", a->cfg.pipeline_comm,
                "Pipeline: how block representations travel between stages: cached (each rank "
                "keeps what it received; only new blocks are sent, SPEC 5) or naive (all blocks "
                "every time)")
      ->check(CLI::IsMember({"cached", "naive"}))
      ->capture_default_str();
  s->add_option("--dist-timeout", d->timeout_s,
                "Multi-process runs: seconds a rank may wait for the others in one collective "
                "before the job is aborted (0 = wait forever)")
      ->check(CLI::Validator(
          [](const std::string& v) {  // (NaN passes every comparison; CLI11's range printed
                                      //  DBL_MAX in 300 digits: seventeenth pass)
            char* end = nullptr;
            const double t = std::strtod(v.c_str(), &end);
            return end != v.c_str() && *end == '\0' && std::isfinite(t) && t >= 0
                       ? std::string()
                       : "'" + v +
                             "': --dist-timeout must be a finite number of seconds >= 0 (0 = "
                             "wait forever)";
          },
          "SECONDS"))
      ->capture_default_str();
  s->add_option("--grad-overlap", a->cfg.grad_overlap,
                "Data parallel on the CPU: sum each gradient bucket over the ranks while the "
                "backward pass goes on (true) or after it (false); bit-identical results")
      ->capture_default_str();
  s->add_option(
       "--grad-bucket-mib", d->bucket_mib,
       "Multi-process runs: MiB of gradients per all-reduce bucket, the unit "
       "--grad-overlap sends (on 3+ ranks the sums' order, so the last bits, depend on it)")
      ->check(CLI::Validator(
          [](const std::string& v) {
            char* end = nullptr;
            const double m = std::strtod(v.c_str(), &end);
            return end != v.c_str() && *end == '\0' && std::isfinite(m) && m > 0 && m <= 8192
                       ? std::string()
                       : "'" + v + "': --grad-bucket-mib must be a number of MiB in (0, 8192]";
          },
          "MIB"))
      ->capture_default_str();
  s->footer(
      "Data-parallel training on N processes (OpenMPI):\n"
      "  mpirun -np N [--oversubscribe] attnres train ... [--zero1] [--dist-timeout S]\n"
      "Each rank trains on batch-size/N sequences of every micro-batch (--batch-size must be\n"
      "divisible by N) and gradients are summed over ranks, so losses and weights match a\n"
      "1-process run with the same --batch-size. Rank 0 alone prints, writes metrics and\n"
      "checkpoints; a run resumes (--resume) on any number of ranks. The ranks on one host share\n"
      "its cores (override with --threads or OMP_NUM_THREADS). `kill -USR1 <mpirun pid>` stops\n"
      "every rank with a checkpoint (Ctrl-C makes mpirun kill the job). As root, mpirun needs\n"
      "--allow-run-as-root.\n"
      "Pipeline-parallel training (Block or Full AttnRes) on N processes:\n"
      "  mpirun -np N attnres train --residual block ... --pipeline N [--virtual-stages V]\n"
      "      --grad-accum M [--pipeline-comm cached|naive]\n"
      "The sublayers are cut into N*V stages; each step pushes M micro-batches of --batch-size\n"
      "sequences through them (1F1B); losses and weights match a 1-process run with the same\n"
      "--batch-size and --grad-accum. With N x D ranks, --pipeline N makes D data-parallel\n"
      "pipelines, each on batch-size/D sequences. See docs/DISTRIBUTED.md.");
  s->callback([a, d, s] {
    // The closing sample: a new run records it; a resume takes the run's unless given.
    if (!a->cfg.resume || s->count("--sample-tokens") > 0 || s->count("--prompt") > 0) {
      a->cfg.sample_tokens = a->sample_tokens;
      a->cfg.prompt = a->prompt;
    }
    if (a->cfg.resume) {
      check_resume_options(*s, a->cfg.out_dir);
      apply_saved_runtime(*s, *a);
      TrainArgs::LayoutGiven& g = a->layout_given;
      g.pipeline = s->count("--pipeline") > 0;
      g.virtual_stages = s->count("--virtual-stages") > 0;
      g.pipeline_comm = s->count("--pipeline-comm") > 0;
      g.zero1 = s->count("--zero1") > 0;
      g.grad_bucket = s->count("--grad-bucket-mib") > 0;
    }
    if (s->count("--grad-bucket-mib") > 0) {
      a->cfg.grad_bucket_elems = std::max<int64_t>(16, std::llround(d->bucket_mib * (1 << 20) / 4));
    }
    if (!a->cfg.resume && !a->cfg.init_from.empty()) apply_init_from_defaults(*s, *a);
    // Options that do nothing in this run are refused (taken without a word, they mislead).
    if (!a->cfg.resume) {
      const std::vector<InertOption> inert = inert_options(*s, a->cfg);
      check(inert.empty(), inert.empty() ? std::string() : inert.front().why);
    }
    run_train(*a, *d);
  });
}

}  // namespace attnres::cli
