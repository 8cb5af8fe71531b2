// The training loop: learning, exact resume, checkpoint layout, and clear errors on bad input.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/model.hpp"
#include "attnres/train.hpp"
#include "test_util.hpp"
#include "train/evaluate.hpp"

namespace fs = std::filesystem;
using namespace attnres;

namespace {

using attnres::testing::slurp;
using attnres::testing::TempDir;

// A small structured corpus: sentences from a tiny grammar, so a model can learn far below the
// unigram entropy.
std::string make_corpus(int sentences, uint64_t seed) {
  const char* subj[] = {"the cat", "a dog", "my friend", "the old king", "her brother"};
  const char* verb[] = {"sees", "likes", "finds", "follows", "remembers"};
  const char* obj[] = {"the river", "a red apple", "the quiet town", "his hat", "the stars"};
  Rng r(seed);
  std::string s;
  for (int i = 0; i < sentences; i++) {
    s += subj[r.next_u64() % 5];
    s += " ";
    s += verb[r.next_u64() % 5];
    s += " ";
    s += obj[r.next_u64() % 5];
    s += ".\n";
  }
  return s;
}

double unigram_entropy_nats(const std::string& s) {
  std::map<unsigned char, double> c;
  for (unsigned char ch : s) c[ch] += 1;
  double h = 0;
  for (auto& [k, n] : c) h -= n / s.size() * std::log(n / s.size());
  return h;
}

TrainConfig small_config(const fs::path& dir, const fs::path& corpus) {
  TrainConfig c;
  c.data_path = corpus.string();
  c.out_dir = (dir / "run").string();
  c.model.n_layer = 2;
  c.model.d_model = 32;
  c.model.n_head = 4;
  c.model.n_kv_head = 2;
  c.batch_size = 8;
  c.seq_len = 32;
  c.steps = 150;
  c.adamw.lr = 5e-3;
  c.schedule.warmup_steps = 10;
  c.eval_every = 50;
  c.eval_batches = 4;
  c.log_every = 1;
  return c;
}

std::vector<double> read_losses(const fs::path& metrics) {
  std::vector<double> out;
  std::ifstream f(metrics);
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && !j.contains("skipped")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

TEST(Train, LearnsFarBelowUnigramEntropy) {
  TempDir td;
  const fs::path dir = td.path;
  const std::string text = make_corpus(3000, 1);
  std::ofstream(dir / "corpus.txt") << text;
  TrainConfig c = small_config(dir, dir / "corpus.txt");
  const TrainResult r = train(c, {});
  const double h1 = unigram_entropy_nats(text);
  EXPECT_EQ(r.steps_done, 150);
  EXPECT_LT(r.final_val_loss.value(), 0.6 * h1) << "unigram entropy " << h1;
  EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "run" / "train_config.json"));
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / "step_00000150" / "optimizer.safetensors"));
}

// A step the process spent stopped (Ctrl-Z, then fg: SIGCONT) is left out of tokens/s. The
// stop is simulated inside step 5: the loss hook sleeps 1 s, once with the continue counter
// advanced and once without; the same second would otherwise cut the rate of 20 short steps.
TEST(Train, AStepSpentStoppedIsNotTimed) {
  TempDir td;
  const fs::path dir = td.path;
  std::ofstream(dir / "corpus.txt") << make_corpus(400, 2);
  auto rate = [&](bool continued_in_step, const std::string& out) {
    TrainConfig c = small_config(dir, dir / "corpus.txt");
    c.out_dir = (dir / out).string();
    c.model.n_layer = 1;
    c.batch_size = 2;
    c.steps = 20;
    c.eval_every = 0;
    std::atomic<uint64_t> conts{0};
    TrainEvents ev;
    ev.continued = [&conts] { return conts.load(); };
    ev.loss_hook = [&](int64_t step, double loss) {
      if (step == 5) {
        std::this_thread::sleep_for(std::chrono::seconds(1));
        if (continued_in_step) conts.fetch_add(1);
      }
      return loss;
    };
    const TrainResult r = train(c, ev);
    return r.tokens_per_s.value();
  };
  const double stopped = rate(false, "stopped");
  const double continued = rate(true, "continued");
  // 19 timed steps of 64 tokens: with the second counted, at most 19 * 64 / 1 s = 1216 tokens/s.
  EXPECT_LT(stopped, 19.0 * 64.0);
  EXPECT_GT(continued, 3.0 * stopped) << "the stopped step was timed";
}

class TrainModes : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainModes, LowersValidationLoss) {
  TempDir td;
  const fs::path dir = td.path;
  std::ofstream(dir / "corpus.txt") << make_corpus(1500, 4);
  TrainConfig c = small_config(dir, dir / "corpus.txt");
  c.model.residual.mode = parse_residual_mode(GetParam());
  c.model.residual.block_size = 2;
  c.steps = 80;
  c.eval_every = 0;
  const TrainResult r = train(c, {});
  EXPECT_LT(r.final_val_loss.value(), std::log(256.0) - 2.0) << GetParam();  // from ~5.5 at init
}

INSTANTIATE_TEST_SUITE_P(Modes, TrainModes,
                         ::testing::Values("prenorm", "full", "block", "static", "denseformer"));

TEST(Train, ResumeReproducesTheUninterruptedRun) {
  TempDir td;
  const fs::path dir = td.path;
  std::ofstream(dir / "corpus.txt") << make_corpus(800, 2);
  TrainConfig c = small_config(dir, dir / "corpus.txt");
  c.steps = 24;
  c.eval_every = 8;  // (the evaluation at 16 reports the mean of steps 9-16, across the resume)
  c.grad_accum = 2;  // resume must also be exact with accumulation
  c.out_dir = (dir / "full").string();
  train(c, {});
  const auto full = read_losses(dir / "full" / "metrics.jsonl");
  ASSERT_EQ(full.size(), 24u);

  // Same run, interrupted after step 10 (the stop flag is what SIGINT sets), then resumed.
  c.out_dir = (dir / "split").string();
  std::atomic<bool> stop{false};
  TrainEvents ev;
  ev.stop = &stop;
  ev.on_step = [&](const StepInfo& s) {
    if (s.step == 5) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    if (s.step == 10) stop = true;
  };
  const TrainResult first = train(c, ev);
  EXPECT_TRUE(first.interrupted);
  EXPECT_EQ(first.steps_done, 10);
  TrainConfig rc;
  rc.out_dir = c.out_dir;
  rc.resume = true;
  const TrainResult second = train(rc, {});
  EXPECT_FALSE(second.interrupted);
  // The run's time counts both calls (a resumed compare run reported its last call's only).
  EXPECT_GT(second.run_seconds, second.seconds + 0.45);
  const auto split = read_losses(dir / "split" / "metrics.jsonl");
  ASSERT_EQ(split.size(), full.size());
  for (size_t i = 0; i < full.size(); i++) EXPECT_EQ(split[i], full[i]) << "step " << i + 1;
  // So are the evaluations' training-loss means (sixteenth hostile pass: the resumed run averaged
  // only its own steps).
  auto train_means = [](const fs::path& metrics) {
    std::map<int64_t, double> out;
    std::ifstream f(metrics);
    std::string line;
    while (std::getline(f, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("train_loss")) out[j["step"].get<int64_t>()] = j["train_loss"].get<double>();
    }
    return out;
  };
  const auto fm = train_means(dir / "full" / "metrics.jsonl");
  ASSERT_EQ(fm.size(), 3u);
  EXPECT_EQ(train_means(dir / "split" / "metrics.jsonl"), fm);
  // Final weights are identical too.
  auto a = load_model((dir / "full" / "model.safetensors").string());
  auto b = load_model((dir / "split" / "model.safetensors").string());
  EXPECT_EQ(0, std::memcmp(a->params(), b->params(), sizeof(float) * a->layout().total()));
}

TEST(Train, BitIdenticalRunsWithMoreThreadsThanCores) {
  // OpenMP reductions combine thread partials in arrival order; with 3+ threads that would change
  // the last bits from run to run. Every reduction on the training path must be ordered.
  TempDir td;
  const fs::path dir = td.path;
  std::ofstream(dir / "corpus.txt") << make_corpus(600, 5);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(3);
  std::vector<std::vector<double>> losses;
  for (const char* run : {"a", "b"}) {
    TrainConfig c = small_config(dir, dir / "corpus.txt");
    c.model.residual.mode = ResidualMode::static_mix;  // exercises the scalar-mix reductions too
    c.steps = 12;
    c.eval_every = 0;
    c.out_dir = (dir / run).string();
    train(c, {});
    losses.push_back(read_losses(dir / run / "metrics.jsonl"));
  }
  omp_set_num_threads(saved);
  ASSERT_EQ(losses[0].size(), 12u);
  for (size_t i = 0; i < losses[0].size(); i++) EXPECT_EQ(losses[0][i], losses[1][i]) << i;
}

TEST(Train, BadInputsGiveClearErrors) {
  TempDir td;
  const fs::path dir = td.path;
  auto expect_error = [](TrainConfig c, const std::string& needle) {
    try {
      train(c, {});
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  std::ofstream(dir / "empty.txt").close();
  expect_error(small_config(dir, dir / "empty.txt"), "empty.txt");
  expect_error(small_config(dir, dir / "nope.txt"), "nope.txt");
  std::ofstream(dir / "tiny.txt") << "just a few words";
  expect_error(small_config(dir, dir / "tiny.txt"), "seq");
  std::ofstream(dir / "ok.txt") << make_corpus(200, 3);
  TrainConfig bad = small_config(dir, dir / "ok.txt");
  bad.adamw.lr = -1;
  expect_error(bad, "--lr");
  bad = small_config(dir, dir / "ok.txt");
  bad.model.n_head = 5;
  expect_error(bad, "n_head");
  bad = small_config(dir, dir / "ok.txt");
  bad.out_dir = (dir / "never_ran").string();
  bad.resume = true;
  expect_error(bad, "without --resume");
}

TEST(Train, RouterTensorsTakeTheirOwnLearningRate) {
  // The residual mode's tensors (from Model::core_entries() on) step with router_lr, exactly as
  // an optimizer with that rate would; the core tensors with lr; router_lr = lr changes nothing.
  ModelConfig mc;
  mc.n_layer = 2;
  mc.d_model = 32;
  mc.n_head = 4;
  mc.vocab_size = 64;
  mc.max_seq_len = 16;
  mc.residual.mode = ResidualMode::full;
  mc.resolve();
  Model a(mc), b(mc), c(mc), same(mc);
  for (Model* m : {&a, &b, &c, &same}) m->init_weights(3);
  const int64_t n = a.layout().total();
  AdamW split(a.layout(), AdamWConfig{}), all_lr(b.layout(), AdamWConfig{}),
      all_router(c.layout(), AdamWConfig{}), plain(same.layout(), AdamWConfig{});
  split.set_first_router_entry(a.core_entries());
  for (int step = 0; step < 3; step++) {
    const auto g = attnres::testing::randn(n, 200 + step);
    split.step(a.params(), g.data(), 1e-2, 1.0f, 1e-4);
    all_lr.step(b.params(), g.data(), 1e-2);
    all_router.step(c.params(), g.data(), 1e-4);
    plain.step(same.params(), g.data(), 1e-2, 1.0f, 1e-2);
  }
  const auto& entries = a.layout().entries();
  ASSERT_LT(a.core_entries(), entries.size());
  for (size_t k = 0; k < entries.size(); k++) {
    const ParamEntry& e = entries[k];
    const Model& want = k < a.core_entries() ? b : c;
    EXPECT_EQ(0,
              std::memcmp(a.params() + e.offset, want.params() + e.offset, sizeof(float) * e.numel))
        << e.name;
  }
  EXPECT_EQ(0, std::memcmp(same.params(), b.params(), sizeof(float) * n));
}

TEST(Train, ShardedAdamWMatchesTheFullOneBitForBit) {
  // ZeRO-1: shards that split tensors anywhere update exactly what the full optimizer updates.
  ModelConfig mc;
  mc.n_layer = 2;
  mc.d_model = 32;
  mc.n_head = 4;
  mc.n_kv_head = 2;
  mc.vocab_size = 64;
  mc.max_seq_len = 16;
  mc.resolve();
  Model full_model(mc), shard_model(mc);
  full_model.init_weights(3);
  shard_model.init_weights(3);
  const int64_t n = full_model.layout().total();
  const std::vector<int64_t> cut = {0, n / 3 + 1, n / 2 + 7, n};  // 3 shards, mid-tensor cuts
  AdamW full(full_model.layout(), AdamWConfig{});
  std::vector<std::unique_ptr<AdamW>> shards;
  for (size_t i = 0; i + 1 < cut.size(); i++) {
    shards.push_back(
        std::make_unique<AdamW>(shard_model.layout(), AdamWConfig{}, cut[i], cut[i + 1]));
    EXPECT_TRUE(shards.back()->sharded());
    EXPECT_EQ(static_cast<int64_t>(shards.back()->m().size()), cut[i + 1] - cut[i]);
  }
  EXPECT_FALSE(full.sharded());
  for (int step = 0; step < 3; step++) {
    const auto g = attnres::testing::randn(n, 100 + step);
    full.step(full_model.params(), g.data(), 1e-2);
    for (auto& sh : shards) sh->step(shard_model.params(), g.data(), 1e-2);
  }
  EXPECT_EQ(0, std::memcmp(full_model.params(), shard_model.params(), sizeof(float) * n));
  for (size_t i = 0; i < shards.size(); i++) {
    EXPECT_EQ(0, std::memcmp(full.m().data() + cut[i], shards[i]->m().data(),
                             sizeof(float) * (cut[i + 1] - cut[i])));
    EXPECT_EQ(0, std::memcmp(full.v().data() + cut[i], shards[i]->v().data(),
                             sizeof(float) * (cut[i + 1] - cut[i])));
  }
  EXPECT_THROW(AdamW(full_model.layout(), AdamWConfig{}, 5, n + 1), Error);
}

TEST(Train, LrSchedules) {
  ScheduleConfig s;
  s.warmup_steps = 4;
  s.total_steps = 20;
  s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(lr_at(s, 1.0, 0), 0.25);
  EXPECT_DOUBLE_EQ(lr_at(s, 1.0, 3), 1.0);
  EXPECT_NEAR(lr_at(s, 1.0, 12), 0.1 + 0.45 * (1 + std::cos(M_PI * 0.5)), 1e-12);
  EXPECT_NEAR(lr_at(s, 1.0, 20), 0.1, 1e-12);
  s.kind = ScheduleKind::wsd;
  s.decay_fraction = 0.25;  // decay over the last 5 steps
  EXPECT_DOUBLE_EQ(lr_at(s, 1.0, 10), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(s, 1.0, 15), 1.0);
  EXPECT_NEAR(lr_at(s, 1.0, 20), 0.1, 1e-12);
  EXPECT_GT(lr_at(s, 1.0, 17), lr_at(s, 1.0, 18));
  EXPECT_THROW(parse_schedule_kind("bogus"), Error);
  EXPECT_EQ(parse_schedule_kind(to_string(ScheduleKind::constant)), ScheduleKind::constant);
}

}  // namespace

// The trainer passes the clip coefficient to AdamW::step instead of scaling the gradients first:
// both must give the same weights bit for bit. grad_norm against a double reference.
TEST(Train, FusedClipEqualsClipThenStep) {
  ParamLayout L;
  L.add("a", {37, 29}, true);
  L.add("b", {1001}, false);
  L.add("c", {64, 64}, true);
  std::vector<float> g = attnres::testing::randn(L.total(), 3, 5.0);
  double ss = 0;
  for (float x : g) ss += double(x) * x;
  EXPECT_NEAR(grad_norm(g.data(), L.total()), std::sqrt(ss), 1e-6 * std::sqrt(ss));
  std::vector<float> p1 = attnres::testing::randn(L.total(), 4), p2 = p1, g1 = g;
  AdamW o1(L, AdamWConfig{}), o2(L, AdamWConfig{});
  for (int s = 0; s < 3; s++) {
    std::vector<float> gs = g1;
    clip_grad_norm(gs.data(), L.total(), 1.0);
    o1.step(p1.data(), gs.data(), 1e-2);
    const float c = clip_scale(grad_norm(g1.data(), L.total()), 1.0);
    ASSERT_LT(c, 1.0f);  // the test must exercise clipping
    o2.step(p2.data(), g1.data(), 1e-2, c);
  }
  for (int64_t i = 0; i < L.total(); i++) ASSERT_EQ(p1[i], p2[i]) << i;
  EXPECT_EQ(clip_scale(0.5, 1.0), 1.0f);
  EXPECT_EQ(clip_scale(10.0, 0.0), 1.0f);  // disabled
}

// Issue 19: the validation loss counts each window once. A split of 5 windows evaluated in
// batches of 4 used to wrap its last batch around to windows 0-2 (counted twice; `eval` also
// reported 8 windows' tokens). The reference is the mean of the windows' losses, one at a time;
// also for two data-parallel ranks (slices of 2), where rank 1 has no row of the last batch.
TEST(Train, ValidationLossCountsEachWindowOnce) {
  ModelConfig mc;
  mc.vocab_size = 17;
  mc.n_layer = 1;
  mc.d_model = 16;
  mc.n_head = 2;
  mc.max_seq_len = 8;
  const int64_t T = 8, windows = 5;
  std::vector<int32_t> ids(static_cast<size_t>(windows * T + 3));
  Rng r(5);
  for (auto& t : ids) t = static_cast<int32_t>(r.next_u64() % 17);
  const TokenSpan span(ids.data(), static_cast<int64_t>(ids.size()));
  ASSERT_EQ(span.num_windows(T), windows);
  Model m(mc);
  m.init_weights(3);
  double ref = 0.0;
  Batch b;
  for (int64_t w = 0; w < windows; w++) {
    span.window_batch(w, 1, T, b);
    ref += m.forward(b.inputs.data(), b.targets.data(), 1, T) / windows;
  }
  auto one = dist::make_local_group(1);
  const WindowLoss all = window_loss(m, span, 4, T, 10, *one[0], true);
  EXPECT_EQ(all.windows, windows);
  EXPECT_NEAR(all.loss, ref, 1e-6);
  // At most 1 batch of 4: the first 4 windows alone.
  double first4 = 0.0;
  for (int64_t w = 0; w < 4; w++) {
    span.window_batch(w, 1, T, b);
    first4 += m.forward(b.inputs.data(), b.targets.data(), 1, T) / 4;
  }
  const WindowLoss cut = window_loss(m, span, 4, T, 1, *one[0], true);
  EXPECT_EQ(cut.windows, 4);
  EXPECT_NEAR(cut.loss, first4, 1e-6);
  for (const bool whole : {false, true}) {
    auto two = dist::make_local_group(2);
    std::vector<double> got(2);
    std::vector<std::thread> ranks;
    for (int k = 0; k < 2; k++) {
      ranks.emplace_back([&, k] {
        Model mk(mc);
        mk.init_weights(3);
        got[static_cast<size_t>(k)] = window_loss(mk, span, 4, T, 10, *two[k], whole).loss;
      });
    }
    for (auto& t : ranks) t.join();
    EXPECT_NEAR(got[0], ref, 1e-6) << "whole batches " << whole;
    EXPECT_EQ(got[0], got[1]);
  }
}

// A pipeline run (2 ranks as threads) resumed from its own checkpoint as the same pipeline
// continues as the uninterrupted run, bit for bit; resumed data-parallel, it says that its sums
// run in another order (fifteenth hostile pass: it differed in the last bits without a word).
TEST(Train, PipelineResumeReproducesTheUninterruptedRun) {
  TempDir td;
  const fs::path dir = td.path;
  std::ofstream(dir / "corpus.txt") << make_corpus(800, 2);
  // Runs c on 2 ranks; the messages, and "error: ..." for a refusal (on every rank).
  auto run = [&](const TrainConfig& c, const std::atomic<bool>* stop = nullptr) {
    auto group = dist::make_local_group(2, /*rendezvous=*/true);
    std::vector<std::thread> ranks;
    std::string notes;
    std::mutex mu;
    for (int r = 0; r < 2; r++) {
      ranks.emplace_back([&, r] {
        omp_set_num_threads(1);
        group[static_cast<size_t>(r)]->set_timeout(120);
        TrainEvents ev;
        ev.stop = stop;
        ev.on_message = [&](const std::string& m) {
          std::lock_guard<std::mutex> lock(mu);
          notes += m + "\n";
        };
        try {
          train(c, ev, *group[static_cast<size_t>(r)]);
        } catch (const Error& e) {
          std::lock_guard<std::mutex> lock(mu);
          notes += std::string("error: ") + e.what() + "\n";
        }
      });
    }
    for (auto& t : ranks) t.join();
    return notes;
  };
  TrainConfig c = small_config(dir, dir / "corpus.txt");
  c.model.residual.mode = ResidualMode::full;
  c.pipeline = 2;
  c.steps = 12;
  c.eval_every = 0;
  c.save_every = 10;
  c.out_dir = (dir / "full").string();
  run(c);
  const auto saved = TrainConfig::from_json(slurp(dir / "full" / "train_config.json"));
  EXPECT_EQ(saved.ranks, 2);
  EXPECT_EQ(saved.pipeline, 2);
  auto a = load_model((dir / "full" / "model.safetensors").string());
  for (const int64_t pipeline : {2, 1}) {
    const fs::path split = dir / ("split" + std::to_string(pipeline));
    fs::copy(dir / "full", split, fs::copy_options::recursive);
    fs::remove_all(split / "checkpoints" / "step_00000012");
    fs::remove(split / "model.safetensors");
    std::ofstream(split / "latest") << "step_00000010\n";
    TrainConfig rc;
    rc.out_dir = split.string();
    rc.resume = true;
    rc.pipeline = pipeline;
    const std::string notes = run(rc);
    auto b = load_model((split / "model.safetensors").string());
    const bool same =
        std::memcmp(a->params(), b->params(), sizeof(float) * a->layout().total()) == 0;
    const bool noted = notes.find(
                           "trained as a pipeline of 2 ranks and continues as "
                           "data-parallel on 2 ranks") != std::string::npos;
    EXPECT_EQ(same, pipeline == 2) << "pipeline " << pipeline;
    EXPECT_EQ(noted, pipeline == 1) << notes;
    const auto now = TrainConfig::from_json(slurp(split / "train_config.json"));
    EXPECT_EQ(now.pipeline, pipeline) << "the layout it continued on is recorded";
  }
  // Sixteenth hostile pass: a resume refused on its layout (too many virtual stages), or stopped
  // before its first checkpoint, rewrote the recorded layout: the next plain resume adopted a
  // layout that could not run, or one no checkpoint was made in. It is recorded with a checkpoint.
  const std::string record = slurp(dir / "split2" / "train_config.json");
  TrainConfig bad;
  bad.out_dir = (dir / "split2").string();
  bad.resume = true;
  bad.pipeline = 2;
  bad.virtual_stages = 8;
  EXPECT_NE(run(bad).find("error: pipeline: 2 ranks x 8 virtual stages"), std::string::npos);
  EXPECT_EQ(slurp(dir / "split2" / "train_config.json"), record);
  std::atomic<bool> stop{true};
  TrainConfig dp = bad;
  dp.pipeline = 1;
  dp.virtual_stages = 1;
  EXPECT_NE(run(dp, &stop).find("continues as data-parallel"), std::string::npos);
  EXPECT_EQ(slurp(dir / "split2" / "train_config.json"), record);
}
