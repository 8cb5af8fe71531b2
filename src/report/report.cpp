// report.md from results.json (see attnres/report.hpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/report.hpp"
#include "core/json_field.hpp"
#include "report/analysis.hpp"
#include "report/stats.hpp"

namespace attnres {

namespace {

// (sized to fit: a loss of 1e308 in a results.json edited by hand was cut to 63 digits)
std::string fmt(const char* f, double x) {
  const int n = std::snprintf(nullptr, 0, f, x);
  std::string out(static_cast<size_t>(std::max(n, 0)), '\0');
  std::snprintf(out.data(), out.size() + 1, f, x);
  return out;
}

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); i++) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

// A number, or "n/a" for null (a figure that was not measured).
std::string num(const nlohmann::json& x, const char* f) {
  return x.is_number() ? fmt(f, x.get<double>()) : std::string("n/a");
}

void write_best_per_mode(std::ostringstream& md, const nlohmann::json& an) {
  if (!an.contains("best_per_mode")) return;
  md << "\n### Each mode at its best setting of the sweep\n\n"
        "The setting with the lowest mean validation loss among those whose every seed finished "
        "(chosen on the validation split itself, so slightly optimistic for every mode alike).\n\n"
        "| mode | best setting | val loss | seeds |\n|---|---|---|---|\n";
  for (const auto& b : an.at("best_per_mode")) {
    md << "| " << b.at("mode").get<std::string>() << " | `" << b.at("group").get<std::string>()
       << "` | " << num(b.at("val_loss_mean"), "%.4f") << " | " << b.at("seeds_ok").get<int64_t>()
       << " |\n";
  }
}

void write_comparisons(std::ostringstream& md, const nlohmann::json& an) {
  if (an.at("comparisons").empty()) return;
  md << "\n### Paired differences\n\n"
        "Runs of one seed share initial weights and batch order, so differences are taken seed "
        "by seed: mean, 95 % interval (Student t over seeds) and the verdict (`lower` or `higher` "
        "when the interval excludes 0; at least 3 seeds for a verdict).\n\n"
        "| configuration | vs | kind | mean diff | 95 % interval | seeds | verdict |\n"
        "|---|---|---|---|---|---|---|\n";
  for (const auto& c : an.at("comparisons")) {
    md << "| " << c.at("group").get<std::string>() << " | " << c.at("vs").get<std::string>()
       << " | " << c.at("kind").get<std::string>() << " | " << num(c.at("mean"), "%+.4f") << " | "
       << (c.at("n").get<int>() >= 2
               ? "[" + num(c.at("lo"), "%+.4f") + ", " + num(c.at("hi"), "%+.4f") + "]"
               : std::string("-"))
       << " | " << c.at("n").get<int>() << " | **" << c.at("verdict").get<std::string>()
       << "** |\n";
  }
}

void write_claims(std::ostringstream& md, const nlohmann::json& an) {
  if (an.at("claims").empty()) return;
  md << "\n### The paper's claims, measured here\n\n"
        "Each claim of the paper (SPEC 6) on this run's numbers: the measured value, its 95 % "
        "interval over seeds (paired with PreNorm where a comparison), and the verdict (`holds` "
        "only when the interval excludes the no-effect value).\n\n"
        "| claim | paper | configuration | measured | 95 % interval | verdict |\n"
        "|---|---|---|---|---|---|\n";
  for (const auto& c : an.at("claims")) {
    md << "| " << c.at("claim").get<std::string>() << " | " << c.at("paper").get<std::string>()
       << " | " << c.at("subject").get<std::string>() << " | "
       << c.at("measured").get<std::string>() << " | " << c.at("interval").get<std::string>()
       << " | **" << c.at("verdict").get<std::string>() << "** |\n";
  }
}

void write_failed(std::ostringstream& md, const nlohmann::json& an) {
  if (an.at("failed_runs").empty()) return;
  md << "\n### Runs that did not finish\n\nReported as such: they count in no mean above.\n\n";
  for (const auto& f : an.at("failed_runs")) {
    md << "* `" << f.at("group").get<std::string>() << "` seed " << f.at("seed").dump() << ": "
       << f.at("status").get<std::string>();
    const std::string why = f.value("reason", std::string());
    if (!why.empty()) md << " (" << why << ")";
    md << "\n";
  }
}

// The mean training speed of a configuration's finished runs, from the runs themselves (null
// when none finished or none was timed), not from the stored aggregate.
nlohmann::json tokens_per_s_of(const nlohmann::json& results, const std::string& group) {
  double sum = 0;
  int n = 0;
  for (const auto& run : results.value("runs", nlohmann::json::array())) {
    if (!run.is_object() || run.value("group", std::string()) != group) continue;
    if (run.value("status", std::string("ok")) != "ok") continue;
    if (!run.contains("final_val_loss") || !run["final_val_loss"].is_number()) continue;
    if (!run.contains("tokens_per_s") || !run["tokens_per_s"].is_number()) continue;
    sum += run["tokens_per_s"].get<double>();
    n++;
  }
  return n ? nlohmann::json(sum / n) : nlohmann::json();
}

// mean +- sample std of the numbers, or "n/a" / "(1 seed)" forms.
std::string mean_sd(const std::vector<double>& x) {
  if (x.empty()) return "n/a";
  double m = 0;
  for (double v : x) m += v;
  m /= static_cast<double>(x.size());
  if (x.size() == 1) return fmt("%.4f", m) + " (1 seed)";
  double ss = 0;
  for (double v : x) ss += (v - m) * (v - m);
  return fmt("%.4f", m) + " +- " + fmt("%.4f", std::sqrt(ss / static_cast<double>(x.size() - 1)));
}

// The downstream tasks (compare --tasks): each configuration's accuracies over its finished
// runs, re-derived from the runs' own scores.
void write_tasks(std::ostringstream& md, const nlohmann::json& r) {
  std::vector<std::string> names;  // (in first-seen order)
  std::map<std::string, bool> has_norm;
  for (const auto& run : r.value("runs", nlohmann::json::array())) {
    if (!run.is_object() || !run.contains("tasks") || !run["tasks"].is_object()) continue;
    for (const auto& [name, t] : run["tasks"].items()) {
      if (!has_norm.count(name)) names.push_back(name);
      has_norm[name] = has_norm[name] || (t.contains("acc_norm") && t["acc_norm"].is_number());
    }
  }
  if (names.empty()) return;
  md << "\n### Downstream tasks\n\nAccuracy of each finished run's final model (`eval --task`), "
        "mean +- sample std over the seeds:\n\n| configuration |";
  for (const auto& n : names)
    md << " " << n << " acc |" << (has_norm[n] ? " " + n + " acc_norm |" : "");
  md << "\n|---|";
  for (const auto& n : names) md << (has_norm[n] ? "---|---|" : "---|");
  md << "\n";
  for (const auto& g : r.at("groups")) {
    const std::string group = g.at("name").get<std::string>();
    md << "| " << group << " |";
    for (const auto& n : names) {
      std::vector<double> acc, norm;
      for (const auto& run : r.at("runs")) {
        if (run.value("group", std::string()) != group) continue;
        if (run.value("status", std::string("ok")) != "ok" || !run.contains("tasks")) continue;
        const auto& t = run["tasks"];
        if (!t.contains(n)) continue;
        if (t[n].contains("acc") && t[n]["acc"].is_number())
          acc.push_back(t[n]["acc"].get<double>());
        if (t[n].contains("acc_norm") && t[n]["acc_norm"].is_number()) {
          norm.push_back(t[n]["acc_norm"].get<double>());
        }
      }
      md << " " << mean_sd(acc) << " |" << (has_norm[n] ? " " + mean_sd(norm) + " |" : "");
    }
    md << "\n";
  }
}

}  // namespace

void write_report(const std::string& run_dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(run_dir) / "results.json").string();
  nlohmann::json r;
  try {
    r = parse_json(read_small_file(path, kMaxResultsBytes, "a comparison's results.json"));
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + path + "' is not valid JSON (" + e.what() + "); rerun `attnres compare`");
  }
  try {
    std::ostringstream md;
    const auto& groups = r.at("groups");
    const auto& tr = r.at("train");
    const std::string baseline = r.at("baseline");
    md << "# attnres compare: " << r.at("data").at("path").get<std::string>() << "\n\n";
    md << "Generated from `results.json` by `attnres report " << run_dir << "`.\n\n";
    // (the note was on the terminal alone, and the report drew the figures as measured; 21st
    // hostile pass)
    if (!r.contains("results_fnv1a64")) {
      md << "**Unchecked figures:** this `results.json` carries no fingerprint (written by an "
            "earlier attnres, or edited): every figure below is drawn as written, and may not be "
            "what the runs measured. Rerun `attnres compare` with the same options to rebuild it "
            "from the runs' records.\n\n";
    }
    md << "* Command: `" << r.at("command").get<std::string>() << "`\n";
    md << "* Date: " << r.at("created").get<std::string>() << "\n";
    const nlohmann::json& hw = r.at("hardware");
    md << "* Hardware: " << hw.at("cpu").get<std::string>() << ", " << hw.at("threads").get<int>()
       << " threads";
    if (hw.contains("threads_of_runs") && hw["threads_of_runs"].is_array() &&
        hw["threads_of_runs"].size() > 1) {
      md << " (the runs trained with " << hw["threads_of_runs"].dump()
         << " threads: their speeds do not compare)";
    }
    // (older files: the CPU in fp32; a CPU bf16 comparison said nothing; fifteenth pass)
    const std::string device = hw.value("device", std::string("cpu"));
    const std::string precision = hw.value("precision", std::string("fp32"));
    if (device != "cpu" || precision != "fp32") {
      md << "; trained on " << device << " (" << precision << " matrix products)";
    }
    md << "\n";
    md << "* Wall time: " << fmt("%.1f", r.at("wall_time_s").get<double>() / 60.0) << " min for "
       << r.at("runs").size() << " runs";
    // (a rerun that kept finished runs timed only what it trained itself; sixteenth pass)
    const int64_t kept = r.value("runs_kept", int64_t{0});
    if (kept > 0) {
      md << ", " << kept << " of them kept from an earlier call of the command (not in that time)";
    }
    if (r.contains("train_time_s") && r["train_time_s"].is_number()) {
      md << "; the runs' own training took " << fmt("%.1f", r["train_time_s"].get<double>() / 60.0)
         << " min";
    }
    md << "\n\n";

    md << "## Setup\n\n";
    const auto& m = r.at("model");
    md << "| setting | value |\n|---|---|\n";
    md << "| data | `" << r.at("data").at("path").get<std::string>()
       << "`: " << with_commas(r.at("data").at("train_tokens").get<int64_t>()) << " train / "
       << with_commas(r.at("data").at("val_tokens").get<int64_t>()) << " validation tokens, "
       << "tokenizer " << r.at("data").at("tokenizer").get<std::string>() << " (vocab "
       << r.at("data").at("vocab_size").get<int64_t>() << ") |\n";
    md << "| model | " << m.at("n_layer").get<int64_t>() << " layers ("
       << 2 * m.at("n_layer").get<int64_t>() << " sublayers), d " << m.at("d_model").get<int64_t>()
       << ", " << m.at("n_head").get<int64_t>() << " heads (kv " << m.at("n_kv_head").get<int64_t>()
       << "), SwiGLU " << m.at("ffn_hidden").get<int64_t>() << ", context "
       << m.at("max_seq_len").get<int64_t>() << ", "
       << (m.at("tied").get<bool>() ? "tied" : "untied") << " head"
       << (m.contains("norm_eps") && m["norm_eps"].is_number()
               ? ", RMSNorm eps " + fmt("%g", m["norm_eps"].get<double>())
               : std::string())
       << " (swept settings: in each configuration's name) |\n";
    md << "| preset | " << r.value("preset", std::string("(none)")) << " |\n";
    md << "| budget per run | " << tr.at("steps").get<int64_t>() << " steps x "
       << tr.at("batch_size").get<int64_t>() << " x " << tr.at("seq_len").get<int64_t>() << " x "
       << tr.at("grad_accum").get<int64_t>() << " = "
       << with_commas(tr.at("tokens_per_run").get<int64_t>()) << " tokens |\n";
    // A swept setting has no one value: the shared one was never used (29th hostile pass).
    std::set<std::string> swept;
    for (const auto& g : r.at("groups")) {
      if (!g.contains("sweep") || !g["sweep"].is_object()) continue;
      for (const auto& [k, v] : g["sweep"].items()) swept.insert(k);
    }
    auto setting = [&](const char* option, const std::string& value) {
      return swept.count(option) ? std::string("swept") : value;
    };
    md << "| optimiser | AdamW lr " << setting("lr", fmt("%g", tr.at("lr").get<double>())) << ", "
       << setting("schedule", tr.at("schedule").get<std::string>()) << " schedule, warm-up "
       << setting("warmup", std::to_string(tr.at("warmup_steps").get<int64_t>()))
       << ", weight decay "
       << setting("weight-decay", fmt("%g", tr.at("weight_decay").get<double>())) << ", clip "
       << setting("grad-clip", fmt("%g", tr.at("grad_clip").get<double>()))
       << (swept.empty() ? "" : " (swept settings: in each configuration's name)") << " |\n";
    md << "| seeds | " << r.at("seeds").dump() << " (per seed: the same initial shared weights "
       << "and batch order in every configuration) |\n";
    const int64_t every = tr.at("eval_every").get<int64_t>();
    md << "| evaluation | " << tr.at("eval_batches").get<int64_t>() << " validation batches "
       << (every > 0 ? "every " + std::to_string(every) + " steps and at the end"
                     : std::string("at the end"))
       << " |\n\n";

    const nlohmann::json an = report::analyze(r);
    md << "## Results\n\n";
    md << "Final validation loss (nats/token) as mean +- sample std over the seeds that finished; "
          "the difference is of the means, to `"
       << baseline << "`.\n\n";
    md << "| configuration | val loss | seeds | perplexity | diff vs " << baseline
       << " | parameters | tokens/s |\n|---|---|---|---|---|---|---|\n";
    // (every number re-derived from the runs, whatever the stored aggregates say)
    const nlohmann::json& gs = an.at("group_stats");
    const nlohmann::json* base_stats = gs.contains(baseline) ? &gs.at(baseline) : nullptr;
    for (const auto& g : groups) {
      const nlohmann::json& st = gs.at(g.at("name").get<std::string>());
      const int n = st.at("seeds_ok").get<int>();
      const int failed = st.at("seeds_failed").get<int>();
      const bool has = st.at("mean").is_number();
      std::string diff = "-";
      if (g.at("name") != baseline) {
        diff =
            has && base_stats && base_stats->at("mean").is_number()
                ? fmt("%+.4f", st.at("mean").get<double>() - base_stats->at("mean").get<double>())
                : std::string("n/a");
      }
      md << "| " << g.at("name").get<std::string>() << " | "
         << (!has     ? std::string("no finished run")
             : n >= 2 ? num(st.at("mean"), "%.4f") + " +- " + num(st.at("sd"), "%.4f")
                      : num(st.at("mean"), "%.4f") + " (1 seed: no spread)")
         << " | " << n << (failed ? " (" + std::to_string(failed) + " failed)" : std::string())
         << " | "
         << (has ? stats::perplexity_text(st.at("mean").get<double>(), 2) : std::string("n/a"))
         << " | " << diff << " | " << with_commas(g.at("params").get<int64_t>()) << " | "
         << num(tokens_per_s_of(r, g.at("name").get<std::string>()), "%.0f") << " |\n";
    }
    write_best_per_mode(md, an);
    write_comparisons(md, an);
    write_claims(md, an);
    write_failed(md, an);
    write_tasks(md, r);
    if (r.contains("checks")) {
      md << "\nChecks: shared initial weights across configurations of a seed: "
         << (r["checks"].value("shared_init", false) ? "yes" : "NO") << "; identical batch order: "
         << (r["checks"].value("shared_batches", false) ? "yes" : "NO") << ".\n";
    }
    md << "\n## Plots\n\n";
    const std::string plots_note = r.value("plots_note", std::string());
    if (!plots_note.empty()) md << "Plots were not drawn: " << plots_note << ".\n\n";
    const bool plots = plots_note.empty();  // no links to pictures that were not drawn
    if (plots) md << "![validation loss](val_loss.png)\n\n";
    if (plots) {
      md << "Per-sublayer output magnitude at the end of training (SPEC 6: PreNorm's grows with "
            "depth, AttnRes stays bounded):\n\n![output RMS](output_rms.png)\n\n";
      md << "Per-sublayer gradient norm at the end of training (SPEC 6: more uniform under "
            "AttnRes):\n\n![gradient norm](grad_norm.png)\n\n";
    }
    for (const auto& g : groups) {
      if (!plots || !g.value("has_depth_weights", false)) continue;
      std::string safe = g.at("name").get<std::string>();
      for (char& c : safe) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-')
          c = '_';
      }
      md << "Learned depth weights of `" << g.at("name").get<std::string>()
         << "` (rows read, columns are sources; mean over a validation batch and seeds):\n\n"
         << "![depth weights " << g.at("name").get<std::string>() << "](depth_weights_" << safe
         << ".png)\n\n";
    }
    md << "## Files\n\n`results.json` (every number above), `runs/<configuration>/seed<k>/` "
          "(each run's `metrics.jsonl`, checkpoints and final `model.safetensors`), the PNG "
          "plots. Regenerate this report and the plots with `attnres report "
       << run_dir << "`.\n";
    write_file_atomic((fs::path(run_dir) / "report.md").string(), md.str());
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + path + "' lacks a field the report needs (" + e.what() +
                "); it may come from another attnres version: rerun `attnres compare`");
  }
}

}  // namespace attnres
