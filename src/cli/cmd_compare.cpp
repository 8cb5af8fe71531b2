// `attnres compare`: train several configurations that differ only in the residual mode (or a
// swept option) on the same data, tokenizer, initial shared weights, batch order and token budget,
// over several seeds; then write results.json, report.md and plots. `attnres report` redraws them.
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/model.hpp"
#include "attnres/report.hpp"
#include "attnres/safetensors.hpp"
#include "attnres/tasks.hpp"
#include "attnres/train.hpp"
#include "backend/backend.hpp"
#include "cli/commands.hpp"
#include "cli/compare_job.hpp"
#include "cli/inert_options.hpp"
#include "cli/progress.hpp"
#include "cli/train_options.hpp"
#include "core/json_field.hpp"
#include "experiment/compare_results.hpp"
#include "experiment/host_info.hpp"
#include "experiment/run_record.hpp"
#include "report/analysis.hpp"
#include "train/run_dir.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace attnres::cli {

namespace {

// Model sizes and budgets for 2 CPU cores (see README "The main job").
const std::map<std::string, std::vector<std::pair<std::string, std::string>>>& presets() {
  static const std::map<std::string, std::vector<std::pair<std::string, std::string>>> p = {
      {"tiny",
       {{"--n-layer", "2"},
        {"--d-model", "64"},
        {"--n-head", "4"},
        {"--seq-len", "64"},
        {"--batch-size", "8"},
        {"--steps", "200"},
        {"--lr", "3e-3"},
        {"--warmup", "20"},
        {"--eval-every", "50"},
        {"--eval-batches", "8"},
        {"--tokenizer", "byte"}}},
      // The README's main job (~15 minutes for 3 modes x 3 seeds): 32 sublayers, where the modes
      // part ways within a few hundred steps (docs/FINDINGS.md).
      {"small",
       {{"--n-layer", "16"},
        {"--d-model", "128"},
        {"--n-head", "4"},
        {"--seq-len", "128"},
        {"--batch-size", "16"},
        {"--steps", "300"},
        {"--lr", "2e-3"},
        {"--warmup", "50"},
        {"--eval-every", "50"},
        {"--eval-batches", "8"},
        {"--tokenizer", "bpe"},
        {"--vocab-size", "2048"}}},
      // 8 sublayers (the earlier main job): the modes were indistinguishable here at eps 1e-5.
      {"shallow",
       {{"--n-layer", "4"},
        {"--d-model", "128"},
        {"--n-head", "4"},
        {"--seq-len", "128"},
        {"--batch-size", "16"},
        {"--steps", "1500"},
        {"--lr", "3e-3"},
        {"--warmup", "100"},
        {"--eval-every", "150"},
        {"--eval-batches", "16"},
        {"--tokenizer", "bpe"},
        {"--vocab-size", "2048"}}},
      // The configuration of issue 17's measurement, 4x the main job's budget (~1 hour).
      {"deep",
       {{"--n-layer", "16"},
        {"--d-model", "128"},
        {"--n-head", "4"},
        {"--seq-len", "128"},
        {"--batch-size", "16"},
        {"--steps", "1200"},
        {"--lr", "2e-3"},
        {"--warmup", "100"},
        {"--eval-every", "200"},
        {"--eval-batches", "16"},
        {"--tokenizer", "bpe"},
        {"--vocab-size", "2048"}}},
      {"base",
       {{"--n-layer", "6"},
        {"--d-model", "256"},
        {"--n-head", "8"},
        {"--seq-len", "256"},
        {"--batch-size", "16"},
        {"--steps", "3000"},
        {"--lr", "2e-3"},
        {"--warmup", "200"},
        {"--eval-every", "250"},
        {"--eval-batches", "16"},
        {"--tokenizer", "bpe"},
        {"--vocab-size", "4096"}}},
  };
  return p;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else if (c != ' ') {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

std::string safe_name(std::string s) {
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') c = '_';
  }
  return s;
}

struct Group {
  std::string name;
  TrainArgs args;
  json sweep = json::object();
  double est_step_s = 0;
};

std::string num_or(const json& x, const char* f, const char* none = "n/a") {
  if (!x.is_number()) return none;
  char b[48];
  std::snprintf(b, sizeof b, f, x.get<double>());
  return b;
}

// The results table, the paired comparisons and the claims, on the terminal.
void print_summary(const json& results) {
  int w = 28;  // the configuration column fits the longest name
  for (const auto& g : results["groups"]) {
    w = std::max(w, static_cast<int>(g["name"].get<std::string>().size()) + 1);
  }
  const std::string vs = "diff vs " + results.value("baseline", std::string("baseline"));
  std::printf("\n%-*s %24s %6s  %s\n", w, "configuration", "val loss (mean +- std)", "seeds",
              vs.c_str());
  for (const auto& g : results["groups"]) {
    const std::string loss =
        !g["val_loss_mean"].is_number() ? std::string("no finished run")
        : g["val_loss_std"].is_number()
            ? num_or(g["val_loss_mean"], "%.4f") + " +- " + num_or(g["val_loss_std"], "%.4f")
            : num_or(g["val_loss_mean"], "%.4f") + " (1 seed)";
    std::printf("%-*s %24s %3d/%-2lld  %s\n", w, g["name"].get<std::string>().c_str(), loss.c_str(),
                g["seeds"].get<int>(),
                static_cast<long long>(g["seeds"].get<int>() + g["seeds_failed"].get<int64_t>()),
                num_or(g["delta_vs_baseline"], "%+.4f", "-").c_str());
  }
  const json& an = results["analysis"];
  if (!an["comparisons"].empty()) {
    std::printf("\npaired differences over seeds (95%% interval):\n");
    for (const auto& c : an["comparisons"]) {
      const std::string iv = c["n"].get<int>() >= 2
                                 ? num_or(c["lo"], "%+.4f") + " .. " + num_or(c["hi"], "%+.4f")
                                 : std::string("(no interval)");
      std::printf("  %-26s - %-22s %s  %-18s  %s (%d seeds)\n",
                  c["group"].get<std::string>().c_str(), c["vs"].get<std::string>().c_str(),
                  num_or(c["mean"], "%+.4f").c_str(), iv.c_str(),
                  c["verdict"].get<std::string>().c_str(), c["n"].get<int>());
    }
  }
  if (!an["claims"].empty()) {
    std::printf("\nthe paper's claims, measured (report.md has the table):\n");
    for (const auto& c : an["claims"]) {
      std::printf("  %-12s %-60.60s %s\n", c["subject"].get<std::string>().c_str(),
                  c["claim"].get<std::string>().c_str(), c["verdict"].get<std::string>().c_str());
    }
  }
  for (const auto& f : an["failed_runs"]) {
    std::printf("run %s seed %s: %s\n", f["group"].get<std::string>().c_str(),
                f["seed"].dump().c_str(), f["status"].get<std::string>().c_str());
  }
}

using Combo = std::vector<std::pair<std::string, std::string>>;

// Presets fill in only what the command line did not set. With --steps given, the preset's
// warm-up keeps its share of the run (300 steps with warm-up 50, run for 60: warm-up 10).
void apply_preset(CompareArgs& a) {
  if (a.preset != "none") {
    auto it = presets().find(a.preset);
    check(it != presets().end(),
          "unknown --preset '" + a.preset + "'; use tiny, small, shallow, deep, base or none");
    std::map<std::string, std::string> p(it->second.begin(), it->second.end());
    if (a.app->count("--steps") > 0 && a.app->count("--warmup") == 0) {
      const double share = std::stod(p.at("--warmup")) / std::stod(p.at("--steps"));
      p["--warmup"] = std::to_string(static_cast<int64_t>(share * double(a.base.cfg.steps)));
    }
    for (const auto& [opt, val] : p) {
      if (a.app->count(opt) == 0) apply_train_args(a.base, {opt + "=" + val});
    }
  }
}

// --modes: a list of distinct residual modes.
std::vector<std::string> parse_modes(const CompareArgs& a) {
  const std::vector<std::string> modes = split(a.modes, ',');
  check(!modes.empty(), "--modes lists no residual mode");
  // (given, it was ignored: every run trained the --modes; sixteenth hostile pass)
  check(a.app == nullptr || a.app->get_option_no_throw("--residual") == nullptr ||
            a.app->count("--residual") == 0,
        "--residual picks one run's mode; a comparison trains each of --modes (e.g. --modes "
        "prenorm,block): give --modes instead");
  for (size_t i = 0; i < modes.size(); i++) {
    for (size_t j = 0; j < i; j++) {
      check(modes[i] != modes[j], "--modes lists '" + modes[i] + "' twice");
    }
  }
  return modes;
}

// Every combination of the swept values (one empty combination without --sweep).
std::vector<Combo> sweep_combos(const CompareArgs& a) {
  std::vector<Combo> combos = {{}};
  for (const std::string& sw : a.sweeps) {
    const auto eq = sw.find('=');
    check(eq != std::string::npos && eq > 0,
          "--sweep '" + sw + "' must look like OPTION=V1,V2 (e.g. block-size=2,4,8)");
    const std::string key = sw.substr(0, eq);
    const auto vals = split(sw.substr(eq + 1), ',');
    check(!vals.empty(), "--sweep '" + sw + "' lists no value");
    check(sw.find(",,") == std::string::npos && sw.back() != ',' && sw[eq + 1] != ',',
          "--sweep '" + sw + "' has an empty value");
    // What every configuration must share (the seeds, the data and the token budget) or what
    // compare sets itself (the mode) cannot be swept.
    static const std::set<std::string> fixed = {
        "seed",   "residual",  "steps",      "batch-size",      "seq-len",      "grad-accum",
        "data",   "tokenizer", "vocab-size", "tokenizer-model", "val-fraction", "out",
        "resume", "init-from", "help",       "config",          "eval-batches", "eval-every",
        "device", "precision", "cuda-graphs"};
    check(!fixed.count(key),
          "--sweep " + key +
              " cannot vary inside one comparison: every configuration shares the "
              "seeds, data, tokenizer, token budget and evaluation" +
              std::string(key == "residual" ? " (compare the modes with --modes)"
                          : key == "seed"   ? " (use --seeds)"
                          : key == "device" || key == "precision" || key == "cuda-graphs"
                              ? " and the device and precision it records (run one compare "
                                "per value, in its own --out)"
                              : " (run one compare per value)"));
    // (--block-size and --block-layers set the same S: either given decides what the other
    // sweeps)
    const std::string alias = key == "block-size"     ? "block-layers"
                              : key == "block-layers" ? "block-size"
                                                      : key;
    for (const std::string& k : {key, alias}) {
      const CLI::Option* given = a.app->get_option_no_throw("--" + k);
      check(given == nullptr || given->count() == 0,
            "--" + k + " is given and also swept (--sweep " + key + "=...); give only the sweep");
    }
    for (size_t i = 0; i < vals.size(); i++) {
      for (size_t j = 0; j < i; j++) {
        check(vals[i] != vals[j], "--sweep " + key + " lists '" + vals[i] + "' twice");
      }
    }
    for (const std::string& other : a.sweeps) {
      if (&other == &sw) break;
      const std::string other_key = other.substr(0, other.find('='));
      check(other_key != key, "--sweep " + key + " is given twice");
      check(other_key != alias, "--sweep " + key + " and --sweep " + alias +
                                    " both set the block size; sweep one of them");
    }
    // (A one-value sweep was reported as swept, with an "each at its best" table over that one
    // value: 30th hostile pass. An unknown option is refused as such, below.)
    check(vals.size() >= 2 || a.app->get_option_no_throw("--" + key) == nullptr,
          "--sweep " + key + " lists one value (" + vals.front() +
              "): a sweep compares two or more; give --" + key + " " + vals.front() + " instead");
    std::vector<Combo> next;
    for (const auto& c : combos) {
      for (const auto& v : vals) {
        auto c2 = c;
        c2.emplace_back(key, v);
        next.push_back(c2);
      }
    }
    combos = next;
  }
  return combos;
}

// What decides the model a configuration trains, with settings that cannot change it left out or
// brought to one form (logging and checkpoint cadence; the router's rate where there is no
// router; the decay fraction outside wsd; n_kv_head 0 = n_head; a block larger than the model).
std::string model_fingerprint(TrainConfig c) {
  c.model.resolve();
  c.model.validate();  // (a block size or layer count of 0 is divided by below)
  ResidualConfig& r = c.model.residual;
  r.block_size = std::min(r.block_size, c.model.n_sublayers());
  // A window of at least every block's output is no window (the mixer sees all sources).
  const int64_t S = std::max<int64_t>(1, r.effective_block_size());  // (modes without blocks)
  const int64_t blocks = (c.model.n_sublayers() + S - 1) / S;
  if (r.window >= blocks) r.window = 0;
  // Settings written two ways: a key epsilon of 0 is the model's norm_eps (none without a key
  // norm); a router warm-up of -1 is the schedule's.
  if (r.key_eps == 0) r.key_eps = c.model.norm_eps;
  if (r.key_norm == KeyNorm::none) r.key_eps = 0;
  if (c.router_warmup == -1) c.router_warmup = c.schedule.warmup_steps;
  json j = json::parse(c.to_json());
  for (const char* k : {"log_every", "save_every", "keep_checkpoints"}) j.erase(k);
  if (c.model.residual.mode == ResidualMode::prenorm) {
    j.erase("router_lr_mult");
    j.erase("router_warmup");
  }
  if (c.schedule.kind != ScheduleKind::wsd) j.erase("decay_fraction");
  if (c.schedule.kind == ScheduleKind::constant) j.erase("min_lr_ratio");
  // The engine computes in single precision: values equal as floats train one model.
  std::function<void(json&)> as_floats = [&](json& v) {
    if (v.is_number_float()) v = static_cast<double>(static_cast<float>(v.get<double>()));
    if (v.is_structured()) {
      for (auto& e : v) as_floats(e);
    }
  };
  as_floats(j);
  // A setting recorded only where it is not its default: a value equal to the default as a float
  // is the default (--sweep attnres-temperature=1,1.0000000001 trained one model twice).
  if (j.contains("model") && j["model"].contains("attnres_temperature") &&
      j["model"]["attnres_temperature"] == 1.0) {
    j["model"].erase("attnres_temperature");
  }
  // A decay to 1 x the peak is no decay: cosine and wsd are the constant schedule (lr_at returns
  // the peak for every step after the warm-up; --sweep schedule=cosine,constant --min-lr-ratio 1
  // trained one model twice, sixteenth hostile pass).
  if (j.contains("min_lr_ratio") && j["min_lr_ratio"] == 1.0) {
    j["schedule"] = to_string(ScheduleKind::constant);
    j.erase("min_lr_ratio");
    j.erase("decay_fraction");
  }
  return train_config_fingerprint(j.dump());
}

// The configurations: every mode times every combination of swept values.
std::vector<Group> make_groups(const CompareArgs& a, const std::vector<std::string>& modes,
                               const std::vector<Combo>& combos) {
  std::vector<Group> groups;
  for (const std::string& mode : modes) {
    for (const auto& combo : combos) {
      Group g;
      g.args = a.base;
      g.name = mode;
      apply_train_args(g.args, {"--residual=" + mode});
      // (--block-layers N is --block-size 2N: either, given or swept, decides S)
      bool sets_block = a.app->count("--block-size") > 0 || a.app->count("--block-layers") > 0;
      for (const auto& [k, v] : combo) {
        apply_train_args(g.args, {"--" + k + "=" + v});
        g.name += " " + k + "=" + v;
        g.sweep[k] = v;
        sets_block |= k == "block-size" || k == "block-layers";
      }
      if (mode == "block" && !sets_block) {
        // About 4-8 blocks: the smallest S >= 2 with ceil(L / S) <= 8.
        const int64_t L = g.args.cfg.model.n_sublayers();
        int64_t S = 2;
        while ((L + S - 1) / S > 8) S++;
        g.args.cfg.model.residual.block_size = S;
        g.name += " S=" + std::to_string(S);
      }
      g.args.finalize();
      groups.push_back(std::move(g));
    }
  }
  // Two configurations that train the same model (a swept option the mode does not use, or one
  // value written two ways) would be reported as two results differing by a made-up 0.
  std::vector<std::string> fp;
  for (const Group& g : groups) {
    g.args.cfg.validate();
    fp.push_back(model_fingerprint(g.args.cfg));
  }
  for (size_t i = 0; i < groups.size(); i++) {
    for (size_t j = i + 1; j < groups.size(); j++) {
      check(fp[i] != fp[j], "'" + groups[i].name + "' and '" + groups[j].name +
                                "' would train the same model (a swept option that mode does "
                                "not use, or one value written two ways); drop one of them");
    }
  }
  return groups;
}

// One tokenizer and token cache for every run, in out/data.
PreparedData prepare_compare_data(const CompareArgs& a) {
  // The device and precision work here (before the data is prepared).
  make_backend(a.base.cfg.device, a.base.cfg.precision);
  fs::create_directories(a.out);
  const std::string data_dir = (fs::path(a.out) / "data").string();
  DataOptions dopt;
  dopt.corpus_path = a.base.cfg.data_path;
  dopt.tokenizer = a.base.cfg.tokenizer;
  dopt.vocab_size = a.base.cfg.bpe_vocab;
  dopt.tokenizer_model = a.base.cfg.tokenizer_model;
  dopt.out_dir = data_dir;
  dopt.val_fraction = a.base.cfg.val_fraction;
  std::printf("preparing data: %s (tokenizer %s)\n", dopt.corpus_path.c_str(),
              to_string(dopt.tokenizer));
  std::fflush(stdout);
  return prepare_data(dopt);
}

// The plan on the terminal, with the compute per run and a timed estimate; returns the estimated
// total seconds (and sets each group's estimated step time).
double print_plan(const CompareArgs& a, std::vector<Group>& groups, const PreparedData& data) {
  const int64_t vocab = data.tokenizer->vocab_size();
  const TrainConfig& b = a.base.cfg;
  const int64_t tokens_per_run = b.steps * b.batch_size * b.seq_len * b.grad_accum;
  const int64_t n_runs = static_cast<int64_t>(groups.size()) * a.seeds;
  std::printf(
      "\ncompare: %zu configuration(s) x %lld seed(s) = %lld runs, %lld steps x %lld "
      "tokens each (%s tokens), on %s (%s train / %s val tokens)\n",
      groups.size(), static_cast<long long>(a.seeds), static_cast<long long>(n_runs),
      static_cast<long long>(b.steps),
      static_cast<long long>(b.batch_size * b.seq_len * b.grad_accum),
      format_count(static_cast<double>(tokens_per_run)).c_str(), b.data_path.c_str(),
      format_count(static_cast<double>(data.train.size())).c_str(),
      format_count(static_cast<double>(data.val.size())).c_str());
  int w = 28;  // the configuration column fits the longest name
  for (const Group& g : groups) w = std::max(w, static_cast<int>(g.name.size()) + 1);
  std::printf("%-*s %12s %14s %14s\n", w, "configuration", "parameters", "MFLOP/token",
              "est. per run");
  double est_total = 0;
  for (Group& g : groups) {
    TrainConfig c = g.args.cfg;
    c.model.vocab_size = vocab;
    c.model.max_seq_len = c.seq_len;
    c.model.resolve();
    c.model.validate();
    Model probe(c.model);
    g.est_step_s = experiment::time_step(c);
    // (whole evaluations: the integer division is meant)
    // NOLINTNEXTLINE(bugprone-integer-division)
    const double evals = c.eval_every > 0 ? static_cast<double>(c.steps / c.eval_every) : 1.0;
    const double est = g.est_step_s * static_cast<double>(c.steps) +
                       evals * static_cast<double>(c.eval_batches) * g.est_step_s / 3.0;
    est_total += est * static_cast<double>(a.seeds);
    std::printf("%-*s %12lld %14.1f %14s\n", w, g.name.c_str(),
                static_cast<long long>(probe.num_params()),
                train_flops_per_token(c.model, c.seq_len) / 1e6, format_duration(est).c_str());
  }
  std::printf("expected total: %s on %d threads\n\n", format_duration(est_total).c_str(),
              omp_get_max_threads());
  std::fflush(stdout);
  return est_total;
}

}  // namespace

namespace {

// The --tasks files, read and checked; two with one file name would share a column.
std::vector<Task> read_tasks(const std::vector<std::string>& paths) {
  std::vector<Task> tasks;
  std::set<std::string> names;
  for (const std::string& p : paths) {
    check(names.insert(file_name_of(p)).second,
          "--tasks: two files are named '" + file_name_of(p) + "'; rename one");
    tasks.push_back(read_task(p));
  }
  return tasks;
}

// Each finished run's final model scored on every task it has no score for yet, or whose file
// changed since it was scored (a kept run's other scores are kept), into runs[i]["tasks"][file
// name] and its run.json.
void score_tasks(const std::string& out, const std::vector<Task>& tasks, json& runs,
                 const std::shared_ptr<Backend>& be) {
  for (json& run : runs) {
    if (tasks.empty() || run.value("status", std::string("ok")) != "ok") continue;
    const fs::path dir = fs::path(out) / run.value("dir", std::string());
    const std::string model_path = (dir / "model.safetensors").string();
    std::unique_ptr<Model> model;
    std::unique_ptr<Tokenizer> tok;
    for (const Task& t : tasks) {
      const std::string name = file_name_of(t.path);
      if (run.contains("tasks") && run["tasks"].contains(name) &&
          run["tasks"][name].value("fingerprint", std::string()) == t.fingerprint) {
        continue;  // (a task file that changed since is scored again)
      }
      if (!model) {
        Metadata meta;
        model = load_model(model_path, &meta, 0, be);  // (as the runs trained: bf16 too)
        run_config_beside(model_path, meta);  // (a model copied in from another run: refused)
        // (and the run's own earlier checkpoint copied over its final model; 19th pass)
        const auto sum = meta.find(kDataChecksumKey);
        experiment::check_recorded_model(run, sum != meta.end() ? sum->second : std::string(),
                                         model_path, dir);
        tok = load_checkpoint_tokenizer(meta, model_path, model->config().vocab_size);
        std::printf("scoring %s seed %s on %zu task(s)\n",
                    run.value("group", std::string()).c_str(), run.at("seed").dump().c_str(),
                    tasks.size());
        std::fflush(stdout);
      }
      const TaskResult r = score_task(*model, *tok, t);
      run["tasks"][name] = {{"kind", to_string(t.kind)},
                            {"fingerprint", t.fingerprint},
                            {"items", r.items},
                            {"acc", std::isfinite(r.acc) ? json(r.acc) : json(nullptr)},
                            {"acc_norm", r.acc_norm >= 0 ? json(r.acc_norm) : json(nullptr)}};
    }
    if (model) experiment::write_run_record(dir / "run.json", run);
  }
  // The results hold the scores of this command's task files only: a kept run's score of a file
  // not named now (maybe edited since) was reported as current (sixteenth hostile pass). Its
  // run.json keeps it, for a later command that names the same file again.
  for (json& run : runs) {
    if (!run.contains("tasks") || !run["tasks"].is_object()) continue;
    json kept = json::object();
    for (const Task& t : tasks) {
      const std::string name = file_name_of(t.path);
      if (run["tasks"].contains(name)) kept[name] = run["tasks"][name];
    }
    run["tasks"] = kept;
    if (kept.empty()) run.erase("tasks");
  }
}

}  // namespace

// --out is neither the corpus directory, inside it, nor a training run's directory: the study's
// files were written among the texts (its rerun then refused that corpus), or among a run's.
// (seventeenth hostile pass)
void check_out_apart_from_data(const std::string& out, const std::string& data) {
  std::error_code ec;
  const fs::path o = fs::weakly_canonical(fs::absolute(out), ec);
  const fs::path d = fs::weakly_canonical(fs::absolute(data), ec);
  if (fs::is_directory(d, ec)) {
    const fs::path rel = o.lexically_relative(d);
    check(rel.empty() || *rel.begin() == "..",
          "--out '" + out + "' is the corpus directory --data '" + data + "' or inside it" +
              ": the study's files would be read as text by later runs; put it elsewhere");
  }
  check(!fs::exists(o / "train_config.json", ec) && !fs::exists(o / "latest", ec),
        "--out '" + out +
            "' is a training run's directory (train_config.json or latest is there); a "
            "comparison keeps its runs in a directory of its own: use another --out");
}

void check_own_outputs(const std::string& out, const char* json_name, const char* md_name,
                       const char* json_key) {
  const fs::path js = fs::path(out) / json_name, md = fs::path(out) / md_name;
  std::error_code ec;
  bool ours = false;
  if (fs::exists(fs::symlink_status(js, ec))) {
    try {
      ours =
          parse_json(read_small_file(js.string(), kMaxResultsBytes, json_name)).contains(json_key);
    } catch (const std::exception&) {  // (Error or a JSON exception: not an earlier output)
    }
    check(ours, "'" + js.string() + "' is not the " + json_name +
                    " of an earlier run of this command, and it would be replaced: it is left "
                    "alone; move it away, or use another --out");
  }
  check(ours || !fs::exists(fs::symlink_status(md, ec)),
        "'" + md.string() + "' is not the " + md_name + " of an earlier run of this command (no " +
            json_name +
            " is beside it), and it would be replaced: it is left alone; move it away, or use "
            "another --out");
  if (ours) return;
  // The plots' names too (a user's val_loss.png was replaced: thirteenth hostile pass).
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string n = e.path().filename().string();
    const bool plot = n == "val_loss.png" || n == "output_rms.png" || n == "grad_norm.png" ||
                      n == "scaling.png" ||
                      (n.rfind("depth_weights_", 0) == 0 && e.path().extension() == ".png");
    check(!plot, "'" + e.path().string() +
                     "' is not a plot of an earlier run of this command (no " + json_name +
                     " is beside it), and it would be replaced: it is left alone; "
                     "move it away, or use another --out");
  }
}

// An option given that does nothing in any run of the comparison is refused, as train refuses it
// (one that some run uses passes: --block-size with --modes prenorm,block).
void refuse_inert_options(const CompareArgs& a, const std::vector<Group>& groups) {
  if (a.app == nullptr || groups.empty()) return;
  std::vector<InertOption> inert = inert_options(*a.app, groups.front().args.cfg);
  for (size_t i = 1; i < groups.size(); i++) {
    const std::vector<InertOption> here = inert_options(*a.app, groups[i].args.cfg);
    std::erase_if(inert, [&](const InertOption& o) {
      return std::none_of(here.begin(), here.end(),
                          [&](const InertOption& h) { return h.option == o.option; });
    });
  }
  check(inert.empty(),
        inert.empty() ? std::string() : "in every run of this comparison, " + inert.front().why);
}

bool run_compare(CompareArgs& a) {
  apply_preset(a);
  a.base.finalize();
  const std::vector<std::string> modes = parse_modes(a);
  check(a.seeds >= 1 && a.seeds <= 100, "--seeds must be in [1, 100]");
  // (--seed 2^64-1 --seeds 3 wrapped to the seeds 0 and 1 without a word; seventeenth pass)
  check(
      a.base.cfg.seed <= std::numeric_limits<uint64_t>::max() - static_cast<uint64_t>(a.seeds - 1),
      "--seed " + std::to_string(a.base.cfg.seed) + " with --seeds " + std::to_string(a.seeds) +
          " runs past the largest seed (2^64 - 1); give a smaller --seed");
  std::vector<Group> groups = make_groups(a, modes, sweep_combos(a));
  refuse_inert_options(a, groups);
  const std::vector<Task> tasks = read_tasks(a.tasks);  // (checked before anything trains)
  check_out_apart_from_data(a.out, a.base.cfg.data_path);
  // (a user's report.md or results.json in --out was replaced at the end: twelfth pass)
  check_own_outputs(a.out, "results.json", "report.md", "groups");
  // One comparison per directory: a second one deleted the first's unfinished runs while they
  // trained, and both wrote results.json.
  fs::create_directories(a.out);
  const RunLock lock(a.out);
  const PreparedData data = prepare_compare_data(a);
  const std::string data_dir = (fs::path(a.out) / "data").string();
  const int64_t vocab = data.tokenizer->vocab_size();
  const TrainConfig& b = a.base.cfg;
  const int64_t n_runs = static_cast<int64_t>(groups.size()) * a.seeds;
  const double est_total = print_plan(a, groups, data);

  // The runs, sequentially. A finished run (run.json present) is kept: rerunning the same command
  // after an interruption continues where it stopped.
  const auto t_start = std::chrono::steady_clock::now();
  const std::atomic<bool>* stop = install_stop_handler();
  json runs = json::array();
  int64_t k = 0, kept_runs = 0;
  double remaining = est_total;
  for (Group& g : groups) {
    for (int64_t s = 0; s < a.seeds; s++, k++) {
      TrainConfig c = g.args.cfg;
      c.seed = b.seed + static_cast<uint64_t>(s);
      c.data_dir = absolute_path(data_dir);
      // As the run records them (train_config.json), so a kept run of another corpus is refused.
      c.data_path = absolute_path(c.data_path);
      c.corpus_fingerprint = data.fingerprint;
      c.tokenizer_fingerprint = data.tokenizer_fingerprint;
      const fs::path dir =
          fs::path(a.out) / "runs" / safe_name(g.name) / ("seed" + std::to_string(c.seed));
      c.out_dir = dir.string();
      const fs::path run_json = dir / "run.json";
      const double est = est_total / static_cast<double>(n_runs);
      if (fs::exists(run_json)) {
        json kept = experiment::kept_run(c, vocab, g.name, a.out);
        kept_runs++;
        std::printf("[run %lld/%lld] %s seed %llu: already done (%s), kept\n",
                    static_cast<long long>(k + 1), static_cast<long long>(n_runs), g.name.c_str(),
                    static_cast<unsigned long long>(c.seed),
                    kept.value("status", std::string("ok")).c_str());
        runs.push_back(kept);
        remaining -= est;
        continue;
      }
      c.resume = experiment::prepare_run_dir(c, vocab);
      char head[200];
      std::snprintf(head, sizeof head, "[run %lld/%lld] %s seed %llu%s",
                    static_cast<long long>(k + 1), static_cast<long long>(n_runs), g.name.c_str(),
                    static_cast<unsigned long long>(c.seed), c.resume ? " (resuming)" : "");
      Progress bar(c.log_every * 10);
      bar.message(head);
      TrainEvents ev;
      ev.stop = stop;
      ev.continued = continue_counter;
      ev.on_step = [&](const StepInfo& si) {
        char f[200];
        const double left = std::max(0.0, remaining - est + si.eta_s);
        std::snprintf(f, sizeof f, "%s | loss %.4f | %s | all runs ETA %s", g.name.c_str(), si.loss,
                      speed_text(si.tokens_per_s).c_str(), format_duration(left).c_str());
        bar.update(si.step, si.total_steps, f, si.eta_s);
      };
      ev.on_eval = [&](const EvalInfo& e) {
        char f[120];
        std::snprintf(f, sizeof f, "  step %lld: val loss %.4f", static_cast<long long>(e.step),
                      e.val_loss);
        bar.message(f);
      };
      // Fault injection for the tests (tests/test_compare.cpp): ATTNRES_TEST_DIVERGE=NAME makes
      // configuration NAME's training losses NaN from step 3 on, as a diverging run's are.
      if (const char* f = std::getenv("ATTNRES_TEST_DIVERGE"); f && g.name == f) {
        ev.loss_hook = [](int64_t step, double loss) {
          return step >= 3 ? std::numeric_limits<double>::quiet_NaN() : loss;
        };
      }
      const experiment::RunOutcome o = experiment::train_run(c, ev);
      bar.finish();
      if (o.result.interrupted) {
        remove_stop_handler();
        std::printf("interrupted; rerun the same command to continue from here\n");
        return false;
      }
      remaining -= est;
      json rj = experiment::run_record(g.name, c, vocab, a.out, o);
      if (!o.diverged.empty()) {
        std::printf("  %s seed %llu diverged: %s\n", g.name.c_str(),
                    static_cast<unsigned long long>(c.seed), o.diverged.c_str());
      }
      experiment::write_run_record(run_json, rj);
      runs.push_back(rj);
    }
  }
  remove_stop_handler();
  score_tasks(a.out, tasks, runs, make_backend(a.base.cfg.device, a.base.cfg.precision));
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

  experiment::ResultsInput in;
  in.command_line = a.command_line;
  in.preset = a.preset;
  in.wall_time_s = wall;
  in.kept_runs = kept_runs;
  in.base = b;
  in.tokenizer_ref = data.tokenizer_ref;
  in.vocab = vocab;
  in.train_tokens = data.train.size();
  in.val_tokens = data.val.size();
  for (const Group& g : groups) in.configs.push_back({g.name, g.args.cfg, g.sweep});
  in.seeds = a.seeds;
  in.runs = runs;
  json results = experiment::assemble_results(in);
  const bool same_init = results["checks"]["shared_init"],
             same_batch = results["checks"]["shared_batches"];
  const std::string results_path = (fs::path(a.out) / "results.json").string();
  std::string why;
  bool plotted = false;
  experiment::write_results(results_path, results);
  if (!a.no_plots) {
    plotted = render_plots(a.out, &why);
  } else {
    why = "--no-plots was given; draw them with `attnres report " + a.out + "`";
  }
  if (!plotted) {
    results["plots_note"] = why;
    experiment::write_results(results_path, results);
  }
  write_report(a.out);

  print_summary(results);
  std::printf("\nshared initial weights: %s, shared batch order: %s\n", same_init ? "yes" : "NO",
              same_batch ? "yes" : "NO");
  if (!plotted) std::printf("plots not drawn: %s\n", why.c_str());
  std::printf("report: %s/report.md (wall time %s)\n", a.out.c_str(),
              format_duration(wall).c_str());
  return true;
}

void add_compare(CLI::App& app) {
  auto a = std::make_shared<CompareArgs>();
  CLI::App* s = app.add_subcommand(
      "compare",
      "Train residual modes side by side (same data, initial weights, batches and budget) over "
      "several seeds; write a report with plots");
  a->app = s;
  add_train_options(s, a->base);
  s->add_option("--out", a->out, "Run directory of the comparison")->capture_default_str();
  s->add_option("--modes", a->modes, "Residual modes to compare, comma-separated")
      ->capture_default_str();
  s->add_option("--seeds", a->seeds,
                "Repeats with seeds seed, seed+1, ... (at least 3 for a verdict on a difference)")
      ->capture_default_str();
  s->add_option("--sweep", a->sweeps,
                "Also vary a training option: OPTION=V1,V2,... (e.g. block-size=2,4,8; "
                "repeatable: the product is run)");
  s->add_option("--preset", a->preset,
                "Model size and budget for 2 CPU cores (times for 3 modes x 3 seeds): tiny "
                "(~1 min), small (32 sublayers, 300 steps, ~15 min), shallow (8 sublayers, 1500 "
                "steps, ~25 min), deep (32 sublayers, 1200 steps, ~1 h), base (6 x d256, hours), "
                "none; explicit options win")
      ->capture_default_str();
  s->add_flag("--no-plots", a->no_plots, "Skip the PNG plots (draw later with `attnres report`)");
  s->add_option("--tasks", a->tasks,
                "Task files (as `eval --task`: multiple choice or minimal pairs) scored on every "
                "run's final model; their accuracies go into results.json and the report")
      ->check(CLI::ExistingFile);
  s->callback([a] {
    a->command_line = command_line();
    if (!run_compare(*a)) throw CLI::RuntimeError(130);  // interrupted: not a finished result
  });
}

// `report` on what `attnres scale` wrote (30th hostile pass: "has no results.json" only): its
// report is there already; each size's comparison can be redrawn. Also a scale still running or
// stopped before its fit (no scaling.json yet: 31st pass).
void check_not_a_scale_dir(const std::string& given) {
  std::error_code ec;
  fs::path dir(given);
  if (dir.filename().empty()) dir = dir.parent_path();  // ("sc/")
  if (fs::is_regular_file(dir / "results.json", ec)) return;
  std::vector<std::string> sizes;
  for (const auto& e :
       fs::directory_iterator(dir, fs::directory_options::skip_permission_denied, ec)) {
    std::error_code ec2;
    if (fs::is_regular_file(e.path() / "results.json", ec2)) sizes.push_back(e.path().string());
  }
  std::sort(sizes.begin(), sizes.end());
  const bool scale = fs::exists(dir / "scaling.json", ec);
  if (!scale && sizes.empty()) return;
  const std::string d = dir.string();
  std::string what;
  if (!scale) {
    what = "'" + d + "' holds comparisons in its subdirectories (a `scale` still running, or " +
           "stopped before its fit?)";
  } else if (fs::is_regular_file(dir / "scaling.md", ec)) {
    what = "'" + d + "' is a directory `attnres scale` wrote: its report is " + d + "/scaling.md" +
           (fs::exists(dir / "scaling.png", ec) ? " (plot: scaling.png)" : "");
  } else {
    what = "'" + d + "' is a directory `attnres scale` wrote, without its report (scaling.md)";
  }
  throw Error(what + "; `report` redraws one comparison" +
              (sizes.empty() ? std::string(": none of its sizes has finished (no results.json)")
                             : ": give one of its sizes, e.g. '" + sizes.front() + "'"));
}

void add_report(CLI::App& app) {
  auto dir = std::make_shared<std::string>();
  CLI::App* s = app.add_subcommand(
      "report", "Regenerate report.md and the plots of a comparison from its results.json");
  s->add_option("run_dir,--run-dir", *dir, "Directory written by `attnres compare`")->required();
  s->callback([dir] {
    check_not_a_scale_dir(*dir);
    std::error_code ec;
    check(fs::exists(fs::path(*dir) / "results.json", ec),
          "'" + *dir + "' has no results.json; give the directory `attnres compare --out` wrote");
    // A comparison running in the directory owns its results.json: a report written meanwhile
    // could put an older one back (the lock refuses, naming its pid).
    const RunLock lock(*dir);
    // Read and check results.json before drawing anything from it.
    const std::string rp = (fs::path(*dir) / "results.json").string();
    json r;
    try {
      r = parse_json(read_small_file(rp, kMaxResultsBytes, "a comparison's results.json"));
    } catch (const json::exception& e) {
      throw Error("'" + rp + "' is not valid JSON (" + e.what() + "); rerun `attnres compare`");
    }
    // (a results.json edited by hand was redrawn as measured; nineteenth and twentieth passes)
    const bool signed_results = experiment::check_results_fingerprint(r, rp);
    if (!signed_results) {
      std::printf(
          "note: '%s' carries no fingerprint (an earlier version's, or edited): its "
          "figures are drawn as written\n",
          rp.c_str());
    }
    try {
      r["analysis"] = report::analyze(r);  // the reading of the current version
    } catch (const json::exception& e) {
      throw Error("'" + rp + "' lacks a field the analysis needs (" + e.what() +
                  "); it may come from another attnres version: rerun `attnres compare`");
    }
    std::string why;
    const bool ok = render_plots(*dir, &why);
    // Record whether the plots exist, so the report says so.
    if (ok) {
      r.erase("plots_note");
    } else {
      r["plots_note"] = why;
    }
    if (signed_results) {
      experiment::write_results(rp, r);
    } else {
      write_file_atomic(rp, r.dump(1) + "\n");
    }
    write_report(*dir);
    if (!ok) std::printf("plots not drawn: %s\n", why.c_str());
    std::printf("report: %s/report.md\n", dir->c_str());
  });
}

}  // namespace attnres::cli
