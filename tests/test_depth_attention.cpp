// The fused depth-attention kernels (SPEC 2-4): fast vs reference, backward vs finite differences,
// two-phase vs one-phase, for every gate / key-norm / head / query combination, including sources
// of very different magnitudes and large scores.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/ops.hpp"
#include "test_util.hpp"

using namespace attnres;
using attnres::testing::dot;
using attnres::testing::fd_check;
using attnres::testing::randn;
using attnres::testing::rel_diff;

namespace {

struct Case {
  bool softmax, key_norm;
  int64_t H;
  bool dynamic;
  double qscale;  // large values give large scores (softmax saturation)
};

std::string name_of(const Case& c) {
  return std::string(c.softmax ? "softmax" : "sigmoid") + (c.key_norm ? "_rms" : "_nonorm") + "_H" +
         std::to_string(c.H) + (c.dynamic ? "_dyn" : "_static") + (c.qscale > 1 ? "_large" : "");
}

struct MixSetup {
  int64_t N = 5, d = 16, S = 5;
  ops::DepthMix m;
  std::vector<std::vector<float>> v, r, g;
  std::vector<float> q;
  int64_t q_ld = 0;
  // Source i has RMS 10^(lo + step * i).
  explicit MixSetup(const Case& c, double lo = -3.0, double step = 1.5) {
    m.d = d;
    m.H = c.H;
    m.softmax = c.softmax;
    m.key_norm = c.key_norm;
    // By default sources span six orders of magnitude (RMS 1e-3 .. 1e3).
    for (int64_t i = 0; i < S; i++) {
      v.push_back(randn(N * d, 10 + i, std::pow(10.0, lo + step * i)));
      r.emplace_back(N * c.H);
      g.emplace_back(N * d, 0.0f);
    }
    q_ld = c.dynamic ? d : 0;
    // Without key norm the raw scores scale with the sources; keep them in exp's range.
    const double qs = c.key_norm ? c.qscale : c.qscale * 1e-3;
    q = randn(c.dynamic ? N * d : d, 3, qs);
    refresh();
  }
  void refresh() {
    for (int64_t i = 0; i < S; i++) ops::depth_rstd(r[i].data(), v[i].data(), N, d, m.H, m.eps);
  }
  std::vector<ops::DepthSource> src() {
    std::vector<ops::DepthSource> s;
    for (int64_t i = 0; i < S; i++) s.push_back({v[i].data(), r[i].data(), g[i].data()});
    return s;
  }
};

class DepthAttention : public ::testing::TestWithParam<Case> {};

TEST_P(DepthAttention, FastMatchesReference) {
  MixSetup t(GetParam());
  auto s = t.src();
  std::vector<float> x1(t.N * t.d), x2(t.N * t.d), l1(t.N * t.m.H), l2(t.N * t.m.H);
  ops::depth_mix_forward(x1.data(), l1.data(), s.data(), t.S, t.q.data(), t.q_ld, t.m, t.N);
  ops::depth_mix_forward_reference(x2.data(), l2.data(), s.data(), t.S, t.q.data(), t.q_ld, t.m,
                                   t.N);
  EXPECT_LT(rel_diff(x1.data(), x2.data(), t.N * t.d), 1e-5);
  if (t.m.softmax) {
    EXPECT_LT(rel_diff(l1.data(), l2.data(), t.N * t.m.H), 1e-5);
  }
  for (float z : x1) ASSERT_TRUE(std::isfinite(z));
}

TEST_P(DepthAttention, BackwardMatchesFiniteDifferences) {
  const Case c = GetParam();
  // Magnitudes 0.1 .. 10: wide enough to matter, narrow enough for fp32 finite differences (the
  // six-decade spread is covered against the double reference above).
  MixSetup t(c, -1.0, 0.5);
  const int64_t nd = t.N * t.d;
  auto R = randn(nd, 99);
  std::vector<float> x(nd), lse(t.N * t.m.H);
  // The loss goes through the double-precision reference (which recomputes the keys' RMS), so
  // the finite differences are as clean as they can be from fp32 inputs.
  auto loss = [&] {
    auto s = t.src();
    ops::depth_mix_forward_reference(x.data(), lse.data(), s.data(), t.S, t.q.data(), t.q_ld, t.m,
                                     t.N);
    return dot(x.data(), R.data(), nd);
  };
  {
    t.refresh();
    auto s0 = t.src();
    ops::depth_mix_forward(x.data(), lse.data(), s0.data(), t.S, t.q.data(), t.q_ld, t.m, t.N);
  }
  auto s = t.src();
  std::vector<float> dq(t.q.size(), 0.0f);
  ops::depth_mix_backward(dq.data(), R.data(), x.data(), lse.data(), s.data(), t.S, t.q.data(),
                          t.q_ld, t.m, t.N);
  for (int64_t i = 0; i < t.S; i++) {
    // Relative step: the sources' scales differ by 1e6.
    // Steps trade truncation (large scores curve sharply) against fp32 noise.
    const double eps = (c.qscale > 1 ? 2e-3 : 1e-2) * std::pow(10.0, -1.0 + 0.5 * i);
    EXPECT_LT(fd_check(loss, t.v[i].data(), nd, t.g[i].data(), eps, 40), 2e-2)
        << "source " << i << " " << name_of(c);
  }
  const double qeps = 1e-3 * (c.key_norm ? c.qscale : c.qscale * 1e-3);
  EXPECT_LT(fd_check(loss, t.q.data(), static_cast<int64_t>(t.q.size()), dq.data(), qeps, 40), 2e-2)
      << "query " << name_of(c);
}

TEST_P(DepthAttention, BackwardAccumulates) {
  MixSetup t(GetParam());
  const int64_t nd = t.N * t.d;
  auto R = randn(nd, 5);
  std::vector<float> x(nd), lse(t.N * t.m.H);
  auto s = t.src();
  ops::depth_mix_forward(x.data(), lse.data(), s.data(), t.S, t.q.data(), t.q_ld, t.m, t.N);
  std::vector<float> dq0(t.q.size(), 0.0f), dq1(t.q.size(), 1.0f);
  ops::depth_mix_backward(dq0.data(), R.data(), x.data(), lse.data(), s.data(), t.S, t.q.data(),
                          t.q_ld, t.m, t.N);
  auto g0 = t.g[2];
  for (auto& gv : t.g) std::fill(gv.begin(), gv.end(), 1.0f);
  ops::depth_mix_backward(dq1.data(), R.data(), x.data(), lse.data(), s.data(), t.S, t.q.data(),
                          t.q_ld, t.m, t.N);
  for (int64_t i = 0; i < nd; i++)
    ASSERT_NEAR(t.g[2][i], g0[i] + 1.0f, 1e-4 * (1 + std::abs(g0[i])));
  for (size_t i = 0; i < dq0.size(); i++)
    ASSERT_NEAR(dq1[i], dq0[i] + 1.0f, 1e-4 * (1 + std::abs(dq0[i])));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, DepthAttention,
    ::testing::Values(Case{true, true, 1, false, 1.0}, Case{true, true, 1, false, 30.0},
                      Case{false, true, 1, false, 1.0}, Case{true, false, 1, false, 1.0},
                      Case{true, true, 4, false, 1.0}, Case{true, true, 1, true, 1.0},
                      Case{false, false, 2, true, 1.0}, Case{true, true, 4, true, 30.0}),
    [](const auto& param_info) { return name_of(param_info.param); });

TEST(DepthAttentionTwoPhase, EqualsOnePhase) {
  for (int64_t H : {1, 4}) {
    MixSetup t(Case{true, true, H, false, 3.0});
    const int64_t K = 3, nd = t.N * t.d, nh = t.N * H;
    // Sources 0..S-2 are "completed blocks"; the last is each query's partial sum.
    std::vector<std::vector<float>> qs;
    for (int64_t k = 0; k < K; k++) qs.push_back(randn(t.d, 50 + k, 3.0));
    auto s = t.src();
    std::vector<std::vector<float>> o(K, std::vector<float>(nd)), l1(K, std::vector<float>(nh));
    std::vector<float*> op, lp;
    std::vector<const float*> qp;
    for (int64_t k = 0; k < K; k++) {
      op.push_back(o[k].data());
      lp.push_back(l1[k].data());
      qp.push_back(qs[k].data());
    }
    ops::depth_mix_phase1(op.data(), lp.data(), s.data(), t.S - 1, qp.data(), K, t.m, t.N);
    for (int64_t k = 0; k < K; k++) {
      std::vector<float> ref(nd), lref(nh), one(nd), lone(nh), x(nd), lse(nh);
      // phase 1 alone == one-phase over the completed sources
      ops::depth_mix_forward(ref.data(), lref.data(), s.data(), t.S - 1, qs[k].data(), 0, t.m, t.N);
      EXPECT_LT(rel_diff(o[k].data(), ref.data(), nd), 1e-6);
      EXPECT_LT(rel_diff(l1[k].data(), lref.data(), nh), 1e-6);
      // phase 2 merge == one-phase over all sources
      ops::depth_mix_phase2(x.data(), lse.data(), o[k].data(), l1[k].data(), s[t.S - 1],
                            qs[k].data(), t.m, t.N);
      ops::depth_mix_forward(one.data(), lone.data(), s.data(), t.S, qs[k].data(), 0, t.m, t.N);
      EXPECT_LT(rel_diff(x.data(), one.data(), nd), 1e-6) << "H=" << H << " k=" << k;
      EXPECT_LT(rel_diff(lse.data(), lone.data(), nh), 1e-6);
    }
  }
}

TEST(DepthAttentionProperties, ZeroQueryIsUniformAverage) {
  MixSetup t(Case{true, true, 2, false, 1.0});
  std::fill(t.q.begin(), t.q.end(), 0.0f);
  auto s = t.src();
  std::vector<float> x(t.N * t.d), lse(t.N * 2);
  ops::depth_mix_forward(x.data(), lse.data(), s.data(), t.S, t.q.data(), 0, t.m, t.N);
  for (int64_t j = 0; j < t.N * t.d; j++) {
    double mean = 0;
    for (int64_t i = 0; i < t.S; i++) mean += t.v[i][j] / double(t.S);
    ASSERT_NEAR(x[j], mean, 1e-4 * (1 + std::abs(mean)));
  }
  for (float l : lse) ASSERT_NEAR(l, std::log(double(t.S)), 1e-5);
}

}  // namespace
