// Whole-model checks: gradient vs finite differences, KV-cache decoding vs full forward,
// checkpoint round trip and its error paths, sampling.
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "attnres/checkpoint.hpp"
#include "attnres/error.hpp"
#include "attnres/generate.hpp"
#include "attnres/model.hpp"
#include "test_util.hpp"

using namespace attnres;
using attnres::testing::fd_check;
using attnres::testing::randn;
using attnres::testing::rel_diff;

namespace {

ModelConfig tiny(bool tied, int64_t n_kv_head) {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = n_kv_head;
  c.d_model = 16;
  c.ffn_hidden = 24;
  c.vocab_size = 13;
  c.max_seq_len = 8;
  c.tied = tied;
  return c;
}

// Random O(1)-signal weights (the default 0.02 init makes gradients too small for fp32 FD).
void randomize(Model& m, uint64_t seed) {
  for (const ParamEntry& e : m.layout().entries()) {
    auto v =
        randn(e.numel, seed++, e.shape.size() == 2 ? 1.0 / std::sqrt(double(e.shape[1])) : 0.3);
    float* p = m.param(e.name);
    for (int64_t i = 0; i < e.numel; i++) p[i] = e.shape.size() == 1 ? 1.0f + v[i] : v[i];
  }
}

std::vector<int32_t> ids(int64_t n, int64_t V, uint64_t seed) {
  Rng r(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(r.next_u64() % V);
  return v;
}

// Files in one temporary directory per test process, removed at exit.
std::string temp_path(const std::string& name) {
  static attnres::testing::TempDir dir;
  return dir.file(name);
}

class ModelGrad : public ::testing::TestWithParam<std::pair<bool, int64_t>> {};

TEST_P(ModelGrad, MatchesFiniteDifferencesForEveryTensor) {
  auto [tied, kv] = GetParam();
  Model m(tiny(tied, kv));
  randomize(m, 11);
  const int64_t B = 2, T = 6;
  auto tok = ids(B * T, 13, 1), tgt = ids(B * T, 13, 2);
  m.forward(tok.data(), tgt.data(), B, T);
  m.zero_grad();
  m.backward();
  std::vector<float> grads(m.grads(), m.grads() + m.layout().total());
  auto loss = [&] { return m.forward(tok.data(), tgt.data(), B, T); };
  for (const ParamEntry& e : m.layout().entries()) {
    EXPECT_LT(fd_check(loss, m.param(e.name), e.numel, grads.data() + e.offset, 1e-2, 24), 3e-2)
        << e.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, ModelGrad,
                         ::testing::Values(std::make_pair(true, int64_t{4}),
                                           std::make_pair(false, int64_t{2})));

// Data-parallel overlap (train/grad_buckets.hpp) sums a tensor's gradient as soon as backward()
// reports it: every tensor is reported once, its gradient then is its final one, and the layers'
// come before the embedding's (else nothing could overlap).
TEST(Model, BackwardReportsEachTensorOnceWhenItsGradientIsFinal) {
  for (const ResidualMode mode : {ResidualMode::prenorm, ResidualMode::full, ResidualMode::block,
                                  ResidualMode::denseformer}) {
    for (const bool tied : {true, false}) {
      ModelConfig c = tiny(tied, 2);
      c.n_layer = 3;
      c.residual.mode = mode;
      c.residual.block_size = 2;
      Model m(c);
      randomize(m, 5);
      auto tok = ids(2 * 6, 13, 1), tgt = ids(2 * 6, 13, 2);
      m.forward(tok.data(), tgt.data(), 2, 6);
      m.zero_grad();
      m.backward();  // a first backward, so the checked one accumulates onto non-zero gradients
      m.forward(tok.data(), tgt.data(), 2, 6);
      std::map<int64_t, std::vector<float>> at_report;  // offset -> gradient when reported
      std::vector<int64_t> order;
      m.backward([&](int64_t offset, int64_t count) {
        EXPECT_EQ(at_report.count(offset), 0u) << "reported twice: offset " << offset;
        at_report[offset].assign(m.grads() + offset, m.grads() + offset + count);
        order.push_back(offset);
      });
      const std::string what = std::string(to_string(mode)) + (tied ? " tied" : " untied");
      ASSERT_EQ(at_report.size(), m.layout().entries().size()) << what;
      for (const ParamEntry& e : m.layout().entries()) {
        ASSERT_EQ(at_report.count(e.offset), 1u) << what << ": " << e.name;
        const std::vector<float>& g = at_report[e.offset];
        ASSERT_EQ(static_cast<int64_t>(g.size()), e.numel) << what << ": " << e.name;
        EXPECT_EQ(std::memcmp(g.data(), m.grads() + e.offset, sizeof(float) * e.numel), 0)
            << what << ": " << e.name << " changed after it was reported final";
      }
      const int64_t emb = m.layout().find("tok_embeddings.weight")->offset;
      const int64_t last_layer = m.layout().find("layers.2.feed_forward.w2.weight")->offset;
      const int64_t first_layer = m.layout().find("layers.0.attention_norm.weight")->offset;
      auto pos = [&](int64_t off) { return std::find(order.begin(), order.end(), off); };
      EXPECT_LT(pos(last_layer), pos(first_layer)) << what;
      EXPECT_LT(pos(first_layer), pos(emb)) << what;
    }
  }
}

TEST(Model, KvCacheDecodingMatchesFullForward) {
  for (bool tied : {true, false}) {
    Model m(tiny(tied, 2));
    randomize(m, 5);
    const int64_t T = 8, V = 13;
    auto tok = ids(T, V, 3);
    m.forward(tok.data(), nullptr, 1, T);
    std::vector<float> full(m.logits(), m.logits() + T * V);
    Decoder dec(m, T);
    std::vector<float> inc(T * V);
    const float* l = dec.feed(tok.data(), 3);  // prefill 3, then one at a time
    std::copy_n(l, 3 * V, inc.data());
    for (int64_t t = 3; t < T; t++) std::copy_n(dec.feed(&tok[t], 1), V, inc.data() + t * V);
    EXPECT_LT(rel_diff(inc.data(), full.data(), T * V), 1e-5);
    EXPECT_THROW(dec.feed(tok.data(), 1), Error);  // context full
  }
}

// Thirteenth hostile pass: a block larger than the model allocated one buffer per sublayer of
// the block (2^20 of them: 16 GB for a 35k-weight model). It is one block of every sublayer: the
// same function and the same memory as S = the sublayer count.
TEST(Model, ABlockLargerThanTheModelIsOneBlock) {
  ModelConfig c = tiny(true, 2);
  c.residual.mode = ResidualMode::block;
  c.residual.block_size = c.n_sublayers();
  Model a(c);
  randomize(a, 9);
  c.residual.block_size = int64_t{1} << 20;
  Model b(c);
  randomize(b, 9);
  const int64_t T = 8;
  auto tok = ids(2 * T, 13, 3), tgt = ids(2 * T, 13, 4);
  EXPECT_EQ(a.forward(tok.data(), tgt.data(), 2, T), b.forward(tok.data(), tgt.data(), 2, T));
  EXPECT_EQ(a.activation_bytes(), b.activation_bytes());
}

TEST(Model, InitIsDeterministicAndScaled) {
  Model a(tiny(false, 2)), b(tiny(false, 2));
  a.init_weights(42);
  b.init_weights(42);
  EXPECT_EQ(0, std::memcmp(a.params(), b.params(), sizeof(float) * a.layout().total()));
  b.init_weights(43);
  EXPECT_NE(0, std::memcmp(a.params(), b.params(), sizeof(float) * a.layout().total()));
  EXPECT_EQ(a.param("norm.weight")[0], 1.0f);
  // Loss at init is close to log(V): logits are near zero.
  auto tok = ids(64, 13, 1), tgt = ids(64, 13, 2);
  EXPECT_NEAR(a.forward(tok.data(), tgt.data(), 8, 8), std::log(13.0), 0.1);
}

TEST(Model, ParamCountMatchesFormula) {
  ModelConfig c = tiny(false, 2);
  Model m(c);
  const int64_t d = 16, hd = 4, F = 24, V = 13;
  const int64_t per_layer = 2 * d + (4 + 2 * 2) * hd * d + d * 4 * hd + 3 * F * d;
  EXPECT_EQ(m.num_params(), 2 * V * d + d + 2 * per_layer);
}

TEST(Model, SaveLoadGivesIdenticalLogits) {
  Model m(tiny(false, 2));
  randomize(m, 9);
  const std::string path = temp_path("rt.safetensors");
  save_model(path, m, {{"tokenizer", "byte"}});
  Metadata meta;
  auto m2 = load_model(path, &meta);
  EXPECT_EQ(meta.at("tokenizer"), "byte");
  EXPECT_EQ(m2->config().to_json(), m.config().to_json());
  auto tok = ids(8, 13, 4);
  m.forward(tok.data(), nullptr, 1, 8);
  m2->forward(tok.data(), nullptr, 1, 8);
  EXPECT_EQ(0, std::memcmp(m.logits(), m2->logits(), sizeof(float) * 8 * 13));
}

TEST(Model, InitialWeightsFromAPreNormCheckpointStartAnAttnResRun) {
  // SPEC 2: with zero queries and unit key gains an AttnRes model computes its PreNorm model's
  // function, so a PreNorm checkpoint starts a Full AttnRes run with the same logits.
  ModelConfig pc = tiny(true, 2);
  pc.norm_eps = 1e-12;  // (the identity is exact but for RMSNorm's epsilon)
  Model pre(pc);
  randomize(pre, 21);
  const std::string path = temp_path("pre.safetensors");
  save_model(path, pre, {});
  ModelConfig fc = pc;
  fc.residual.mode = ResidualMode::full;
  Model full(fc);
  full.init_weights(5);
  const int64_t kept = load_initial_weights(full, path);
  EXPECT_EQ(kept, static_cast<int64_t>(full.layout().entries().size() - full.core_entries()));
  EXPECT_EQ(kept, 2 * (2 * pc.n_layer + 1));  // a query and a key gain per mixer
  auto tok = ids(8, 13, 7);
  pre.forward(tok.data(), nullptr, 1, 8);
  full.forward(tok.data(), nullptr, 1, 8);
  EXPECT_LT(rel_diff(pre.logits(), full.logits(), 8 * 13), 1e-5);
  // Settings that change the function but no shape are reported, the checkpoint's value first.
  {
    ModelConfig tc = fc;
    tc.residual.temperature = 0.5;
    tc.norm_eps = 1e-6;
    Model hot(tc);
    randomize(hot, 3);
    const std::string hpath = temp_path("hot.safetensors");
    save_model(hpath, hot, {});
    std::vector<std::string> changed;
    load_initial_weights(full, hpath, &changed);
    ASSERT_EQ(changed.size(), 3u);
    EXPECT_EQ(changed[0], "norm_eps 1e-06 -> 1e-12");
    EXPECT_EQ(changed[1], "attnres key eps 1e-06 -> 1e-12");  // it follows norm_eps
    EXPECT_EQ(changed[2], "attnres temperature 0.5 -> 1");
  }
  // The other way round (a Full checkpoint into a PreNorm model) has tensors it cannot place.
  const std::string fpath = temp_path("full.safetensors");
  save_model(fpath, full, {});
  Model pre2(pc);
  try {
    load_initial_weights(pre2, fpath);
    ADD_FAILURE() << "a full checkpoint loaded into a prenorm model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not"), std::string::npos) << e.what();
  }
  // Another size: a core tensor is missing or has another shape.
  ModelConfig wide = pc;
  wide.d_model = 32;
  wide.ffn_hidden = 48;
  Model w(wide);
  EXPECT_THROW(load_initial_weights(w, path), Error);
  // A non-finite weight is refused, naming the tensor.
  pre.param("norm.weight")[3] = std::nanf("");
  save_model(path, pre, {});
  try {
    load_initial_weights(full, path);
    ADD_FAILURE() << "a NaN weight was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'norm.weight' holds 1 of 16 non-finite"),
              std::string::npos)
        << e.what();
  }
}

TEST(Model, BadCheckpointsGiveClearErrors) {
  Model m(tiny(true, 4));
  m.init_weights(1);
  const std::string path = temp_path("good.safetensors");
  save_model(path, m, {});
  const auto size = std::filesystem::file_size(path);
  auto expect_error = [](const std::string& p, const std::string& needle) {
    try {
      load_model(p);
      ADD_FAILURE() << "no error for " << p;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // truncated
  const std::string trunc = temp_path("trunc.safetensors");
  std::filesystem::copy_file(path, trunc, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(trunc, size - 100);
  expect_error(trunc, "trunc.safetensors");
  // corrupted header byte
  const std::string bad = temp_path("bad.safetensors");
  std::filesystem::copy_file(path, bad, std::filesystem::copy_options::overwrite_existing);
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(9);
    f.put('\x01');
  }
  expect_error(bad, "bad.safetensors");
  expect_error(temp_path("missing.safetensors"), "missing.safetensors");
  // Loading into a differently configured model names the missing tensor.
  Model untied(tiny(false, 4));
  auto r = SafetensorsReader::open(path);
  try {
    load_weights(untied, r);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("output.weight"), std::string::npos) << e.what();
  }
}

TEST(Model, BadConfigValuesAreRejected) {
  ModelConfig c = tiny(true, 4);
  c.n_head = 3;  // 16 % 3 != 0
  EXPECT_THROW(Model{c}, Error);
  c = tiny(true, 3);  // 4 % 3 != 0
  EXPECT_THROW(Model{c}, Error);
  // Names are parsed once, at the edge (CLI, checkpoints): an unknown one is an error naming it
  // and the choices.
  for (const char* json :
       {R"({"residual": "nonsense"})", R"({"attnres_gate": "nonsense"})",
        R"({"attnres_key_norm": "nonsense"})", R"({"attnres_query": "nonsense"})"}) {
    try {
      ModelConfig::from_json(json);
      ADD_FAILURE() << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'nonsense' is unknown; use"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(parse_residual_mode("static"), ResidualMode::static_mix);
  EXPECT_STREQ(to_string(DepthQuery::static_query), "static");
  for (const char* m : {"prenorm", "full", "block", "static", "denseformer"}) {
    EXPECT_STREQ(to_string(parse_residual_mode(m)), m);
  }
  EXPECT_THROW(ModelConfig::from_json("{\"n_layer\": \"two\"}"), Error);
  EXPECT_THROW(ModelConfig::from_json("not json"), Error);
  c = tiny(true, 4);
  c.residual.mode = ResidualMode::full;
  c.residual.key_eps = -1e-3;
  EXPECT_THROW(Model{c}, Error);
  c.residual.key_eps = 0;
  c.residual.temperature = 0;
  EXPECT_THROW(Model{c}, Error);
  c.residual.temperature = 1e-300;  // rounds to 0 as a float
  EXPECT_THROW(Model{c}, Error);
  c.residual.temperature = 1;
  c.residual.key_eps = 1e-300;
  EXPECT_THROW(Model{c}, Error);
  c.residual.key_eps = 0;
  c.norm_eps = 1e-300;
  EXPECT_THROW(Model{c}, Error);
  c = tiny(true, 4);  // prenorm does not use them, but a bad value is never kept silently
  c.residual.temperature = -1;
  EXPECT_THROW(Model{c}, Error);
}

TEST(Model, KeyNormEpsilonIsStoredOnlyWhenSet) {
  ModelConfig c = tiny(true, 4);
  c.residual.mode = ResidualMode::full;
  EXPECT_EQ(c.to_json().find("attnres_key_eps"), std::string::npos);  // old files stay as they are
  EXPECT_EQ(ModelConfig::from_json(c.to_json()).key_norm_eps(), c.norm_eps);
  c.residual.key_eps = 1e-8;
  const ModelConfig back = ModelConfig::from_json(c.to_json());
  EXPECT_EQ(back.key_norm_eps(), 1e-8);
  EXPECT_EQ(back.norm_eps, c.norm_eps);
  EXPECT_EQ(back.residual.temperature, 1.0);
  c.residual.temperature = 0.125;
  EXPECT_EQ(ModelConfig::from_json(c.to_json()).residual.temperature, 0.125);
}

TEST(Sampling, GreedyTopKTopP) {
  std::vector<float> logits = {0.1f, 2.0f, 1.9f, -1.0f, 2.0f};
  SamplingConfig g;
  g.temperature = 0;
  uint64_t st = 1;
  EXPECT_EQ(sample_token(logits.data(), 5, g, st), 1);  // first of the tied maxima
  SamplingConfig k1;
  k1.top_k = 1;
  for (int i = 0; i < 20; i++) EXPECT_EQ(sample_token(logits.data(), 5, k1, st), 1);
  // top_p tiny keeps only the most likely token.
  SamplingConfig p;
  p.top_p = 1e-6;
  for (int i = 0; i < 20; i++) EXPECT_EQ(sample_token(logits.data(), 5, p, st), 1);
  // Full sampling follows softmax frequencies.
  SamplingConfig s;
  std::vector<int> count(5, 0);
  const int n = 20000;
  for (int i = 0; i < n; i++) count[sample_token(logits.data(), 5, s, st)]++;
  double z = 0;
  for (float l : logits) z += std::exp(l);
  for (int v = 0; v < 5; v++) EXPECT_NEAR(count[v] / double(n), std::exp(logits[v]) / z, 0.015);
}

TEST(Sampling, GenerateIsDeterministicAndGreedyFollowsArgmax) {
  Model m(tiny(true, 4));
  randomize(m, 3);
  SamplingConfig g;
  g.temperature = 0;
  std::vector<int32_t> prompt = {1, 2, 3};
  auto out = generate(m, prompt, 4, g, nullptr);
  ASSERT_EQ(out.size(), 4u);
  // Re-derive greedily with full forwards.
  std::vector<int32_t> seq = prompt;
  for (int32_t tok : out) {
    m.forward(seq.data(), nullptr, 1, static_cast<int64_t>(seq.size()));
    const float* last = m.logits() + (seq.size() - 1) * 13;
    EXPECT_EQ(tok, std::max_element(last, last + 13) - last);
    seq.push_back(tok);
  }
  SamplingConfig s;
  s.seed = 7;
  EXPECT_EQ(generate(m, prompt, 5, s, nullptr), generate(m, prompt, 5, s, nullptr));
  // Context limit: generation stops when the context (8) is full.
  EXPECT_LE(generate(m, prompt, 100, s, nullptr).size(), 5u + 1);
}

}  // namespace
