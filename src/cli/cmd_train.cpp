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

namespace attnres::cli {

namespace {

std::atomic<bool> g_stop{false};
extern "C" void on_signal(int) {
  if (g_stop.load()) std::_Exit(130);  // second Ctrl-C: leave now
  g_stop.store(true);
}

struct TrainArgs {
  TrainConfig cfg;
  bool untied = false;
  int64_t sample_tokens = 200;
  std::string prompt = "The ";
};

void run_train(TrainArgs& a) {
  TrainConfig& cfg = a.cfg;
  cfg.model.tied = !a.untied;
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
  g_stop.store(false);
  ev.stop = &g_stop;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  const TrainResult r = train(cfg, ev);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
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
  TrainConfig& c = a->cfg;
  c.data_path = kDefaultCorpus;
  CLI::App* s = app.add_subcommand("train", "Train a model on a text corpus");
  s->add_option("--data", c.data_path, "UTF-8 text file or directory of them")
      ->capture_default_str();
  s->add_option("--out", c.out_dir, "Run directory (checkpoints, metrics, final model)")
      ->capture_default_str();
  s->add_flag("--resume", c.resume, "Continue the run in --out from its latest checkpoint");
  s->add_option("--tokenizer", c.tokenizer, "byte | bpe (SentencePiece BPE trained on the corpus)")
      ->capture_default_str();
  s->add_option("--vocab-size", c.bpe_vocab, "BPE vocabulary size")->capture_default_str();
  s->add_option("--val-fraction", c.val_fraction, "Held-out fraction of the tokens")
      ->capture_default_str();
  // model
  s->add_option("--n-layer", c.model.n_layer, "Transformer blocks")->capture_default_str();
  s->add_option("--n-head", c.model.n_head, "Attention heads")->capture_default_str();
  s->add_option("--n-kv-head", c.model.n_kv_head, "Key/value heads (GQA; 0 = n_head)")->capture_default_str();
  s->add_option("--d-model", c.model.d_model, "Model width")->capture_default_str();
  s->add_option("--ffn-hidden", c.model.ffn_hidden, "SwiGLU hidden width (0 = 8/3 d)")
      ->capture_default_str();
  s->add_flag("--untied", a->untied, "Separate LM head instead of the tied embedding");
  ResidualConfig& r = c.model.residual;
  s->add_option("--residual", r.mode, "Residual: prenorm | full | block | static | denseformer")
      ->check(CLI::IsMember({"prenorm", "full", "block", "static", "denseformer"}))
      ->capture_default_str();
  s->add_option("--block-size", r.block_size, "block: sublayers per block (S)")
      ->capture_default_str();
  s->add_option("--attnres-gate", r.gate, "full/block: softmax | sigmoid")
      ->check(CLI::IsMember({"softmax", "sigmoid"}))
      ->capture_default_str();
  s->add_option("--attnres-key-norm", r.key_norm, "full/block: rms | none (RMSNorm on keys)")
      ->check(CLI::IsMember({"rms", "none"}))
      ->capture_default_str();
  s->add_option("--attnres-heads", r.heads, "full/block: depth-attention heads (split d)")
      ->capture_default_str();
  s->add_option("--attnres-query", r.query,
                "full/block: static | dynamic (query = w + W * most recent source)")
      ->check(CLI::IsMember({"static", "dynamic"}))
      ->capture_default_str();
  s->add_option("--attnres-window", r.window,
                "full/block: embedding plus the last K sources only (0 = all)")
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
  s->add_option("--schedule", c.schedule.kind, "cosine | wsd | constant")->capture_default_str();
  s->add_option("--decay-fraction", c.schedule.decay_fraction, "WSD: fraction of steps decaying")
      ->capture_default_str();
  s->add_option("--weight-decay", c.adamw.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str();
  s->add_option("--beta1", c.adamw.beta1, "AdamW beta1")->capture_default_str();
  s->add_option("--beta2", c.adamw.beta2, "AdamW beta2")->capture_default_str();
  s->add_option("--grad-clip", c.grad_clip, "Global grad-norm clip (0 = off)")
      ->capture_default_str();
  s->add_option("--seed", c.seed, "Seed for initialisation and batch order")->capture_default_str();
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
  s->add_option("--sample-tokens", a->sample_tokens, "Tokens sampled after training (0 = none)")
      ->capture_default_str();
  s->add_option("--prompt", a->prompt, "Prompt of the final sample")->capture_default_str();
  s->callback([a] { run_train(*a); });
}

}  // namespace attnres::cli
