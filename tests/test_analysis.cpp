// The comparison's statistics (src/report/stats) and its reading (src/report/analysis) on
// hand-made results whose intervals and verdicts are worked out below by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "report/analysis.hpp"
#include "report/stats.hpp"

using nlohmann::json;
namespace stats = attnres::stats;

namespace {

TEST(Stats, StudentQuantilesMatchTheTable) {
  // Two-sided 95 % critical values of Student's t (any statistics textbook).
  EXPECT_NEAR(stats::t_quantile_975(1), 12.706, 1e-3);
  EXPECT_NEAR(stats::t_quantile_975(2), 4.303, 1e-3);
  EXPECT_NEAR(stats::t_quantile_975(9), 2.262, 1e-3);
  EXPECT_NEAR(stats::t_quantile_975(40), 2.021, 2e-3);
  EXPECT_NEAR(stats::t_quantile_975(120), 1.980, 2e-3);
  EXPECT_TRUE(std::isnan(stats::t_quantile_975(0)));
}

// Fourteenth hostile pass: a perplexity beyond 1e63 was printed with its digits cut off.
TEST(Stats, PerplexityTextIsNeverCut) {
  EXPECT_EQ(stats::perplexity_text(std::log(2.5), 3), "2.500");
  EXPECT_EQ(stats::perplexity_text(std::log(2.5), 2), "2.50");
  EXPECT_EQ(stats::perplexity_text(329.51, 2), "1.272e+143");  // e^329.51 (Python: 1.272e+143)
  EXPECT_EQ(stats::perplexity_text(1077.44, 2), "e^1077.4 (beyond a double)");
}

TEST(Stats, MeanIntervalAndVerdicts) {
  // mean 2, sd 1, n 3: half width 4.303 / sqrt(3) = 2.4843.
  const auto a = stats::mean_interval({1, 2, 3});
  EXPECT_EQ(a.n, 3);
  EXPECT_DOUBLE_EQ(a.mean, 2.0);
  EXPECT_NEAR(a.sd, 1.0, 1e-12);
  EXPECT_NEAR(a.lo, 2.0 - 2.48434, 1e-4);
  EXPECT_NEAR(a.hi, 2.0 + 2.48434, 1e-4);
  EXPECT_EQ(a.verdict, stats::Verdict::indistinguishable);
  EXPECT_EQ(stats::mean_interval({-0.05, -0.06, -0.04}).verdict, stats::Verdict::lower);
  EXPECT_EQ(stats::mean_interval({0.05, 0.06, 0.04}).verdict, stats::Verdict::higher);
  // Two seeds never give a verdict, however clear.
  EXPECT_EQ(stats::mean_interval({-1.0, -1.01}).verdict, stats::Verdict::too_few);
  const auto one = stats::mean_interval({0.5});
  EXPECT_EQ(one.verdict, stats::Verdict::too_few);
  EXPECT_EQ(one.lo, 0.5);
  EXPECT_TRUE(std::isnan(stats::mean_interval({}).mean));
  // CV: mean 1.75, sample sd 1.5.
  EXPECT_NEAR(stats::coefficient_of_variation({4, 1, 1, 1}), 1.5 / 1.75, 1e-12);
}

json run(const std::string& group, int seed, double loss, const json& diag = nullptr,
         const std::string& status = "ok") {
  return {{"group", group},
          {"seed", seed},
          {"status", status},
          {"final_val_loss", status == "ok" ? json(loss) : json(nullptr)},
          {"diagnostics", diag}};
}

json diag(std::vector<double> input_rms, std::vector<double> grad, json weights = nullptr) {
  json d = {{"input_rms", input_rms}, {"output_rms", input_rms}, {"grad_norm", grad}};
  if (!weights.is_null()) d["depth_weights"] = {{"w", weights}};
  return d;
}

json three_modes() {
  json r = {{"seeds", {1, 2, 3}},
            {"groups",
             {{{"name", "prenorm"}, {"mode", "prenorm"}, {"sweep", json::object()}},
              {{"name", "full"}, {"mode", "full"}, {"sweep", json::object()}},
              {{"name", "block S=2"}, {"mode", "block"}, {"sweep", json::object()}}}},
            {"runs", json::array()}};
  // Full's mixers: the second reads its most recent source most, the third the embedding.
  const json w = {{1.0, nullptr, nullptr}, {0.3, 0.7, nullptr}, {0.5, 0.2, 0.3}};
  const double pre[] = {3.00, 3.10, 2.90}, full[] = {2.95, 3.04, 2.86},
               block[] = {3.02, 3.08, 2.95};
  for (int s = 0; s < 3; s++) {
    r["runs"].push_back(run("prenorm", s + 1, pre[s], diag({1, 2, 4, 8}, {4, 1, 1, 1})));
    r["runs"].push_back(run("full", s + 1, full[s], diag({1, 1, 1, 1.5}, {1, 1, 1, 1.2}, w)));
    r["runs"].push_back(run("block S=2", s + 1, block[s], diag({1, 1, 1, 1.5}, {1, 1, 1, 1.2}, w)));
  }
  return r;
}

const json& find(const json& rows, const std::string& key, const std::string& value,
                 const std::string& key2 = "", const std::string& value2 = "") {
  for (const auto& row : rows) {
    if (row.at(key) == value && (key2.empty() || row.at(key2).get<std::string>().find(value2) == 0))
      return row;
  }
  static const json none;
  ADD_FAILURE() << "no row with " << key << " = " << value << " " << value2;
  return none;
}

TEST(Analysis, PairedComparisonsAndClaims) {
  const json a = attnres::report::analyze(three_modes());
  EXPECT_EQ(a["baseline"], "prenorm");
  EXPECT_EQ(a["selection"], "fixed");
  // full - prenorm = -0.05, -0.06, -0.04: mean -0.05, sd 0.01, half 4.303 * 0.01 / sqrt(3).
  const json& cf = find(a["comparisons"], "group", "full");
  EXPECT_EQ(cf["vs"], "prenorm");
  EXPECT_EQ(cf["n"], 3);
  EXPECT_NEAR(cf["mean"].get<double>(), -0.05, 1e-12);
  EXPECT_NEAR(cf["lo"].get<double>(), -0.05 - 0.024843, 1e-5);
  EXPECT_NEAR(cf["hi"].get<double>(), -0.05 + 0.024843, 1e-5);
  EXPECT_EQ(cf["verdict"], "lower");
  // block - prenorm = +0.02, -0.02, +0.05: the interval holds 0.
  EXPECT_EQ(find(a["comparisons"], "group", "block S=2")["verdict"], "indistinguishable");

  const json& claims = a["claims"];
  EXPECT_EQ(find(claims, "subject", "full", "claim", "lower validation loss")["verdict"], "holds");
  EXPECT_EQ(find(claims, "subject", "block S=2", "claim", "lower validation loss")["verdict"],
            "not shown (interval includes no effect)");
  // Growth 1.5x against 8x in every seed: bounded.
  EXPECT_EQ(find(claims, "subject", "full", "claim", "hidden-state")["verdict"], "holds");
  // CV 0.095 against 0.857: more uniform.
  EXPECT_EQ(find(claims, "subject", "full", "claim", "more uniform")["verdict"], "holds");
  // One mixer of the two with a choice reads its most recent source most: exactly one half, so
  // not shown; the embedding gets 0.3 - 1/2 and 0.5 - 1/3 over uniform: mean -1.7 points, in
  // every seed, so the claim is contradicted.
  EXPECT_EQ(find(claims, "subject", "full", "claim", "depth weights")["verdict"],
            "not shown (interval includes no effect)");
  EXPECT_EQ(find(claims, "subject", "full", "claim", "weight kept")["verdict"], "contradicted");
  // block - full = +0.07, +0.04, +0.09 (lo 0.004 > 0) while Full's gain is significant.
  EXPECT_EQ(find(claims, "subject", "block S=2", "claim", "Block AttnRes recovers")["verdict"],
            "contradicted");
  EXPECT_TRUE(a["failed_runs"].empty());
}

TEST(Analysis, FailedRunsCountNowhere) {
  json r = three_modes();
  for (auto& x : r["runs"]) {
    if (x["group"] == "full" && x["seed"] == 3) x = run("full", 3, 0, nullptr, "diverged");
  }
  const json a = attnres::report::analyze(r);
  ASSERT_EQ(a["failed_runs"].size(), 1u);
  EXPECT_EQ(a["failed_runs"][0]["status"], "diverged");
  const json& cf = find(a["comparisons"], "group", "full");
  EXPECT_EQ(cf["n"], 2);  // the two seeds where both finished
  EXPECT_EQ(cf["verdict"], "too few seeds");
  EXPECT_NEAR(cf["mean"].get<double>(), -0.055, 1e-12);
  // Every run of full diverged: no numbers at all for it.
  for (auto& x : r["runs"]) {
    if (x["group"] == "full") x = run("full", x["seed"], 0, nullptr, "diverged");
  }
  const json b = attnres::report::analyze(r);
  EXPECT_EQ(find(b["comparisons"], "group", "full")["n"], 0);
  EXPECT_TRUE(find(b["comparisons"], "group", "full")["mean"].is_null());
  EXPECT_EQ(find(b["claims"], "subject", "full", "claim", "lower validation loss")["verdict"],
            "no data (no finished run with this measurement)");
}

TEST(Analysis, EachModeAtItsBestSweepValue) {
  json r = {{"seeds", {1, 2, 3}}, {"groups", json::array()}, {"runs", json::array()}};
  auto group = [&](const std::string& mode, const std::string& lr, std::vector<double> losses,
                   int diverged_seed = 0) {
    const std::string name = mode + " lr=" + lr;
    r["groups"].push_back({{"name", name}, {"mode", mode}, {"sweep", {{"lr", lr}}}});
    for (int s = 1; s <= 3; s++) {
      r["runs"].push_back(s == diverged_seed ? run(name, s, 0, nullptr, "diverged")
                                             : run(name, s, losses[s - 1]));
    }
  };
  group("prenorm", "1e-3", {3.0, 3.1, 2.9});
  group("prenorm", "2e-3", {2.9, 3.0, 2.8});  // prenorm's best
  group("full", "1e-3", {2.8, 2.9, 2.7});     // full's best among complete groups
  group("full", "2e-3", {2.0, 2.0, 2.0}, 2);  // lowest mean, but a seed diverged: not eligible
  const json a = attnres::report::analyze(r);
  EXPECT_EQ(a["selection"], "best per mode");
  EXPECT_EQ(a["selected"]["prenorm"], "prenorm lr=2e-3");
  EXPECT_EQ(a["selected"]["full"], "full lr=1e-3");
  // Same settings: full lr=1e-3 - prenorm lr=1e-3 = -0.2 each seed; at the best: -0.1 each.
  bool same = false, best = false;
  for (const auto& c : a["comparisons"]) {
    if (c["group"] == "full lr=1e-3" && c["kind"] == "same settings") {
      same = true;
      EXPECT_EQ(c["vs"], "prenorm lr=1e-3");
      EXPECT_NEAR(c["mean"].get<double>(), -0.2, 1e-12);
    }
    if (c["kind"] == "each at its best") {
      best = true;
      EXPECT_EQ(c["group"], "full lr=1e-3");
      EXPECT_EQ(c["vs"], "prenorm lr=2e-3");
      EXPECT_NEAR(c["mean"].get<double>(), -0.1, 1e-12);
    }
  }
  EXPECT_TRUE(same);
  EXPECT_TRUE(best);
  ASSERT_EQ(a["best_per_mode"].size(), 2u);
  EXPECT_EQ(a["failed_runs"].size(), 1u);
}

TEST(Analysis, OneModeSweptIsComparedWithItsFirstValue) {
  // An ablation of one mode (no PreNorm): each value against the first, seed by seed.
  json r = {{"seeds", {1, 2, 3}}, {"groups", json::array()}, {"runs", json::array()}};
  auto group = [&](const std::string& t, std::vector<double> losses) {
    const std::string name = "full attnres-temperature=" + t;
    r["groups"].push_back(
        {{"name", name}, {"mode", "full"}, {"sweep", {{"attnres-temperature", t}}}});
    for (int s = 1; s <= 3; s++) r["runs"].push_back(run(name, s, losses[s - 1]));
  };
  group("1", {3.0, 3.2, 2.8});
  group("0.5", {3.1, 3.25, 2.95});  // +0.1, +0.05, +0.15: mean +0.1, sd 0.05
  group("2", {3.0, 3.2, 2.8});      // no difference at all
  const json a = attnres::report::analyze(r);
  ASSERT_EQ(a["comparisons"].size(), 2u);
  const json& c = a["comparisons"][0];
  EXPECT_EQ(c["group"], "full attnres-temperature=0.5");
  EXPECT_EQ(c["vs"], "full attnres-temperature=1");
  EXPECT_EQ(c["kind"], "vs first value");
  EXPECT_NEAR(c["mean"].get<double>(), 0.1, 1e-12);
  // half width 4.303 * 0.05 / sqrt(3) = 0.12422: the interval holds 0.
  EXPECT_NEAR(c["hi"].get<double>(), 0.1 + 0.12422, 1e-4);
  EXPECT_EQ(c["verdict"], "indistinguishable");
  EXPECT_NEAR(a["comparisons"][1]["mean"].get<double>(), 0.0, 1e-12);
  // No PreNorm: no claims against it.
  EXPECT_TRUE(a["claims"].empty());
}

}  // namespace

#include "report/scaling.hpp"

namespace {

TEST(Scaling, PowerLawFitRecoversExactLawsAndTheComputeFactor) {
  namespace sc = attnres::scaling;
  // The paper's fits (SPEC 6): baseline 1.891 C^-0.057, Block 1.870 C^-0.058.
  const std::vector<double> C = {1.0, 3.0, 10.0, 30.0, 100.0};
  std::vector<double> lb, lk;
  for (double c : C) {
    lb.push_back(1.891 * std::pow(c, -0.057));
    lk.push_back(1.870 * std::pow(c, -0.058));
  }
  const sc::PowerFit fb = sc::fit_power_law(C, lb), fk = sc::fit_power_law(C, lk);
  EXPECT_NEAR(fb.A, 1.891, 1e-9);
  EXPECT_NEAR(fb.alpha, 0.057, 1e-9);
  EXPECT_NEAR(fb.r2, 1.0, 1e-12);
  EXPECT_EQ(fb.n, 5);
  EXPECT_NEAR(fk.alpha, 0.058, 1e-9);
  // At C = 100 Block's loss needs (1.891 / L)^(1/0.057) of the baseline's compute.
  const double L = fk.at(100.0);
  const double want = std::pow(1.891 / L, 1.0 / 0.057) / 100.0;
  EXPECT_NEAR(sc::compute_advantage(fb, L, 100.0), want, 1e-6 * want);
  EXPECT_GT(want, 1.0);
  // Curve against curve: a mode 2 % below the baseline at every compute, same exponent, needs
  // (1 / 0.98)^(1 / alpha) times less compute, whatever C (e.g. 1.426x at alpha 0.057).
  std::vector<double> lm;
  for (double l : lb) lm.push_back(0.98 * l);
  const sc::PowerFit fm = sc::fit_power_law(C, lm);
  const double shift = std::pow(1.0 / 0.98, 1.0 / 0.057);
  EXPECT_NEAR(sc::fitted_advantage(fb, fm, 100.0), shift, 1e-6 * shift);
  EXPECT_NEAR(sc::fitted_advantage(fb, fm, 3.0), shift, 1e-6 * shift);
  EXPECT_NEAR(shift, 1.426, 1e-3);
  // Degenerate inputs give NaN, not a made-up law.
  EXPECT_TRUE(std::isnan(sc::fit_power_law({1.0}, {2.0}).alpha));
  EXPECT_TRUE(std::isnan(sc::fit_power_law({2.0, 2.0}, {1.0, 1.1}).alpha));
  EXPECT_EQ(sc::fit_power_law({1.0, -1.0, 2.0}, {2.0, 2.0, 0.0}).n, 1);
}

}  // namespace
