// Hostile and corrupt inputs: sizes that must be rejected before any allocation, references that
// must not escape the checkpoint directory, and the inputs the fuzzers (fuzz/) found. Every case
// must end in attnres::Error naming the file, never a crash, std::bad_alloc or a huge allocation.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "attnres/checkpoint.hpp"
#include "attnres/data.hpp"
#include "attnres/error.hpp"
#include "attnres/fileio.hpp"
#include "attnres/model.hpp"
#include "attnres/optim.hpp"
#include "attnres/tokenizer.hpp"
#include "attnres/train.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace attnres;
using attnres::testing::TempDir;

namespace {

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A safetensors file with the given JSON header (padded) and data section.
std::string safetensors_bytes(const std::string& header, const std::string& body) {
  std::string h = header;
  h.append((8 - h.size() % 8) % 8, ' ');
  const uint64_t n = h.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + h + body;
}

// Runs f, which must throw attnres::Error whose message contains every needle (a std::bad_alloc
// or any other exception fails the test).
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "'" << n << "' not in: " << e.what();
  }
}

// Twenty-second hostile pass: a printed resume command with --out 'runs/x;touch PWNED' ran
// `touch PWNED` when pasted. A path in a suggested command is one shell word.
TEST(HostileInputs, PathsInSuggestedCommandsAreOneShellWord) {
  EXPECT_EQ(attnres::shell_word("runs/x-1_2.3"), "runs/x-1_2.3");
  EXPECT_EQ(attnres::shell_word("runs/x;touch PWNED"), "'runs/x;touch PWNED'");
  EXPECT_EQ(attnres::shell_word("it's $(rm) `x`"), "'it'\\''s $(rm) `x`'");
  EXPECT_EQ(attnres::shell_word(""), "''");
  attnres::testing::TempDir td;
  const std::string out = td.path + "/x;touch PWNED";
  TrainConfig c;
  c.out_dir = out;
  c.data_path = td.path + "/c.txt";
  std::ofstream(c.data_path) << std::string(4000, 'a');
  c.model.n_layer = 1;
  c.model.d_model = 16;
  c.model.n_head = 2;
  c.batch_size = 2;
  c.seq_len = 8;
  c.steps = 2;
  c.eval_every = 0;
  c.log_every = 1;
  EXPECT_NE(train(c, {}).resume_command.find("--out '" + out + "'"), std::string::npos);
}

TEST(HostileInputs, SafetensorsHeaderClaimingATerabyte) {
  TempDir td;
  const std::string p = td.file("huge_header.safetensors");
  const uint64_t n = uint64_t{1} << 40;
  write_bytes(p, std::string(reinterpret_cast<const char*>(&n), 8) + "{}");
  expect_error([&] { SafetensorsReader::open(p); },
               {"huge_header.safetensors", "truncated", "1099511627776"});
}

TEST(HostileInputs, SafetensorsTensorClaimingATerabyte) {
  TempDir td;
  const std::string p = td.file("huge_tensor.safetensors");
  write_bytes(p, safetensors_bytes(
                     R"({"w":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,4]}})",
                     std::string(4, '\0')));
  expect_error([&] { SafetensorsReader::open(p); }, {"huge_tensor.safetensors", "'w'", "needs"});
  // Offsets past the end of the file are refused too, whatever the shape says.
  write_bytes(
      p, safetensors_bytes(
             R"({"w":{"dtype":"F32","shape":[262144,262144],"data_offsets":[0,274877906944]}})",
             std::string(4, '\0')));
  expect_error([&] { SafetensorsReader::open(p); }, {"run past the data section"});
}

// The config in a checkpoint's metadata is checked against the file's tensors before the model
// is allocated: a config claiming a 2^40-float embedding with a tiny tensor fails cheaply.
TEST(HostileInputs, CheckpointConfigClaimingAHugeModel) {
  TempDir td;
  ModelConfig small;
  small.n_layer = 1;
  small.d_model = 8;
  small.n_head = 2;
  small.vocab_size = 16;
  small.max_seq_len = 8;
  Model m(small);
  const std::string p = td.file("liar.safetensors");
  save_model(p, m, {});
  // Rewrite the metadata's config to claim a vocabulary of 2^24 and width 2^16.
  ModelConfig big = m.config();
  big.vocab_size = int64_t{1} << 24;
  big.d_model = int64_t{1} << 16;
  big.n_head = 512;
  big.n_kv_head = 512;
  big.ffn_hidden = 8;
  big.max_seq_len = 8;
  SafetensorsReader r = SafetensorsReader::open(p);
  SafetensorsWriter w;
  std::vector<std::vector<float>> keep;
  for (const std::string& n : r.names()) {
    keep.push_back(r.read_f32(n));
    w.add_f32(n, r.info(n).shape, keep.back().data());
  }
  w.set_metadata("config", big.to_json());
  w.write(p);
  expect_error([&] { load_model(p); },
               {"liar.safetensors", "tok_embeddings.weight", "[16777216,65536]", "disagree"});
}

TEST(HostileInputs, ConfigSizesAreBounded) {
  ModelConfig c;
  c.d_model = int64_t{1} << 40;
  c.resolve();
  expect_error([&] { c.validate(); }, {"d_model must be in [2, 65536]"});
  c = ModelConfig();
  c.vocab_size = int64_t{1} << 40;
  c.resolve();
  expect_error([&] { c.validate(); }, {"vocab_size"});
  c = ModelConfig();
  c.max_seq_len = int64_t{1} << 20;
  c.d_model = 4096;
  c.n_head = 1;  // head_dim 4096: 2^32 RoPE floats
  c.resolve();
  expect_error([&] { c.validate(); }, {"max_seq_len x head_dim"});
  c = ModelConfig();
  c.resolve();
  c.ffn_hidden = int64_t{1} << 50;
  expect_error([&] { c.validate(); }, {"ffn_hidden"});
  // Eleventh hostile pass: --weight-decay 1e30 trained a finite garbage model (every weight
  // scaled by 1 - lr wd, about -1e27), saved with exit 0.
  TrainConfig t;
  t.adamw.lr = 1e-3;
  t.adamw.weight_decay = 1e30;
  expect_error([&] { t.validate(); }, {"--weight-decay x --lr must be below 1"});
  t.adamw.weight_decay = 999.0;  // lr x wd = 0.999: a strong decay, but a decay
  t.validate();
  // Thirteenth pass: values that round to 1 or 0 in the float optimizer, and an evaluation
  // count whose windows overflowed (no window evaluated, "final val loss -0.0000").
  t.adamw.weight_decay = 0.0;
  t.adamw.beta1 = 0.99999999;
  expect_error([&] { t.validate(); }, {"betas must be in [0, 1) in single precision"});
  t.adamw.beta1 = 1e300;  // (beyond float: refused before any cast, which would be UB)
  expect_error([&] { t.validate(); }, {"betas"});
  t.adamw.beta1 = 0.9;
  t.adamw.beta2 = 0.9999999999999999;
  expect_error([&] { t.validate(); }, {"betas"});
  t.adamw.beta2 = 0.999;
  t.adamw.lr = 1e-300;
  expect_error([&] { t.validate(); }, {"--lr must be in [1e-30, 10)"});
  t.adamw.lr = 1e-3;
  t.eval_batches = int64_t{1} << 61;
  expect_error([&] { t.validate(); }, {"--eval-batches in [1, 2^30]"});
}

// The tokenizer reference comes from checkpoint metadata: it may only name a file beside the
// checkpoint. "../../dev/zero" would otherwise be read forever.
TEST(HostileInputs, TokenizerReferenceCannotLeaveTheCheckpointDirectory) {
  TempDir td;
  for (const char* ref : {"sentencepiece:../../../../../../dev/zero", "sentencepiece:/dev/zero",
                          "sentencepiece:sub/tok.model", "sentencepiece:..", "sentencepiece:."}) {
    expect_error([&] { load_tokenizer(ref, td.path); }, {"plain file name"});
  }
  expect_error([&] { load_tokenizer(std::string("sentencepiece:a\0b", 17), td.path); },
               {"plain file name"});
}

// One 8 MiB line without a newline, with invalid UTF-8 and control bytes: read, sanitized and
// tokenized in parallel chunks exactly like in one piece.
TEST(HostileInputs, HugeLineWithInvalidUtf8) {
  TempDir td;
  std::string line(size_t{8} << 20, 'a');
  for (size_t i = 0; i < line.size(); i += 4099) line[i] = static_cast<char>(0x80 + i % 64);
  for (size_t i = 7; i < line.size(); i += 65537) line[i] = '\x01';
  write_bytes(td.file("long.txt"), line);
  Corpus c = read_corpus(td.file("long.txt"));
  EXPECT_GT(c.replaced_invalid_utf8, 0);
  std::string again;
  EXPECT_EQ(append_sanitized_utf8(c.text, again), 0);
  auto tok = make_byte_tokenizer();
  EXPECT_EQ(encode_parallel(*tok, c.text, 1 << 16), tok->encode(c.text));
}

// Found by fuzz_config: a float where an integer belongs ({"n_layer": 1e300}) went through
// nlohmann's get<int64_t>(), a float-to-integer conversion out of range (undefined behaviour,
// reported by UBSan). Now every field's type and range is checked.
TEST(HostileInputs, ConfigFieldsOfTheWrongTypeOrRange) {
  expect_error([] { ModelConfig::from_json(R"({"n_layer": 1e300})"); },
               {"model config", "'n_layer'", "an integer", "1e+300"});
  expect_error([] { ModelConfig::from_json(R"({"d_model": 99999999999999999999})"); },
               {"'d_model'"});
  expect_error([] { ModelConfig::from_json(R"({"tied": 1})"); }, {"'tied'", "true or false"});
  expect_error([] { ModelConfig::from_json(R"({"residual": 3})"); }, {"'residual'", "a string"});
  expect_error([] { TrainConfig::from_json(R"({"steps": 1e30})"); },
               {"training config", "'steps'", "an integer"});
  expect_error([] { TrainConfig::from_json(R"({"seed": -1})"); }, {"'seed'", "non-negative"});
  expect_error([] { TrainConfig::from_json(R"({"bpe_vocab": 4294967296})"); },
               {"'bpe_vocab'", "in range"});
  expect_error([] { TrainConfig::from_json(R"({"model": {"n_head": 2.5}})"); }, {"'n_head'"});
  expect_error([] { TrainConfig::from_json("[1, 2]"); }, {"JSON object"});
  // Valid files still load.
  ModelConfig c;
  c.residual.mode = ResidualMode::block;
  EXPECT_EQ(ModelConfig::from_json(c.to_json()).to_json(), c.to_json());
  TrainConfig t;
  EXPECT_EQ(TrainConfig::from_json(t.to_json()).to_json(), t.to_json());
}

// --resume names train_config.json when it is corrupt.
TEST(HostileInputs, CorruptTrainConfigOnResumeNamesTheFile) {
  TempDir td;
  fs::create_directories(td.file("run"));
  write_bytes(td.file("run/train_config.json"), R"({"steps": "many"})");
  TrainConfig rc;
  rc.out_dir = td.file("run");
  rc.resume = true;
  expect_error([&] { train(rc, {}); }, {"train_config.json", "'steps'", "without --resume"});
}

TEST(HostileInputs, CorpusWithNulBytesIsRefused) {
  TempDir td;
  write_bytes(td.file("nul.txt"), std::string("text\0more", 9));
  expect_error([&] { read_corpus(td.file("nul.txt")); }, {"nul.txt", "binary"});
}

}  // namespace

namespace {

// A tiny model's checkpoint and optimizer state in td, for the tests below to poison.
struct SavedRun {
  ModelConfig cfg;
  std::string model, optim;
};
SavedRun save_tiny(const TempDir& td) {
  SavedRun s;
  s.cfg.n_layer = 1;
  s.cfg.d_model = 16;
  s.cfg.n_head = 2;
  s.cfg.max_seq_len = 8;
  Model m(s.cfg);
  m.init_weights(1);
  s.model = td.file("model.safetensors");
  s.optim = td.file("optimizer.safetensors");
  save_model(s.model, m, {{"step", "3"}});
  AdamW opt(m.layout(), AdamWConfig{});
  save_optimizer(s.optim, m, opt, {});
  return s;
}

}  // namespace

// Issue 19, class B: weights or moments that are NaN or Inf are refused where they are loaded
// (they used to be trained on, saved over the good checkpoint, or evaluated to `loss nan`), and
// never saved by the trainer.
TEST(HostileInputs, NonFiniteWeightsAndMomentsAreRefusedOnLoad) {
  TempDir td;
  const SavedRun s = save_tiny(td);
  {
    auto m = load_model(s.model);
    m->param("layers.0.feed_forward.w2.weight")[5] = std::numeric_limits<float>::infinity();
    save_model(td.file("inf.safetensors"), *m, {});
    expect_error(
        [&] { load_model(td.file("inf.safetensors")); },
        {"inf.safetensors", "is unusable", "'layers.0.feed_forward.w2.weight' holds 1 of"});
    expect_error([&] { check_weights_finite(*m, "not saving", "fix"); }, {"not saving", "fix"});
  }
  auto m = load_model(s.model);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -1.0f}) {
    AdamW opt(m->layout(), AdamWConfig{});
    opt.v().data()[7] = bad;
    save_optimizer(td.file("o.safetensors"), *m, opt, {});
    AdamW back(m->layout(), AdamWConfig{});
    expect_error([&] { load_optimizer(td.file("o.safetensors"), *m, back); },
                 {"o.safetensors", "is unusable", "'v.tok_embeddings.weight'"});
  }
}

// Class L: a checkpoint's step and the optimizer's step count must be counts in range (they were
// trusted: `step` 99 of 5 planned ended the run as done, -3 trained on garbage, "abc" was an
// internal error).
TEST(HostileInputs, CheckpointStepsMustBeCountsInRange) {
  EXPECT_EQ(checkpoint_step({{"step", "4"}}, 5, "c"), 4);
  for (const char* bad : {"99", "-3", "abc", "", "4 ", "99999999999999999999"}) {
    expect_error(
        [&] {
          checkpoint_step({{"step", bad}}, 5, "ckpt");
        },
        {"ckpt", "not a count in [0, 5]"});
  }
  expect_error([&] { checkpoint_step({}, 5, "ckpt"); }, {"no 'step'"});
  TempDir td;
  const SavedRun s = save_tiny(td);
  auto m = load_model(s.model);
  AdamW opt(m->layout(), AdamWConfig{});
  save_optimizer(td.file("o.safetensors"), *m, opt, {});
  // adam_steps -5 in the metadata (written as the saver would, then edited)
  std::string bytes = read_file(td.file("o.safetensors"));
  const size_t at = bytes.find("\"adam_steps\":\"0\"");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 16, "\"adam_steps\":\"-\"");
  write_bytes(td.file("o.safetensors"), bytes);
  AdamW back(m->layout(), AdamWConfig{});
  // (the edit breaks the file's checksum; without one, as another writer's file, the value is
  // checked itself)
  expect_error([&] { load_optimizer(td.file("o.safetensors"), *m, back); }, {"checksum mismatch"});
  const size_t key = bytes.find(kDataChecksumKey);
  ASSERT_NE(key, std::string::npos);
  // another key of the same length, not a damaged checksum name (that is refused)
  bytes.replace(key, std::strlen(kDataChecksumKey),
                std::string(std::strlen(kDataChecksumKey), 'q'));
  write_bytes(td.file("o.safetensors"), bytes);
  expect_error([&] { load_optimizer(td.file("o.safetensors"), *m, back); },
               {"adam_steps is '-'", "not a count"});
}

// Class G: a valid header of many small tensors parses in time linear in their number (nlohmann's
// callback parser rescanned the header at each entry: 40k entries took 10 s, 80k 47 s). Measured
// as a ratio in one run, not against a clock (a fixed 10 s bound failed under ASan on a loaded
// machine at 10.17 s): 4x the entries take about 4x the time linearly, 16x quadratically.
TEST(HostileInputs, HeaderOfManyTensorsParsesInLinearTime) {
  TempDir td;
  auto parse_seconds = [&](int n) {
    std::string header = "{";
    for (int i = 0; i < n; i++) {
      header += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[1]," +
                "\"data_offsets\":[" + std::to_string(4 * i) + "," + std::to_string(4 * i + 4) +
                "]}";
    }
    header += "}";
    write_bytes(td.file("many.safetensors"),
                safetensors_bytes(header, std::string(static_cast<size_t>(4 * n), '\0')));
    const auto t0 = std::chrono::steady_clock::now();
    const SafetensorsReader r = SafetensorsReader::open(td.file("many.safetensors"));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(r.names().size(), static_cast<size_t>(n));
    return s;
  };
  const double small = parse_seconds(15000), large = parse_seconds(60000);
  EXPECT_LT(large, 9.0 * std::max(small, 0.02))
      << small << " s for 15k entries, " << large << " s for 60k";
  // (and a key twice in one object is still refused)
  write_bytes(td.file("dup.safetensors"),
              safetensors_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                                "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                                std::string(8, '\0')));
  expect_error([&] { SafetensorsReader::open(td.file("dup.safetensors")); }, {"appears twice"});
}

// Deeply nested JSON (200k levels, a 400 KB file) overflowed the stack in `info`, `train
// --resume` and `report`; every JSON read from a file is now refused past 64 levels.
TEST(HostileInputs, DeeplyNestedJsonIsRefused) {
  TempDir td;
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  write_bytes(td.file("deep.safetensors"),
              safetensors_bytes(
                  "{\"t\":{\"dtype\":\"F32\",\"shape\":" + deep + ",\"data_offsets\":[0,0]}}", ""));
  expect_error([&] { SafetensorsReader::open(td.file("deep.safetensors")); },
               {"deep.safetensors", "nested deeper than 64 levels"});
  expect_error([&] { ModelConfig::from_json("{\"n_layer\":" + deep + "}"); },
               {"nested deeper than 64 levels"});
  expect_error([&] { TrainConfig::from_json("{\"model\":" + deep + "}"); },
               {"nested deeper than 64 levels"});
  EXPECT_NO_THROW(ModelConfig::from_json(ModelConfig{}.to_json()));
}
