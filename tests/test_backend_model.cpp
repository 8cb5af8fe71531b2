// Whole models on every backend other than the CPU against the same model on the CPU: the loss,
// logits and every parameter's gradient of one forward/backward, then a few AdamW steps (losses
// and weights track), KV-cache decoding, checkpoints written from and read into a device model,
// and `train`/`eval`/`generate`/`compare --device` runs that track the CPU's. "cuda-host" (the CUDA
// kernels emulated on the host) runs everywhere; "cuda" needs a GPU and is skipped, with the
// reason, without one.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "attnres/backend.hpp"
#include "attnres/checkpoint.hpp"
#include "attnres/diagnostics.hpp"
#include "attnres/error.hpp"
#include "attnres/generate.hpp"
#include "attnres/model.hpp"
#include "attnres/optim.hpp"
#include "attnres/train.hpp"
#include "backend/backend.hpp"
#include "core/blas.hpp"
#include "core/profile.hpp"
#include "core/rng.hpp"
#include "test_util.hpp"
#include "train/device_step.hpp"

namespace fs = std::filesystem;
using namespace attnres;
using attnres::testing::randn;
using attnres::testing::rel_diff;

namespace {

struct Case {
  const char* name;
  const char* mode;
  int64_t block_size = 2;
  const char* gate = "softmax";
  const char* key_norm = "rms";
  int64_t heads = 1;
  int64_t window = 0;
  bool tied = true;
  int64_t kv_heads = 2;
  const char* query = "static";
  double temperature = 1;
  double norm_eps = 0;  // 0 = the default
};

const Case kCases[] = {
    {"prenorm", "prenorm"},
    {"block_s2", "block", 2},
    {"block_s4_untied_mha", "block", 4, "softmax", "rms", 1, 0, false, 4},
    {"full", "full"},
    {"full_sigmoid_nonorm", "full", 1, "sigmoid", "none"},
    {"full_heads2_window3", "full", 1, "softmax", "rms", 2, 3},
    // eps 1e-5: with the default 1e-10 (no damping of the small averaged inputs) the random
    // query projections make this case's 3 AdamW steps chaotic enough that fp32 rounding grows
    // past the tolerances (grad norm 2e-4 apart at step 2; step 0 still agrees to 1e-5).
    {"full_dynamic", "full", 1, "softmax", "rms", 1, 0, true, 2, "dynamic", 1, 1e-5},
    {"block_dynamic_sigmoid_nonorm", "block", 2, "sigmoid", "none", 1, 0, true, 2, "dynamic"},
    {"full_temperature", "full", 1, "softmax", "rms", 1, 0, true, 2, "static", 0.4},
    {"block_dynamic_temperature", "block", 2, "softmax", "rms", 1, 0, true, 2, "dynamic", 0.6},
    {"static", "static"},
    {"denseformer", "denseformer"},
};

ModelConfig config_of(const Case& c) {
  ModelConfig m;
  m.n_layer = 3;
  m.n_head = 4;
  m.n_kv_head = c.kv_heads;
  m.d_model = 32;
  m.ffn_hidden = 48;
  m.vocab_size = 41;
  m.max_seq_len = 12;
  m.tied = c.tied;
  m.residual.mode = parse_residual_mode(c.mode);
  m.residual.block_size = c.block_size;
  m.residual.gate = parse_depth_gate(c.gate);
  m.residual.key_norm = parse_key_norm(c.key_norm);
  m.residual.heads = c.heads;
  m.residual.window = c.window;
  m.residual.query = parse_depth_query(c.query);
  m.residual.temperature = c.temperature;
  if (c.norm_eps > 0) m.norm_eps = c.norm_eps;
  return m;
}

std::shared_ptr<Backend> backend_or_skip(const std::string& name, std::string* why) {
  try {
    return make_backend(name);
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
}

// Initial weights with the depth-attention parameters moved off their zero start, so the depth
// weights differ across sources and tokens (at init they are uniform).
std::vector<float> test_weights(Model& m) {
  m.init_weights(7);
  std::vector<float> w = m.params_to_host();
  uint64_t seed = 100;
  for (const ParamEntry& e : m.layout().entries()) {
    if (e.name.find("_res.") == std::string::npos) continue;
    const auto noise = randn(e.numel, seed++, 0.5);
    for (int64_t i = 0; i < e.numel; i++) w[e.offset + i] += noise[i];
  }
  return w;
}

// N random token ids and targets below V.
struct TokenBatch {
  std::vector<int32_t> tok, tgt;
  TokenBatch(int64_t N, int64_t V, uint64_t seed) : tok(N), tgt(N) {
    Rng r(seed);
    for (int64_t i = 0; i < N; i++) {
      tok[i] = static_cast<int32_t>(r.next_u64() % V);
      tgt[i] = static_cast<int32_t>(r.next_u64() % V);
    }
  }
};

// The logits (T, V) of a decoder fed tok[0..3) as a prompt, then the rest one token at a time.
std::vector<float> decoded_logits(const Model& m, const std::vector<int32_t>& tok, int64_t T) {
  const int64_t V = m.config().vocab_size;
  Decoder dec(m, T);
  std::vector<float> all;
  const float* l = dec.feed(tok.data(), 3);
  all.insert(all.end(), l, l + 3 * V);
  for (int64_t t = 3; t < T; t++) {
    l = dec.feed(&tok[t], 1);
    all.insert(all.end(), l, l + V);
  }
  return all;
}

// The loss `attnres eval` prints for these arguments (-1 with a failure when it prints none).
double cli_eval_loss(const std::string& args) {
  const auto r = attnres::testing::run_cli(args);
  EXPECT_EQ(r.code, 0) << r.out;
  const size_t at = r.out.find("| loss ");
  EXPECT_NE(at, std::string::npos) << r.out;
  return at == std::string::npos ? -1.0 : std::stod(r.out.substr(at + 7));
}

std::vector<float> logits_of(const Model& m, int64_t n) {
  std::vector<float> h(static_cast<size_t>(n));
  m.backend().download(h.data(), m.logits(), sizeof(float) * h.size());
  return h;
}

}  // namespace

// The profiling backend (make_profiled_backend) over the CPU: bit for bit the same loss,
// logits and gradients as the CPU backend; with the profiler on, every op family the step uses
// gets time in its phase (the router's work as "residual"); off, nothing is counted; the ops
// inside a Region count towards it.
TEST(ProfiledBackend, TimesEveryOpFamilyAndChangesNoResult) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const ModelConfig cfg = config_of(c);
    Model plain(cfg), timed(cfg, make_profiled_backend(make_backend("cpu")));
    const std::vector<float> w = test_weights(plain);
    plain.params_from_host(w.data());
    timed.params_from_host(w.data());
    const int64_t B = 2, T = 11, N = B * T;
    const TokenBatch batch(N, cfg.vocab_size, 3);
    auto step = [&](Model& m) {
      m.zero_grad();
      const double loss = m.forward(batch.tok.data(), batch.tgt.data(), B, T);
      m.backward();
      return loss;
    };
    const double lp = step(plain);
    prof::reset();
    prof::enable(true);
    const double lt = step(timed);
    prof::enable(false);
    EXPECT_EQ(lt, lp);
    EXPECT_EQ(logits_of(timed, N * cfg.vocab_size), logits_of(plain, N * cfg.vocab_size));
    EXPECT_EQ(timed.grads_to_host(), plain.grads_to_host());
    for (int op : {prof::kEmbedding, prof::kRmsNorm, prof::kMatmul, prof::kRope, prof::kAttention,
                   prof::kSwiglu, prof::kResidual}) {
      EXPECT_GT(prof::seconds(op, prof::kForward), 0.0) << prof::op_name(op);
      EXPECT_GT(prof::seconds(op, prof::kBackward), 0.0) << prof::op_name(op);
    }
    EXPECT_GT(prof::seconds(prof::kCrossEntropy, prof::kForward), 0.0);
    EXPECT_GT(prof::seconds(prof::kElementwise, prof::kBackward), 0.0);  // zeroed gradients
    EXPECT_EQ(prof::seconds(prof::kOptimizer, prof::kForward), 0.0);
    prof::reset();
    step(timed);  // the profiler off
    for (int op = 0; op < prof::kOpCount; op++) {
      EXPECT_EQ(prof::seconds(op, prof::kForward) + prof::seconds(op, prof::kBackward), 0.0)
          << prof::op_name(op);
    }
  }
  auto be = make_profiled_backend(make_backend("cpu"));
  DevBuf<float> x;
  x.on(be.get()).resize(1 << 16);
  prof::reset();
  prof::enable(true);
  {
    const prof::Region region(prof::kOptimizer);
    be->scale(x.data(), 0.5f, 1 << 16);
    be->sum_squares(x.data(), 1 << 16);
  }
  be->scale(x.data(), 0.5f, 1 << 16);
  prof::enable(false);
  EXPECT_GT(prof::seconds(prof::kOptimizer, prof::kForward), 0.0);
  EXPECT_GT(prof::seconds(prof::kElementwise, prof::kForward), 0.0);
  const double outside = prof::seconds(prof::kElementwise, prof::kForward);
  prof::reset();
  prof::enable(true);
  {
    const prof::Region region(prof::kOptimizer);
    be->scale(x.data(), 0.5f, 1 << 16);
  }
  prof::enable(false);
  EXPECT_EQ(prof::seconds(prof::kElementwise, prof::kForward), 0.0);  // counted by the region
  EXPECT_GT(outside, 0.0);
}

namespace {

// The backend of the test's name (skipped, with the reason, when unavailable here) and the
// model configuration of its case.
class BackendModel : public ::testing::TestWithParam<std::tuple<std::string, Case>> {
 protected:
  void SetUp() override {
    const std::string& name = std::get<0>(GetParam());
    std::string why;
    be = backend_or_skip(name, &why);
    if (!be) GTEST_SKIP() << "no " << name << " test: " << why;
    cfg = config_of(std::get<1>(GetParam()));
  }
  std::shared_ptr<Backend> be;
  ModelConfig cfg;
};

}  // namespace

TEST_P(BackendModel, MatchesTheCpuModel) {
  Model cpu(cfg), dev(cfg, be);
  EXPECT_TRUE(cpu.on_cpu());
  EXPECT_FALSE(dev.on_cpu());
  const std::vector<float> w = test_weights(cpu);
  cpu.params_from_host(w.data());
  dev.params_from_host(w.data());
  EXPECT_EQ(dev.params_to_host(), w);

  const int64_t B = 2, T = 11, N = B * T, V = cfg.vocab_size;
  const TokenBatch batch(N, V, 3);
  const std::vector<int32_t>&tok = batch.tok, &tgt = batch.tgt;
  cpu.zero_grad();
  dev.zero_grad();
  const double lc = cpu.forward(tok.data(), tgt.data(), B, T);
  const double ld = dev.forward(tok.data(), tgt.data(), B, T);
  EXPECT_NEAR(ld, lc, 1e-5 * lc);
  const std::vector<float> logits_c(cpu.logits(), cpu.logits() + N * V);
  EXPECT_LT(rel_diff(logits_of(dev, N * V).data(), logits_c.data(), N * V), 1e-5);
  cpu.backward();
  dev.backward();
  const std::vector<float> gc = cpu.grads_to_host(), gd = dev.grads_to_host();
  // Every tensor, relative to its own norm; a floor of 1e-5 of the whole gradient's norm for
  // tensors whose gradient is zero in exact arithmetic (the first mixer has one source, so its
  // query gets rounding noise only).
  const double floor = 1e-5 * std::sqrt(std::inner_product(gc.begin(), gc.end(), gc.begin(), 0.0));
  for (const ParamEntry& e : cpu.layout().entries()) {
    EXPECT_LT(rel_diff(gd.data() + e.offset, gc.data() + e.offset, e.numel, floor), 1e-4) << e.name;
  }

  // A few AdamW steps with clipping on each backend: losses and weights stay together (rounding
  // differences grow with each step, faster with larger learning rates).
  AdamWConfig ac;
  ac.lr = 2e-3;
  ac.eps = 1e-6;  // Adam turns a zero gradient's rounding noise (first mixer) into +-lr steps
  AdamW oc(cpu.layout(), ac), od(dev.layout(), ac, &dev.backend());
  for (int step = 0; step < 3; step++) {
    if (step > 0) {
      cpu.zero_grad();
      dev.zero_grad();
      const double a = cpu.forward(tok.data(), tgt.data(), B, T);
      const double b = dev.forward(tok.data(), tgt.data(), B, T);
      EXPECT_NEAR(b, a, 1e-4 * a) << "step " << step;
      cpu.backward();
      dev.backward();
    }
    const double nc = grad_norm(cpu.grads(), cpu.num_params());
    const double nd = std::sqrt(dev.backend().sum_squares(dev.grads(), dev.num_params()));
    EXPECT_NEAR(nd, nc, 1e-4 * nc) << "step " << step;
    oc.step(cpu.params(), cpu.grads(), ac.lr, clip_scale(nc, 0.5));
    od.step(dev.params(), dev.grads(), ac.lr, clip_scale(nd, 0.5));
  }
  const std::vector<float> pc = cpu.params_to_host(), pd = dev.params_to_host();
  EXPECT_LT(rel_diff(pd.data(), pc.data(), cpu.num_params()), 1e-4);
  EXPECT_LT(rel_diff(od.m().download().data(), oc.m().data(), cpu.num_params()), 1e-3);
}

// bf16 GEMMs (fp32 accumulation and master weights): the loss and gradients stay within bf16's
// rounding of the fp32 CPU model's (the GEMMs themselves are checked exactly in test_backend).
// Head dimension 16, so on a GPU attention runs the flash kernels.
TEST_P(BackendModel, Bf16GemmsStayNearFp32) {
  ModelConfig c16 = cfg;
  c16.d_model = 64;
  Model cpu(c16), dev(c16, be);
  dev.backend().set_matmul_precision(MatmulPrecision::bf16);
  const std::vector<float> w = test_weights(cpu);
  cpu.params_from_host(w.data());
  dev.params_from_host(w.data());
  const int64_t B = 2, T = 11;
  const TokenBatch batch(B * T, c16.vocab_size, 4);
  cpu.zero_grad();
  dev.zero_grad();
  const double lc = cpu.forward(batch.tok.data(), batch.tgt.data(), B, T);
  const double ld = dev.forward(batch.tok.data(), batch.tgt.data(), B, T);
  EXPECT_NEAR(ld, lc, 1e-3 * lc);  // measured <= 1.5e-5
  EXPECT_NE(ld, lc);               // the GEMMs did round
  cpu.backward();
  dev.backward();
  const std::vector<float> gc = cpu.grads_to_host(), gd = dev.grads_to_host();
  EXPECT_LT(rel_diff(gd.data(), gc.data(), cpu.num_params()), 5e-2);  // measured 0.3-1.4 %
}

// The training diagnostics (sublayer magnitudes, mean depth weights) of a device model are the
// CPU model's.
TEST_P(BackendModel, DiagnosticsMatchTheCpu) {
  Model cpu(cfg), dev(cfg, be);
  const std::vector<float> w = test_weights(cpu);
  cpu.params_from_host(w.data());
  dev.params_from_host(w.data());
  const int64_t B = 2, T = 11;
  const TokenBatch batch(B * T, cfg.vocab_size, 6);
  const Diagnostics dc = measure_diagnostics(cpu, batch.tok.data(), B, T);
  const Diagnostics dd = measure_diagnostics(dev, batch.tok.data(), B, T);
  ASSERT_EQ(dd.has_weights, dc.has_weights);
  EXPECT_EQ(dc.has_weights, cfg.residual.mode != ResidualMode::prenorm);
  EXPECT_EQ(dd.weight_rows, dc.weight_rows);
  EXPECT_EQ(dd.weight_cols, dc.weight_cols);
  ASSERT_EQ(dd.weights.size(), dc.weights.size());
  for (size_t r = 0; r < dc.weights.size(); r++) {
    ASSERT_EQ(dd.weights[r].size(), dc.weights[r].size());
    for (size_t c = 0; c < dc.weights[r].size(); c++) {
      if (std::isnan(dc.weights[r][c])) {
        EXPECT_TRUE(std::isnan(dd.weights[r][c])) << r << "," << c;
      } else {
        EXPECT_NEAR(dd.weights[r][c], dc.weights[r][c], 1e-5) << r << "," << c;
      }
    }
  }
  ASSERT_EQ(dd.input_rms.size(), dc.input_rms.size());
  for (size_t l = 0; l < dc.input_rms.size(); l++) {
    EXPECT_NEAR(dd.input_rms[l], dc.input_rms[l], 1e-5 * dc.input_rms[l]);
    EXPECT_NEAR(dd.output_rms[l], dc.output_rms[l], 1e-5 * dc.output_rms[l]);
  }
}

// KV-cache decoding on the device (a prefill of 3 tokens, then one at a time) gives the CPU
// decoder's logits, and both give the full forward's last-position logits; with bf16 GEMMs, within
// bf16's rounding.
TEST_P(BackendModel, DecoderMatchesTheCpuDecoder) {
  Model cpu(cfg), dev(cfg, be);
  const std::vector<float> w = test_weights(cpu);
  cpu.params_from_host(w.data());
  dev.params_from_host(w.data());
  const int64_t T = 9, V = cfg.vocab_size;
  const TokenBatch batch(T, V, 5);
  auto run = [&](const Model& m) { return decoded_logits(m, batch.tok, T); };
  const std::vector<float> lc = run(cpu), ld = run(dev);
  EXPECT_LT(rel_diff(ld.data(), lc.data(), T * V), 1e-5);
  cpu.forward(batch.tok.data(), batch.tgt.data(), 1, T);
  const std::vector<float> full = logits_of(cpu, T * V);
  EXPECT_LT(rel_diff(full.data(), lc.data(), T * V), 1e-5);
  dev.backend().set_matmul_precision(MatmulPrecision::bf16);
  const std::vector<float> lb = run(dev);
  dev.backend().set_matmul_precision(MatmulPrecision::fp32);
  EXPECT_LT(rel_diff(lb.data(), lc.data(), T * V), 2e-2);
  EXPECT_GT(rel_diff(lb.data(), lc.data(), T * V), 1e-6);  // the GEMMs did round
}

INSTANTIATE_TEST_SUITE_P(All, BackendModel,
                         ::testing::Combine(::testing::Values("cuda-host", "cuda"),
                                            ::testing::ValuesIn(kCases)),
                         [](const auto& param_info) {
                           std::string n = std::get<0>(param_info.param) + "_" +
                                           std::get<1>(param_info.param).name;
                           for (auto& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

namespace {
const char* kDevices[] = {"cuda-host", "cuda"};
class BackendRuns : public ::testing::TestWithParam<const char*> {};
}  // namespace

// Checkpoints: written from a device model they read back bit for bit on the CPU, and a device
// model loads what the CPU wrote, optimizer state included.
TEST_P(BackendRuns, CheckpointsMoveBetweenBackends) {
  std::string why;
  auto be = backend_or_skip(GetParam(), &why);
  if (!be) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  attnres::testing::TempDir td;
  const ModelConfig cfg = config_of(kCases[1]);
  Model dev(cfg, be);
  const std::vector<float> w = test_weights(dev);
  dev.params_from_host(w.data());
  const std::string path = td.path + "/m.safetensors";
  save_model(path, dev, {});
  auto cpu = load_model(path);
  EXPECT_EQ(cpu->params_to_host(), w);
  Model dev2(cfg, be);
  load_weights(dev2, SafetensorsReader::open(path));
  EXPECT_EQ(dev2.params_to_host(), w);

  AdamW oc(cpu->layout(), AdamWConfig{});
  const auto m = randn(cpu->num_params(), 5);
  auto v = randn(cpu->num_params(), 6, 0.1);
  for (float& x : v) x = std::fabs(x);  // a second moment (a negative one is refused on load)
  std::copy(m.begin(), m.end(), oc.m().data());
  std::copy(v.begin(), v.end(), oc.v().data());
  oc.set_steps_taken(9);
  save_optimizer(td.path + "/o.safetensors", *cpu, oc, {});
  AdamW od(dev2.layout(), AdamWConfig{}, &dev2.backend());
  load_optimizer(td.path + "/o.safetensors", dev2, od);
  EXPECT_EQ(od.m().download(), m);
  EXPECT_EQ(od.v().download(), v);
  EXPECT_EQ(od.steps_taken(), 9);
  save_optimizer(td.path + "/o2.safetensors", dev2, od, {});
  AdamW back(cpu->layout(), AdamWConfig{});
  load_optimizer(td.path + "/o2.safetensors", *cpu, back);
  EXPECT_EQ(std::vector<float>(back.m().data(), back.m().data() + m.size()), m);
}

// The device step (loss, norm, clip and verdict decided on the device; train/device_step.hpp),
// uncaptured and replayed from graphs, against the host's step: its loss and gradient norm
// against the CPU's, its weights after four clipped, weight-decayed steps of two micro-batches
// each against the same backend's host-driven step (the same kernels up to the update, so only
// the reduction order of the norm differs: compared with the CPU instead, AdamW's first steps,
// which move each weight by about lr whatever its gradient's size, would amplify the rounding
// of the tiniest gradients). A step with a non-finite loss changes nothing and is taken back.
TEST_P(BackendRuns, DeviceStepMatchesTheHostStep) {
  std::string why;
  auto be = backend_or_skip(GetParam(), &why);
  if (!be) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  for (const bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "graphs" : "uncaptured");
    const ModelConfig cfg = config_of(kCases[1]);  // block
    Model cpu(cfg), ref(cfg, be), dev(cfg, be);
    const std::vector<float> w = test_weights(cpu);
    cpu.params_from_host(w.data());
    ref.params_from_host(w.data());
    dev.params_from_host(w.data());
    AdamWConfig ac;
    ac.weight_decay = 0.5;
    AdamW oc(cpu.layout(), ac), oref(ref.layout(), ac, be.get()), od(dev.layout(), ac, be.get());
    const double max_norm = 0.05, lr = 2e-2;
    DeviceStep ds(dev, od, max_norm, 0.5f, graphs);
    const int64_t B = 2, T = 8, n = cpu.num_params();
    for (int step = 0; step < 4; step++) {
      SCOPED_TRACE(step);
      // Each step from the host step's weights and moments: the two round an update's last bit
      // differently now and then (below), and over steps AdamW magnifies that through the
      // tiniest gradients (8e-6 after four steps of a Block model whose gradients were the
      // same bits at every step's start): compared step by step, not as trajectories.
      const std::vector<float> pw = ref.params_to_host(), m0 = oref.m().download(),
                               v0 = oref.v().download();
      dev.params_from_host(pw.data());
      od.m().upload(m0.data(), m0.size());
      od.v().upload(v0.data(), v0.size());
      cpu.zero_grad();
      ref.zero_grad();
      ds.begin();
      double loss = 0;
      for (int micro = 0; micro < 2; micro++) {
        const TokenBatch tb(B * T, cfg.vocab_size, 50 + 2 * step + micro);
        loss += cpu.forward(tb.tok.data(), tb.tgt.data(), B, T);
        cpu.backward();
        ref.forward(tb.tok.data(), tb.tgt.data(), B, T);
        ref.backward();
        ds.micro(tb.tok.data(), tb.tgt.data(), B, T);
      }
      for (int64_t i = 0; i < n; i++) cpu.grads()[i] *= 0.5f;
      const double norm = grad_norm(cpu.grads(), n);
      ASSERT_GT(norm, 2 * max_norm);  // clipped
      oc.step(cpu.params(), cpu.grads(), lr, clip_scale(norm, max_norm));
      be->scale(ref.grads(), 0.5f, n);
      const double ref_norm = std::sqrt(be->sum_squares(ref.grads(), n));
      oref.step(ref.params(), ref.grads(), lr, clip_scale(ref_norm, max_norm));
      const DeviceStep::Result r = ds.finish(lr);
      EXPECT_TRUE(r.ok);
      EXPECT_NEAR(r.loss_sum / 2, loss / 2, 1e-5 * loss);
      // Against the CPU's norm on the same weights (step 0); later the CPU run has its own
      // weights (AdamW moved the smallest gradients' weights by about lr, whatever their rounding:
      // 1.0e-4 apart at step 3 on a Sapphire Rapids Xeon), so against this backend's host step.
      if (step == 0) {
        EXPECT_NEAR(r.norm, norm, 1e-4 * norm);
      }
      EXPECT_NEAR(r.norm, ref_norm, 1e-5 * ref_norm);
      const std::vector<float> pr = ref.params_to_host(), pd = dev.params_to_host();
      double worst = 0;
      for (int64_t i = 0; i < n; i++) worst = std::max(worst, double(std::fabs(pr[i] - pd[i])));
      // (cuda-host: 2 ulps of a weight near 1; the device's AdamW functor and the host loop may
      // round the update's last bit differently (FMA contraction: 1.19e-7 on an AVX2 Zen 3
      // build); on a GPU a replayed GEMM may use another cuBLAS algorithm, and AdamW's first
      // steps magnify the tiniest gradients' rounding up to about lr)
      EXPECT_LT(worst, std::string(GetParam()) == "cuda-host" ? 2.5e-7 : 2 * lr);
    }
    EXPECT_EQ(od.steps_taken(), 4);
    // (a step moves a weight by up to lr, and decays it by lr * 0.5 * |w|: both far above the
    // bound above on cuda-host, where the two steps' gradients are the same bits)
    if (graphs) {
      EXPECT_EQ(ds.captures(), 2);     // forward+backward, update
      EXPECT_EQ(ds.replays(), 7 + 3);  // each ran uncaptured once first
      EXPECT_EQ(ds.off_reason(), "");
    }

    // Another batch shape: a forward captured for the first one is not replayed for it.
    {
      const TokenBatch tb(T, cfg.vocab_size, 99);
      const double want = cpu.forward(tb.tok.data(), tb.tgt.data(), 1, T);
      ds.begin();
      ds.micro(tb.tok.data(), tb.tgt.data(), 1, T);
      EXPECT_NEAR(ds.finish(0.0).loss_sum, want, 1e-3 * want);
    }

    // A NaN weight: the loss is NaN, the update skipped on the device, the step taken back.
    const int64_t taken = od.steps_taken();
    std::vector<float> bad = dev.params_to_host();
    bad[dev.layout().find("tok_embeddings.weight")->offset] = NAN;
    dev.params_from_host(bad.data());
    const std::vector<float> m0 = od.m().download();
    ds.begin();
    std::vector<int32_t> zeros(B * T, 0);  // token 0 reads the NaN
    ds.micro(zeros.data(), zeros.data(), B, T);
    const DeviceStep::Result r = ds.finish(lr);
    EXPECT_FALSE(r.ok);
    EXPECT_EQ(od.steps_taken(), taken);
    const std::vector<float> after = dev.params_to_host();
    EXPECT_EQ(0, std::memcmp(after.data(), bad.data(), sizeof(float) * bad.size()));
    EXPECT_EQ(od.m().download(), m0);
  }
}

// A step that reads values back on the host cannot be captured (here: recording the sublayer
// statistics downloads them): after two failed captures graphs turn off, saying why, and every
// step still runs, uncaptured, with the same results.
TEST_P(BackendRuns, GraphsTurnOffWhereTheStepReadsBack) {
  std::string why;
  auto be = backend_or_skip(GetParam(), &why);
  if (!be) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  const ModelConfig cfg = config_of(kCases[3]);  // full
  std::vector<double> losses[2];
  for (const bool graphs : {false, true}) {
    Model dev(cfg, be);
    const std::vector<float> w = test_weights(dev);
    dev.params_from_host(w.data());
    dev.set_record_stats(true);
    AdamW od(dev.layout(), AdamWConfig{}, be.get());
    DeviceStep ds(dev, od, 1.0, 1.0f, graphs);
    for (int step = 0; step < 4; step++) {
      const TokenBatch tb(2 * 8, cfg.vocab_size, 70 + step);
      ds.begin();
      ds.micro(tb.tok.data(), tb.tgt.data(), 2, 8);
      losses[graphs].push_back(ds.finish(1e-3).loss_sum);
    }
    if (graphs) {
      EXPECT_LE(ds.captures(), 1);  // (the update may have been, before graphs turned off)
      EXPECT_NE(ds.off_reason().find("a download while capturing"), std::string::npos)
          << ds.off_reason();
    }
  }
  // (bit for bit on cuda-host; on a GPU cuBLAS may choose its algorithms anew in a capture)
  const double tol = std::string(GetParam()) == "cuda-host" ? 0.0 : 1e-5;
  for (size_t i = 0; i < losses[0].size(); i++) {
    EXPECT_NEAR(losses[1][i], losses[0][i], tol * losses[0][i]) << "step " << i;
  }
}

// `train --device`: the same run on the CPU and on the device; losses track step by step and the
// final validation loss agrees. Unsupported options fail with the fix named.
TEST_P(BackendRuns, TrainingTracksTheCpuRun) {
  std::string why;
  if (!backend_or_skip(GetParam(), &why)) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  attnres::testing::TempDir td;
  {
    std::ofstream f(td.path + "/corpus.txt");
    for (int i = 0; i < 300; i++)
      f << "the cat sees the river " << i % 7 << ". a dog likes hats.\n";
  }
  auto run = [&](const std::string& device, const std::string& mode, std::vector<double>* losses,
                 const std::string& precision = "fp32", bool graphs = false) {
    TrainConfig c;
    c.data_path = td.path + "/corpus.txt";
    c.out_dir = td.path + "/run_" + device + "_" + mode + "_" + precision + (graphs ? "_g" : "");
    c.data_dir = td.path + "/data";
    c.model.n_layer = 2;
    c.model.d_model = 32;
    c.model.n_head = 4;
    c.model.n_kv_head = 2;
    c.model.residual.mode = parse_residual_mode(mode);
    c.model.residual.block_size = 2;
    c.batch_size = 4;
    c.seq_len = 16;
    c.steps = 6;
    c.grad_accum = 2;
    c.adamw.lr = 5e-3;
    c.eval_every = 3;
    c.eval_batches = 2;
    c.save_every = 3;
    c.device = parse_device(device);
    c.precision = parse_precision(precision);
    c.cuda_graphs = graphs;
    TrainEvents ev;  // (no loss_hook: on a device that would keep the host's step)
    ev.on_step = [losses](const StepInfo& si) { losses->push_back(si.loss); };
    return train(c, ev);
  };
  std::map<std::string, std::vector<double>> cpu_losses;
  for (const char* mode : {"block", "full", "static", "denseformer"}) {
    SCOPED_TRACE(mode);
    std::vector<double> lc, ld, lg;
    const TrainResult rc = run("cpu", mode, &lc), rd = run(GetParam(), mode, &ld);
    ASSERT_EQ(lc.size(), 6u);
    ASSERT_EQ(ld.size(), 6u);
    for (size_t i = 0; i < lc.size(); i++) EXPECT_NEAR(ld[i], lc[i], 1e-4 * lc[i]) << "step " << i;
    EXPECT_LT(lc.back(), lc.front());  // it learned
    ASSERT_TRUE(rd.final_val_loss && rc.final_val_loss);
    EXPECT_NEAR(*rd.final_val_loss, *rc.final_val_loss, 1e-4 * *rc.final_val_loss);
    cpu_losses[mode] = lc;
    // --cuda-graphs: the replayed steps compute exactly what the uncaptured ones do (the same
    // kernels in the same order), across the evaluations and checkpoints between them.
    const TrainResult rg = run(GetParam(), mode, &lg, "fp32", true);
    // (the same kernels in the same order: bit for bit on cuda-host; on a GPU cuBLAS may pick
    // its algorithms anew inside a capture, so to rounding there)
    const double tol = std::string(GetParam()) == "cuda-host" ? 0.0 : 1e-5;
    ASSERT_EQ(lg.size(), ld.size());
    for (size_t i = 0; i < lg.size(); i++) EXPECT_NEAR(lg[i], ld[i], tol * ld[i]) << "step " << i;
    ASSERT_TRUE(rg.final_val_loss);
    EXPECT_NEAR(*rg.final_val_loss, *rd.final_val_loss, tol * *rd.final_val_loss);
    EXPECT_GT(rg.graph_captures, 0);
    EXPECT_GT(rg.graph_replays, 2 * rg.graph_captures);
    EXPECT_EQ(rg.graphs_off_reason, "");
  }
  for (const char* mode : {"block", "full"}) {
    // bf16 GEMMs and depth sources: the losses stay within bf16 rounding of the fp32 run's
    SCOPED_TRACE(std::string(mode) + " bf16");
    const std::vector<double>& lc = cpu_losses[mode];
    std::vector<double> lb;
    run(GetParam(), mode, &lb, "bf16");
    ASSERT_EQ(lb.size(), lc.size());
    for (size_t i = 0; i < lc.size(); i++) EXPECT_NEAR(lb[i], lc[i], 1e-2 * lc[i]) << "step " << i;
    EXPECT_LT(lb.back(), lb.front());
  }
}

// A run stopped on the device resumes on the CPU (the checkpoint files are the same) and goes on
// as the uninterrupted device run does, to rounding.
TEST_P(BackendRuns, ADeviceRunResumesOnTheCpu) {
  std::string why;
  if (!backend_or_skip(GetParam(), &why)) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  attnres::testing::TempDir td;
  {
    std::ofstream f(td.path + "/corpus.txt");
    for (int i = 0; i < 300; i++) f << "resume the run " << i % 11 << " on another device.\n";
  }
  auto config = [&](const std::string& out, const std::string& device) {
    TrainConfig c;
    c.data_path = td.path + "/corpus.txt";
    c.out_dir = td.path + "/" + out;
    c.data_dir = td.path + "/data";
    c.model.n_layer = 2;
    c.model.d_model = 32;
    c.model.n_head = 4;
    c.model.residual.mode = ResidualMode::full;
    c.batch_size = 4;
    c.seq_len = 16;
    c.steps = 6;
    c.adamw.lr = 5e-3;
    c.eval_every = 0;
    c.eval_batches = 2;
    c.device = parse_device(device);
    return c;
  };
  std::vector<double> whole, resumed;
  TrainEvents ev;
  ev.on_step = [&whole](const StepInfo& si) { whole.push_back(si.loss); };
  train(config("whole", GetParam()), ev);
  std::atomic<bool> stop{false};
  TrainEvents first;  // the same run, stopped after step 3 (a checkpoint is saved)
  first.stop = &stop;
  first.on_step = [&stop](const StepInfo& si) {
    if (si.step == 3) stop = true;
  };
  const TrainResult r1 = train(config("split", GetParam()), first);
  EXPECT_TRUE(r1.interrupted);
  TrainConfig again = config("split", "cpu");
  again.resume = true;
  TrainEvents second;
  second.loss_hook = [&resumed](int64_t, double loss) {
    resumed.push_back(loss);
    return loss;
  };
  train(again, second);
  ASSERT_EQ(whole.size(), 6u);
  ASSERT_EQ(resumed.size(), 3u);  // steps 4..6
  for (size_t i = 0; i < 3; i++) EXPECT_NEAR(resumed[i], whole[3 + i], 1e-4 * whole[3 + i]);
}

// `attnres eval --device`: the same loss as on the CPU (and within bf16 rounding of it).
TEST_P(BackendRuns, EvalAndGenerateOnTheDeviceMatchTheCpu) {
  std::string why;
  if (!backend_or_skip(GetParam(), &why)) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  attnres::testing::TempDir td;
  {
    std::ofstream f(td.path + "/corpus.txt");
    for (int i = 0; i < 200; i++) f << "a small corpus line number " << i << " for the eval.\n";
  }
  ModelConfig cfg = config_of(kCases[3]);  // full
  cfg.vocab_size = 256;                    // the byte tokenizer's
  cfg.max_seq_len = 16;
  Model m(cfg);
  const std::vector<float> w = test_weights(m);
  m.params_from_host(w.data());
  save_model(td.path + "/model.safetensors", m, {});
  auto eval_loss = [&](const std::string& extra) {
    return cli_eval_loss("eval " + td.path + "/model.safetensors --data " + td.path +
                         "/corpus.txt --batches 2 " + extra);
  };
  const double cpu = eval_loss("");
  EXPECT_GT(cpu, 0.0);
  EXPECT_NEAR(eval_loss("--device " + std::string(GetParam())), cpu, 1e-4);
  EXPECT_NEAR(eval_loss("--device " + std::string(GetParam()) + " --precision bf16"), cpu,
              1e-3 * cpu);
  // Greedy generation: the same tokens.
  auto gen = [&](const std::string& extra) {
    const auto r = attnres::testing::run_cli("generate " + td.path +
                                             "/model.safetensors --prompt 'a small' -n 12 "
                                             "--temperature 0 " +
                                             extra);
    EXPECT_EQ(r.code, 0) << r.out;
    return r.out;
  };
  const std::string text = gen("");
  EXPECT_GT(text.size(), std::string("a small").size());
  EXPECT_EQ(gen("--device " + std::string(GetParam())), text);
}

// `attnres compare --device`: the same validation losses as on the CPU, and the report says where
// it trained.
TEST_P(BackendRuns, CompareOnTheDeviceMatchesTheCpu) {
  std::string why;
  if (!backend_or_skip(GetParam(), &why)) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  attnres::testing::TempDir td;
  {
    std::ofstream f(td.path + "/corpus.txt");
    for (int i = 0; i < 300; i++)
      f << "the cat sees the river " << i % 7 << ". a dog likes hats.\n";
  }
  auto losses = [&](const std::string& name, const std::string& extra) {
    const auto r = attnres::testing::run_cli(
        "compare --preset tiny --modes prenorm,block --seeds 1 --steps 8 --no-plots --data " +
        td.path + "/corpus.txt --out " + td.path + "/" + name + " " + extra);
    EXPECT_EQ(r.code, 0) << r.out;
    std::ifstream f(td.path + "/" + name + "/results.json");
    const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
    std::vector<double> v;
    if (j.is_discarded()) {
      ADD_FAILURE() << "no results.json: " << r.out;
      return std::make_pair(v, std::string());
    }
    for (const auto& g : j.at("groups")) v.push_back(g.at("val_loss_mean").get<double>());
    return std::make_pair(v, j.at("hardware").value("device", std::string()));
  };
  const auto cpu = losses("cpu", "");
  const auto dev = losses("dev", "--device " + std::string(GetParam()));
  EXPECT_EQ(cpu.second, "cpu");
  EXPECT_EQ(dev.second, GetParam());
  ASSERT_EQ(dev.first.size(), 2u);
  ASSERT_EQ(cpu.first.size(), 2u);
  for (size_t i = 0; i < 2; i++) EXPECT_NEAR(dev.first[i], cpu.first[i], 1e-4 * cpu.first[i]);
}

// `attnres train --cuda-graphs`: the run says what it captured and replayed; on the CPU the flag
// is refused with the fix.
TEST_P(BackendRuns, TrainWithCudaGraphsOnTheCli) {
  std::string why;
  if (!backend_or_skip(GetParam(), &why)) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  attnres::testing::TempDir td;
  {
    std::ofstream f(td.path + "/corpus.txt");
    for (int i = 0; i < 200; i++) f << "graphs replay the step " << i % 5 << " again.\n";
  }
  const std::string args = "train --data " + td.path +
                           "/corpus.txt --n-layer 2 --d-model 32 "
                           "--n-head 2 --batch-size 2 --seq-len 16 --steps 5 --eval-every 2 "
                           "--eval-batches 1 --residual block --cuda-graphs --out " +
                           td.path;
  const auto r = attnres::testing::run_cli(args + "/dev --device " + std::string(GetParam()));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("CUDA graphs: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" replays "), std::string::npos) << r.out;
  const auto bad = attnres::testing::run_cli(args + "/cpu");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--cuda-graphs captures the step on --device cuda"), std::string::npos)
      << bad.out;
}

// `attnres bench --device`: every mode runs there, with the CPU's initial losses.
TEST_P(BackendRuns, BenchOnTheDeviceMatchesTheCpu) {
  std::string why;
  if (!backend_or_skip(GetParam(), &why)) GTEST_SKIP() << "no " << GetParam() << " test: " << why;
  attnres::testing::TempDir td;
  auto bench = [&](const std::string& name, const std::string& extra,
                   const std::string& steps = "--steps 1 --warmup 0") {
    const std::string js = td.path + "/" + name + ".json";
    const auto r = attnres::testing::run_cli(
        "bench --d-model 32 --n-layer 2 --n-head 2 --seq-len 32 --batch-size 2 --vocab 64 " +
        steps + " --decode-tokens 4 --json " + js + " " + extra);
    EXPECT_EQ(r.code, 0) << r.out;
    std::ifstream f(js);
    return nlohmann::json::parse(f, nullptr, false);
  };
  const auto cpu = bench("cpu", ""), dev = bench("dev", "--device " + std::string(GetParam()));
  ASSERT_FALSE(cpu.is_discarded());
  ASSERT_FALSE(dev.is_discarded());
  EXPECT_EQ(dev.at("device"), GetParam());
  ASSERT_EQ(dev.at("modes").size(), 3u);
  for (size_t i = 0; i < 3; i++) {
    const auto& c = cpu.at("modes")[i];
    const auto& d = dev.at("modes")[i];
    EXPECT_EQ(d.at("mode"), c.at("mode"));
    EXPECT_NEAR(d.at("loss0").get<double>(), c.at("loss0").get<double>(), 1e-5);
    EXPECT_GT(d.at("tokens_per_s").get<double>(), 0.0);
    EXPECT_GT(d.at("decode_ms_per_token").get<double>(), 0.0);
  }
  // --cuda-graphs: the timed steps replay graphs
  const auto g =
      bench("graphs", "--cuda-graphs --device " + std::string(GetParam()), "--steps 2 --warmup 1");
  ASSERT_FALSE(g.is_discarded());
  for (const auto& r : g.at("modes")) EXPECT_GT(r.at("graph_replays").get<int64_t>(), 0) << r;
}

INSTANTIATE_TEST_SUITE_P(Devices, BackendRuns, ::testing::ValuesIn(kDevices),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

// ---- bf16 on the CPU (--precision bf16 --device cpu): the linear layers' products on bf16
// operands, fp32 sums, master weights, optimizer and loss. The products themselves are checked
// against a reference in test_ops (GemmBf16MatchesReferenceAllTransposes) and test_backend.

// Every residual configuration: the loss and gradients within bf16's rounding of fp32's.
TEST(CpuBf16, EveryModelStaysNearFp32) {
  for (const Case& k : kCases) {
    SCOPED_TRACE(k.name);
    ModelConfig c = config_of(k);
    c.d_model = 64;
    Model cpu(c), bf(c, make_backend(Device::cpu, MatmulPrecision::bf16));
    ASSERT_EQ(bf.backend().matmul_precision(), MatmulPrecision::bf16);
    EXPECT_EQ(cpu_backend()->matmul_precision(), MatmulPrecision::fp32);  // (shared: unchanged)
    const std::vector<float> w = test_weights(cpu);
    cpu.params_from_host(w.data());
    bf.params_from_host(w.data());
    const int64_t B = 2, T = 11;
    const TokenBatch batch(B * T, c.vocab_size, 4);
    cpu.zero_grad();
    bf.zero_grad();
    const double lc = cpu.forward(batch.tok.data(), batch.tgt.data(), B, T);
    const double lb = bf.forward(batch.tok.data(), batch.tgt.data(), B, T);
    EXPECT_NEAR(lb, lc, 2e-3 * lc);
    EXPECT_NE(lb, lc);  // the products did round
    cpu.backward();
    bf.backward();
    const std::vector<float> gc = cpu.grads_to_host(), gb = bf.grads_to_host();
    EXPECT_LT(rel_diff(gb.data(), gc.data(), cpu.num_params()), 5e-2);
  }
}

// KV-cache decoding with bf16 products: each weight is rounded once for the decoder's life; the
// logits stay within bf16's rounding of the fp32 decoder's, and the bf16 model's own full
// forward gives the same logits to fp32 summation order (prefill, then tokens one at a time).
TEST(CpuBf16, DecoderStaysNearFp32AndMatchesTheBf16Forward) {
  for (const Case& k : {kCases[0], kCases[1], kCases[3]}) {
    SCOPED_TRACE(k.name);
    ModelConfig c = config_of(k);
    Model cpu(c), bf(c, make_backend(Device::cpu, MatmulPrecision::bf16));
    const std::vector<float> w = test_weights(cpu);
    cpu.params_from_host(w.data());
    bf.params_from_host(w.data());
    const int64_t T = 9, V = c.vocab_size;
    const TokenBatch batch(T, V, 5);
    auto run = [&](const Model& m) { return decoded_logits(m, batch.tok, T); };
    const std::vector<float> lc = run(cpu), lb = run(bf);
    EXPECT_LT(rel_diff(lb.data(), lc.data(), T * V), 2e-2);
    EXPECT_GT(rel_diff(lb.data(), lc.data(), T * V), 1e-6);  // the products did round
    bf.forward(batch.tok.data(), batch.tgt.data(), 1, T);
    const std::vector<float> full = logits_of(bf, T * V);
    EXPECT_LT(rel_diff(full.data(), lb.data(), T * V), 1e-5);
    EXPECT_EQ(run(bf), lb);  // a second decoder: the same bits
  }
}

// `train --precision bf16` on the CPU tracks the fp32 run over 200 steps in every residual mode;
// its checkpoints stay fp32, and load and evaluate in either precision.
TEST(CpuBf16, TrainingTracksFp32AndCheckpointsStayFp32) {
  attnres::testing::TempDir td;
  {
    // Words drawn at random: a loss floor both runs approach (a text they could memorise would
    // let two runs' losses part by chance as they fall towards zero).
    const char* words[] = {"the", "cat", "sees", "a", "river", "dog", "likes", "hats", "and"};
    std::ofstream f(td.path + "/corpus.txt");
    Rng r(5);
    for (int i = 0; i < 4000; i++) f << words[r.next_u64() % 9] << (i % 12 == 11 ? ".\n" : " ");
  }
  auto run = [&](const std::string& mode, const std::string& precision,
                 std::vector<double>* losses) {
    TrainConfig c;
    c.data_path = td.path + "/corpus.txt";
    c.out_dir = td.path + "/run_" + mode + "_" + precision;
    c.data_dir = td.path + "/data";
    c.model.n_layer = 2;
    c.model.d_model = 32;
    c.model.n_head = 4;
    c.model.n_kv_head = 2;
    c.model.residual.mode = parse_residual_mode(mode);
    c.model.residual.block_size = 2;
    c.batch_size = 4;
    c.seq_len = 16;
    c.steps = 200;
    c.adamw.lr = 3e-3;
    c.eval_every = 100;
    c.eval_batches = 4;
    c.save_every = 100;
    c.log_every = 1000;
    c.precision = parse_precision(precision);
    TrainEvents ev;
    ev.on_step = [losses](const StepInfo& si) { losses->push_back(si.loss); };
    return train(c, ev);
  };
  for (const char* mode : {"prenorm", "full", "block"}) {
    SCOPED_TRACE(mode);
    std::vector<double> lc, lb;
    const TrainResult rc = run(mode, "fp32", &lc), rb = run(mode, "bf16", &lb);
    ASSERT_EQ(lc.size(), 200u);
    ASSERT_EQ(lb.size(), 200u);
    EXPECT_NEAR(lb[0], lc[0], 1e-3 * lc[0]);  // the same weights and batch, rounded products
    EXPECT_NE(lb[0], lc[0]);
    double worst = 0;  // the largest relative gap of the 20-step mean losses
    for (size_t i = 0; i < 200; i += 20) {
      double a = 0, b = 0;
      for (size_t j = i; j < i + 20; j++) a += lc[j], b += lb[j];
      worst = std::max(worst, std::abs(b - a) / a);
    }
    // (Measured here: 0.1-1.5 %; 3.0 % in block mode on the GPU machine's CPU, 2026-12-04. The
    // fp32 runs of two seeds part by 1-3 % at 200 steps: bf16's rounding moves a run about as
    // much as another seed does, and a broken bf16 path far more.)
    EXPECT_LT(worst, 4e-2);
    EXPECT_LT(lb.back(), 0.6 * lb.front());  // it learned
    ASSERT_TRUE(rc.final_val_loss && rb.final_val_loss);
    EXPECT_NEAR(*rb.final_val_loss, *rc.final_val_loss, 5e-2 * *rc.final_val_loss);  // 0-2.6 %
    // The checkpoint holds fp32 weights, evaluated in either precision.
    const std::string model = td.path + "/run_" + mode + "_bf16/model.safetensors";
    std::ifstream f(model, std::ios::binary);
    uint64_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    f.read(header.data(), static_cast<std::streamsize>(n));
    EXPECT_EQ(header.find("BF16"), std::string::npos);
    EXPECT_NE(header.find("\"F32\""), std::string::npos);
    auto eval_loss = [&](const std::string& precision) {
      return cli_eval_loss("eval " + model + " --data " + td.path +
                           "/corpus.txt --batches 4 --precision " + precision);
    };
    const double e32 = eval_loss("fp32"), e16 = eval_loss("bf16");
    EXPECT_GT(e32, 0.0);
    EXPECT_NEAR(e16, e32, 1e-2 * e32);
  }
}

// The CLI: bf16 on the CPU for generate and bench, and the note on a CPU without AVX512-BF16
// (where the products are widened to fp32) exactly there.
TEST(CpuBf16, CommandsRunAndSayWhenTheCpuHasNoBf16) {
  attnres::testing::TempDir td;
  ModelConfig cfg = config_of(kCases[1]);  // block
  cfg.vocab_size = 256;
  cfg.max_seq_len = 16;
  Model m(cfg);
  const std::vector<float> w = test_weights(m);
  m.params_from_host(w.data());
  save_model(td.path + "/model.safetensors", m, {});
  const auto g = attnres::testing::run_cli("generate " + td.path +
                                           "/model.safetensors --prompt 'a small' -n 8 "
                                           "--temperature 0 --precision bf16");
  EXPECT_EQ(g.code, 0) << g.out;
  const auto b = attnres::testing::run_cli(
      "bench --precision bf16 --d-model 32 --n-layer 2 --n-head 2 --seq-len 16 --batch-size 2 "
      "--vocab 64 --steps 2 --warmup 1 --decode-tokens 4 --json " +
      td.path + "/b.json");
  EXPECT_EQ(b.code, 0) << b.out;
  std::ifstream jf(td.path + "/b.json");
  const auto j = nlohmann::json::parse(jf, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << b.out;
  EXPECT_EQ(j.at("precision"), "bf16");
  const std::string note = "this CPU has no AVX512-BF16";
  for (const auto* r : {&g, &b}) {
    EXPECT_EQ(r->out.find(note) != std::string::npos, !cpu_has_bf16()) << r->out;
  }
}
