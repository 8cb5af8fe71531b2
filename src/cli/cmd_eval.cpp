// `attnres eval`: loss and perplexity of a checkpoint on a corpus's held-out split.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/tasks.hpp"
#include "attnres/train.hpp"
#include "backend/backend.hpp"
#include "cli/commands.hpp"
#include "cli/device_options.hpp"
#include "cli/progress.hpp"
#include "cli/train_options.hpp"
#include "core/number_text.hpp"
#include "report/stats.hpp"
#include "train/evaluate.hpp"

namespace attnres::cli {

namespace {

struct EvalArgs {
  std::string model, data, split = "val";
  DeviceArgs dev;
  int64_t seq_len = 0, batch_size = 8, batches = 50;
  double val_fraction = -1;
  std::vector<std::string> tasks;
};

std::string with_stderr(double v, double se) {
  char b[64];
  if (std::isnan(se)) {
    std::snprintf(b, sizeof b, "%.4f (1 item: no standard error)", v);
  } else {
    std::snprintf(b, sizeof b, "%.4f +- %.4f", v, se);
  }
  return b;
}

// Said beside a result computed with bf16 products (it differs from fp32's in the third digit).
const char* products_note(const DeviceArgs& d) {
  return d.precision == MatmulPrecision::bf16 ? " | bf16 matrix products" : "";
}

// `eval --task FILE...`: each task file's accuracy (attnres/tasks.hpp), instead of the loss.

void run_tasks(const EvalArgs& a, Model& model, const Tokenizer& tok) {
  std::vector<Task> tasks;
  for (const std::string& p : a.tasks) tasks.push_back(read_task(p));  // (all checked first)
  for (const Task& t : tasks) {
    const TaskResult r = score_task(model, tok, t);
    for (const auto& s : r.logliks) {
      for (double x : s) {
        check(std::isfinite(x), "a log-likelihood on task '" + t.path +
                                    "' is not finite: the weights of '" + a.model +
                                    "' overflow the forward pass (evaluate an earlier checkpoint)");
      }
    }
    std::printf("task %s (%s, %lld %s): acc %s", t.path.c_str(), to_string(t.kind),
                static_cast<long long>(r.items),
                t.kind == TaskKind::minimal_pair ? (r.items == 1 ? "pair" : "pairs")
                                                 : (r.items == 1 ? "item" : "items"),
                with_stderr(r.acc, r.acc_stderr).c_str());
    if (r.acc_norm >= 0) {
      std::printf(" | acc_norm %s", with_stderr(r.acc_norm, r.acc_norm_stderr).c_str());
    }
    std::printf("%s\n", products_note(a.dev));
    if (r.items_cut > 0) {  // (eighteenth hostile pass: cut without a word)
      std::printf(
          "note: %lld item(s) longer than the model's context of %lld tokens were scored "
          "on their context's last tokens (cut from the left)\n",
          static_cast<long long>(r.items_cut), static_cast<long long>(model.config().max_seq_len));
    }
  }
}

// The corpora a model's weights trained on, each with the share of it held out: its run's (from
// the train_config.json beside it, when there is one), its own metadata's (a model copied out of
// its run), and those of the models its weights started from (--init-from, kept through
// export-hf and import-hf; 24th hostile pass).
std::vector<TrainedOn> corpora_of(const std::optional<TrainConfig>& run, const Metadata& meta) {
  std::vector<TrainedOn> all = trained_on(meta);
  if (run && !run->corpus_fingerprint.empty() && run->val_fraction > 0) {
    all.insert(all.begin(),
               {run->corpus_fingerprint, run->val_fraction, run->tokenizer_fingerprint});
  }
  return all;
}

void run_eval(const EvalArgs& a) {
  Metadata meta;
  std::shared_ptr<Backend> be = open_backend(a.dev);
  auto model = load_model(a.model, &meta, 0, be);
  if (!a.tasks.empty()) {
    auto tok = load_checkpoint_tokenizer(meta, a.model, model->config().vocab_size);
    run_tasks(a, *model, *tok);
    return;
  }
  // Defaults from the run that produced the model, when its train_config.json is beside it.
  std::string data = a.data;
  double val_fraction = a.val_fraction;
  std::optional<Corpus> corpus;
  std::optional<TrainConfig> run;
  std::string run_dir;
  if (data.empty() || val_fraction < 0) {
    run = run_config_beside(a.model, meta, &run_dir);
  } else {
    try {  // (only to know whether --data is the run's own corpus; below)
      run = run_config_beside(a.model, meta, &run_dir);
    } catch (const Error&) {  // another run's directory: its corpus says nothing of this model
    }
  }
  if (run && data.empty()) {
    data = run->data_path;
    corpus = read_trained_corpus(*run, run_dir);
  }
  check(!data.empty(), "no --data given and no train_config.json beside '" + a.model + "'");
  check(val_fraction < 0 || (val_fraction > 0 && val_fraction < 1),
        "--val-fraction must be in (0, 1)");
  auto tok = load_checkpoint_tokenizer(meta, a.model, model->config().vocab_size);
  if (!corpus) corpus = read_corpus(data);
  // A larger held-out share of the run's own corpus (by default, or named by --data: the same
  // text at any path, or the run's corpus path even edited since) reaches into the text it
  // trained on, and was reported as a val loss (18th, 19th and 20th hostile passes; a model
  // copied out of its run, by the corpus and share its metadata records: 21st).
  std::error_code ec;
  const bool by_path = run && (a.data.empty() || absolute_path(a.data) == run->data_path ||
                               std::filesystem::equivalent(a.data, run->data_path, ec));
  const std::string fingerprint = hex64(fnv1a64(corpus->text));
  // The smallest share held out of this text where the weights trained on it (by path: the run's
  // corpus; by text: any corpus they trained on); -1 when they never did.
  double held_out = by_path && run->val_fraction > 0 ? run->val_fraction : -1;
  // A share counted in another tokenizer's tokens says nothing of this split (28th hostile pass).
  const auto tk = meta.find(kTokenizerHashKey);
  const std::string model_tok = tk == meta.end() ? std::string() : tk->second;
  const std::vector<TrainedOn> shares = corpora_of(run, meta);
  for (const TrainedOn& t : shares) {
    if (t.fingerprint != fingerprint) continue;
    if (held_out < 0 || t.val_fraction < held_out) held_out = t.val_fraction;
  }
  const TrainedOn* other =
      model_tok.empty() ? nullptr : share_of_another_tokenizer(shares, fingerprint, model_tok);
  check(!other || a.split != "val",
        "the weights of '" + a.model + "' started from a model that trained on this text with " +
            "another tokenizer (fingerprint " + (other ? other->tokenizer : std::string()) +
            ", this model's " + model_tok +
            "): the share it held out was counted in that tokenizer's tokens, which cut the " +
            "text elsewhere, so no val split of it is known to be held out; evaluate on other " +
            "text, or pass --split all to measure the whole text (not held out)");
  const bool own_corpus = held_out > 0;
  // The run's corpus changed since (cut, extended, a file of its directory removed): the val
  // split of the text as it is now need not be the run's held-out text, and was training text
  // reported as held out (twenty-third hostile pass).
  check(!by_path || a.split != "val" || run->corpus_fingerprint.empty() ||
            fingerprint == run->corpus_fingerprint,
        "'" + data + "' is the corpus the run in '" + run_dir +
            "' trained on, changed since (fingerprint " + fingerprint + ", the run's " +
            (run ? run->corpus_fingerprint : std::string()) +
            "): its val split is no longer the run's held-out text and may be text the model "
            "trained on. Restore the corpus, evaluate on other text, or pass --split all to "
            "measure the whole text as it is now (not held out)");
  if (val_fraction < 0) {
    val_fraction = own_corpus ? held_out : run ? run->val_fraction : 0.1;
  }
  check(!own_corpus || a.split != "val" || val_fraction <= held_out,
        "--val-fraction " + exact_text(val_fraction) + " is larger than the run's (" +
            exact_text(held_out) + ") on the corpus it trained on (its own run's, or that " +
            "of a model its weights started from): that val split would include text the " +
            "model trained on; give at most " + exact_text(held_out) +
            ", or --data with other text");
  const std::vector<int32_t> ids = tok->encode(corpus->text);
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t n_train = static_cast<int64_t>(static_cast<double>(n) * (1.0 - val_fraction));
  TokenSpan span = a.split == "val"     ? TokenSpan(ids.data() + n_train, n - n_train)
                   : a.split == "train" ? TokenSpan(ids.data(), n_train)
                                        : TokenSpan(ids.data(), n);
  // (a window past the context the model was trained with would be measured as a shorter one)
  check(a.seq_len <= model->config().max_seq_len,
        "--seq-len " + std::to_string(a.seq_len) + " is beyond the context of '" + a.model + "' (" +
            std::to_string(model->config().max_seq_len) +
            " tokens, its max_seq_len); give at most that");
  const int64_t T = a.seq_len > 0 ? a.seq_len : model->config().max_seq_len;
  const int64_t windows = span.num_windows(T);
  check(windows >= 1, "the " + a.split + " split has " + std::to_string(span.size()) +
                          " tokens, fewer than seq_len + 1; use --seq-len smaller or more data");
  const int64_t B = std::min(a.batch_size, windows);
  Progress bar(10);
  auto comm = std::move(dist::make_local_group(1)[0]);
  const auto t0 = std::chrono::steady_clock::now();
  const WindowLoss w = window_loss(
      *model, span, B, T, a.batches, *comm, /*whole_batches=*/true,
      [&](int64_t done, int64_t total, double mean) {
        char f[64];
        std::snprintf(f, sizeof f, "loss %.4f", mean);
        // (the ETA was always 00:00; twenty-first hostile pass)
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        bar.update(
            done, total, f,
            done > 0 ? secs / static_cast<double>(done) * static_cast<double>(total - done) : 0.0);
      });
  bar.finish();
  // Finite weights can still overflow (e.g. 1e18 in every weight): no loss is printed then.
  check(std::isfinite(w.loss), "the loss of '" + a.model + "' on this data is not finite (" +
                                   std::to_string(w.loss) +
                                   "): its weights overflow the forward pass; the checkpoint is "
                                   "unusable (evaluate an earlier one)");
  const std::string ppl = stats::perplexity_text(w.loss, 3);  // (no "inf" as a measurement)
  std::printf(
      "%s split of %s: %lld tokens evaluated | loss %.4f | perplexity %s | %.4f bits/token%s\n",
      a.split.c_str(), data.c_str(), static_cast<long long>(w.windows * T), w.loss, ppl.c_str(),
      w.loss / std::log(2.0), products_note(a.dev));
}

}  // namespace

void add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* s = app.add_subcommand("eval", "Loss and perplexity of a checkpoint on a corpus");
  s->add_option("model,--model", a->model, "model.safetensors to evaluate")->required();
  s->add_option("--data", a->data, "Corpus (default: the one the model was trained on)");
  s->add_option("--split", a->split, "val | train | all")
      ->check(CLI::IsMember({"val", "train", "all"}))
      ->capture_default_str();
  s->add_option(
      "--val-fraction", a->val_fraction,
      "Held-out fraction (default: the run's, as its train_config.json or the model's metadata "
      "records it; else 0.1)");
  // (CLI11 checks the ranges: a batch of 0 windows divided by zero, negative counts reported
  // perplexity 1 over a negative number of tokens)
  s->add_option("--seq-len", a->seq_len, "Window length (default 0: the model's context)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  s->add_option("--batch-size", a->batch_size, "Windows per batch")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  s->add_option("--batches", a->batches, "Most batches to evaluate")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  s->add_option("--task", a->tasks,
                "Score a task file instead of the loss (repeatable): JSON Lines of "
                "{\"context\", \"choices\", \"label\"} (multiple choice: acc and acc_norm) or "
                "{\"sentence_good\", \"sentence_bad\"} (minimal pairs: acc); docs/INTEROP.md")
      ->check(CLI::ExistingFile);
  add_device_options(s, a->dev);
  s->callback([a, s] {
    // (the task file is the text: these were dropped without a word; twelfth hostile pass)
    for (const char* o :
         {"--data", "--split", "--val-fraction", "--seq-len", "--batch-size", "--batches"}) {
      check(a->tasks.empty() || s->count(o) == 0,
            std::string(o) +
                " does not apply to --task (the task file is the text scored); "
                "leave it out, or evaluate the loss and the tasks in two commands");
    }
    check(a->split != "all" || s->count("--val-fraction") == 0,
          "--val-fraction sets where the val split starts, but --split all measures the whole "
          "text: drop it, or pass --split val or train");
    run_eval(*a);
  });
}

}  // namespace attnres::cli
