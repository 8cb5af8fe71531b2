// report.md from results.json (see attnres/report.hpp).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/report.hpp"

namespace attnres {

namespace {

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); i++) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

}  // namespace

void write_report(const std::string& run_dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(run_dir) / "results.json").string();
  nlohmann::json r;
  try {
    r = nlohmann::json::parse(read_file(path));
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
    md << "* Command: `" << r.at("command").get<std::string>() << "`\n";
    md << "* Date: " << r.at("created").get<std::string>() << "\n";
    const nlohmann::json& hw = r.at("hardware");
    md << "* Hardware: " << hw.at("cpu").get<std::string>() << ", " << hw.at("threads").get<int>()
       << " threads";
    if (hw.contains("device") && hw.at("device").get<std::string>() != "cpu") {  // older files: cpu
      md << "; trained on " << hw.at("device").get<std::string>() << " ("
         << hw.value("precision", std::string("fp32")) << ")";
    }
    md << "\n";
    md << "* Wall time: " << fmt("%.1f", r.at("wall_time_s").get<double>() / 60.0)
       << " min for " << r.at("runs").size() << " runs\n\n";

    md << "## Setup\n\n";
    const auto& m = r.at("model");
    md << "| setting | value |\n|---|---|\n";
    md << "| data | `" << r.at("data").at("path").get<std::string>() << "`: "
       << with_commas(r.at("data").at("train_tokens").get<int64_t>()) << " train / "
       << with_commas(r.at("data").at("val_tokens").get<int64_t>()) << " validation tokens, "
       << "tokenizer " << r.at("data").at("tokenizer").get<std::string>() << " (vocab "
       << r.at("data").at("vocab_size").get<int64_t>() << ") |\n";
    md << "| model | " << m.at("n_layer").get<int64_t>() << " layers (" << 2 * m.at("n_layer").get<int64_t>()
       << " sublayers), d " << m.at("d_model").get<int64_t>() << ", " << m.at("n_head").get<int64_t>()
       << " heads (kv " << m.at("n_kv_head").get<int64_t>() << "), SwiGLU " << m.at("ffn_hidden").get<int64_t>()
       << ", context " << m.at("max_seq_len").get<int64_t>() << ", "
       << (m.at("tied").get<bool>() ? "tied" : "untied") << " head |\n";
    md << "| preset | " << r.value("preset", std::string("(none)")) << " |\n";
    md << "| budget per run | " << tr.at("steps").get<int64_t>() << " steps x "
       << tr.at("batch_size").get<int64_t>() << " x " << tr.at("seq_len").get<int64_t>() << " x "
       << tr.at("grad_accum").get<int64_t>() << " = "
       << with_commas(tr.at("tokens_per_run").get<int64_t>()) << " tokens |\n";
    md << "| optimiser | AdamW lr " << fmt("%g", tr.at("lr").get<double>()) << ", "
       << tr.at("schedule").get<std::string>() << " schedule, warm-up "
       << tr.at("warmup_steps").get<int64_t>() << ", weight decay "
       << fmt("%g", tr.at("weight_decay").get<double>()) << ", clip "
       << fmt("%g", tr.at("grad_clip").get<double>()) << " |\n";
    md << "| seeds | " << r.at("seeds").dump() << " (per seed: the same initial shared weights "
       << "and batch order in every configuration) |\n";
    md << "| evaluation | " << tr.at("eval_batches").get<int64_t>()
       << " validation batches every " << tr.at("eval_every").get<int64_t>() << " steps |\n\n";

    md << "## Results\n\n";
    md << "Final validation loss (nats/token) as mean +- sample std over seeds; the difference is "
          "to `" << baseline << "`.\n\n";
    md << "| configuration | val loss | perplexity | diff vs " << baseline
       << " | parameters | tokens/s |\n|---|---|---|---|---|---|\n";
    for (const auto& g : groups) {
      const int n = g.at("seeds").get<int>();
      md << "| " << g.at("name").get<std::string>() << " | "
         << fmt("%.4f", g.at("val_loss_mean").get<double>()) << " +- "
         << fmt("%.4f", g.at("val_loss_std").get<double>()) << (n < 2 ? " (1 seed)" : "") << " | "
         << fmt("%.2f", g.at("ppl_mean").get<double>()) << " | "
         << (g.at("name") == baseline ? std::string("-")
                                      : fmt("%+.4f", g.at("delta_vs_baseline").get<double>()))
         << " | " << with_commas(g.at("params").get<int64_t>()) << " | "
         << fmt("%.0f", g.at("tokens_per_s_mean").get<double>()) << " |\n";
    }
    // A plain reading: which differences exceed the seed-to-seed spread.
    md << "\n";
    const auto* base = &groups[0];
    for (const auto& g : groups) {
      if (g.at("name") == baseline) base = &g;
    }
    for (const auto& g : groups) {
      if (&g == base) continue;
      const double d = g.at("delta_vs_baseline").get<double>();
      const double spread = 2.0 * std::max(g.at("val_loss_std").get<double>(),
                                           base->at("val_loss_std").get<double>());
      md << "* `" << g.at("name").get<std::string>() << "`: " << fmt("%+.4f", d) << " vs `"
         << baseline << "`, "
         << (g.at("seeds").get<int>() < 2 ? std::string("one seed, so no spread to judge against")
             : std::abs(d) > spread
                 ? "larger than twice the seed std (" + fmt("%.4f", spread) + "): a clear " +
                       (d < 0 ? std::string("improvement") : std::string("regression"))
                 : "within twice the seed std (" + fmt("%.4f", spread) + "): not distinguishable "
                   "at this budget")
         << ".\n";
    }
    if (r.contains("checks")) {
      md << "\nChecks: shared initial weights across configurations of a seed: "
         << (r["checks"].value("shared_init", false) ? "yes" : "NO")
         << "; identical batch order: " << (r["checks"].value("shared_batches", false) ? "yes" : "NO")
         << ".\n";
    }

    md << "\n## Plots\n\n";
    const std::string plots_note = r.value("plots_note", std::string());
    if (!plots_note.empty()) md << "Plots were not drawn: " << plots_note << ".\n\n";
    md << "![validation loss](val_loss.png)\n\n";
    md << "Per-sublayer output magnitude at the end of training (SPEC 6: PreNorm's grows with "
          "depth, AttnRes stays bounded):\n\n![output RMS](output_rms.png)\n\n";
    md << "Per-sublayer gradient norm at the end of training (SPEC 6: more uniform under "
          "AttnRes):\n\n![gradient norm](grad_norm.png)\n\n";
    for (const auto& g : groups) {
      if (!g.value("has_depth_weights", false)) continue;
      std::string safe = g.at("name").get<std::string>();
      for (char& c : safe) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') c = '_';
      }
      md << "Learned depth weights of `" << g.at("name").get<std::string>()
         << "` (rows read, columns are sources; mean over a validation batch and seeds):\n\n"
         << "![depth weights " << g.at("name").get<std::string>() << "](depth_weights_" << safe
         << ".png)\n\n";
    }
    md << "## Files\n\n`results.json` (every number above), `runs/<configuration>/seed<k>/` "
          "(each run's `metrics.jsonl`, checkpoints and final `model.safetensors`), the PNG "
          "plots. Regenerate this report and the plots with `attnres report " << run_dir << "`.\n";
    write_file_atomic((fs::path(run_dir) / "report.md").string(), md.str());
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + path + "' lacks a field the report needs (" + e.what() +
                "); it may come from another attnres version: rerun `attnres compare`");
  }
}

}  // namespace attnres
