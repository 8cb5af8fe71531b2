// `attnres train`: train a model on a text corpus, with a progress bar, evaluation and a sample.
#include <sys/resource.h>

#include <csignal>
#include <cmath>
#include <cstdio>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/generate.hpp"
#include "attnres/train.hpp"
#include "cli/commands.hpp"
#include "cli/progress.hpp"
#include "cli/train_options.hpp"

namespace attnres::cli {

namespace {

void run_train(TrainArgs& a) {
  TrainConfig& cfg = a.cfg;
  a.finalize();
  Progress bar(cfg.log_every);
  TrainEvents ev;
  ev.on_message = [&](const std::string& m) { bar.message(m); };
  ev.on_step = [&](const StepInfo& s) {
    char f[160];
    std::snprintf(f, sizeof f, "loss %.4f | lr %.2e | %s tok/s", s.loss, s.lr,
                  format_count(s.tokens_per_s).c_str());
    bar.update(s.step, s.total_steps, f, s.eta_s);
  };
  ev.on_eval = [&](const EvalInfo& e) {
    char f[160];
    std::snprintf(f, sizeof f, "step %lld: val loss %.4f (train %.4f)",
                  static_cast<long long>(e.step), e.val_loss, e.train_loss);
    bar.message(f);
  };
  ev.stop = install_stop_handler();
  const TrainResult r = train(cfg, ev);
  remove_stop_handler();
  bar.finish();
  if (r.interrupted) {
    std::printf("stopped at step %lld; continue with: attnres train --resume --out %s\n",
                static_cast<long long>(r.steps_done), cfg.out_dir.c_str());
    return;
  }
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  std::printf(
      "done: %lld steps in %s | final val loss %.4f (ppl %.2f) | %s tok/s, %.1f GFLOP/s model "
      "FLOPs | %lld params | peak memory %.0f MiB\nmodel: %s\n",
      static_cast<long long>(r.steps_done), format_duration(r.seconds).c_str(),
      r.final_val_loss, std::exp(r.final_val_loss), format_count(r.tokens_per_s).c_str(),
      r.model_gflops, static_cast<long long>(r.num_params), ru.ru_maxrss / 1024.0,
      r.model_path.c_str());
  if (a.sample_tokens > 0) {
    Metadata meta;
    auto model = load_model(r.model_path, &meta);
    auto tok = load_tokenizer(meta.at("tokenizer"), cfg.out_dir);
    SamplingConfig sc;
    sc.temperature = 0.8;
    sc.top_k = 40;
    sc.seed = cfg.seed;
    auto prompt = tok->encode(a.prompt);
    if (prompt.empty()) prompt.push_back(0);
    auto out = generate(*model, prompt, a.sample_tokens, sc, nullptr);
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), out.begin(), out.end());
    std::printf("sample (temperature 0.8, top-k 40):\n----\n%s\n----\n", tok->decode(all).c_str());
  }
}

}  // namespace

void add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* s = app.add_subcommand("train", "Train a model on a text corpus");
  add_train_options(s, *a);
  s->add_option("--out", a->cfg.out_dir, "Run directory (checkpoints, metrics, final model)")
      ->capture_default_str();
  s->add_flag("--resume", a->cfg.resume, "Continue the run in --out from its latest checkpoint");
  s->add_option("--sample-tokens", a->sample_tokens, "Tokens sampled after training (0 = none)")
      ->capture_default_str();
  s->add_option("--prompt", a->prompt, "Prompt of the final sample")->capture_default_str();
  s->callback([a] { run_train(*a); });
}

}  // namespace attnres::cli
