#include "report/analysis.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "attnres/error.hpp"
#include "report/stats.hpp"

namespace attnres::report {

using nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool run_ok(const json& r) {
  return r.value("status", std::string("ok")) == "ok" && r.contains("final_val_loss") &&
         r.at("final_val_loss").is_number();
}

const json& diag_of(const json& r) {
  static const json none;
  return r.contains("diagnostics") ? r.at("diagnostics") : none;
}

// (sized to fit: a loss of 1e308 in a results.json edited by hand was cut to 63 digits)
std::string fmt(const char* f, double x) {
  const int n = std::snprintf(nullptr, 0, f, x);
  std::string out(static_cast<size_t>(std::max(n, 0)), '\0');
  std::snprintf(out.data(), out.size() + 1, f, x);
  return out;
}

// The finite values of a diagnostics array (null entries are non-finite measurements).
std::vector<double> finite_array(const json& diag, const char* key) {
  std::vector<double> v;
  if (!diag.is_object() || !diag.contains(key) || !diag[key].is_array()) return v;
  for (const auto& x : diag[key]) {
    if (!x.is_number()) return {};  // a non-finite entry makes the whole profile unusable
    v.push_back(x.get<double>());
  }
  return v;
}

// Mean of the last quarter over the mean of the first quarter (at least one sublayer each).
double depth_growth(const std::vector<double>& v) {
  if (v.size() < 2) return kNaN;
  const size_t q = std::max<size_t>(1, v.size() / 4);
  double first = 0, last = 0;
  for (size_t i = 0; i < q; i++) first += v[i] / static_cast<double>(q);
  for (size_t i = v.size() - q; i < v.size(); i++) last += v[i] / static_cast<double>(q);
  return first > 0 ? last / first : kNaN;
}

struct DepthStructure {
  double recent_share = kNaN;  // mixers whose largest weight is on their most recent source
  double emb_excess = kNaN;    // mean weight on the embedding minus the uniform share
};

DepthStructure depth_structure(const json& diag) {
  DepthStructure s;
  if (!diag.is_object() || !diag.contains("depth_weights")) return s;
  const json& dw = diag.at("depth_weights");
  if (!dw.is_object() || !dw.contains("w") || !dw.at("w").is_array()) return s;  // (not a table)
  int rows = 0, recent = 0;
  double excess = 0;
  for (const auto& row : dw.at("w")) {
    if (!row.is_array()) continue;
    std::vector<std::pair<size_t, double>> src;  // (column, weight) of the row's sources
    for (size_t j = 0; j < row.size(); j++) {
      if (row[j].is_number()) src.emplace_back(j, row[j].get<double>());
    }
    if (src.size() < 2 || src.front().first != 0) continue;  // one source: nothing to choose
    rows++;
    size_t best = 0;
    for (size_t k = 1; k < src.size(); k++) {
      if (src[k].second > src[best].second) best = k;
    }
    recent += best + 1 == src.size();
    excess += src.front().second - 1.0 / static_cast<double>(src.size());
  }
  if (rows > 0) {
    s.recent_share = static_cast<double>(recent) / rows;
    s.emb_excess = excess / rows;
  }
  return s;
}

// Per-seed values of one group: seed -> run.
using BySeed = std::map<uint64_t, const json*>;

BySeed ok_runs(const json& results, const std::string& group) {
  BySeed m;
  for (const auto& r : results.at("runs")) {
    if (r.at("group") == group && run_ok(r)) m[r.at("seed").get<uint64_t>()] = &r;
  }
  return m;
}

// Per-seed differences f(a) - f(b) over the seeds where both have a finite value.
template <typename F>
std::vector<double> paired(const BySeed& a, const BySeed& b, F f) {
  std::vector<double> d;
  for (const auto& [seed, ra] : a) {
    const auto it = b.find(seed);
    if (it == b.end()) continue;
    const double x = f(*ra), y = f(*it->second);
    if (std::isfinite(x) && std::isfinite(y)) d.push_back(x - y);
  }
  return d;
}

template <typename F>
std::vector<double> values(const BySeed& a, F f) {
  std::vector<double> v;
  for (const auto& [seed, r] : a) {
    const double x = f(*r);
    if (std::isfinite(x)) v.push_back(x);
  }
  return v;
}

double val_loss(const json& r) { return r.at("final_val_loss").get<double>(); }
double log_input_growth(const json& r) {
  return std::log(depth_growth(finite_array(diag_of(r), "input_rms")));
}
double log_output_growth(const json& r) {
  return std::log(depth_growth(finite_array(diag_of(r), "output_rms")));
}
double grad_cv(const json& r) {
  return stats::coefficient_of_variation(finite_array(diag_of(r), "grad_norm"));
}

json interval_json(const stats::Interval& iv) {
  auto num = [](double x) { return std::isfinite(x) ? json(x) : json(nullptr); };
  return {{"n", iv.n},        {"mean", num(iv.mean)}, {"sd", num(iv.sd)},
          {"lo", num(iv.lo)}, {"hi", num(iv.hi)},     {"verdict", stats::verdict_name(iv.verdict)}};
}

// A claim that some quantity is LOWER for the subject: the interval's verdict as the claim's.
std::string claim_verdict(const stats::Interval& iv) {
  if (iv.n == 0) return "no data (no finished run with this measurement)";
  switch (iv.verdict) {
    case stats::Verdict::lower:
      return "holds";
    case stats::Verdict::higher:
      return "contradicted";
    case stats::Verdict::indistinguishable:
      return "not shown (interval includes no effect)";
    case stats::Verdict::too_few:
      return "too few seeds (need 3)";
  }
  return "?";
}

std::string iv_text(const stats::Interval& iv, const char* f) {
  if (iv.n == 0) return "no data";
  if (iv.n < 2) return "one seed: no interval";
  return "[" + fmt(f, iv.lo) + ", " + fmt(f, iv.hi) + "] (" + std::to_string(iv.n) + " seeds)";
}

json claim(const std::string& text, const std::string& paper, const std::string& subject,
           const std::string& measured, const std::string& interval, const std::string& verdict,
           int n) {
  return {{"claim", text},
          {"paper", paper},
          {"subject", subject},
          {"measured", measured},
          {"interval", interval},
          {"verdict", verdict},
          {"n", n}};
}

// The group of each mode that the mode is judged at: its only one, or its best mean validation
// loss over the sweep among groups whose every seed finished.
std::map<std::string, std::string> select_groups(const json& results, bool swept, json& best_rows) {
  std::map<std::string, std::string> sel;
  std::map<std::string, double> best;
  const size_t n_seeds = results.contains("seeds") ? results.at("seeds").size() : 0;
  for (const auto& g : results.at("groups")) {
    const std::string mode = g.at("mode"), name = g.at("name");
    const BySeed ok = ok_runs(results, name);
    const auto v = values(ok, val_loss);
    const double mean = v.empty() ? kNaN : stats::mean_interval(v).mean;
    const bool complete = !v.empty() && (n_seeds == 0 || v.size() == n_seeds);
    if (!swept) {
      sel[mode] = name;
      continue;
    }
    if (complete && (!best.count(mode) || mean < best[mode])) {
      best[mode] = mean;
      sel[mode] = name;
    }
  }
  if (swept) {
    for (const auto& g : results.at("groups")) {
      const std::string mode = g.at("mode");
      if (!sel.count(mode) || sel[mode] != g.at("name")) continue;
      best_rows.push_back({{"mode", mode},
                           {"group", g.at("name")},
                           {"sweep", g.value("sweep", json::object())},
                           {"val_loss_mean", best[mode]},
                           {"seeds_ok", ok_runs(results, g.at("name")).size()}});
    }
  }
  return sel;
}

// The same swept values as g, in the baseline mode (for same-settings comparisons).
const json* same_settings(const json& results, const json& g, const std::string& base_mode) {
  for (const auto& b : results.at("groups")) {
    if (b.at("mode") == base_mode &&
        b.value("sweep", json::object()) == g.value("sweep", json::object()))
      return &b;
  }
  return nullptr;
}

void add_claims(const json& results, const std::map<std::string, std::string>& sel,
                const std::string& base_mode, json& claims) {
  if (!sel.count(base_mode) || base_mode != "prenorm") return;
  const BySeed base = ok_runs(results, sel.at(base_mode));
  std::map<std::string, stats::Interval> loss_iv;
  for (const char* mode : {"full", "block"}) {
    if (!sel.count(mode)) continue;
    const std::string subject = sel.at(mode);
    const BySeed runs = ok_runs(results, subject);
    const auto dl = stats::mean_interval(paired(runs, base, val_loss));
    loss_iv[mode] = dl;
    claims.push_back(claim("lower validation loss than PreNorm at the same tokens",
                           "-0.02 to -0.06 nats (SPEC 6)", subject,
                           dl.n ? fmt("%+.4f nats", dl.mean) : "no data", iv_text(dl, "%+.4f"),
                           claim_verdict(dl), dl.n));
    for (const auto& [key, fn, text] :
         {std::tuple{"input", &log_input_growth,
                     "hidden-state magnitude bounded over depth (sublayer input RMS, last quarter "
                     "/ first quarter, vs PreNorm's)"},
          std::tuple{"output", &log_output_growth,
                     "sublayer output magnitude bounded over depth (output RMS, last quarter / "
                     "first quarter, vs PreNorm's)"}}) {
      const auto mine = values(runs, fn), theirs = values(base, fn);
      const auto d = stats::mean_interval(paired(runs, base, fn));
      const double gm = mine.empty() ? kNaN : std::exp(stats::mean_interval(mine).mean);
      const double gb = theirs.empty() ? kNaN : std::exp(stats::mean_interval(theirs).mean);
      const std::string iv = d.n >= 2 ? "ratio [" + fmt("%.3g", std::exp(d.lo)) + ", " +
                                            fmt("%.3g", std::exp(d.hi)) + "] (" +
                                            std::to_string(d.n) + " seeds)"
                                      : iv_text(d, "%.3g");
      claims.push_back(claim(text, "PreNorm grows with depth, AttnRes stays bounded", subject,
                             d.n ? fmt("%.3gx", gm) + " vs PreNorm " + fmt("%.3gx", gb) +
                                       " (ratio " + fmt("%.3g", std::exp(d.mean)) + ")"
                                 : "no diagnostics",
                             iv, claim_verdict(d), d.n));
      (void)key;
    }
    {
      const auto d = stats::mean_interval(paired(runs, base, grad_cv));
      const auto mine = values(runs, grad_cv), theirs = values(base, grad_cv);
      claims.push_back(
          claim("more uniform gradient norms over depth (coefficient of variation, vs PreNorm's)",
                "AttnRes spreads them evenly", subject,
                d.n ? "CV " + fmt("%.2f", stats::mean_interval(mine).mean) + " vs PreNorm " +
                          fmt("%.2f", stats::mean_interval(theirs).mean)
                    : "no diagnostics",
                iv_text(d, "%+.2f"), claim_verdict(d), d.n));
    }
    {
      // Diagonal dominance: the share of mixers reading their most recent source most, against
      // one half (the claim holds when the interval lies above it).
      std::vector<double> share_minus_half, emb;
      for (const auto& [seed, r] : runs) {
        const DepthStructure s = depth_structure(diag_of(*r));
        if (std::isfinite(s.recent_share)) share_minus_half.push_back(0.5 - s.recent_share);
        if (std::isfinite(s.emb_excess)) emb.push_back(-s.emb_excess);
      }
      const auto ds = stats::mean_interval(share_minus_half);
      claims.push_back(claim(
          "depth weights diagonal-dominant (share of mixers whose largest weight is their most "
          "recent source)",
          "each sublayer leans on its predecessor", subject,
          ds.n ? fmt("%.0f%%", 100 * (0.5 - ds.mean)) + " of mixers" : "no depth weights",
          ds.n >= 2 ? "[" + fmt("%.0f%%", 100 * std::max(0.0, 0.5 - ds.hi)) + ", " +
                          fmt("%.0f%%", 100 * std::min(1.0, 0.5 - ds.lo)) + "] (" +
                          std::to_string(ds.n) + " seeds; holds above 50%)"
                    : iv_text(ds, "%.2f"),
          claim_verdict(ds), ds.n));
      const auto de = stats::mean_interval(emb);
      claims.push_back(
          claim("weight kept on the embedding (mean weight on it minus the uniform share)",
                "learned weights keep weight on the embedding", subject,
                de.n ? fmt("%+.1f", -100 * de.mean) + " points" : "no depth weights",
                de.n >= 2 ? "[" + fmt("%+.1f", -100 * de.hi) + ", " + fmt("%+.1f", -100 * de.lo) +
                                "] points (" + std::to_string(de.n) + " seeds)"
                          : iv_text(de, "%.2f"),
                claim_verdict(de), de.n));
    }
  }
  if (sel.count("full") && sel.count("block")) {
    const BySeed full = ok_runs(results, sel.at("full")), block = ok_runs(results, sel.at("block"));
    const auto d = stats::mean_interval(paired(block, full, val_loss));
    const auto& lf = loss_iv.at("full");
    const auto& lb = loss_iv.at("block");
    std::string verdict, measured = d.n ? "Block - Full " + fmt("%+.4f nats", d.mean) : "no data";
    if (lf.n && lb.n && lf.mean < 0 && lb.mean < 0) {
      measured += "; Block keeps " + fmt("%.0f%%", 100 * lb.mean / lf.mean) + " of Full's gain";
    }
    if (d.verdict == stats::Verdict::too_few) {
      verdict = claim_verdict(d);
    } else if (lf.verdict != stats::Verdict::lower) {
      verdict = d.verdict == stats::Verdict::lower
                    ? "contradicted: Block beats Full, which has no significant gain over PreNorm"
                    : "not testable: Full has no significant gain over PreNorm";
    } else if (lb.verdict == stats::Verdict::lower && lb.mean / lf.mean >= 0.5) {
      verdict = "holds";
    } else {
      verdict = d.verdict == stats::Verdict::higher ? "contradicted" : "not shown";
    }
    claims.push_back(claim("Block AttnRes recovers most of Full AttnRes's gain",
                           "Block within ~0.01 of Full, Full at least as good", sel.at("block"),
                           measured, iv_text(d, "%+.4f"), verdict, d.n));
  }
}

}  // namespace

// The shape analyze() relies on: groups with unique names, runs naming a group, one run per
// (group, seed). A hand-edited or damaged results.json is refused, not half-read.
static void validate(const json& results) {
  check(results.is_object(), "results.json must hold a JSON object");
  const json& groups = results.at("groups");
  const json& runs = results.at("runs");
  check(groups.is_array() && !groups.empty(), "results.json: 'groups' must be a non-empty list");
  check(runs.is_array(), "results.json: 'runs' must be a list");
  std::set<std::string> names;
  for (const auto& g : groups) {
    const std::string n = g.at("name");
    check(names.insert(n).second, "results.json: two configurations are named '" + n + "'");
  }
  std::set<std::pair<std::string, uint64_t>> seen;
  for (const auto& r : runs) {
    const std::string g = r.at("group");
    check(names.count(g),
          "results.json: a run names configuration '" + g + "', which is not one of its groups");
    const uint64_t seed = r.at("seed").get<uint64_t>();
    check(seen.insert({g, seed}).second,
          "results.json: configuration '" + g + "' has two runs with seed " + std::to_string(seed));
    if (r.contains("final_val_loss") && r.at("final_val_loss").is_number()) {
      const double v = r.at("final_val_loss").get<double>();
      check(std::isfinite(v) && v >= 0, "results.json: run '" + g + "' seed " +
                                            std::to_string(seed) + " has validation loss " +
                                            std::to_string(v) + ", which no run can measure");
    }
  }
}

// Each configuration's validation loss over its finished runs, re-derived from the runs.
static json group_stats(const json& results) {
  json out = json::object();
  for (const auto& g : results.at("groups")) {
    const std::string name = g.at("name");
    const auto v = values(ok_runs(results, name), val_loss);
    int failed = 0;
    for (const auto& r : results.at("runs")) failed += r.at("group") == name && !run_ok(r);
    const auto iv = stats::mean_interval(v);
    auto num = [](double x) { return std::isfinite(x) ? json(x) : json(nullptr); };
    out[name] = {{"seeds_ok", iv.n},
                 {"seeds_failed", failed},
                 {"mean", num(iv.mean)},
                 {"sd", iv.n >= 2 ? json(iv.sd) : json(nullptr)}};
  }
  return out;
}

json analyze(const json& results) {
  validate(results);
  json out = json::object();
  const auto& groups = results.at("groups");
  bool swept = false;
  for (const auto& g : groups) swept |= !g.value("sweep", json::object()).empty();
  std::string base_mode = groups.empty() ? "" : groups.front().at("mode").get<std::string>();
  for (const auto& g : groups) {
    if (g.at("mode") == "prenorm") base_mode = "prenorm";
  }
  json best_rows = json::array();
  const auto sel = select_groups(results, swept, best_rows);
  out["baseline"] = base_mode;
  out["selection"] = swept ? "best per mode" : "fixed";
  out["selected"] = sel;
  if (swept) out["best_per_mode"] = best_rows;

  json comps = json::array();
  auto compare_to = [&](const json& g, const std::string& vs, const char* kind) {
    const auto d = stats::mean_interval(
        paired(ok_runs(results, g.at("name")), ok_runs(results, vs), val_loss));
    json c = interval_json(d);
    c["group"] = g.at("name");
    c["vs"] = vs;
    c["kind"] = kind;
    comps.push_back(c);
  };
  for (const auto& g : groups) {
    if (g.at("mode") == base_mode) continue;
    if (const json* b = same_settings(results, g, base_mode))
      compare_to(g, (*b).at("name"), "same settings");
  }
  if (swept && sel.count(base_mode)) {
    for (const auto& g : groups) {
      const std::string mode = g.at("mode");
      if (mode == base_mode || !sel.count(mode) || sel.at(mode) != g.at("name")) continue;
      const json* same = same_settings(results, g, base_mode);
      if (same && same->at("name") == sel.at(base_mode)) continue;  // already compared above
      compare_to(g, sel.at(base_mode), "each at its best");
    }
  }
  // Within a mode, each swept value against the mode's first (an ablation: temperature, S, ...).
  std::map<std::string, std::string> first_of_mode;
  for (const auto& g : groups) {
    const std::string mode = g.at("mode");
    if (g.value("sweep", json::object()).empty()) continue;
    if (!first_of_mode.count(mode)) {
      first_of_mode[mode] = g.at("name");
    } else {
      compare_to(g, first_of_mode.at(mode), "vs first value");
    }
  }
  out["comparisons"] = comps;

  json claims = json::array();
  add_claims(results, sel, base_mode, claims);
  out["claims"] = claims;

  json failed = json::array();
  for (const auto& r : results.at("runs")) {
    if (run_ok(r)) continue;
    failed.push_back({{"group", r.at("group")},
                      {"seed", r.at("seed")},
                      {"status", r.value("status", std::string("no final validation loss"))},
                      {"reason", r.value("reason", std::string())}});
  }
  out["failed_runs"] = failed;
  out["group_stats"] = group_stats(results);
  return out;
}

}  // namespace attnres::report
