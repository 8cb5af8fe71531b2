// Hugging Face interop (issue 20), with transformers itself as the oracle: the fixtures under
// tests/fixtures/hf/ are random LlamaForCausalLM models saved by save_pretrained with their
// logits (tools/gen_hf_fixtures.py); these tests need no Python.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "attnres/checkpoint.hpp"
#include "attnres/error.hpp"
#include "attnres/interop.hpp"
#include "attnres/safetensors.hpp"
#include "attnres/tokenizer.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using namespace attnres;
using attnres::testing::TempDir;

namespace {

std::string fixture(const std::string& name) {
  return std::string(ATTNRES_FIXTURE_DIR) + "/hf/" + name;
}

struct Expected {
  std::vector<int32_t> tokens;
  std::vector<float> logits;
  int64_t B = 0, T = 0;
};

Expected expected(const std::string& name) {
  SafetensorsReader r = SafetensorsReader::open(fixture(name) + "/expected.safetensors");
  EXPECT_EQ(r.metadata().at("fixture_version"), "1");
  Expected e;
  e.tokens = r.read_i32("tokens");
  e.logits = r.read_f32("logits");
  e.B = r.info("tokens").shape[0];
  e.T = r.info("tokens").shape[1];
  return e;
}

std::vector<float> logits_of(Model& m, const Expected& e) {
  m.forward(e.tokens.data(), nullptr, e.B, e.T);
  return std::vector<float>(m.logits(), m.logits() + e.logits.size());
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); i++) {
    d = std::max(d, std::fabs(double(a[i]) - b[i]));
  }
  return d;
}

HfImportOptions mode(ResidualMode m, int64_t block_size = 4) {
  HfImportOptions o;
  o.residual.mode = m;
  o.residual.block_size = block_size;
  return o;
}

// A copy of a fixture directory that a test may edit.
std::string copy_fixture(const TempDir& t, const std::string& name, const std::string& as = "") {
  const std::string dst = t.file(as.empty() ? name : as);
  fs::copy(fixture(name), dst, fs::copy_options::recursive);
  return dst;
}

nlohmann::json read_json(const std::string& p) { return nlohmann::json::parse(std::ifstream(p)); }
void write_json(const std::string& p, const nlohmann::json& j) { std::ofstream(p) << j.dump(2); }

// import_hf's Error message for `dir`, or "" when it imports.
std::string import_error(const std::string& dir, ResidualMode m = ResidualMode::prenorm) {
  try {
    import_hf(dir, mode(m));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// The PreNorm import computes transformers' logits: GQA, an untied head and rope_theta 500000
// in float32; a tied head and sharded bfloat16 weights in the other fixture.
TEST(ImportHf, LogitsMatchTransformers) {
  for (const char* name : {"llama_gqa", "llama_tied_bf16"}) {
    SCOPED_TRACE(name);
    const Expected e = expected(name);
    HfImport im = import_hf(fixture(name), mode(ResidualMode::prenorm));
    const ModelConfig& c = im.model->config();
    EXPECT_EQ(c.n_layer, 3);
    EXPECT_EQ(c.n_kv_head, std::string(name) == "llama_gqa" ? 2 : 4);
    EXPECT_EQ(c.tied, std::string(name) == "llama_tied_bf16");
    EXPECT_EQ(im.source.weights_dtype, std::string(name) == "llama_gqa" ? "F32" : "BF16");
    EXPECT_EQ(im.source.shards.size(), std::string(name) == "llama_gqa" ? 1u : 5u);
    EXPECT_EQ(im.source.tokenizer_pieces, 320);
    const double d = max_abs_diff(logits_of(*im.model, e), e.logits);
    std::printf("%s: largest logit difference from transformers %.3g\n", name, d);
    EXPECT_LT(d, 1e-4);
  }
}

// Upcycled to Full or Block AttnRes (zero queries, unit key gains), the model computes the
// PreNorm function: to float rounding where the RMSNorm epsilon is negligible (1e-12), and
// measurably off where it is not (1e-5 against this random model's small hidden states), which
// the import's probe reports.
TEST(ImportHf, UpcycledModelsComputeThePrenormFunction) {
  const Expected e = expected("llama_tied_bf16");
  for (auto [m, S] : {std::pair{ResidualMode::full, 1},
                      {ResidualMode::block, 2},
                      {ResidualMode::block, 4},
                      {ResidualMode::block, 6}}) {
    SCOPED_TRACE(std::string(to_string(m)) + " S=" + std::to_string(S));
    HfImport im = import_hf(fixture("llama_tied_bf16"), mode(m, S));
    EXPECT_LT(max_abs_diff(logits_of(*im.model, e), e.logits), 1e-4);
    EXPECT_LT(im.probe_max_diff, 1e-5);
    EXPECT_GT(im.probe_max_logit, 0.1);
    EXPECT_EQ(im.probe_tokens, 32);
  }
  HfImport pre = import_hf(fixture("llama_gqa"), mode(ResidualMode::prenorm));
  EXPECT_LT(pre.probe_max_diff, 0);  // not measured for a PreNorm import
  HfImport full = import_hf(fixture("llama_gqa"), mode(ResidualMode::full));
  EXPECT_GT(full.probe_max_diff, 1e-3);
  EXPECT_LT(full.probe_max_diff, 0.1 * full.probe_max_logit);
}

TEST(ImportHf, TensorNamesMapBothWays) {
  EXPECT_EQ(hf_tensor_name("tok_embeddings.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(hf_tensor_name("layers.11.attention.wk.weight"),
            "model.layers.11.self_attn.k_proj.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.feed_forward.w1.weight"),
            "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.feed_forward.w3.weight"), "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.ffn_norm.weight"),
            "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(hf_tensor_name("output.weight"), "lm_head.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.res.query"), "");
  // AttnRes mixers, in Kimi K3's names (the public K3 code and its ports).
  EXPECT_EQ(hf_tensor_name("layers.3.attn_res.query"),
            "model.layers.3.self_attention_res_proj.weight");
  EXPECT_EQ(hf_tensor_name("layers.3.attn_res.key_norm.weight"),
            "model.layers.3.self_attention_res_norm.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.mlp_res.query"), "model.layers.0.mlp_res_proj.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.mlp_res.key_norm.weight"),
            "model.layers.0.mlp_res_norm.weight");
  EXPECT_EQ(hf_tensor_name("out_res.query"), "model.output_attn_res_proj.weight");
  EXPECT_EQ(hf_tensor_name("out_res.key_norm.weight"), "model.output_attn_res_norm.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.attn_res.query_proj.weight"), "");  // (dynamic queries)
  EXPECT_EQ(hf_tensor_shape("out_res.query", {8}), (std::vector<int64_t>{1, 8}));
  EXPECT_EQ(hf_tensor_shape("out_res.key_norm.weight", {8}), (std::vector<int64_t>{8}));
}

// Every config.json setting the engine would not compute exactly is refused, naming the file and
// the key.
TEST(ImportHf, UnsupportedConfigsAreRefusedByName) {
  TempDir t;
  const std::string dir = copy_fixture(t, "llama_gqa");
  const std::string cfg = dir + "/config.json";
  const nlohmann::json good = read_json(cfg);
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"model_type", "gpt2", "model_type 'gpt2' is not supported"},
      {"architectures", nlohmann::json::array({"Qwen2ForCausalLM"}), "Qwen2ForCausalLM"},
      {"attention_bias", true, "attention_bias"},
      {"mlp_bias", true, "mlp_bias"},
      {"sliding_window", 4096, "sliding-window"},
      {"num_local_experts", 8, "mixture of experts"},
      {"hidden_act", "gelu", "hidden_act 'gelu'"},
      {"head_dim", 16, "head_dim 16"},
      {"rope_parameters", {{"rope_type", "llama3"}, {"rope_theta", 5e5}}, "rope_type 'llama3'"},
      {"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}, "rope_type 'linear'"},
      // (seventeenth hostile pass: imported as a full rotary, another function)
      {"partial_rotary_factor", 0.5, "'partial_rotary_factor' is 0.5"},
      {"hidden_size", "32", "'hidden_size' must be an integer"},
      {"architectures", "Qwen2ForCausalLM", "Qwen2ForCausalLM"},  // (a string, not a list)
      {"num_hidden_layers", nullptr, "num_hidden_layers"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    nlohmann::json j = good;
    if (c.value.is_null()) {
      j.erase(c.key);
    } else {
      j[c.key] = c.value;
    }
    write_json(cfg, j);
    const std::string err = import_error(dir);
    EXPECT_NE(err.find(c.expect), std::string::npos) << err;
    EXPECT_NE(err.find("config.json"), std::string::npos) << err;
  }
  write_json(cfg, good);
  EXPECT_EQ(import_error(dir), "");
}

// Weights that disagree with config.json, missing or foreign shards and tensors, non-finite
// values, other weight formats and tokenizers: each an Error naming the file.
TEST(ImportHf, BadWeightsAndTokenizersAreRefusedByName) {
  TempDir t;
  {  // a shape that disagrees with config.json
    const std::string dir = copy_fixture(t, "llama_gqa");
    nlohmann::json j = read_json(dir + "/config.json");
    j["intermediate_size"] = 96;
    write_json(dir + "/config.json", j);
    const std::string err = import_error(dir);
    EXPECT_NE(err.find("mlp.gate_proj.weight"), std::string::npos) << err;
    EXPECT_NE(err.find("has shape [80,32] but config.json needs [96,32]"), std::string::npos)
        << err;
    fs::remove_all(dir);
  }
  {  // untied in config.json, but the file has no head
    const std::string dir = copy_fixture(t, "llama_tied_bf16");
    nlohmann::json j = read_json(dir + "/config.json");
    j["tie_word_embeddings"] = false;
    write_json(dir + "/config.json", j);
    EXPECT_NE(import_error(dir).find("no tensor 'lm_head.weight'"), std::string::npos);
    fs::remove_all(dir);
  }
  {  // tied in config.json, yet the file holds a head: not read, and the import says so
    // (twenty-first hostile pass: dropped without a word)
    const std::string dir = copy_fixture(t, "llama_gqa");
    EXPECT_FALSE(inspect_hf(dir).unread_tied_head);
    nlohmann::json j = read_json(dir + "/config.json");
    j["tie_word_embeddings"] = true;
    write_json(dir + "/config.json", j);
    EXPECT_TRUE(inspect_hf(dir).unread_tied_head);
    const auto r =
        attnres::testing::run_cli("import-hf " + dir + " --out " + t.file("tied.safetensors"));
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("the lm_head.weight in the files is not read"), std::string::npos)
        << r.out;
    fs::remove_all(dir);
  }
  {  // num_key_value_heads null is the head count, as transformers reads it; an index entry
     // naming a shard that does not hold the tensor is refused
    const std::string dir = copy_fixture(t, "llama_tied_bf16");
    nlohmann::json j = read_json(dir + "/config.json");
    j["num_key_value_heads"] = nullptr;
    write_json(dir + "/config.json", j);
    EXPECT_EQ(import_error(dir), "");
    nlohmann::json ix = read_json(dir + "/model.safetensors.index.json");
    const std::string right = ix["weight_map"]["model.norm.weight"];
    ix["weight_map"]["model.norm.weight"] = right == "model-00001-of-00005.safetensors"
                                                ? "model-00002-of-00005.safetensors"
                                                : "model-00001-of-00005.safetensors";
    write_json(dir + "/model.safetensors.index.json", ix);
    const std::string err = import_error(dir);
    EXPECT_NE(err.find("puts tensor 'model.norm.weight' in"), std::string::npos) << err;
    fs::remove_all(dir);
  }
  {  // a missing shard, and a shard name that leaves the directory
    const std::string dir = copy_fixture(t, "llama_tied_bf16");
    fs::remove(dir + "/model-00003-of-00005.safetensors");
    std::string err = import_error(dir);
    EXPECT_NE(err.find("model-00003-of-00005.safetensors' named by"), std::string::npos) << err;
    EXPECT_NE(err.find("is missing"), std::string::npos) << err;
    nlohmann::json j = read_json(dir + "/model.safetensors.index.json");
    j["weight_map"]["model.norm.weight"] = "../../etc/passwd";
    write_json(dir + "/model.safetensors.index.json", j);
    err = import_error(dir);
    EXPECT_NE(err.find("not a file name in the model directory"), std::string::npos) << err;
    fs::remove_all(dir);
  }
  const std::string dir = copy_fixture(t, "llama_gqa");
  const std::string weights = dir + "/model.safetensors";
  const std::string original = attnres::testing::slurp(weights);
  SafetensorsReader r = SafetensorsReader::open(fixture("llama_gqa") + "/model.safetensors");
  std::map<std::string, std::vector<float>> ts;
  for (const std::string& n : r.names()) ts[n] = r.read_f32(n);
  auto rewrite = [&](const std::map<std::string, std::vector<float>>& m) {
    SafetensorsWriter w;
    for (const auto& [n, v] : m) {
      std::vector<int64_t> shape = {static_cast<int64_t>(v.size())};
      if (r.has(n)) shape = r.info(n).shape;
      w.add_f32(n, shape, v.data());
    }
    w.write(weights);
  };
  {  // a bias, a foreign tensor, a NaN
    auto m = ts;
    m["model.layers.0.self_attn.q_proj.bias"] = std::vector<float>(32, 0.0f);
    rewrite(m);
    EXPECT_NE(import_error(dir).find("biases are not supported"), std::string::npos);
    m = ts;
    m["model.layers.0.mlp.router.weight"] = std::vector<float>(8, 0.0f);
    rewrite(m);
    EXPECT_NE(import_error(dir).find("'model.layers.0.mlp.router.weight', which a Llama model"),
              std::string::npos);
    m = ts;
    m["model.layers.1.self_attn.v_proj.weight"][5] = std::nanf("");
    rewrite(m);
    const std::string err = import_error(dir);
    EXPECT_NE(err.find("v_proj.weight' in '"), std::string::npos) << err;
    EXPECT_NE(err.find("1 non-finite"), std::string::npos) << err;
    m = ts;
    m["model.layers.0.self_attn.rotary_emb.inv_freq"] = std::vector<float>(4, 1.0f);
    rewrite(m);
    EXPECT_EQ(import_error(dir), "");  // RoPE's tables are recomputed
  }
  std::ofstream(weights, std::ios::binary) << original;
  {  // a tokenizer of another vocabulary; none; only a tokenizer.json
    train_sentencepiece(std::string(2000, 'a') + " hello world, the quick brown fox\n", 300,
                        dir + "/tokenizer.model");
    std::string err = import_error(dir);
    EXPECT_NE(err.find("has 300 pieces but config.json's vocab_size is 320"), std::string::npos)
        << err;
    fs::remove(dir + "/tokenizer.model");
    EXPECT_NE(import_error(dir).find("has no SentencePiece tokenizer.model"), std::string::npos);
    std::ofstream(dir + "/tokenizer.json") << "{}";
    err = import_error(dir);
    EXPECT_NE(err.find("byte-level BPE"), std::string::npos) << err;
  }
  {  // PyTorch pickles only
    fs::remove(weights);
    std::ofstream(dir + "/pytorch_model.bin") << "x";
    EXPECT_NE(import_error(dir).find("safe_serialization=True"), std::string::npos);
  }
}

// The CLI writes the checkpoint and its tokenizer, which eval and generate then use; on any
// failure it writes nothing; it never replaces an existing checkpoint without --overwrite, nor
// another model's tokenizer.
// 30th hostile pass: a directory given where a checkpoint file belongs (--init-from, eval,
// generate) said only "is a directory". A Hugging Face model's directory points at import-hf; a
// run's directory at its model file.
TEST(ImportHf, ADirectoryGivenForACheckpointSaysWhatToGive) {
  using attnres::testing::run_cli;
  TempDir t;
  const std::string hf = fixture("llama_gqa");
  auto r =
      run_cli("eval " + hf + " --task " + std::string(ATTNRES_FIXTURE_DIR) + "/tasks/pairs.jsonl");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("is a directory holding a Hugging Face model (config.json)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("attnres import-hf " + hf + " --out model.safetensors"), std::string::npos)
      << r.out;
  std::ofstream(t.file("c.txt")) << std::string(4000, 'a');
  r = run_cli("train --data " + t.file("c.txt") + " --init-from " + hf + " --out " + t.file("r") +
              " --steps 1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("--init-from: '" + hf + "' is a directory holding a Hugging Face model"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(std::filesystem::exists(t.file("r")));
  // The suggested command quotes the path (31st pass: a space or quote broke it).
  const std::string spaced = copy_fixture(t, "llama_gqa", "sp ace");
  r = run_cli("eval '" + spaced + "' --task " + std::string(ATTNRES_FIXTURE_DIR) +
              "/tasks/pairs.jsonl");
  EXPECT_NE(r.out.find("attnres import-hf '" + spaced + "' --out"), std::string::npos) << r.out;
  // A config.json that is not a Hugging Face model's (a user's notes) is not taken for one.
  std::filesystem::create_directories(t.file("notes"));
  std::ofstream(t.file("notes/config.json")) << "{\"lr\": 0.1}\n";
  r = run_cli("eval " + t.file("notes") + " --task " + std::string(ATTNRES_FIXTURE_DIR) +
              "/tasks/pairs.jsonl");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(r.out.find("Hugging Face"), std::string::npos) << r.out;
  // A directory holding a model.safetensors (a run's): that file is named.
  const std::string run = copy_fixture(t, "llama_gqa", "run");
  std::filesystem::remove(run + "/config.json");
  r = run_cli("generate " + run + " --prompt a -n 1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("is a directory, not a checkpoint file: give its model, '" + run +
                       "/model.safetensors'"),
            std::string::npos)
      << r.out;
}

TEST(ImportHf, CliWritesACheckpointOrNothing) {
  using attnres::testing::run_cli;
  TempDir t;
  const std::string out = t.file("m/model.safetensors");
  auto r = run_cli("import-hf " + fixture("llama_gqa") + " --out " + out + " --residual block " +
                   "--block-layers 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("upcycled"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("blocks of 2 sublayers = 1 layer)"), std::string::npos) << r.out;
  Metadata meta;
  auto m = load_model(out, &meta);
  EXPECT_EQ(m->config().residual.mode, ResidualMode::block);
  EXPECT_EQ(m->config().residual.block_size, 2);
  EXPECT_EQ(meta.at("tokenizer"), "sentencepiece:tokenizer.model");
  EXPECT_EQ(attnres::testing::slurp(t.file("m/tokenizer.model")),
            attnres::testing::slurp(fixture("llama_gqa") + "/tokenizer.model"));
  r = run_cli("generate " + out + " --prompt 'To be' -n 8 --seed 1");
  EXPECT_EQ(r.code, 0) << r.out;
  // Sixth hostile pass: task files whose context is empty on a SentencePiece model, which encodes
  // "\n" to no tokens (every pair failed as "does not fit the context").
  const std::string tasks = std::string(ATTNRES_FIXTURE_DIR) + "/tasks/";
  r = run_cli("eval " + out + " --task " + tasks + "pairs.jsonl --task " + tasks + "mc.jsonl");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(minimal pairs, 6 pairs): acc"), std::string::npos) << r.out;
  // Sixth hostile pass: --overwrite never deletes what its writer did not write: export-hf into
  // the directory it reads (it deleted the whole run), into a directory of other files, and train
  // into a Hugging Face model's directory (its weights were taken for a run's model).
  const std::string hfdir = copy_fixture(t, "llama_gqa", "hfdir");
  r = run_cli("train --data " + hfdir + "/config.json --out " + hfdir +
              " --overwrite --steps 1 --seq-len 8 --batch-size 2 --n-layer 1 --d-model 16 "
              "--n-head 2 --eval-every 0 --eval-batches 1 --sample-tokens 0");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("model.safetensors' is not what an attnres run writes"), std::string::npos)
      << r.out;
  EXPECT_EQ(import_error(hfdir), "");
  // Refusals: --out exists; another tokenizer beside --out; a bad directory (nothing written).
  r = run_cli("import-hf " + fixture("llama_gqa") + " --out " + out);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("pass --overwrite"), std::string::npos) << r.out;
  fs::create_directory(t.file("k"));
  std::ofstream(t.file("k/tokenizer.model")) << "another model's tokenizer";
  r = run_cli("import-hf " + fixture("llama_tied_bf16") + " --out " +
              t.file("k/model.safetensors"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("is another tokenizer"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(t.file("k/model.safetensors")));
  EXPECT_EQ(attnres::testing::slurp(t.file("k/tokenizer.model")), "another model's tokenizer");
  const std::string bad = copy_fixture(t, "llama_gqa");
  fs::remove(bad + "/model.safetensors");
  r = run_cli("import-hf " + bad + " --out " + t.file("n/model.safetensors"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("error: "), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(t.file("n")));
  // Fifth hostile pass: an --out that is the tokenizer's own path (the checkpoint overwrote the
  // tokenizer it had just copied, exit 0), a directory, or the source's own weights.
  r = run_cli("import-hf " + fixture("llama_gqa") + " --out " + t.file("q/tokenizer.model"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("is where the tokenizer goes"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(t.file("q")));
  r = run_cli("import-hf " + fixture("llama_gqa") + " --out " + t.file("q/"));
  EXPECT_EQ(r.code, 1);
  EXPECT_FALSE(fs::exists(t.file("q")));
  const std::string src = copy_fixture(t, "llama_gqa", "src");
  const std::string weights = attnres::testing::slurp(src + "/model.safetensors");
  r = run_cli("import-hf " + src + " --out " + src + "/model.safetensors --overwrite");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("is not an attnres checkpoint"), std::string::npos) << r.out;
  EXPECT_EQ(attnres::testing::slurp(src + "/model.safetensors"), weights);
  r = run_cli("import-hf " + fixture("llama_gqa") + " --out " + out + " --overwrite");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(load_model(out)->config().residual.mode, ResidualMode::prenorm);
  r = run_cli("export-hf " + out + " --out " + t.file("m") + " --overwrite");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("holds the checkpoint being exported"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(out));
  fs::create_directories(t.file("mine"));
  std::ofstream(t.file("mine/notes.txt")) << "keep";
  r = run_cli("export-hf " + out + " --out " + t.file("mine") + " --overwrite");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("--overwrite replaces only"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(t.file("mine/notes.txt")));
  // Seventh pass (minor, now refused): a Hugging Face model directory holds only the names an
  // export writes, and `export-hf --overwrite` replaced it; `import-hf --overwrite` replaced
  // another model's weights file given as --out.
  const std::string hub = copy_fixture(t, "llama_gqa", "hub");
  const std::string hub_weights = attnres::testing::slurp(hub + "/model.safetensors");
  r = run_cli("export-hf " + out + " --out " + hub + " --overwrite");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("is not an earlier export of attnres"), std::string::npos) << r.out;
  fs::copy_file(hub + "/model.safetensors", t.file("theirs.safetensors"));
  r = run_cli("import-hf " + hub + " --out " + t.file("theirs.safetensors") + " --overwrite");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("is not an attnres checkpoint"), std::string::npos) << r.out;
  EXPECT_EQ(attnres::testing::slurp(hub + "/model.safetensors"), hub_weights);
  EXPECT_EQ(attnres::testing::slurp(t.file("theirs.safetensors")), hub_weights);
  // Twenty-second pass: `info` on a Hugging Face model's weights suggested `attnres train`.
  r = run_cli("info " + t.file("theirs.safetensors"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("convert its directory with `attnres import-hf"), std::string::npos)
      << r.out;
  // Fourteenth pass: a generation_config.json written by hand beside an earlier export (which
  // export-hf never writes) was deleted by `export-hf --overwrite`.
  ASSERT_EQ(run_cli("export-hf " + out + " --out " + t.file("exp14")).code, 0);
  std::ofstream(t.file("exp14/generation_config.json")) << "{\"temperature\": 0.7}\n";
  r = run_cli("export-hf " + out + " --out " + t.file("exp14") + " --overwrite");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("holds 'generation_config.json'"), std::string::npos) << r.out;
  EXPECT_EQ(attnres::testing::slurp(t.file("exp14/generation_config.json")),
            "{\"temperature\": 0.7}\n");
  // Eighth pass: an --out inside a training run (over its model.safetensors or one of its
  // checkpoints) left the run's files disagreeing with each other.
  ASSERT_EQ(run_cli("train --data " + hub + "/config.json --n-layer 1 --d-model 16 --n-head 2 " +
                    "--seq-len 8 --batch-size 2 --steps 2 --eval-every 0 --eval-batches 1 " +
                    "--sample-tokens 0 --out " + t.file("trun"))
                .code,
            0);
  const std::string run_model = attnres::testing::slurp(t.file("trun/model.safetensors"));
  for (const std::string& o :
       {t.file("trun/model.safetensors"),
        t.file("trun/checkpoints/step_00000002/model.safetensors"), t.file("trun/latest")}) {
    r = run_cli("import-hf " + hub + " --out " + o + " --overwrite");
    EXPECT_EQ(r.code, 1) << o;
    EXPECT_NE(r.out.find("inside a training run"), std::string::npos) << r.out;
  }
  EXPECT_EQ(attnres::testing::slurp(t.file("trun/model.safetensors")), run_model);
  // --block-layers N (the production convention, layers per block) is S = 2N in train too.
  r = run_cli("train --data " + fixture("llama_gqa") + "/config.json --residual block " +
              "--block-layers 3 --n-layer 3 --d-model 16 --n-head 2 --seq-len 8 --batch-size 2 " +
              "--steps 1 --eval-every 0 --eval-batches 1 --sample-tokens 0 --out " + t.file("bl"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_json(t.file("bl/train_config.json")).at("model").at("block_size"), 6);
  r = run_cli("import-hf " + fixture("llama_gqa") + " --out x --block-layers 2");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("--block-layers is an option of --residual block"), std::string::npos);
  // Eleventh hostile pass: --block-size outside --residual block was dropped without a word (an
  // AttnRes export kept its own blocks; full and prenorm have none).
  for (const char* rest : {"", " --residual full", " --residual prenorm"}) {
    r = run_cli("import-hf " + fixture("llama_gqa") + " --out x --block-size 5" + rest);
    EXPECT_EQ(r.code, 1) << rest;
    EXPECT_NE(r.out.find("--block-size is an option of --residual block"), std::string::npos)
        << r.out;
  }
}

namespace {

// A small English corpus (the fixtures' tokenizers were trained on these words).
std::string write_corpus(const TempDir& t) {
  const std::vector<std::string> lines = {
      "To be, or not to be, that is the question:",     "whether 'tis nobler in the mind to suffer",
      "the slings and arrows of outrageous fortune,",   "or to take arms against a sea of troubles",
      "and by opposing end them. To die, to sleep;",    "no more; and by a sleep to say we end",
      "the heart-ache and the thousand natural shocks", "that flesh is heir to."};
  std::string text;
  attnres::Rng rng(7);
  for (int i = 0; i < 3000; i++) text += lines[rng.next_u64() % lines.size()] + "\n";
  std::ofstream(t.file("corpus.txt")) << text;
  return t.file("corpus.txt");
}

std::string slurp_corpus(const std::string& p) { return attnres::testing::slurp(p); }

double eval_loss(const std::string& model, const std::string& corpus) {
  auto r = attnres::testing::run_cli("eval " + model + " --data " + corpus + " --seq-len 32");
  EXPECT_EQ(r.code, 0) << r.out;
  const size_t at = r.out.find("| loss ");
  return at == std::string::npos ? 1e9 : std::stod(r.out.substr(at + 7));
}

}  // namespace

// `train --init-from` an imported model: it takes the checkpoint's architecture and tokenizer
// (no model options given), lowers the loss, and a resume reads the run's own tokenizer copy.
TEST(ImportHf, InitFromContinuesTrainingAnImportedModel) {
  using attnres::testing::run_cli;
  TempDir t;
  const std::string corpus = write_corpus(t);
  const std::string hf = copy_fixture(t, "llama_gqa");
  auto r = run_cli("import-hf " + hf + " --out " + t.file("imp/model.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  const double before = eval_loss(t.file("imp/model.safetensors"), corpus);
  r = run_cli("train --init-from " + t.file("imp/model.safetensors") + " --data " + corpus +
              " --steps 40 --batch-size 4 --seq-len 32 --lr 3e-3 --warmup 5 --eval-every 0 "
              "--sample-tokens 0 --out " +
              t.file("run"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer sentencepiece:tokenizer.model (vocab 320)"), std::string::npos)
      << r.out;
  Metadata meta;
  auto m = load_model(t.file("run/model.safetensors"), &meta);
  EXPECT_EQ(m->config().n_kv_head, 2);
  EXPECT_FALSE(m->config().tied);
  EXPECT_EQ(m->config().norm_eps, 1e-5);
  EXPECT_EQ(m->config().rope_theta, 500000.0);
  EXPECT_EQ(attnres::testing::slurp(t.file("run/tokenizer.model")),
            attnres::testing::slurp(hf + "/tokenizer.model"));
  const double after = eval_loss(t.file("run/model.safetensors"), corpus);
  std::printf("eval loss: imported %.4f, after 40 steps %.4f\n", before, after);
  EXPECT_LT(after, before - 0.5);
  // The imported model's directory is gone: a resume reads the run's copy of its tokenizer.
  fs::remove_all(t.file("imp"));
  r = run_cli("train --resume --out " + t.file("run"));
  EXPECT_EQ(r.code, 0) << r.out;
  // Fifth hostile pass: another tokenizer of the same vocabulary beside the checkpoint is refused
  // (it trained the weights through other pieces, and the new run recorded it as its own).
  const std::string own = attnres::testing::slurp(t.file("run/tokenizer.model"));
  std::string other = slurp_corpus(corpus);
  std::reverse(other.begin(), other.end());
  train_sentencepiece(other, 320, t.file("run/tokenizer.model"));
  ASSERT_NE(attnres::testing::slurp(t.file("run/tokenizer.model")), own);
  r = run_cli("train --init-from " + t.file("run/model.safetensors") + " --data " + corpus +
              " --steps 2 --out " + t.file("run3"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("is not the one"), std::string::npos) << r.out;
  std::ofstream(t.file("run/tokenizer.model"), std::ios::trunc | std::ios::binary) << own;
  // --vocab-size would be ignored: the checkpoint's tokenizer brings its vocabulary.
  r = run_cli("train --init-from " + t.file("run/model.safetensors") + " --vocab-size 500 --data " +
              corpus + " --steps 2 --out " + t.file("run4"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("drop --vocab-size"), std::string::npos) << r.out;
  // --tokenizer byte contradicts the checkpoint's SentencePiece tokenizer.
  r = run_cli("train --init-from " + t.file("run/model.safetensors") + " --tokenizer byte --data " +
              corpus + " --steps 2 --out " + t.file("run2"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("drop --tokenizer byte"), std::string::npos) << r.out;
}

namespace {

// A random model (PreNorm unless `residual` says otherwise) with every weight perturbed (the norm
// gains and AttnRes queries too), and a SentencePiece tokenizer of its vocabulary at `tok`.
std::unique_ptr<Model> random_model(bool tied, const std::string& tok,
                                    const ResidualConfig& residual = {}) {
  ModelConfig c;
  c.n_layer = 2;
  c.d_model = 32;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.ffn_hidden = 64;
  c.vocab_size = 300;
  c.max_seq_len = 32;
  c.norm_eps = 1e-6;
  c.rope_theta = 20000;
  c.tied = tied;
  c.residual = residual;
  auto m = std::make_unique<Model>(c);
  m->init_weights(5);
  std::vector<float> p = m->params_to_host();
  attnres::Rng rng(9);
  for (float& x : p) x += static_cast<float>(0.05 * rng.normal());
  m->params_from_host(p.data());
  std::string text;
  for (int i = 0; i < 400; i++) {
    text += "the quick brown fox " + std::to_string(i % 37) + " jumps over the lazy dog\n";
  }
  train_sentencepiece(text, 300, tok);
  return m;
}

// random_model exported to t/hf_tied or t/hf_untied with its tokenizer; returns the directory.
std::string export_random(const TempDir& t, bool tied, std::unique_ptr<Model>* m) {
  *m = random_model(tied, t.file("tok.model"));
  const std::string out = t.file(tied ? "hf_tied" : "hf_untied");
  export_hf(**m, t.file("tok.model"), out, false);
  return out;
}

}  // namespace

// export-hf writes HF's names and config; import-hf of that reads the same model back, bit for
// bit; and the imported fixture exports to the very tensors transformers saved.
TEST(ExportHf, RoundTripsBitForBit) {
  TempDir t;
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    std::unique_ptr<Model> m;
    const std::string out = export_random(t, tied, &m);
    const nlohmann::json cfg = read_json(out + "/config.json");
    EXPECT_EQ(cfg.at("architectures")[0], "LlamaForCausalLM");
    EXPECT_EQ(cfg.at("num_key_value_heads"), 2);
    EXPECT_EQ(cfg.at("tie_word_embeddings"), tied);
    EXPECT_EQ(cfg.at("rope_theta"), 20000.0);
    EXPECT_EQ(cfg.at("rms_norm_eps"), 1e-6);
    HfImport back = import_hf(out, mode(ResidualMode::prenorm));
    const std::vector<float> a = m->params_to_host(), b = back.model->params_to_host();
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
    EXPECT_EQ(back.model->config().to_json(), m->config().to_json());
    EXPECT_THROW(export_hf(*m, "", out, false), Error);  // exists, no --overwrite
    EXPECT_NO_THROW(export_hf(*m, "", out, true));
    EXPECT_FALSE(fs::exists(out + "/tokenizer.model"));  // (replaced: the byte tokenizer has none)
  }
  HfImport im = import_hf(fixture("llama_gqa"), mode(ResidualMode::prenorm));
  export_hf(*im.model, fixture("llama_gqa") + "/tokenizer.model", t.file("again"), false);
  SafetensorsReader orig = SafetensorsReader::open(fixture("llama_gqa") + "/model.safetensors");
  SafetensorsReader mine = SafetensorsReader::open(t.file("again/model.safetensors"));
  EXPECT_EQ(orig.names(), mine.names());
  for (const std::string& n : orig.names()) {
    const std::vector<float> x = orig.read_f32(n), y = mine.read_f32(n);
    ASSERT_EQ(x.size(), y.size()) << n;
    EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float))) << n;
  }
}

// A Full or Block AttnRes model exports with Kimi K3's mixer names ([1, d] projections, norm
// gains), our config keys and modeling_attnres.py; import-hf reads it back bit for bit as the
// same mode. The variants modeling_attnres.py does not compute are refused, nothing written.
TEST(ExportHf, AttnResModelsRoundTripWithK3Names) {
  TempDir t;
  for (int64_t S : {1, 4, 3}) {
    SCOPED_TRACE("S = " + std::to_string(S));
    ResidualConfig r;
    r.mode = S == 1 ? ResidualMode::full : ResidualMode::block;
    r.block_size = S;
    auto m = random_model(S != 3, t.file("tok.model"), r);
    const std::string out = t.file("attnres" + std::to_string(S));
    export_hf(*m, t.file("tok.model"), out, false);
    const nlohmann::json cfg = read_json(out + "/config.json");
    EXPECT_EQ(cfg.at("architectures")[0], "AttnResForCausalLM");
    EXPECT_EQ(cfg.at("model_type"), "attnres");
    EXPECT_EQ(cfg.at("attnres_block_size"), S);
    EXPECT_EQ(cfg.at("auto_map").at("AutoModelForCausalLM"), "modeling_attnres.AttnResForCausalLM");
    EXPECT_EQ(cfg.contains("attn_res_block_size"), S == 4);  // (K3's, in layers: S even only)
    if (S == 4) {
      EXPECT_EQ(cfg.at("attn_res_block_size"), 2);
    }
    EXPECT_NE(
        attnres::testing::slurp(out + "/modeling_attnres.py").find("class AttnResForCausalLM"),
        std::string::npos);
    SafetensorsReader st = SafetensorsReader::open(out + "/model.safetensors");
    for (const char* n :
         {"model.layers.1.self_attention_res_proj.weight", "model.layers.1.mlp_res_proj.weight",
          "model.output_attn_res_proj.weight"}) {
      EXPECT_EQ(st.info(n).shape, (std::vector<int64_t>{1, 32})) << n;
    }
    EXPECT_EQ(st.info("model.layers.0.mlp_res_norm.weight").shape, (std::vector<int64_t>{32}));
    const float* q = m->params() + m->layout().find("layers.1.mlp_res.query")->offset;
    EXPECT_EQ(st.read_f32("model.layers.1.mlp_res_proj.weight"), std::vector<float>(q, q + 32));
    HfImport back = import_hf(out, mode(ResidualMode::prenorm));  // (the directory's own mode)
    EXPECT_EQ(back.model->config().to_json(), m->config().to_json());
    const std::vector<float> a = m->params_to_host(), b = back.model->params_to_host();
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
    EXPECT_LT(back.probe_tokens, 1);  // (nothing upcycled)
    EXPECT_THROW(import_hf(out, mode(S == 1 ? ResidualMode::block : ResidualMode::full)), Error);
    // (--residual prenorm named by the user wrote the AttnRes model without a word; 23rd pass)
    HfImportOptions named = mode(ResidualMode::prenorm);
    named.residual_given = true;
    EXPECT_THROW(import_hf(out, named), Error);
    if (S == 4) {  // A Llama config with K3's attn_res_block_size and tensors maps 1:1 too.
      nlohmann::json k3 = read_json(out + "/config.json");
      for (const char* k :
           {"attnres_residual", "attnres_block_size", "attnres_key_norm_eps", "auto_map"}) {
        k3.erase(k);
      }
      k3["model_type"] = "llama";
      k3["architectures"] = {"LlamaForCausalLM"};
      std::ofstream(out + "/config.json", std::ios::trunc) << k3.dump();
      HfImport k = import_hf(out, mode(ResidualMode::prenorm));
      EXPECT_EQ(k.model->config().residual.mode, ResidualMode::block);
      EXPECT_EQ(k.model->config().residual.block_size, 4);
      const std::vector<float> c = k.model->params_to_host();
      EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(float)));
    }
  }
  for (int v = 0; v < 4; v++) {
    ResidualConfig r;
    r.mode = ResidualMode::full;
    if (v == 0) r.gate = DepthGate::sigmoid;
    if (v == 1) r.query = DepthQuery::dynamic;
    if (v == 2) r.heads = 2;
    if (v == 3) r.temperature = 2;
    auto m = random_model(true, t.file("tok.model"), r);
    try {
      export_hf(*m, "", t.file("variant"), false);
      ADD_FAILURE() << "variant " << v << " was exported";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("does not compute"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(t.file("variant")));
  }
}

// A byte-tokenizer model exports without tokenizer files; config.json says so, and import-hf
// reads it back as a byte-tokenizer checkpoint that evaluates to the same loss (it refused: no
// tokenizer.model).
TEST(ExportHf, ByteTokenizerModelsRoundTripThroughTheCli) {
  using attnres::testing::run_cli;
  TempDir t;
  std::ofstream(t.file("c.txt")) << std::string(4000, 'a') + "the quick brown fox\n";
  const std::string tiny =
      " --n-layer 1 --d-model 16 --n-head 2 --seq-len 16 --batch-size 2 "
      "--eval-every 0 --sample-tokens 0 --tokenizer byte --residual full";
  auto r = run_cli("train --data " + t.file("c.txt") + tiny + " --steps 3 --out " + t.file("run"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("export-hf " + t.file("run/model.safetensors") + " --out " + t.file("hf"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_json(t.file("hf/config.json")).at("attnres_tokenizer"), "byte");
  EXPECT_FALSE(fs::exists(t.file("hf/tokenizer.model")));
  r = run_cli("import-hf " + t.file("hf") + " --out " + t.file("back/model.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer byte"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(t.file("back/tokenizer.model")));
  const auto a = run_cli("eval " + t.file("run/model.safetensors") + " --data " + t.file("c.txt"));
  const auto b = run_cli("eval " + t.file("back/model.safetensors") + " --data " + t.file("c.txt"));
  ASSERT_EQ(a.code, 0) << a.out;
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(a.out.substr(a.out.find("loss")), b.out.substr(b.out.find("loss")));
  // A config that claims bytes with another vocabulary is refused.
  nlohmann::json cfg = read_json(t.file("hf/config.json"));
  cfg["vocab_size"] = 300;
  std::ofstream(t.file("hf/config.json"), std::ios::trunc) << cfg.dump();
  EXPECT_THROW(inspect_hf(t.file("hf")), Error);
}

// Seventh hostile pass: export-hf's temporary and old directories are new ones of its own, never
// a path of the user's that happens to carry the name (it used to remove_all "OUT.tmp.<pid>" and
// "OUT.old.<pid>" before using them).
TEST(ExportHf, NeverRemovesAPathNextToOut) {
  TempDir t;
  std::unique_ptr<Model> m;
  const std::string out = export_random(t, true, &m);
  const std::string pid = std::to_string(::getpid());
  for (const std::string& n : {out + ".tmp." + pid, out + ".old." + pid}) {
    fs::create_directories(n);
    std::ofstream(n + "/mine.txt") << "the user's file\n";
  }
  fs::create_directories(t.file("elsewhere"));
  std::ofstream(t.file("elsewhere/keep.txt")) << "keep\n";
  for (const std::string& n : {out + ".tmp.XXXXXX", out + ".old.XXXXXX"}) {
    fs::create_directory_symlink(t.file("elsewhere"), n);
  }
  export_hf(*m, "", out, true);
  export_hf(*m, t.file("tok.model"), out, true);
  for (const std::string& n : {out + ".tmp." + pid, out + ".old." + pid}) {
    EXPECT_EQ(attnres::testing::slurp(n + "/mine.txt"), "the user's file\n") << n;
  }
  EXPECT_EQ(attnres::testing::slurp(t.file("elsewhere/keep.txt")), "keep\n");
  EXPECT_TRUE(fs::exists(out + "/tokenizer.model"));
  int leftovers = 0;  // only the planted paths remain beside the export
  for (const auto& e : fs::directory_iterator(t.path)) {
    leftovers += e.path().filename().string().find("hf_tied.") == 0 ? 1 : 0;
  }
  EXPECT_EQ(leftovers, 4);
  // (mkdtemp makes 0700 directories; the export itself gets the umask's mode, as mkdir would)
  const mode_t old_mask = ::umask(022);
  export_hf(*m, "", out, true);
  ::umask(old_mask);
  EXPECT_EQ(fs::status(out).permissions() & fs::perms::all,
            fs::perms::all & ~(fs::perms::group_write | fs::perms::others_write));
}

namespace {

// The engine's greedy continuation of `prompt`: n tokens, each the argmax of a full forward.
std::vector<int32_t> greedy(Model& m, std::vector<int32_t> seq, int n) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> out;
  for (int i = 0; i < n; i++) {
    const int64_t T = static_cast<int64_t>(seq.size());
    m.forward(seq.data(), nullptr, 1, T);
    const float* last = m.logits() + (T - 1) * V;
    seq.push_back(static_cast<int32_t>(std::max_element(last, last + V) - last));
    out.push_back(seq.back());
  }
  return out;
}

}  // namespace

// transformers loads the exported directory and computes the engine's logits: a PreNorm export
// as LlamaForCausalLM, a Full/Block one through its modeling_attnres.py (trust_remote_code),
// whose `generate` then continues a prompt as the engine does; a Block export's logits also come
// out of Kimi K3's per-layer recurrence (tools/check_hf_export.py). Needs a Python with
// transformers: ATTNRES_HF_PYTHON (e.g. /work/venv-hf/bin/python; tools/README.md); skipped
// without it.
TEST(ExportHf, TransformersComputesTheEnginesLogits) {
  const char* py = std::getenv("ATTNRES_HF_PYTHON");
  if (py == nullptr || *py == '\0') {
    GTEST_SKIP() << "set ATTNRES_HF_PYTHON to a Python with torch and transformers to run this";
  }
  TempDir t;
  struct Case {
    const char* name;
    bool tied;
    ResidualMode mode;
    int64_t S;
  };
  for (const Case& k : {Case{"prenorm tied", true, ResidualMode::prenorm, 0},
                        Case{"prenorm untied", false, ResidualMode::prenorm, 0},
                        Case{"full tied", true, ResidualMode::full, 1},
                        Case{"block S=2 untied", false, ResidualMode::block, 2},
                        Case{"block S=4 tied", true, ResidualMode::block, 4}}) {
    SCOPED_TRACE(k.name);
    ResidualConfig r;
    r.mode = k.mode;
    if (k.S > 0) r.block_size = k.S;
    std::unique_ptr<Model> m = random_model(k.tied, t.file("tok.model"), r);
    const std::string out = t.file("hf");
    export_hf(*m, t.file("tok.model"), out, false);
    std::vector<int32_t> tokens(2 * 16);
    for (size_t i = 0; i < tokens.size(); i++) tokens[i] = static_cast<int32_t>((i * 37 + 5) % 300);
    m->forward(tokens.data(), nullptr, 2, 16);
    std::vector<float> logits(m->logits(), m->logits() + 2 * 16 * 300);
    const std::vector<int32_t> prompt(tokens.begin(), tokens.begin() + 5);
    const std::vector<int32_t> cont = greedy(*m, prompt, 8);
    SafetensorsWriter w;
    w.add_i32("tokens", {2, 16}, tokens.data());
    w.add_f32("logits", {2, 16, 300}, logits.data());
    w.add_i32("prompt", {1, 5}, prompt.data());
    w.add_i32("greedy", {1, 8}, cont.data());
    w.write(t.file("expected.safetensors"));
    const std::string script = std::string(ATTNRES_FIXTURE_DIR) + "/../../tools/check_hf_export.py";
    const std::string cmd =
        std::string(py) + " " + script + " " + out + " " + t.file("expected.safetensors") + " 2>&1";
    FILE* p = ::popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string said;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) said.append(buf, n);
    const int st = ::pclose(p);
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (code == 77) GTEST_SKIP() << said;
    EXPECT_EQ(code, 0) << said;
    const size_t at = said.rfind("transformers vs attnres");
    std::printf("%s: %s", k.name, at == std::string::npos ? said.c_str() : said.substr(at).c_str());
    fs::remove_all(out);
  }
}
