// `attnres eval --task` (issue 20): every choice's log-likelihood equals an independent float64
// PyTorch computation (tools/gen_task_fixtures.py, tools/reference_model.py), and so do the
// accuracies; malformed task files are errors naming the file, line and key.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "attnres/checkpoint.hpp"
#include "attnres/error.hpp"
#include "attnres/tasks.hpp"
#include "test_util.hpp"

using namespace attnres;
using attnres::testing::TempDir;

namespace {

std::string dir() { return std::string(ATTNRES_FIXTURE_DIR) + "/tasks/"; }

std::string task_error(const std::string& text) {
  TempDir t;
  std::ofstream(t.file("t.jsonl")) << text;
  try {
    read_task(t.file("t.jsonl"));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Tasks, LogLikelihoodsAndAccuraciesMatchPyTorch) {
  const nlohmann::json want = nlohmann::json::parse(std::ifstream(dir() + "expected.json"));
  EXPECT_EQ(want.at("fixture_version"), "1");
  Metadata meta;
  auto model = load_model(dir() + "model.safetensors", &meta);
  auto tok = load_checkpoint_tokenizer(meta, dir() + "model.safetensors", 256);
  for (const char* name : {"mc", "pairs"}) {
    SCOPED_TRACE(name);
    const Task task = read_task(dir() + name + ".jsonl");
    EXPECT_EQ(task.kind,
              std::string(name) == "mc" ? TaskKind::multiple_choice : TaskKind::minimal_pair);
    const TaskResult r = score_task(*model, *tok, task);
    const nlohmann::json& w = want.at(name);
    ASSERT_EQ(r.logliks.size(), w.at("logliks").size());
    for (size_t i = 0; i < r.logliks.size(); i++) {
      ASSERT_EQ(r.logliks[i].size(), w.at("logliks")[i].size());
      for (size_t k = 0; k < r.logliks[i].size(); k++) {
        const double ref = w.at("logliks")[i][k].get<double>();
        EXPECT_NEAR(r.logliks[i][k], ref, 1e-5 * std::fabs(ref) + 1e-5) << i << "," << k;
      }
    }
    EXPECT_DOUBLE_EQ(r.acc, w.at("acc").get<double>());
    EXPECT_NEAR(r.acc_stderr, std::sqrt(r.acc * (1 - r.acc) / (r.items - 1)), 1e-12);
    if (task.kind == TaskKind::multiple_choice) {
      EXPECT_DOUBLE_EQ(r.acc_norm, w.at("acc_norm").get<double>());
    } else {
      EXPECT_LT(r.acc_norm, 0);  // not defined for pairs
    }
  }
}

// A sequence longer than the model's context keeps its last tokens; a choice alone longer than
// it is an error.
TEST(Tasks, LongContextsAreCutFromTheLeft) {
  Metadata meta;
  auto model = load_model(dir() + "model.safetensors", &meta, 16);
  auto tok = load_checkpoint_tokenizer(meta, dir() + "model.safetensors", 256);
  Task t;
  t.path = "inline";
  t.items.push_back({std::string(100, 'a') + " the cat", {" sat", " ran"}, 0});
  Task cut = t;
  cut.items[0].context = std::string(12, 'a') + " the cat";  // the 16 inputs the model sees
  const TaskResult a = score_task(*model, *tok, t), b = score_task(*model, *tok, cut);
  EXPECT_EQ(a.logliks, b.logliks);
  EXPECT_EQ(a.items_cut, 1);  // (counted, for eval's note)
  Task short_task = t;
  short_task.items[0].context = "the cat";
  EXPECT_EQ(score_task(*model, *tok, short_task).items_cut, 0);
  t.items[0].choices = {std::string(40, 'x'), "y"};
  EXPECT_THROW(score_task(*model, *tok, t), Error);
}

TEST(Tasks, MalformedFilesNameTheLineAndKey) {
  EXPECT_NE(task_error("").find("has no items"), std::string::npos);
  EXPECT_NE(
      task_error("{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"label\": 0}\nnot json\n")
          .find("line 2 is not valid JSON"),
      std::string::npos);
  EXPECT_NE(
      task_error("{\"context\": \"a\", \"choices\": [\"x\"], \"label\": 0}\n").find("two or more"),
      std::string::npos);
  EXPECT_NE(task_error("{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"label\": 2}\n")
                .find("'label' 2 is not the index of a choice"),
            std::string::npos);
  EXPECT_NE(task_error("{\"context\": \"a\", \"choices\": [\"x\", \"y\"]}\n").find("no 'label'"),
            std::string::npos);
  EXPECT_NE(task_error("{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"label\": 0}\n"
                       "{\"sentence_good\": \"a\", \"sentence_bad\": \"b\"}\n")
                .find("one kind per file"),
            std::string::npos);
  EXPECT_NE(task_error("{\"sentence_good\": \"a\"}\n").find("needs both"), std::string::npos);
  EXPECT_NE(task_error("{\"question\": \"a\"}\n").find("neither a multiple-choice item"),
            std::string::npos);
  EXPECT_NE(task_error("{\"context\": 5, \"choices\": [\"x\", \"y\"], \"label\": 0}\n")
                .find("'context' must be a string"),
            std::string::npos);
  EXPECT_EQ(task_error("\n{\"sentence_good\": \"a\", \"sentence_bad\": \"b\"}\n\n"), "");
}

// The CLI prints the accuracies with their standard errors.
TEST(Tasks, EvalTaskPrintsAccuracies) {
  const auto r = attnres::testing::run_cli("eval " + dir() + "model.safetensors --task " + dir() +
                                           "mc.jsonl --task " + dir() + "pairs.jsonl");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(multiple choice, 10 items): acc 0.3000 +- 0.1528 | acc_norm 0.3000"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("(minimal pairs, 6 pairs): acc 0.3333 +- 0.2108"), std::string::npos)
      << r.out;
  // Twelfth hostile pass: the loss's options were dropped without a word next to --task.
  for (const char* o : {" --data /nonexistent", " --split train", " --seq-len 4", " --batches 2"}) {
    const auto bad = attnres::testing::run_cli("eval " + dir() + "model.safetensors --task " +
                                               dir() + "mc.jsonl" + o);
    EXPECT_EQ(bad.code, 1) << o << bad.out;
    EXPECT_NE(bad.out.find("does not apply to --task"), std::string::npos) << bad.out;
  }
}
