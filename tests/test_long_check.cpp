// The short version of the long-run independent check (issue 17, tools/long_check.py): PyTorch
// trained each residual mode for 200 AdamW steps from tests/fixtures/long_check_init.safetensors
// on the byte tokens of long_check_corpus.txt, with attnres's batch order and schedule, and
// recorded the validation curve (long_check_torch.json). attnres, started from the same weights
// (train --init-from; the AttnRes tensors start as in a new run), must follow the same curves
// and so the same AttnRes-minus-PreNorm gaps. The gaps are 0.02-0.16 nats here; the two engines
// agreed to 1e-5 - 3e-5 with 1, 2 and 3 threads (float32 summation order is all that differs), so
// 1e-3 is a wide margin that a changed schedule (one warm-up step more: 0.17) never meets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attnres/train.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const fs::path kFixtures = ATTNRES_FIXTURE_DIR;

attnres::TrainConfig config_from(const json& s, const std::string& mode, const json& extra,
                                 const std::string& out) {
  attnres::TrainConfig c;
  c.data_path = (kFixtures / "long_check_corpus.txt").string();
  c.tokenizer = attnres::parse_tokenizer_kind(s.at("tokenizer"));
  c.val_fraction = s.at("val_fraction");
  json m = s.at("model");
  m["residual"] = mode;
  if (extra.contains("block_size")) m["block_size"] = extra["block_size"];
  c.model = attnres::ModelConfig::from_json(m.dump());
  c.batch_size = s.at("batch_size");
  c.seq_len = s.at("seq_len");
  c.grad_accum = s.at("grad_accum");
  c.steps = s.at("steps");
  c.adamw.lr = s.at("lr");
  c.adamw.beta1 = s.at("beta1");
  c.adamw.beta2 = s.at("beta2");
  c.adamw.eps = s.at("adam_eps");
  c.adamw.weight_decay = s.at("weight_decay");
  c.schedule.kind = attnres::parse_schedule_kind(s.at("schedule"));
  c.schedule.warmup_steps = s.at("warmup_steps");
  c.schedule.min_lr_ratio = s.at("min_lr_ratio");
  c.grad_clip = s.at("grad_clip");
  c.eval_every = s.at("eval_every");
  c.eval_batches = s.at("eval_batches");
  c.seed = s.at("seed");
  c.init_from = (kFixtures / "long_check_init.safetensors").string();
  c.out_dir = out;
  return c;
}

std::vector<double> val_curve(const fs::path& metrics) {
  std::vector<double> v;
  std::ifstream f(metrics);
  for (std::string line; std::getline(f, line);) {
    const json j = json::parse(line);
    if (j.contains("val_loss")) v.push_back(j["val_loss"]);
  }
  return v;
}

TEST(LongCheck, TrainingFollowsTheIndependentPyTorchRunInEveryMode) {
  const json fx = json::parse(attnres::testing::slurp(kFixtures / "long_check_torch.json"));
  const json& s = fx.at("settings");
  attnres::testing::TempDir td;
  std::map<std::string, std::vector<double>> ours;
  double worst = 0, worst_gap = 0;
  for (const auto& [mode, extra] : fx.at("modes").items()) {
    const attnres::TrainConfig c = config_from(s, mode, extra, (fs::path(td.path) / mode).string());
    attnres::train(c, {});
    ours[mode] = val_curve(fs::path(c.out_dir) / "metrics.jsonl");
    const std::vector<double> theirs = fx.at("val_loss").at(mode);
    ASSERT_EQ(ours[mode].size(), theirs.size()) << mode;
    for (size_t i = 0; i < theirs.size(); i++) {
      EXPECT_NEAR(ours[mode][i], theirs[i], 1e-3) << mode << " at evaluation " << i;
      worst = std::max(worst, std::abs(ours[mode][i] - theirs[i]));
    }
  }
  // The gaps the issue is about, at every evaluation.
  for (const char* mode : {"full", "block"}) {
    for (size_t i = 0; i < ours[mode].size(); i++) {
      const double g_ours = ours[mode][i] - ours["prenorm"][i];
      const double g_theirs =
          fx["val_loss"][mode][i].get<double>() - fx["val_loss"]["prenorm"][i].get<double>();
      EXPECT_NEAR(g_ours, g_theirs, 1e-3) << mode << " - prenorm at evaluation " << i;
      worst_gap = std::max(worst_gap, std::abs(g_ours - g_theirs));
    }
  }
  std::printf("largest difference to PyTorch: %.2e in a loss, %.2e in a gap\n", worst, worst_gap);
}

}  // namespace
