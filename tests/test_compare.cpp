// `attnres compare` / `attnres report` end to end on a tiny budget: the report's numbers are the
// ones in results.json, the plots are valid PNGs, and the runs of one seed really share their
// initial weights and batch order while different seeds do not.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "attnres/train.hpp"
#include "experiment/run_record.hpp"
#include "test_util.hpp"
#include "train/run_dir.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using attnres::testing::slurp;
using attnres::testing::TempDir;

int run(const std::string& args, std::string* out = nullptr) {
  const auto r = attnres::testing::run_cli(args);
  if (out) *out = r.out;
  return r.code;
}

std::string corpus(const fs::path& dir) {
  std::ofstream f(dir / "corpus.txt");
  const char* w[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"};
  unsigned x = 1;
  for (int i = 0; i < 6000; i++) {
    x = x * 1103515245u + 12345u;
    f << w[(x >> 16) % 10] << ((i % 9 == 8) ? ".\n" : " ");
  }
  return (dir / "corpus.txt").string();
}

// A PNG: signature, an IHDR chunk with a non-empty size, and IEND at the end.
void expect_png(const fs::path& p) {
  ASSERT_TRUE(fs::exists(p)) << p;
  const std::string s = slurp(p);
  ASSERT_GT(s.size(), 100u) << p;
  EXPECT_EQ(s.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << p;
  EXPECT_EQ(s.substr(12, 4), "IHDR") << p;
  auto be32 = [&](size_t o) {
    return (uint32_t(uint8_t(s[o])) << 24) | (uint32_t(uint8_t(s[o + 1])) << 16) |
           (uint32_t(uint8_t(s[o + 2])) << 8) | uint32_t(uint8_t(s[o + 3]));
  };
  EXPECT_GT(be32(16), 10u) << "width of " << p;
  EXPECT_GT(be32(20), 10u) << "height of " << p;
  EXPECT_EQ(s.substr(s.size() - 8, 4), "IEND") << p;
}

std::string f4(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4f", x);
  return b;
}

TEST(Compare, TinyEndToEndReportMatchesResultsAndPlotsExist) {
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = corpus(dir);
  const fs::path out = dir / "cmp";
  std::string log;
  ASSERT_EQ(run("compare --preset tiny --modes prenorm,block --seeds 2 --steps 200 --data " + data +
                    " --out " + out.string(),
                &log),
            0)
      << log;
  const json r = json::parse(slurp(out / "results.json"));
  const std::string report = slurp(out / "report.md");
  ASSERT_EQ(r["groups"].size(), 2u);
  ASSERT_EQ(r["runs"].size(), 4u);
  EXPECT_EQ(r["baseline"], "prenorm");
  for (const auto& g : r["groups"]) {
    // Every number of the results table comes from results.json.
    EXPECT_NE(report.find(f4(g["val_loss_mean"].get<double>()) + " +- " +
                          f4(g["val_loss_std"].get<double>())),
              std::string::npos)
        << g["name"] << "\n"
        << report;
    // ... and results.json's aggregate is the mean of its runs.
    double mean = 0;
    int n = 0;
    for (const auto& run : r["runs"]) {
      if (run["group"] == g["name"]) {
        mean += run["final_val_loss"].get<double>();
        n++;
      }
    }
    EXPECT_EQ(n, 2);
    EXPECT_NEAR(g["val_loss_mean"].get<double>(), mean / n, 1e-12);
    EXPECT_LT(g["val_loss_mean"].get<double>(), 5.0);  // it trained (from ~5.5)
  }
  // Shared initial weights and batch order within a seed; different across seeds.
  std::map<uint64_t, std::set<std::string>> init_by_seed, batch_by_seed;
  for (const auto& run : r["runs"]) {
    init_by_seed[run["seed"]].insert(run["init_hash"].get<std::string>());
    batch_by_seed[run["seed"]].insert(run["batch_hash"].get<std::string>());
  }
  ASSERT_EQ(init_by_seed.size(), 2u);
  for (const auto& [seed, hs] : init_by_seed) EXPECT_EQ(hs.size(), 1u) << "seed " << seed;
  for (const auto& [seed, hs] : batch_by_seed) EXPECT_EQ(hs.size(), 1u) << "seed " << seed;
  EXPECT_NE(*init_by_seed.begin()->second.begin(), *init_by_seed.rbegin()->second.begin());
  EXPECT_NE(*batch_by_seed.begin()->second.begin(), *batch_by_seed.rbegin()->second.begin());
  EXPECT_TRUE(r["checks"]["shared_init"].get<bool>());
  EXPECT_TRUE(r["checks"]["shared_batches"].get<bool>());
  // Plots.
  for (const char* png : {"val_loss.png", "output_rms.png", "grad_norm.png"}) expect_png(out / png);
  const std::string block_name = r["groups"][1]["name"];
  EXPECT_EQ(block_name, "block S=2");
  expect_png(out / "depth_weights_block_S_2.png");
  EXPECT_FALSE(fs::exists(out / "depth_weights_prenorm.png"));
  EXPECT_NE(report.find("depth_weights_block_S_2.png"), std::string::npos);
  EXPECT_EQ(report.find("Plots were not drawn"), std::string::npos) << report;
  // `attnres report` regenerates the same report from results.json.
  fs::remove(out / "report.md");
  fs::remove(out / "val_loss.png");
  // Tenth hostile pass: a json.py in the directory ran as the plotting script's own module
  // (Python puts the script's directory first on sys.path), and a plot's name linked to a user's
  // file had that file overwritten with a PNG.
  {
    std::ofstream(out / "json.py") << "open(" << json((dir / "CODE_RAN").string()).dump()
                                   << ", 'w').write('ran')\nraise SystemExit(3)\n";
    std::ofstream(dir / "thesis.txt") << "my thesis\n";
    fs::remove(out / "grad_norm.png");
    fs::create_symlink(dir / "thesis.txt", out / "grad_norm.png");
  }
  ASSERT_EQ(run("report " + out.string(), &log), 0) << log;
  EXPECT_EQ(slurp(out / "report.md"), report);
  expect_png(out / "val_loss.png");
  EXPECT_FALSE(fs::exists(dir / "CODE_RAN"));
  EXPECT_EQ(slurp(dir / "thesis.txt"), "my thesis\n");
  EXPECT_FALSE(fs::is_symlink(out / "grad_norm.png"));
  expect_png(out / "grad_norm.png");
  for (const auto& e : fs::directory_iterator(out)) {  // the private plot directory is gone
    EXPECT_NE(e.path().filename().string().rfind(".plots.", 0), 0u) << e.path();
  }
  // 30th hostile pass: a drawing killed before it removed its private directory left it for
  // good. The next one removes those of processes that are gone (and only its own kind of files);
  // a live process's stays.
  {
    const pid_t child = ::fork();
    if (child == 0) ::_exit(0);
    ASSERT_GT(child, 0);
    ASSERT_EQ(::waitpid(child, nullptr, 0), child);
    const fs::path gone = out / (".plots." + std::to_string(child) + ".AbC123");
    const fs::path live = out / (".plots." + std::to_string(::getpid()) + ".XyZ789");
    const fs::path other = out / (".plots." + std::to_string(child) + ".Mine00");
    for (const fs::path& p : {gone, live, other}) {
      fs::create_directory(p);
      std::ofstream(p / "plot_report.py") << "# half written\n";
      std::ofstream(p / "val_loss.png") << "partial";
    }
    std::ofstream(other / "notes.txt") << "not a plot\n";
    ASSERT_EQ(run("report " + out.string(), &log), 0) << log;
    EXPECT_FALSE(fs::exists(gone));
    EXPECT_TRUE(fs::exists(live / "val_loss.png"));
    EXPECT_TRUE(fs::exists(other / "notes.txt"));
    fs::remove_all(live);
    fs::remove_all(other);
  }
  fs::remove(out / "json.py");
  // Rerunning the same command keeps the finished runs.
  ASSERT_EQ(run("compare --preset tiny --modes prenorm,block --seeds 2 --steps 200 --data " + data +
                    " --out " + out.string() + " --no-plots",
                &log),
            0);
  EXPECT_NE(log.find("already done"), std::string::npos) << log;
  // Its wall time is its own; the runs' training time is theirs (the rerun reported its seconds
  // of wall time as the comparison's; sixteenth hostile pass).
  const json again = json::parse(slurp(out / "results.json"));
  EXPECT_EQ(again["runs_kept"], 4);
  double trained = 0;
  for (const auto& run : again["runs"]) trained += run["seconds"].get<double>();
  EXPECT_DOUBLE_EQ(again["train_time_s"].get<double>(), trained);
  EXPECT_GT(trained, 0.0);
  EXPECT_NE(slurp(out / "report.md").find("4 of them kept from an earlier call"),
            std::string::npos);
}

TEST(Compare, SweepAnyTrainOption) {
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = corpus(dir);
  const fs::path out = dir / "cmp";
  std::string log;
  ASSERT_EQ(run("compare --preset tiny --modes block --sweep block-size=1,4 --sweep "
                "attnres-heads=1,2 --seeds 1 --steps 10 --no-plots --data " +
                    data + " --out " + out.string(),
                &log),
            0)
      << log;
  const json r = json::parse(slurp(out / "results.json"));
  std::set<std::string> names;
  for (const auto& g : r["groups"]) names.insert(g["name"]);
  EXPECT_EQ(names.size(), 4u);
  EXPECT_TRUE(names.count("block block-size=1 attnres-heads=2")) << log;
  for (const auto& g : r["groups"]) {
    // (as the runs trained: resolved, not the 0 = "derive it" of an unset option; 16th pass)
    EXPECT_GT(g["residual"]["ffn_hidden"].get<int64_t>(), 0) << g.dump();
    EXPECT_GT(g["residual"]["n_kv_head"].get<int64_t>(), 0) << g.dump();
    if (g["name"] == "block block-size=4 attnres-heads=2") {
      EXPECT_EQ(g["residual"]["block_size"], 4);
      EXPECT_EQ(g["residual"]["attnres_heads"], 2);
    }
    // (29th pass: the vocabulary and context were the defaults, 256 and 256, not the runs')
    int runs_of_group = 0;
    for (const auto& run : r["runs"]) {
      if (run["group"] != g["name"]) continue;
      runs_of_group++;
      EXPECT_EQ(g["residual"], run["settings"]["model"]) << g.dump();
    }
    EXPECT_EQ(runs_of_group, 1) << g.dump();
  }
  EXPECT_NE(slurp(out / "report.md").find("Plots were not drawn"), std::string::npos);
  // Unknown options and malformed sweeps are errors that say what is wrong.
  EXPECT_EQ(run("compare --preset tiny --sweep nosuchoption=1,2 --data " + data + " --out " +
                    (dir / "bad").string(),
                &log),
            1);
  EXPECT_NE(log.find("nosuchoption"), std::string::npos) << log;
  EXPECT_EQ(run("compare --preset tiny --sweep block-size --data " + data + " --out " +
                    (dir / "bad2").string(),
                &log),
            1);
  EXPECT_NE(log.find("OPTION=V1,V2"), std::string::npos) << log;
  EXPECT_EQ(run("compare --preset tiny --sweep lr=1e-3,,2e-3 --data " + data + " --out " +
                    (dir / "bad3").string(),
                &log),
            1);
  EXPECT_NE(log.find("empty value"), std::string::npos) << log;
  EXPECT_EQ(run("compare --preset tiny --sweep lr=1e-3 --data " + data + " --out " +
                    (dir / "bad3b").string(),
                &log),
            1);
  EXPECT_NE(log.find("--sweep lr lists one value (1e-3): a sweep compares two or more; give "
                     "--lr 1e-3 instead"),
            std::string::npos)
      << log;
  EXPECT_FALSE(fs::exists(dir / "bad3b"));
  EXPECT_EQ(run("compare --preset tiny --lr 1e-3 --sweep lr=2e-3,4e-3 --data " + data + " --out " +
                    (dir / "bad4").string(),
                &log),
            1);
  EXPECT_NE(log.find("--lr is given and also swept"), std::string::npos) << log;
  EXPECT_EQ(run("compare --preset x --data " + data + " --out " + (dir / "bad5").string(), &log),
            1);
  EXPECT_NE(log.find("unknown --preset"), std::string::npos) << log;
  EXPECT_NE(run("compare --preset '' --data " + data + " --out " + (dir / "bad5").string(), &log),
            0);
  EXPECT_NE(log.find("--preset: an empty value"), std::string::npos) << log;
  EXPECT_EQ(run("report " + (dir / "nothing").string(), &log), 1);
  EXPECT_NE(log.find("results.json"), std::string::npos) << log;
}

TEST(Compare, DivergedRunsAreReportedAsSuchNeverAsNumbers) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  std::string log;
  ::setenv("ATTNRES_TEST_DIVERGE", "full", 1);  // full's losses turn NaN from step 3 on
  const int code =
      run("compare --preset tiny --modes prenorm,full --seeds 3 --steps 20 "
          "--no-plots --data " +
              data + " --out " + out.string(),
          &log);
  ::unsetenv("ATTNRES_TEST_DIVERGE");
  ASSERT_EQ(code, 0) << log;
  EXPECT_NE(log.find("diverged"), std::string::npos) << log;
  const json r = json::parse(slurp(out / "results.json"));
  int diverged = 0;
  for (const auto& x : r["runs"]) {
    if (x["group"] != "full") {
      EXPECT_EQ(x["status"], "ok");
      EXPECT_TRUE(x["final_val_loss"].is_number());
      continue;
    }
    diverged++;
    EXPECT_EQ(x["status"], "diverged");
    EXPECT_TRUE(x["final_val_loss"].is_null()) << x.dump();
    EXPECT_NE(x["reason"].get<std::string>().find("diverged"), std::string::npos);
  }
  EXPECT_EQ(diverged, 3);
  for (const auto& g : r["groups"]) {
    if (g["name"] != "full") continue;
    EXPECT_TRUE(g["val_loss_mean"].is_null());
    EXPECT_EQ(g["seeds"], 0);
    EXPECT_EQ(g["seeds_failed"], 3);
  }
  EXPECT_EQ(r["analysis"]["failed_runs"].size(), 3u);
  const std::string report = slurp(out / "report.md");
  EXPECT_NE(report.find("| full | no finished run | 0 (3 failed) |"), std::string::npos) << report;
  EXPECT_NE(report.find("Runs that did not finish"), std::string::npos) << report;
  EXPECT_NE(report.find("`full` seed 1337: diverged"), std::string::npos) << report;
  for (const char* bad : {" nan", " -nan", " inf", "0.0000 +-"}) {
    EXPECT_EQ(report.find(bad), std::string::npos) << bad << "\n" << report;
  }
}

TEST(Compare, ARunResumedAfterItsEndReportsItsMeasuredLoss) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  const std::string cmd =
      "compare --preset tiny --modes prenorm --seeds 1 --steps 20 --no-plots "
      "--data " +
      data + " --out " + out.string();
  std::string log;
  ASSERT_EQ(run(cmd, &log), 0) << log;
  const json first = json::parse(slurp(out / "results.json"))["runs"][0];
  // The run finished but its run.json is gone (e.g. a stop between the two): the rerun resumes
  // it at its last step, which trains nothing, and must evaluate, not report 0.
  const fs::path run_json = out / first["dir"].get<std::string>() / "run.json";
  ASSERT_TRUE(fs::remove(run_json));
  ASSERT_EQ(run(cmd, &log), 0) << log;
  EXPECT_NE(log.find("resuming"), std::string::npos) << log;
  const json again = json::parse(slurp(out / "results.json"))["runs"][0];
  EXPECT_NEAR(again["final_val_loss"].get<double>(), first["final_val_loss"].get<double>(), 1e-6);
  EXPECT_GT(again["final_val_loss"].get<double>(), 0.5);
  // Nothing was timed in the second call: the throughput logged by the first is reported.
  EXPECT_NEAR(again["tokens_per_s"].get<double>(), first["tokens_per_s"].get<double>(),
              1e-6 * first["tokens_per_s"].get<double>());
  // The CLI's train says the same: a number that was measured, or that none was.
  const fs::path tr = fs::path(td.path) / "tr";
  ASSERT_EQ(run("train --n-layer 1 --d-model 32 --n-head 2 --seq-len 16 --batch-size 4 --steps 6 "
                "--eval-every 3 --save-every 3 --keep-checkpoints 3 --log-every 1 --data " +
                    data + " --out " + tr.string(),
                &log),
            0)
      << log;
  const auto at = log.find("final val loss ");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string loss = log.substr(at + 15, 6);
  ASSERT_EQ(run("train --resume --out " + tr.string(), &log), 0) << log;
  EXPECT_NE(log.find("final val loss " + loss), std::string::npos) << log;
  EXPECT_NE(log.find("no steps timed in this call"), std::string::npos) << log;
  EXPECT_EQ(log.find("0.0000 (ppl 1.00)"), std::string::npos) << log;
  // Resumed from step 3 (as if it had died there), the run's clock goes on from the time it had
  // logged at step 3, so loss-vs-time curves continue.
  std::ofstream(tr / "latest") << "step_00000003\n";
  ASSERT_EQ(run("train --resume --out " + tr.string(), &log), 0) << log;
  std::vector<double> at3, at4;  // elapsed_s of every step-3 / step-4 line, in file order
  std::ifstream metrics(tr / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const json j = json::parse(line);
    if (!j.contains("elapsed_s") || j.contains("val_loss")) continue;
    if (j["step"] == 3) at3.push_back(j["elapsed_s"]);
    if (j["step"] == 4) at4.push_back(j["elapsed_s"]);
  }
  ASSERT_EQ(at3.size(), 1u);
  ASSERT_EQ(at4.size(), 2u);
  EXPECT_GT(at4[1], at3[0]);
}

// 26th hostile pass: a run whose call timed no step (one step: the first holds the warm-up; or
// a step the process was stopped in) has no measured speed. Its metrics line said one all the
// same (the step's wall time), and compare reported it as the configuration's tokens/s.
TEST(Compare, ARunWithNoTimedStepReportsNoSpeed) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  std::string log;
  ASSERT_EQ(run("compare --preset tiny --modes prenorm --seeds 1 --steps 1 --no-plots --data " +
                    data + " --out " + out.string(),
                &log),
            0)
      << log;
  const json r = json::parse(slurp(out / "results.json"))["runs"][0];
  EXPECT_TRUE(r["tokens_per_s"].is_null()) << r.dump();
  EXPECT_NE(slurp(out / "report.md").find("| n/a |"), std::string::npos)
      << slurp(out / "report.md");
  std::ifstream metrics(out / r["dir"].get<std::string>() / "metrics.jsonl");
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const json j = json::parse(line);
    if (!j.contains("step") || !j.contains("loss") || j.contains("val_loss")) continue;
    steps++;
    EXPECT_TRUE(j["tokens_per_s"].is_null()) << line;
  }
  EXPECT_EQ(steps, 1);
}

TEST(Compare, KeptRunsMustHaveTheCommandsSettings) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  const std::string cmd = "compare --preset tiny --modes prenorm --seeds 1 --no-plots --data " +
                          data + " --out " + out.string();
  std::string log;
  ASSERT_EQ(run(cmd + " --steps 10", &log), 0) << log;
  EXPECT_EQ(run(cmd + " --steps 12", &log), 1) << log;
  EXPECT_NE(log.find("other settings"), std::string::npos) << log;
  ASSERT_EQ(run(cmd + " --steps 10", &log), 0) << log;  // the same command keeps it
  EXPECT_NE(log.find("already done"), std::string::npos) << log;
  {  // Ninth pass: `train --overwrite` at a run's place left its run.json, so compare kept the
     // old record (its loss) for the new model.
    const fs::path place = out / "runs" / "prenorm" / "seed1337";
    std::string tl;
    ASSERT_EQ(run("train --data " + data + " --n-layer 1 --d-model 16 --n-head 2 --seq-len 16 " +
                      "--steps 2 --eval-every 0 --eval-batches 1 --sample-tokens 0 --overwrite " +
                      "--residual full --out " + place.string(),
                  &tl),
              0)
        << tl;
    EXPECT_FALSE(fs::exists(place / "run.json"));
    EXPECT_EQ(run(cmd + " --steps 10", &log), 1) << log;
    EXPECT_EQ(log.find("already done"), std::string::npos) << log;
    EXPECT_NE(log.find("other settings"), std::string::npos) << log;
    fs::remove_all(place);
    ASSERT_EQ(run(cmd + " --steps 10", &log), 0) << log;
  }
  // Issue 19: the same command on a changed corpus does not keep the old corpus's result.
  std::ofstream(data, std::ios::app) << "a line the kept run never saw.\n";
  EXPECT_EQ(run(cmd + " --steps 10", &log), 1) << log;
  EXPECT_NE(log.find("other settings than this command's (corpus_fingerprint differ)"),
            std::string::npos)
      << log;
}

// Fourth hostile pass: one comparison per --out. A second one deleted the first's unfinished
// runs while they trained (neither had a checkpoint yet), and both wrote results.json.
TEST(Compare, OneComparisonPerDirectory) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  fs::create_directories(out);
  std::string log;
  {
    const attnres::RunLock other(out.string());  // (as a running comparison holds it)
    EXPECT_EQ(run("compare --preset tiny --modes prenorm --seeds 1 --steps 5 --no-plots --data " +
                      data + " --out " + out.string(),
                  &log),
              1);
    EXPECT_NE(log.find("another attnres process (pid " + std::to_string(::getpid()) + ")"),
              std::string::npos)
        << log;
    EXPECT_FALSE(fs::exists(out / "results.json"));
  }
  EXPECT_EQ(run("compare --preset tiny --modes prenorm --seeds 1 --steps 5 --no-plots --data " +
                    data + " --out " + out.string(),
                &log),
            0)
      << log;
  const fs::path place = out / "runs" / "full" / "seed1337";
  {
    // Eighth pass: `report` during a comparison rewrote results.json under it; and a train
    // running (without a checkpoint yet) at a run's place was cleared and trained over.
    const attnres::RunLock other(out.string());
    EXPECT_EQ(run("report " + out.string(), &log), 1) << log;
    EXPECT_NE(log.find("another attnres process"), std::string::npos) << log;
  }
  fs::create_directories(place);
  {
    const attnres::RunLock live(place.string());  // (as a user's `train --out place` holds it)
    EXPECT_EQ(run("compare --preset tiny --modes prenorm,full --seeds 1 --steps 5 --no-plots "
                  "--data " +
                      data + " --out " + out.string(),
                  &log),
              1);
    EXPECT_NE(log.find("another attnres process (pid " + std::to_string(::getpid()) + ")"),
              std::string::npos)
        << log;
    EXPECT_TRUE(fs::exists(place / ".lock"));
  }
}

// Seventh hostile pass: the place of a run without a checkpoint was remove_all'd before it
// trained, whatever it held (a directory of the user's at OUT/runs/prenorm/seed1337 was lost).
TEST(Compare, NeverDeletesTheUsersFilesAtARunsPlace) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  const fs::path place = out / "runs" / "prenorm" / "seed1337";
  const std::string cmd =
      "compare --preset tiny --modes prenorm --seeds 1 --steps 5 --no-plots "
      "--data " +
      data + " --out " + out.string();
  fs::create_directories(place / "sub");
  std::ofstream(place / "sub" / "thesis.tex") << "years of work";
  std::ofstream(place / "train_config.json") << "{}";  // (as if a run had started there)
  std::string log;
  EXPECT_EQ(run(cmd, &log), 1) << log;
  EXPECT_NE(log.find("is left alone"), std::string::npos) << log;
  EXPECT_EQ(slurp(place / "sub" / "thesis.tex"), "years of work");
  fs::remove_all(place);
  fs::create_directories(fs::path(td.path) / "mine");
  std::ofstream(fs::path(td.path) / "mine" / "x") << "mine";
  fs::create_directory_symlink(fs::path(td.path) / "mine", place);
  EXPECT_EQ(run(cmd, &log), 1) << log;
  EXPECT_NE(log.find("is not a directory"), std::string::npos) << log;
  EXPECT_EQ(slurp(fs::path(td.path) / "mine" / "x"), "mine");
  fs::remove(place);
  // Fourteenth pass: a user's notes under a run's file name there were deleted too.
  fs::create_directories(place);
  std::ofstream(place / "metrics.jsonl") << "my notes: this seed looked odd\n";
  EXPECT_EQ(run(cmd, &log), 1) << log;
  EXPECT_NE(log.find("is left alone"), std::string::npos) << log;
  EXPECT_EQ(slurp(place / "metrics.jsonl"), "my notes: this seed looked odd\n");
  fs::remove_all(place);
  // What an unfinished run leaves there is replaced.
  fs::create_directories(place / "checkpoints" / "step_00000002.tmp");
  std::ofstream(place / "train_config.json") << attnres::TrainConfig().to_json();
  std::ofstream(place / "metrics.jsonl")
      << "{\"step\": 1, \"loss\": 5.5, \"elapsed_s\": 0.1, \"tokens\": 512}\n";
  std::ofstream(place / "checkpoints" / "step_00000002.tmp" / "model.safetensors.tmp.1.0") << "x";
  EXPECT_EQ(run(cmd, &log), 0) << log;
  EXPECT_TRUE(fs::exists(place / "run.json"));
}

// Fifteenth hostile pass: a bf16 comparison scored its tasks in fp32, and neither its report nor
// eval said a result came from bf16 products.
TEST(Compare, ABf16ComparisonScoresAndSaysBf16) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  const std::string task = std::string(ATTNRES_FIXTURE_DIR) + "/tasks/mc.jsonl";
  std::string log;
  ASSERT_EQ(run("compare --preset tiny --modes prenorm --seeds 1 --steps 4 --no-plots "
                "--precision bf16 --data " +
                    data + " --out " + out.string() + " --tasks " + task,
                &log),
            0)
      << log;
  const std::string report = slurp(out / "report.md");
  EXPECT_NE(report.find("trained on cpu (bf16 matrix products)"), std::string::npos) << report;
  const json run_json = json::parse(slurp(out / "runs" / "prenorm" / "seed1337" / "run.json"));
  std::string eval_out;
  ASSERT_EQ(run("eval --precision bf16 " +
                    (out / "runs" / "prenorm" / "seed1337" / "model.safetensors").string() +
                    " --task " + task,
                &eval_out),
            0)
      << eval_out;
  char want[64];
  std::snprintf(want, sizeof want, "acc %.4f",
                run_json.at("tasks").at("mc.jsonl").at("acc").get<double>());
  EXPECT_NE(eval_out.find(want), std::string::npos) << eval_out << " vs " << run_json.dump();
  EXPECT_NE(eval_out.find("bf16 matrix products"), std::string::npos) << eval_out;
}

// Fifteenth hostile pass: a --threads 1 comparison rerun without --threads kept its runs and
// labelled them (and their speeds) with the rerun's thread count.
TEST(Compare, KeptRunsKeepTheirThreadCount) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  const std::string cmd =
      "compare --preset tiny --modes prenorm --seeds 1 --steps 4 --no-plots "
      "--data " +
      data + " --out " + out.string();
  std::string log;
  ASSERT_EQ(run("--threads 1 " + cmd, &log), 0) << log;
  ASSERT_EQ(run("--threads 2 " + cmd, &log), 0) << log;
  EXPECT_NE(log.find("kept"), std::string::npos) << log;
  const json r = json::parse(slurp(out / "results.json"));
  EXPECT_EQ(r.at("hardware").at("threads").get<int>(), 1) << r.at("hardware").dump();
  EXPECT_EQ(r.at("runs").at(0).at("threads").get<int>(), 1);
  // Sixteenth hostile pass: a kept run.json of valid JSON but another shape: internal error.
  const fs::path rj = out / "runs" / "prenorm" / "seed1337" / "run.json";
  const std::string good = slurp(rj);
  for (const char* shape : {"[]", "{}", "{\"group\": \"prenorm\", \"seed\": 7}"}) {
    std::ofstream(rj) << shape;
    EXPECT_EQ(run(cmd, &log), 1) << shape << "\n" << log;
    EXPECT_NE(log.find("is not the record of a run of this comparison"), std::string::npos) << log;
  }
  // Nineteenth: a record edited by hand (a loss, a speed) was reported as measured, and flipped
  // a verdict; every record carries a fingerprint of its content.
  json edited = json::parse(good);
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"final_val_loss", 1.0}, {"tokens_per_s", 1e12}, {"record_fnv1a64", "0"}}) {
    json bad = edited;
    bad[key] = value;
    std::ofstream(rj) << bad.dump();
    EXPECT_EQ(run(cmd, &log), 1) << key << "=" << value << "\n" << log;
    EXPECT_NE(log.find("is not as compare wrote it"), std::string::npos) << log;
  }
  // A record as compare writes it, but another place's (e.g. copied in): fingerprinted anew.
  auto copied_in = [&](json j) { attnres::experiment::write_run_record(rj, j); };
  // Seventeenth: a record naming another run's directory (its model was scored as this run's)
  // or group; a record without settings whose run trained other ones (a 2-step run was kept in
  // a longer comparison, its loss averaged in).
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"dir", "../elsewhere"}, {"dir", "runs/full/seed1337"}, {"group", "full"}}) {
    json bad = edited;
    bad[key] = value;
    copied_in(bad);
    EXPECT_EQ(run(cmd, &log), 1) << key << "=" << value << "\n" << log;
    EXPECT_NE(log.find("is the record of another run"), std::string::npos) << log;
  }
  // Eighteenth: fields the results read whole, of another type (internal error).
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"params", "x"},
           {"flops_per_token", nullptr},
           {"diagnostics", {{"depth_weights", json::object()}}},
           {"diagnostics", {{"depth_weights", {{"w", {5, 6}}}}}}}) {
    json bad = edited;
    bad[key] = value;
    copied_in(bad);
    EXPECT_EQ(run(cmd, &log), 1) << key << "=" << value << "\n" << log;
    EXPECT_NE(log.find("is not the record of a run of this comparison"), std::string::npos) << log;
  }
  const fs::path tc = rj.parent_path() / "train_config.json";
  const std::string tc_good = slurp(tc);
  json tcj = json::parse(tc_good);
  tcj["steps"] = 2;
  // Eighteenth: another run's train_config.json (and model) beside a record with settings.
  std::ofstream(rj) << good;
  std::ofstream(tc) << tcj.dump();
  EXPECT_EQ(run(cmd, &log), 1) << log;
  EXPECT_NE(log.find("train_config.json' was made with other settings"), std::string::npos) << log;
  std::ofstream(tc) << tc_good;
  edited.erase("dir");  // (a record without its directory is this run's, no other place's)
  copied_in(edited);
  EXPECT_EQ(run(cmd, &log), 0) << log;
  edited.erase("settings");
  copied_in(edited);
  EXPECT_EQ(run(cmd, &log), 0) << log;  // (its train_config.json has this command's settings)
  std::ofstream(tc) << tcj.dump();
  EXPECT_EQ(run(cmd, &log), 1) << log;
  EXPECT_NE(log.find("train_config.json' was made with other settings"), std::string::npos) << log;
  std::ofstream(tc) << tc_good;
  std::ofstream(rj) << good;
  EXPECT_EQ(run(cmd, &log), 0) << log;
  // Twentieth: a kept run whose final model is gone (or another) is not "already done".
  const fs::path model = rj.parent_path() / "model.safetensors";
  fs::rename(model, rj.parent_path() / "moved.safetensors");
  EXPECT_EQ(run(cmd, &log), 1) << log;
  EXPECT_NE(log.find("has lost its final model"), std::string::npos) << log;
  fs::rename(rj.parent_path() / "moved.safetensors", model);
  EXPECT_EQ(run(cmd, &log), 0) << log;
}

// compare --tasks scores every finished run's final model on the task files (the same numbers as
// `eval --task` on that model), keeps a kept run's scores, puts the accuracies in the report,
// and refuses a malformed task file before anything trains.
TEST(Compare, TasksScoreEveryRunsFinalModel) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const fs::path out = fs::path(td.path) / "cmp";
  const std::string tasks = std::string(" --tasks ") + ATTNRES_FIXTURE_DIR + "/tasks/mc.jsonl" +
                            " --tasks " + ATTNRES_FIXTURE_DIR + "/tasks/pairs.jsonl";
  const std::string base =
      "compare --preset tiny --modes prenorm,full --seeds 1 --steps 10 "
      "--no-plots --data " +
      data;
  const std::string cmd = base + " --out " + out.string();
  std::string log;
  ASSERT_EQ(run(cmd + tasks, &log), 0) << log;
  EXPECT_NE(log.find("scoring full seed 1337 on 2 task(s)"), std::string::npos) << log;
  const json run_json = json::parse(slurp(out / "runs" / "full" / "seed1337" / "run.json"));
  std::string eval_out;
  ASSERT_EQ(run("eval " + (out / "runs" / "full" / "seed1337" / "model.safetensors").string() +
                    " --task " + ATTNRES_FIXTURE_DIR + "/tasks/mc.jsonl",
                &eval_out),
            0)
      << eval_out;
  char want[64];
  std::snprintf(want, sizeof want, "acc %.4f",
                run_json.at("tasks").at("mc.jsonl").at("acc").get<double>());
  EXPECT_NE(eval_out.find(want), std::string::npos) << eval_out << " vs " << run_json.dump();
  const std::string report = slurp(out / "report.md");
  EXPECT_NE(report.find("| configuration | mc.jsonl acc | mc.jsonl acc_norm | pairs.jsonl acc |"),
            std::string::npos)
      << report;
  ASSERT_EQ(run(cmd + tasks, &log), 0) << log;  // kept runs keep their scores
  EXPECT_EQ(log.find("scoring"), std::string::npos) << log;
  // Sixteenth hostile pass: a rerun naming one task file reported the other's kept scores too.
  ASSERT_EQ(run(cmd + " --tasks " + ATTNRES_FIXTURE_DIR + "/tasks/pairs.jsonl", &log), 0) << log;
  const json only = json::parse(slurp(out / "results.json"));
  for (const auto& r : only.at("runs")) {
    EXPECT_FALSE(r.at("tasks").contains("mc.jsonl")) << r.dump();
    EXPECT_TRUE(r.at("tasks").contains("pairs.jsonl")) << r.dump();
  }
  EXPECT_EQ(slurp(out / "report.md").find("mc.jsonl"), std::string::npos);
  // Seventh hostile pass: a task file edited since (here: its last item dropped) kept the old
  // file's scores, keyed by file name alone; its fingerprint now says it changed.
  fs::create_directories(fs::path(td.path) / "edited");
  std::string mc = slurp(fs::path(ATTNRES_FIXTURE_DIR) / "tasks" / "mc.jsonl");
  mc.erase(mc.rfind('\n', mc.size() - 2) + 1);
  std::ofstream(fs::path(td.path) / "edited" / "mc.jsonl") << mc;
  const int64_t items = run_json.at("tasks").at("mc.jsonl").at("items").get<int64_t>();
  ASSERT_EQ(run(cmd + " --tasks " + (fs::path(td.path) / "edited" / "mc.jsonl").string(), &log), 0)
      << log;
  EXPECT_NE(log.find("scoring full seed 1337"), std::string::npos) << log;
  const json rescored = json::parse(slurp(out / "runs" / "full" / "seed1337" / "run.json"));
  EXPECT_EQ(rescored.at("tasks").at("mc.jsonl").at("items").get<int64_t>(), items - 1);
  std::ofstream(fs::path(td.path) / "bad.jsonl") << "{\"context\": \"a\"}\n";
  EXPECT_EQ(run(base + " --out " + (fs::path(td.path) / "cmp2").string() + " --tasks " +
                    (fs::path(td.path) / "bad.jsonl").string(),
                &log),
            1);
  EXPECT_NE(log.find("bad.jsonl' line 1"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(fs::path(td.path) / "cmp2" / "runs"));
  // Twelfth hostile pass: another run's model copied over a kept run's was scored and recorded
  // as that run's. The model records its run's settings, and the run its model's checksum: the
  // kept run is refused (twentieth pass: before, when scored).
  const fs::path full = out / "runs" / "full" / "seed1337" / "model.safetensors";
  fs::copy_file(out / "runs" / "prenorm" / "seed1337" / "model.safetensors", full,
                fs::copy_options::overwrite_existing);
  std::ofstream(fs::path(td.path) / "edited" / "mc.jsonl", std::ios::app)
      << mc.substr(0, mc.find('\n') + 1);
  EXPECT_EQ(run(cmd + " --tasks " + (fs::path(td.path) / "edited" / "mc.jsonl").string(), &log), 1)
      << log;
  EXPECT_NE(log.find("is not the final model its run recorded"), std::string::npos) << log;
  // Nineteenth: the run's own earlier checkpoint copied over its final model was scored as the
  // run's; a record names its final model's checksum (here: another one's).
  const fs::path prj = out / "runs" / "prenorm" / "seed1337" / "run.json";
  json pj = json::parse(slurp(prj));
  ASSERT_TRUE(pj.contains("model_checksum")) << pj.dump();
  pj["model_checksum"] = "0123456789abcdef";
  attnres::experiment::write_run_record(prj, pj);
  std::ofstream(fs::path(td.path) / "edited" / "mc.jsonl", std::ios::app)
      << mc.substr(0, mc.find('\n') + 1);
  EXPECT_EQ(run(cmd + " --tasks " + (fs::path(td.path) / "edited" / "mc.jsonl").string(), &log), 1)
      << log;
  EXPECT_NE(log.find("is not the final model its run recorded"), std::string::npos) << log;
}

TEST(Compare, HostileOptionsAndFilesGiveClearErrors) {
  TempDir td;
  const fs::path dir(td.path);
  const std::string data = corpus(dir);
  const fs::path out = dir / "cmp";
  const std::string base = "compare --preset tiny --seeds 1 --steps 10 --no-plots --data " + data;
  std::string log;
  // A run that stopped before its run.json was written resumes only under the same settings.
  ASSERT_EQ(run(base + " --modes prenorm --out " + out.string(), &log), 0) << log;
  // One seed has no spread: no "+- 0.0000" on the terminal or in results.json.
  EXPECT_EQ(log.find("+- 0.0000"), std::string::npos) << log;
  EXPECT_NE(log.find(" (1 seed)"), std::string::npos) << log;
  EXPECT_TRUE(json::parse(slurp(out / "results.json"))["groups"][0]["val_loss_std"].is_null());
  // --no-plots: no links to pictures that were never drawn.
  EXPECT_EQ(slurp(out / "report.md").find(".png"), std::string::npos);
  const fs::path run_dir = out / "runs" / "prenorm" / "seed1337";
  ASSERT_TRUE(fs::remove(run_dir / "run.json"));
  EXPECT_EQ(run(base + " --modes prenorm --lr 1e-3 --out " + out.string(), &log), 1) << log;
  EXPECT_NE(log.find("train_config.json' was made with other settings"), std::string::npos) << log;
  EXPECT_NE(log.find("(lr differ)"), std::string::npos) << log;
  // Logging options do not decide a result: the same run is kept.
  ASSERT_EQ(run(base + " --modes prenorm --log-every 5 --out " + out.string(), &log), 0) << log;
  // Twenty-first pass: with run.json gone, an edited metrics.jsonl (speed, curve, diagnostics)
  // was taken as the kept run's measurements.
  {
    ASSERT_TRUE(fs::remove(run_dir / "run.json"));
    const std::string logged = slurp(run_dir / "metrics.jsonl");
    std::ofstream(run_dir / "metrics.jsonl", std::ios::trunc) << "{\"step\": 0}\n" << logged;
    EXPECT_EQ(run(base + " --modes prenorm --out " + out.string(), &log), 1) << log;
    EXPECT_NE(log.find("does not begin with what that run had logged"), std::string::npos) << log;
    EXPECT_FALSE(fs::exists(run_dir / "run.json"));
    std::ofstream(run_dir / "metrics.jsonl", std::ios::trunc) << logged;  // (as it was: kept)
    ASSERT_EQ(run(base + " --modes prenorm --out " + out.string(), &log), 0) << log;
    // Twenty-second: lines appended past what the checkpoint recorded were read as measured.
    ASSERT_TRUE(fs::remove(run_dir / "run.json"));
    std::ofstream(run_dir / "metrics.jsonl", std::ios::app)
        << "{\"elapsed_s\":0.3,\"step\":10,\"tokens\":1,\"val_loss\":1.0}\n";
    ASSERT_EQ(run(base + " --modes prenorm --out " + out.string(), &log), 0) << log;
    const json curve = json::parse(slurp(run_dir / "run.json"))["curve"];
    ASSERT_FALSE(curve.empty());
    for (const json& point : curve) EXPECT_NE(point[1].get<double>(), 1.0) << curve.dump();
  }
  // The same configuration twice, or an option every configuration must share, is refused.
  const std::string other = " --out " + (dir / "other").string();
  EXPECT_EQ(run(base + " --modes full,full" + other, &log), 1);
  EXPECT_NE(log.find("--modes lists 'full' twice"), std::string::npos) << log;
  EXPECT_EQ(run(base + " --modes prenorm --sweep lr=1e-3,1e-3" + other, &log), 1);
  EXPECT_NE(log.find("lists '1e-3' twice"), std::string::npos) << log;
  // Thirteenth pass: --block-size given and --block-layers swept (or the reverse) set one S.
  for (const char* sw :
       {" --block-size 2 --sweep block-layers=1,2", " --block-layers 1 --sweep block-size=2,4",
        " --sweep block-size=2,4 --sweep block-layers=1,2"}) {
    EXPECT_EQ(run(base + " --modes block" + std::string(sw) + other, &log), 1) << sw;
    EXPECT_NE(log.find("block-"), std::string::npos) << log;
  }
  // Twelfth hostile pass: a user's report.md or results.json in --out was replaced at the end
  // (thirteenth: or a user's plot).
  for (const auto& [name, text] :
       std::vector<std::pair<std::string, std::string>>{{"report.md", "# my notes\n"},
                                                        {"results.json", "{\"my\": \"results\"}\n"},
                                                        {"val_loss.png", "my plot\n"}}) {
    const fs::path mine = dir / ("mine_" + name);
    fs::create_directories(mine);
    std::ofstream(mine / name) << text;
    EXPECT_EQ(run(base + " --modes prenorm --out " + mine.string(), &log), 1) << name;
    EXPECT_NE(log.find("of an earlier run of this command"), std::string::npos) << log;
    EXPECT_EQ(slurp(mine / name), text);
  }
  // Thirteenth hostile pass: a user's tokenizer.model where compare keeps its own was trained
  // over (train refused the same case).
  {
    const fs::path mine = dir / "mine_tokenizer";
    fs::create_directories(mine / "data");
    std::ofstream(mine / "data" / "tokenizer.model") << "my tokenizer\n";
    EXPECT_EQ(run(base + " --modes prenorm --tokenizer bpe --vocab-size 300 --out " + mine.string(),
                  &log),
              1);
    EXPECT_NE(log.find("was not prepared by attnres"), std::string::npos) << log;
    EXPECT_EQ(slurp(mine / "data" / "tokenizer.model"), "my tokenizer\n");
  }
  // Eleventh hostile pass: the same model twice under two names (an option the mode does not
  // use, one value written two ways), reported as two results differing by 0.
  // (thirteenth pass: settings that cannot change the model, or that mean the same)
  for (const char* sw :
       {" --modes prenorm,block --sweep block-size=1,2", " --modes prenorm --sweep lr=1e-3,0.001",
        " --modes prenorm --sweep router-lr-mult=1,2", " --modes prenorm --sweep log-every=1,2",
        " --modes prenorm --sweep keep-checkpoints=1,2",
        " --modes prenorm --n-head 2 --sweep n-kv-head=0,2",
        " --modes block --sweep block-size=40,60",
        " --modes full --n-layer 2 --sweep attnres-window=0,4",
        // (fourteenth: values equal in float32, and settings written two ways)
        " --modes prenorm --sweep lr=0.003,0.0030000000001",
        " --modes full --sweep attnres-key-eps=0,1e-10",
        " --modes full --attnres-key-norm none --sweep attnres-key-eps=1e-5,1e-3",
        " --modes full --warmup 2 --sweep router-warmup=-1,2",
        " --modes prenorm --schedule constant --sweep min-lr-ratio=0.1,0.5",
        // (sixteenth: a value equal to an unrecorded default as a float)
        " --modes full --sweep attnres-temperature=1,1.0000000001",
        // (a decay to 1 x the peak is the constant schedule)
        " --modes prenorm --min-lr-ratio 1 --sweep schedule=cosine,constant",
        " --modes prenorm --min-lr-ratio 1 --sweep schedule=wsd,constant"}) {
    EXPECT_EQ(run(base + sw + other, &log), 1) << sw;
    EXPECT_NE(log.find("would train the same model"), std::string::npos) << sw << log;
  }
  // (tokenizer-model: each configuration trained its own tokenizer; eleventh hostile pass)
  for (const char* key :
       {"seed", "residual", "steps", "tokenizer", "tokenizer-model", "data", "help"}) {
    EXPECT_EQ(run(base + " --modes prenorm --sweep " + std::string(key) + "=1,2" + other, &log), 1)
        << key;
    EXPECT_NE(log.find("cannot vary inside one comparison"), std::string::npos) << key << log;
  }
  // A damaged results.json is an error naming the file, never an internal error.
  const fs::path rj = out / "results.json";
  const std::string good = slurp(rj);
  for (const std::string& bad :
       {std::string(""), std::string("[]"), good.substr(0, good.size() / 2),
        std::string("{\"groups\": NaN}")}) {
    std::ofstream(rj, std::ios::trunc) << bad;
    EXPECT_EQ(run("report " + out.string(), &log), 1) << bad.substr(0, 40) << "\n" << log;
    EXPECT_NE(log.find("results.json"), std::string::npos) << log;
    EXPECT_EQ(log.find("internal error"), std::string::npos) << log;
  }
  // Nineteenth and twentieth passes: a figure edited by hand was drawn as measured. A results.json
  // carries a fingerprint of its figures; an edited one is refused.
  json r = json::parse(good);
  ASSERT_TRUE(r.contains("results_fnv1a64"));
  r["runs"][0]["final_val_loss"] = 3.0;
  std::ofstream(rj, std::ios::trunc) << r.dump();
  EXPECT_EQ(run("report " + out.string(), &log), 1) << log;
  EXPECT_NE(log.find("is not as compare wrote it"), std::string::npos) << log;
  // One without (an earlier version's) is drawn as written, with a note; its analysis still
  // checks what it reads.
  r = json::parse(good);
  r.erase("results_fnv1a64");
  r["runs"].push_back(r["runs"][0]);  // the same seed twice
  std::ofstream(rj, std::ios::trunc) << r.dump();
  EXPECT_EQ(run("report " + out.string(), &log), 1) << log;
  EXPECT_NE(log.find("two runs with seed 1337"), std::string::npos) << log;
  // The report's table comes from the runs, not from stored aggregates.
  r = json::parse(good);
  r.erase("results_fnv1a64");
  r["groups"][0]["val_loss_mean"] = 0.123456;
  std::ofstream(rj, std::ios::trunc) << r.dump();
  ASSERT_EQ(run("report " + out.string(), &log), 0) << log;
  EXPECT_NE(log.find("carries no fingerprint"), std::string::npos) << log;
  const std::string report = slurp(out / "report.md");
  EXPECT_EQ(report.find("0.1235"), std::string::npos) << report;
  EXPECT_NE(report.find(f4(r["runs"][0]["final_val_loss"].get<double>()) + " (1 seed: no spread)"),
            std::string::npos)
      << report;
  // `report` drew the plots it links to.
  EXPECT_NE(report.find("(val_loss.png)"), std::string::npos) << report;
  EXPECT_TRUE(fs::exists(out / "val_loss.png"));
}

TEST(Compare, ScaleFitsALawPerModeFromTheComparisonsAtEachSize) {
  TempDir td;
  const fs::path dir(td.path);
  const std::string data = corpus(dir);
  const fs::path out = dir / "sc";
  std::string log;
  ASSERT_EQ(
      run("--threads 1 scale --sizes 1x32,2x32,2x64 --modes prenorm,full "
          "--tokens-per-param 0.5 --min-steps 20 --tokenizer byte --seq-len 32 --batch-size 4 "
          "--no-plots --data " +
              data + " --out " + out.string(),
          &log),
      0)
      << log;
  const json s = json::parse(slurp(out / "scaling.json"));
  EXPECT_EQ(s["baseline"], "prenorm");
  for (const char* mode : {"prenorm", "full"}) {
    const json& m = s["modes"][mode];
    ASSERT_EQ(m["points"].size(), 3u) << mode;
    // Each point is that size's comparison: C = FLOPs/token x tokens, L = its mean val loss.
    for (const auto& p : m["points"]) {
      const json r = json::parse(slurp(out / p["size"].get<std::string>() / "results.json"));
      for (const auto& g : r["groups"]) {
        if (g["name"] != mode) continue;
        EXPECT_DOUBLE_EQ(p["val_loss"].get<double>(), g["val_loss_mean"].get<double>());
        EXPECT_DOUBLE_EQ(p["flops"].get<double>(), g["flops_per_token"].get<double>() *
                                                       r["train"]["tokens_per_run"].get<double>());
      }
    }
    EXPECT_EQ(m["fit"]["points"], 3);
    EXPECT_GT(m["fit"]["alpha"].get<double>(), 0.0) << "loss falls with compute";
  }
  EXPECT_TRUE(s["advantage"]["full"]["factor"].is_number()) << s.dump();
  EXPECT_NE(slurp(out / "scaling.md").find("Compute advantage"), std::string::npos);
  // --no-plots: no link to a plot that was never drawn (22nd hostile pass).
  EXPECT_EQ(slurp(out / "scaling.md").find("scaling.png"), std::string::npos);
  // `report` on it (30th hostile pass: "has no results.json" only) names the scale's own report
  // and a size's comparison, which it redraws.
  EXPECT_EQ(run("report " + out.string(), &log), 1) << log;
  EXPECT_NE(log.find("is a directory `attnres scale` wrote: its report is " + out.string() +
                     "/scaling.md;"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("give one of its sizes, e.g. '" + (out / "L1_d32").string() + "'"),
            std::string::npos)
      << log;
  EXPECT_EQ(run("report " + (out / "L1_d32").string(), &log), 0) << log;
  // A scale stopped before its fit (no scaling.json; 31st pass): its finished sizes are named.
  fs::create_directories(dir / "part" / "L2_d32");
  fs::copy_file(out / "L1_d32" / "results.json", dir / "part" / "L1_d32.json");
  fs::create_directories(dir / "part" / "L1_d32");
  fs::rename(dir / "part" / "L1_d32.json", dir / "part" / "L1_d32" / "results.json");
  EXPECT_EQ(run("report " + (dir / "part").string() + "/", &log), 1) << log;
  EXPECT_NE(log.find("holds comparisons in its subdirectories"), std::string::npos) << log;
  EXPECT_NE(log.find("e.g. '" + (dir / "part" / "L1_d32").string() + "'"), std::string::npos)
      << log;
  // Sizes must be LxD, growing, at least two.
  for (const char* bad : {"4x64", "4x64,2x32", "4x60,8x64", "ax64,8x64"}) {
    EXPECT_EQ(run("scale --sizes " + std::string(bad) + " --data " + data + " --out " +
                      (dir / "bad").string(),
                  &log),
              1)
        << bad;
    EXPECT_NE(log.find("--sizes"), std::string::npos) << bad << log;
  }
}

}  // namespace

namespace {

// A preset's warm-up keeps its share of the run when --steps is given (the main job's 50 of 300
// steps become 2 of 12), and an explicit --warmup still wins.
TEST(Compare, PresetWarmupScalesWithExplicitSteps) {
  TempDir td;
  const std::string data = corpus(fs::path(td.path));
  const std::string small =
      " --n-layer 1 --d-model 16 --n-head 2 --seq-len 16 --batch-size 2 "
      "--tokenizer byte --eval-every 0 --eval-batches 1 --no-plots "
      "--modes prenorm --seeds 1 --data " +
      data;
  auto warmup_of = [&](const std::string& out) {
    const json j = json::parse(slurp(fs::path(out) / "runs/prenorm/seed1337/train_config.json"));
    return j.at("warmup_steps").get<int64_t>();
  };
  const std::string a = (fs::path(td.path) / "a").string(), b = (fs::path(td.path) / "b").string();
  ASSERT_EQ(run("compare --preset small --steps 12" + small + " --out " + a), 0);
  EXPECT_EQ(warmup_of(a), 2);
  ASSERT_EQ(run("compare --preset small --steps 12 --warmup 5" + small + " --out " + b), 0);
  EXPECT_EQ(warmup_of(b), 5);
}

}  // namespace

namespace {

// Eleventh hostile pass: options the user gave were replaced without a word. compare's automatic
// block size overrode --block-layers (given or swept: two runs of the same model, "+0.0000"), and
// scale overrode --warmup, --n-head and --eval-every (and dropped --n-layer, --d-model, --steps).
TEST(Compare, GivenOptionsAreNeverReplacedSilently) {
  TempDir td;
  const fs::path dir(td.path);
  const std::string data = corpus(dir);
  const std::string common = " --seeds 1 --no-plots --tokenizer byte --data " + data;
  const std::string tiny = common + " --steps 4";
  std::string log;
  auto block_sizes = [&](const fs::path& out) {
    std::map<std::string, int64_t> s;
    const json r = json::parse(slurp(out / "results.json"));
    for (const auto& g : r["groups"]) s[g["name"]] = g["residual"]["block_size"].get<int64_t>();
    return s;
  };
  const fs::path a = dir / "a", b = dir / "b";
  ASSERT_EQ(
      run("compare --preset tiny --modes block --block-layers 2" + tiny + " --out " + a.string(),
          &log),
      0)
      << log;
  EXPECT_EQ(block_sizes(a), (std::map<std::string, int64_t>{{"block", 4}})) << log;
  ASSERT_EQ(run("compare --preset tiny --modes block --sweep block-layers=1,2" + tiny + " --out " +
                    b.string(),
                &log),
            0)
      << log;
  EXPECT_EQ(block_sizes(b), (std::map<std::string, int64_t>{{"block block-layers=1", 2},
                                                            {"block block-layers=2", 4}}))
      << log;
  const std::string sizes =
      " --sizes 1x32,2x32 --modes prenorm --min-steps 4 --seq-len 16 "
      "--batch-size 2 --tokens-per-param 0.01";
  for (const char* o : {"--n-layer 3", "--d-model 48", "--steps 9"}) {
    EXPECT_EQ(run("scale" + sizes + common + " " + o + " --out " + (dir / "bad").string(), &log), 1)
        << o;
    EXPECT_NE(log.find("is set for each size by scale"), std::string::npos) << o << log;
  }
  const fs::path c = dir / "c";
  ASSERT_EQ(run("--threads 1 scale" + sizes + common +
                    " --warmup 0 --n-head 4 --eval-every 2 --out " + c.string(),
                &log),
            0)
      << log;
  for (const char* size : {"L1_d32", "L2_d32"}) {
    const json j =
        json::parse(slurp(c / size / "runs" / "prenorm" / "seed1337" / "train_config.json"));
    EXPECT_EQ(j["warmup_steps"], 0) << size;
    EXPECT_EQ(j["eval_every"], 2) << size;
    EXPECT_EQ(j["model"]["n_head"], 4) << size;
  }
}

// Fifteenth hostile pass: a comparison run killed between an evaluation and its next checkpoint
// logs that evaluation again when it resumes; the curve had the point twice, and the seeds' mean
// curve (averaged by position) was wrong. The later line replaces every point from its step on.
TEST(Compare, ARepeatedEvaluationReplacesTheCurvesLaterPoints) {
  TempDir td;
  const fs::path p = fs::path(td.path) / "metrics.jsonl";
  std::ofstream(p) << R"({"step":10,"val_loss":4.0,"tokens":100}
{"step":20,"val_loss":3.5,"tokens":200}
{"step":30,"val_loss":3.2,"tokens":300}
{"step":5,"loss":4.1}
{"step":20,"val_loss":3.4,"tokens":200}
{"step":30,"val_loss":3.1,"tokens":300}
)";
  const auto m = attnres::experiment::read_metrics(p);
  ASSERT_EQ(m.curve.size(), 3u) << m.curve.dump();
  EXPECT_EQ(m.curve[1][1], 3.4);
  EXPECT_EQ(m.curve[2][1], 3.1);
  EXPECT_EQ(m.curve[2][0], 300);
}

// Fifteenth hostile pass: a setting recorded only where it is not the default (runtime: absent
// for the CPU in fp32) was not compared, so an fp32 rerun kept a comparison's bf16 runs.
TEST(Compare, ASettingOnlyTheKeptRunRecordsDiffers) {
  const nlohmann::json want = {{"steps", 10}, {"lr", 0.001}};
  nlohmann::json have = want;
  EXPECT_NO_THROW(attnres::experiment::check_same_settings(have, want, "d", "run.json"));
  have["out_dir"] = "elsewhere";  // (no setting)
  EXPECT_NO_THROW(attnres::experiment::check_same_settings(have, want, "d", "run.json"));
  have["runtime"] = {{"device", "cpu"}, {"precision", "bf16"}};
  try {
    attnres::experiment::check_same_settings(have, want, "d", "run.json");
    ADD_FAILURE() << "a bf16 run was kept for an fp32 command";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("runtime differ"), std::string::npos) << e.what();
    // ... naming the options that continue them
    EXPECT_NE(std::string(e.what()).find("--device cpu --precision bf16"), std::string::npos)
        << e.what();
  }
}

}  // namespace
