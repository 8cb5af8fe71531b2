#include "experiment/compare_results.hpp"

#include <omp.h>

#include <cmath>
#include <set>

#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "experiment/host_info.hpp"
#include "report/analysis.hpp"
#include "report/stats.hpp"

using nlohmann::json;

namespace attnres::experiment {

namespace {

// One configuration's row of the results table: means over its finished runs (null if none).
json aggregate(const Configuration& g, const json& runs, int64_t vocab) {
  std::vector<double> v, tps;
  int64_t params = 0, failed = 0;
  double fpt = 0;
  bool has_w = false;
  for (const auto& r : runs) {
    if (r["group"] != g.name) continue;
    params = r["params"];
    fpt = r["flops_per_token"];
    if (r.value("status", std::string("ok")) != "ok" || !r["final_val_loss"].is_number()) {
      failed++;
      continue;
    }
    v.push_back(r["final_val_loss"]);
    if (r["tokens_per_s"].is_number()) tps.push_back(r["tokens_per_s"]);
    has_w |= r["diagnostics"].is_object() && r["diagnostics"].contains("depth_weights");
  }
  // As the runs trained it: ffn_hidden and n_kv_head resolved, the tokenizer's vocabulary and the
  // configuration's context (the defaults, 256 and 256, were recorded: 29th hostile pass).
  ModelConfig model = g.cfg.model;
  model.vocab_size = vocab;
  model.max_seq_len = g.cfg.seq_len;
  model.resolve();
  json j = {{"name", g.name},
            {"mode", to_string(g.cfg.model.residual.mode)},
            {"residual", json::parse(model.to_json())},
            {"sweep", g.sweep},
            {"params", params},
            {"flops_per_token", fpt},
            {"seeds", static_cast<int>(v.size())},
            {"seeds_failed", failed},
            {"has_depth_weights", has_w}};
  if (v.empty()) {
    j["val_loss_mean"] = j["val_loss_std"] = j["ppl_mean"] = nullptr;
  } else {
    const stats::Interval iv = stats::mean_interval(v);
    j["val_loss_mean"] = iv.mean;
    j["val_loss_std"] = v.size() >= 2 ? json(iv.sd) : json(nullptr);  // (one seed has no spread)
    j["ppl_mean"] = std::exp(iv.mean);
  }
  j["tokens_per_s_mean"] = tps.empty() ? json(nullptr) : json(stats::mean_interval(tps).mean);
  return j;
}

// The difference of each configuration's mean to the baseline's (null where either has none).
void add_deltas(json& groups, const std::string& baseline) {
  const json* base = nullptr;
  for (const auto& g : groups) {
    if (g["name"] == baseline) base = &g;
  }
  for (auto& g : groups) {
    const bool both =
        g["val_loss_mean"].is_number() && base && (*base)["val_loss_mean"].is_number();
    g["delta_vs_baseline"] =
        both ? json(g["val_loss_mean"].get<double>() - (*base)["val_loss_mean"].get<double>())
             : json(nullptr);
  }
}

// Whether the runs of one seed share initial weights and batch order across configurations.
json shared_checks(const json& runs) {
  bool same_init = true, same_batch = true;
  for (const auto& r1 : runs) {
    for (const auto& r2 : runs) {
      if (r1["seed"] != r2["seed"]) continue;
      same_init &= r1["init_hash"] == r2["init_hash"];
      if (!r1["batch_hash"].is_null() && !r2["batch_hash"].is_null()) {
        same_batch &= r1["batch_hash"] == r2["batch_hash"];
      }
    }
  }
  return {{"shared_init", same_init}, {"shared_batches", same_batch}};
}

}  // namespace

std::string baseline_of(const std::vector<Configuration>& configs) {
  std::string pre;
  int n = 0;
  for (const Configuration& c : configs) {
    if (c.cfg.model.residual.mode == ResidualMode::prenorm) {
      pre = c.name;
      n++;
    }
  }
  return n == 1 ? pre : configs.front().name;
}

namespace {

// The runs' own training time, kept runs' included (each run.json's measured seconds).
double train_time_s(const json& runs) {
  double t = 0;
  for (const auto& r : runs) {
    if (r.contains("seconds") && r["seconds"].is_number()) t += r["seconds"].get<double>();
  }
  return t;
}

}  // namespace

namespace {
constexpr const char* kResultsKey = "results_fnv1a64";

std::string results_fingerprint(json r) {
  for (const char* k : {kResultsKey, "analysis", "plots_note"}) r.erase(k);
  return hex64(fnv1a64(r.dump()));
}
}  // namespace

void write_results(const std::string& path, json& results) {
  results[kResultsKey] = results_fingerprint(results);
  write_file_atomic(path, results.dump(1) + "\n");
}

bool check_results_fingerprint(const json& results, const std::string& path) {
  if (!results.is_object() || !results.contains(kResultsKey)) return false;
  check(results[kResultsKey].is_string() &&
            results[kResultsKey].get<std::string>() == results_fingerprint(results),
        "'" + path +
            "' is not as compare wrote it (edited since): its figures would be drawn unmeasured; "
            "rerun `attnres compare` with the same options (its kept runs are reused)");
  return true;
}

json assemble_results(const ResultsInput& in) {
  const TrainConfig& b = in.base;
  const std::string baseline = baseline_of(in.configs);
  json gj = json::array();
  for (const Configuration& g : in.configs) gj.push_back(aggregate(g, in.runs, in.vocab));
  add_deltas(gj, baseline);
  ModelConfig mc = in.configs.front().cfg.model;
  mc.vocab_size = in.vocab;
  mc.max_seq_len = in.configs.front().cfg.seq_len;
  mc.resolve();
  json seeds = json::array();
  for (int64_t s = 0; s < in.seeds; s++) seeds.push_back(b.seed + static_cast<uint64_t>(s));
  const int64_t tokens_per_run = b.steps * b.batch_size * b.seq_len * b.grad_accum;
  // The threads the runs trained with: a kept run's own (a rerun with other --threads labelled
  // its kept runs with the rerun's count; fifteenth hostile pass).
  std::set<int> threads;
  for (const json& r : in.runs) {
    if (r.contains("threads") && r["threads"].is_number_integer()) {
      threads.insert(r["threads"].get<int>());
    }
  }
  if (threads.empty()) threads.insert(omp_get_max_threads());
  json results = {{"format", "attnres-compare/2"},
                  {"command", in.command_line},
                  {"created", now_iso()},
                  {"hardware",
                   {{"cpu", cpu_name()},
                    {"threads", *threads.rbegin()},
                    {"threads_of_runs", threads},
                    {"device", to_string(b.device)},
                    {"precision", to_string(b.precision)}}},
                  {"wall_time_s", in.wall_time_s},
                  {"runs_kept", in.kept_runs},
                  {"train_time_s", train_time_s(in.runs)},
                  {"preset", in.preset},
                  {"data",
                   {{"path", b.data_path},
                    {"tokenizer", in.tokenizer_ref},
                    {"vocab_size", in.vocab},
                    {"train_tokens", in.train_tokens},
                    {"val_tokens", in.val_tokens}}},
                  {"model", json::parse(mc.to_json())},
                  {"train",
                   {{"steps", b.steps},
                    {"batch_size", b.batch_size},
                    {"seq_len", b.seq_len},
                    {"grad_accum", b.grad_accum},
                    {"tokens_per_run", tokens_per_run},
                    {"lr", b.adamw.lr},
                    {"weight_decay", b.adamw.weight_decay},
                    {"grad_clip", b.grad_clip},
                    {"schedule", to_string(b.schedule.kind)},
                    {"warmup_steps", b.schedule.warmup_steps},
                    {"eval_every", b.eval_every},
                    {"eval_batches", b.eval_batches}}},
                  {"seeds", seeds},
                  {"baseline", baseline},
                  {"groups", gj},
                  {"runs", in.runs},
                  {"checks", shared_checks(in.runs)}};
  results["analysis"] = report::analyze(results);
  return results;
}

}  // namespace attnres::experiment
