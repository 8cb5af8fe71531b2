// `attnres scale`: the same comparison at several model sizes with budgets growing with size,
// a power-law fit L = A * C^-alpha of each mode's validation loss against training FLOPs, and
// each mode's compute advantage over the baseline at the largest size (SPEC 6: 1.25x for Block).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/report.hpp"
#include "cli/commands.hpp"
#include "cli/compare_job.hpp"
#include "report/scaling.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace attnres::cli {

namespace {

struct ScaleArgs {
  CompareArgs cmp;
  std::string sizes = "4x64,6x96,8x128";
  double tokens_per_param = 2.0;
  int64_t min_steps = 100;
};

struct Size {
  int64_t n_layer = 0, d_model = 0;
  std::string name() const {
    return "L" + std::to_string(n_layer) + "_d" + std::to_string(d_model);
  }
};

std::vector<Size> parse_sizes(const std::string& text) {
  std::vector<Size> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    Size z;
    char x = 0, extra = 0;
    std::stringstream is(item);
    check(static_cast<bool>(is >> z.n_layer >> x >> z.d_model) && x == 'x' && !(is >> extra) &&
              z.n_layer >= 1 && z.n_layer <= 256 && z.d_model >= 32 && z.d_model % 32 == 0 &&
              z.d_model <= 8192,
          "--sizes '" + item +
              "' must be LAYERSxWIDTH with 1-256 layers and a width that is a "
              "multiple of 32 (e.g. 4x64,6x96,8x128)");
    check(out.empty() || 12.0 * z.n_layer * z.d_model * z.d_model >
                             12.0 * out.back().n_layer * out.back().d_model * out.back().d_model,
          "--sizes must grow: '" + item + "' is not larger than the size before it");
    out.push_back(z);
  }
  check(out.size() >= 2, "--sizes needs at least two sizes for a fit (e.g. 4x64,6x96,8x128)");
  return out;
}

json fit_json(const scaling::PowerFit& f) {
  auto num = [](double x) { return std::isfinite(x) ? json(x) : json(nullptr); };
  return {{"A", num(f.A)}, {"alpha", num(f.alpha)}, {"r2", num(f.r2)}, {"points", f.n}};
}

// Each mode's points (C, L) from the comparisons, its fit, and its advantage at the largest size.
json summarize(const std::vector<Size>& sizes, const std::vector<json>& results) {
  json modes = json::object();
  for (size_t i = 0; i < sizes.size(); i++) {
    const json& r = results[i];
    const json& an = r.at("analysis");
    for (const auto& [mode, group] : an.at("selected").items()) {
      for (const auto& g : r.at("groups")) {
        if (g.at("name") != group || !g.at("val_loss_mean").is_number()) continue;
        const double C = g.at("flops_per_token").get<double>() *
                         r.at("train").at("tokens_per_run").get<double>();
        modes[mode]["points"].push_back(
            {{"size", sizes[i].name()}, {"flops", C}, {"val_loss", g.at("val_loss_mean")}});
      }
    }
  }
  const std::string base = results.back().at("analysis").at("baseline");
  std::map<std::string, scaling::PowerFit> fits;
  for (auto& [mode, m] : modes.items()) {
    std::vector<double> C, L;
    for (const auto& p : m["points"]) {
      C.push_back(p["flops"]);
      L.push_back(p["val_loss"]);
    }
    fits[mode] = scaling::fit_power_law(C, L);
    m["fit"] = fit_json(fits[mode]);
  }
  json adv = json::object();
  const bool base_ok = fits.count(base) && std::isfinite(fits[base].alpha) && fits[base].alpha > 0;
  for (auto& [mode, m] : modes.items()) {
    if (mode == base) continue;
    const json& last = m["points"].back();
    if (!base_ok || last["size"] != sizes.back().name()) {
      adv[mode] = {{"factor", nullptr},
                   {"why", base_ok ? "no finished run at the largest size"
                                   : "the baseline's loss does not fall with compute here"}};
      continue;
    }
    const double C = last["flops"], L = last["val_loss"];
    const double f = scaling::fitted_advantage(fits[base], fits[mode], C);
    const double fm = scaling::compute_advantage(fits[base], L, C);
    auto num = [](double x) { return std::isfinite(x) ? json(x) : json(nullptr); };
    adv[mode] = {{"factor", num(f)}, {"factor_measured", num(fm)}, {"at_flops", C}};
    // How well the baseline's fit describes its own point there, against the measured gap.
    for (const auto& p : modes[base]["points"]) {
      if (p["size"] != sizes.back().name()) continue;
      adv[mode]["baseline_fit_miss"] = num(p["val_loss"].get<double>() - fits[base].at(C));
      adv[mode]["measured_gap"] = num(L - p["val_loss"].get<double>());
    }
  }
  return {
      {"format", "attnres-scaling/1"}, {"baseline", base}, {"modes", modes}, {"advantage", adv}};
}

std::string fmt4(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4f", x);
  return b;
}

// plotted: whether scaling.png was drawn (a link to a plot never drawn; 22nd hostile pass).
std::string markdown(const json& s, const std::vector<Size>& sizes, const std::vector<json>& res,
                     bool plotted) {
  std::ostringstream md;
  char b[160];
  md << "# attnres scale\n\n| size | parameters | steps | tokens | configuration | val loss "
        "| training FLOPs |\n|---|---|---|---|---|---|---|\n";
  for (size_t i = 0; i < sizes.size(); i++) {
    for (const auto& g : res[i].at("groups")) {
      std::snprintf(b, sizeof b, "%.3e",
                    g.at("flops_per_token").get<double>() *
                        res[i].at("train").at("tokens_per_run").get<double>());
      md << "| " << sizes[i].name() << " | " << g.at("params").get<int64_t>() << " | "
         << res[i].at("train").at("steps").get<int64_t>() << " | "
         << res[i].at("train").at("tokens_per_run").get<int64_t>() << " | "
         << g.at("name").get<std::string>() << " | "
         << (g.at("val_loss_mean").is_number() ? fmt4(g.at("val_loss_mean").get<double>())
                                               : std::string("no finished run"))
         << " | " << b << " |\n";
    }
  }
  md << "\n## Fits: L = A * C^-alpha (C = training FLOPs)\n\n| mode | A | alpha | r^2 | points |"
        "\n|---|---|---|---|---|\n";
  for (const auto& [mode, m] : s.at("modes").items()) {
    const json& f = m.at("fit");
    if (f.at("alpha").is_number()) {
      std::snprintf(b, sizeof b, "| %s | %.4g | %.4f | %.3f | %d |\n", mode.c_str(),
                    f.at("A").get<double>(), f.at("alpha").get<double>(), f.at("r2").get<double>(),
                    f.at("points").get<int>());
    } else {
      std::snprintf(b, sizeof b, "| %s | - | - | - | %d (too few for a fit) |\n", mode.c_str(),
                    f.at("points").get<int>());
    }
    md << b;
  }
  if (sizes.size() < 3) {
    md << "\nWith two sizes a fit is the line through two points (r^2 = 1 says nothing); give "
          "three or more sizes to test the law.\n";
  }
  const std::string base = s.at("baseline");
  md << "\n## Compute advantage over `" << base
     << "` at the largest size\n\nFrom the fits, curve against curve (the paper's reading: 1.25x "
        "for Block AttnRes): the compute the baseline's fit needs to reach the loss the mode's fit "
        "gives at the largest size's compute, over that compute. In brackets, the same from the "
        "mode's measured loss against the baseline's fit. With one seed per size and few sizes, "
        "read both as estimates.\n\n";
  for (const auto& [mode, a] : s.at("advantage").items()) {
    if (a.at("factor").is_number()) {
      char measured[32] = "-";
      if (a.at("factor_measured").is_number()) {
        std::snprintf(measured, sizeof measured, "%.3fx", a.at("factor_measured").get<double>());
      }
      std::snprintf(b, sizeof b, "* `%s`: %.3fx (measured loss: %s)\n", mode.c_str(),
                    a.at("factor").get<double>(), measured);
      md << b;
      const json miss = a.value("baseline_fit_miss", json(nullptr));
      const json gap = a.value("measured_gap", json(nullptr));
      if (miss.is_number() && gap.is_number() &&
          std::fabs(miss.get<double>()) > std::fabs(gap.get<double>())) {
        char note[400];
        std::snprintf(note, sizeof note,
                      "  * `%s`'s fit misses its own point at this size by %+.4f, more than the "
                      "measured gap (%+.4f): the law does not describe these points well enough "
                      "for either factor to mean much; add sizes or seeds.\n",
                      base.c_str(), miss.get<double>(), gap.get<double>());
        md << note;
      }
    } else {
      md << "* `" << mode << "`: not measured (" << a.value("why", std::string("no fit")) << ")\n";
    }
  }
  if (plotted) md << "\n![loss vs compute](scaling.png)\n";
  md << "\nEach size's own comparison (results, paired differences, claims) is in its folder: ";
  for (const Size& z : sizes) md << "[" << z.name() << "](" << z.name() << "/report.md) ";
  md << "\n";
  return md.str();
}

bool run_scale(ScaleArgs& a, CLI::App* app) {
  const std::vector<Size> sizes = parse_sizes(a.sizes);
  check(a.tokens_per_param > 0 && a.tokens_per_param <= 1e4,
        "--tokens-per-param must be in (0, 1e4]");
  check(a.min_steps >= 1, "--min-steps must be >= 1");
  check(a.cmp.seeds >= 1 && a.cmp.seeds <= 100, "--seeds must be in [1, 100]");  // (before size 1)
  // What each size sets itself: the model's shape (--sizes) and its budget (--tokens-per-param,
  // --min-steps). Given as well, they were dropped without a word (eleventh hostile pass).
  for (const char* o : {"--n-layer", "--d-model", "--steps"}) {
    check(app->count(o) == 0,
          std::string(o) +
              " is set for each size by scale (--sizes LAYERSxWIDTH; the steps by "
              "--tokens-per-param and --min-steps); leave it out");
  }
  check_out_apart_from_data(a.cmp.out, a.cmp.base.cfg.data_path);
  check_own_outputs(a.cmp.out, "scaling.json", "scaling.md", "modes");
  std::vector<json> results;
  for (size_t i = 0; i < sizes.size(); i++) {
    CompareArgs c = a.cmp;
    c.preset = "none";
    c.app = app;
    c.out = (fs::path(a.cmp.out) / sizes[i].name()).string();
    const Size& z = sizes[i];
    // Budget: tokens_per_param x the blocks' weights (12 L d^2: attention 4 d^2, SwiGLU 8 d^2).
    const double params = 12.0 * static_cast<double>(z.n_layer * z.d_model * z.d_model);
    const TrainConfig& b = a.cmp.base.cfg;
    const double per_step = static_cast<double>(b.batch_size * b.seq_len * b.grad_accum);
    const int64_t steps = std::max<int64_t>(
        a.min_steps, static_cast<int64_t>(std::ceil(a.tokens_per_param * params / per_step)));
    apply_train_args(
        c.base, {"--n-layer=" + std::to_string(z.n_layer), "--d-model=" + std::to_string(z.d_model),
                 "--steps=" + std::to_string(steps)});
    // Defaults that scale with the size; a value the user gave is kept for every size.
    auto by_size = [&](const char* o, int64_t v) {
      if (app->count(o) == 0) apply_train_args(c.base, {std::string(o) + "=" + std::to_string(v)});
    };
    by_size("--n-head", z.d_model / 32);
    by_size("--warmup", std::min<int64_t>(100, steps / 10));
    by_size("--eval-every", std::max<int64_t>(1, steps / 5));
    check(c.base.cfg.model.n_head >= 1 && c.base.cfg.model.d_model % c.base.cfg.model.n_head == 0,
          "--n-head " + std::to_string(c.base.cfg.model.n_head) + " does not divide the width " +
              std::to_string(z.d_model) + " of size " + z.name() +
              "; leave it out (width/32 heads) or give one that divides every width");
    std::printf("\n=== scale: size %zu/%zu, %s: %lld layers, d %lld, %lld steps (%.3g tokens)\n",
                i + 1, sizes.size(), z.name().c_str(), static_cast<long long>(z.n_layer),
                static_cast<long long>(z.d_model), static_cast<long long>(steps),
                static_cast<double>(steps) * per_step);
    std::fflush(stdout);
    if (!run_compare(c)) return false;
    results.push_back(
        json::parse(read_small_file((fs::path(c.out) / "results.json").string(), kMaxResultsBytes,
                                    "a comparison's results.json")));
  }
  const json s = summarize(sizes, results);
  write_file_atomic((fs::path(a.cmp.out) / "scaling.json").string(), s.dump(1) + "\n");
  std::string why;
  const bool plotted = a.cmp.no_plots ? false : render_plots(a.cmp.out, &why);
  std::string md = markdown(s, sizes, results, plotted);
  if (!plotted)
    md += "\nThe plot was not drawn: " + (a.cmp.no_plots ? std::string("--no-plots") : why) + ".\n";
  write_file_atomic((fs::path(a.cmp.out) / "scaling.md").string(), md);
  std::printf("\n%s", md.c_str());
  std::printf("\nscaling report: %s/scaling.md\n", a.cmp.out.c_str());
  return true;
}

}  // namespace

void add_scale(CLI::App& app) {
  auto a = std::make_shared<ScaleArgs>();
  a->cmp.out = "runs/scale";
  a->cmp.seeds = 1;
  // Defaults of a small comparison; explicit options win.
  apply_train_args(a->cmp.base, {"--seq-len=128", "--batch-size=16", "--lr=3e-3",
                                 "--eval-batches=16", "--tokenizer=bpe", "--vocab-size=2048"});
  CLI::App* s = app.add_subcommand(
      "scale",
      "The comparison at several model sizes, budgets growing with size; fit L = A C^-alpha per "
      "mode and report each mode's compute advantage at the largest size");
  add_train_options(s, a->cmp.base);
  s->add_option("--out", a->cmp.out, "Directory of the study")->capture_default_str();
  s->add_option("--modes", a->cmp.modes, "Residual modes, comma-separated")->capture_default_str();
  s->add_option("--seeds", a->cmp.seeds, "Seeds per size")->capture_default_str();
  s->add_option("--sizes", a->sizes, "Model sizes LAYERSxWIDTH, growing (heads: width/32)")
      ->capture_default_str();
  s->add_option("--tokens-per-param", a->tokens_per_param,
                "Training tokens per weight of the blocks (12 L d^2) at each size")
      ->capture_default_str();
  s->add_option("--min-steps", a->min_steps, "Fewest optimizer steps at any size")
      ->capture_default_str();
  s->add_flag("--no-plots", a->cmp.no_plots, "Skip the plots");
  s->callback([a, s] {
    a->cmp.command_line = command_line();
    if (!run_scale(*a, s)) throw CLI::RuntimeError(130);
  });
}

}  // namespace attnres::cli
