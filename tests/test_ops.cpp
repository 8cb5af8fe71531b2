// Every op: backward vs central finite differences, backward accumulates (+=), and every fast
// kernel vs its reference. One table row per (op, input).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "core/bf16.hpp"
#include "core/blas.hpp"
#include "core/simd.hpp"
#include "core/vmath.hpp"
#include "ops/ops.hpp"
#include "test_util.hpp"

using namespace attnres;
using attnres::testing::dot;
using attnres::testing::fd_check;
using attnres::testing::randn;
using attnres::testing::rel_diff;

namespace {
constexpr double kTol = 2e-2;  // fp32 forward, fp64 differences with eps = 1e-3
}

TEST(Ops, SgemmMatchesReferenceAllTransposes) {
  const int64_t M = 37, N = 29, K = 45;
  for (int ta = 0; ta < 2; ta++) {
    for (int tb = 0; tb < 2; tb++) {
      auto A = randn(M * K, 1), B = randn(K * N, 2), C0 = randn(M * N, 3);
      auto C1 = C0, C2 = C0;
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      sgemm(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 1.0f, C1.data(), N);
      sgemm_reference(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 1.0f, C2.data(), N);
      EXPECT_LT(rel_diff(C1.data(), C2.data(), M * N), 1e-5) << "ta=" << ta << " tb=" << tb;
    }
  }
}

// bf16 rounding by its definition (round to nearest, ties to even): values worked out by hand.
TEST(Ops, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16_bits(1.00390625f), 0x3f80);  // 1 + 2^-8: a tie, to the even 1
  EXPECT_EQ(float_to_bf16_bits(1.01171875f), 0x3f82);  // 1 + 3 2^-8: a tie, to the even 1 + 2^-6
  EXPECT_EQ(float_to_bf16_bits(std::nextafter(1.00390625f, 2.0f)), 0x3f81);  // above: up
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::nanf("")))));
  EXPECT_EQ(bf16_bits_to_float(0x3f82), 1.015625f);
  // The threaded host conversion is the scalar one.
  const auto x = randn(300001, 7, 100.0);
  std::vector<uint16_t> b(x.size());
  std::vector<float> back(x.size());
  to_bf16_host(b.data(), x.data(), static_cast<int64_t>(x.size()));
  from_bf16_host(back.data(), b.data(), static_cast<int64_t>(b.size()));
  for (size_t i = 0; i < x.size(); i += 997) {
    ASSERT_EQ(b[i], float_to_bf16_bits(x[i])) << i;
    ASSERT_EQ(back[i], bf16_bits_to_float(b[i])) << i;
  }
}

// gemm_bf16 (oneDNN's matmul primitive where the CPU has bf16, else widened) and its widened path
// against the double-accumulating reference on the same bf16 values: every transpose, both betas,
// leading dimensions wider than the rows, shapes thin and odd.
TEST(Ops, GemmBf16MatchesReferenceAllTransposes) {
  struct Case {
    int64_t M, N, K;
  };
  for (const Case c : {Case{37, 29, 45}, Case{1, 64, 128}, Case{3, 70, 133}, Case{4, 5, 16},
                       Case{130, 3, 17}, Case{64, 96, 1}}) {
    for (int t = 0; t < 8; t++) {
      const bool ta = t & 1, tb = t & 2;
      const float beta = (t & 4) ? 1.0f : 0.0f;
      const int64_t M = c.M, N = c.N, K = c.K;
      const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
      auto bits = [](const std::vector<float>& v) {
        std::vector<uint16_t> r(v.size());
        for (size_t i = 0; i < v.size(); i++) r[i] = float_to_bf16_bits(v[i]);
        return r;
      };
      const auto A = bits(randn((ta ? K : M) * lda, 1)), B = bits(randn((tb ? N : K) * ldb, 2));
      const auto C0 = randn(M * ldc, 3);
      auto fast = C0, widened = C0, ref = C0;
      gemm_bf16(ta, tb, M, N, K, A.data(), lda, B.data(), ldb, beta, fast.data(), ldc);
      gemm_bf16_widened(ta, tb, M, N, K, A.data(), lda, B.data(), ldb, beta, widened.data(), ldc);
      gemm_bf16_reference(ta, tb, M, N, K, A.data(), lda, B.data(), ldb, beta, ref.data(), ldc);
      const std::string what = "M=" + std::to_string(M) + " N=" + std::to_string(N) +
                               " K=" + std::to_string(K) + " ta=" + std::to_string(ta) +
                               " tb=" + std::to_string(tb) + " beta=" + std::to_string(beta);
      EXPECT_LT(rel_diff(fast.data(), ref.data(), M * ldc), 1e-5) << what;
      EXPECT_LT(rel_diff(widened.data(), ref.data(), M * ldc), 1e-5) << what;
      for (int64_t i = 0; i < M; i++) {  // the padding between rows is left alone
        for (int64_t j = N; j < ldc; j++) ASSERT_EQ(fast[i * ldc + j], C0[i * ldc + j]) << what;
      }
    }
  }
  std::printf("gemm_bf16 ran %s\n", cpu_has_bf16() ? "natively (oneDNN, AVX512-BF16)"
                                                   : "widened to fp32 (no AVX512-BF16 here)");
}

TEST(Ops, EmbeddingGradient) {
  const int64_t V = 11, C = 6, N = 9;
  std::vector<int32_t> ids = {3, 1, 3, 0, 10, 3, 7, 1, 2};  // repeats must accumulate
  auto wte = randn(V * C, 1), R = randn(N * C, 2);
  std::vector<float> out(N * C), dwte(V * C, 0.0f);
  auto loss = [&] {
    ops::embedding_forward(out.data(), ids.data(), wte.data(), N, C);
    return dot(out.data(), R.data(), N * C);
  };
  ops::embedding_backward(dwte.data(), R.data(), ids.data(), N, C);
  EXPECT_LT(fd_check(loss, wte.data(), V * C, dwte.data(), 1e-3, 1000), kTol);
}

TEST(Ops, RmsNormGradient) {
  const int64_t N = 5, C = 16;
  auto x = randn(N * C, 1, 3.0), g = randn(C, 2), R = randn(N * C, 3);
  std::vector<float> out(N * C), rstd(N), dx(N * C, 0.0f), dg(C, 0.0f);
  const float eps = 1e-5f;
  auto loss = [&] {
    ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), g.data(), N, C, eps);
    return dot(out.data(), R.data(), N * C);
  };
  loss();
  ops::rmsnorm_backward(dx.data(), dg.data(), R.data(), x.data(), g.data(), rstd.data(), N, C);
  EXPECT_LT(fd_check(loss, x.data(), N * C, dx.data()), kTol);
  EXPECT_LT(fd_check(loss, g.data(), C, dg.data()), kTol);
  // Forward against the formula in double (recompute: fd_check left `out` at a perturbed point).
  loss();
  for (int64_t n = 0; n < N; n++) {
    double ss = 0;
    for (int64_t c = 0; c < C; c++) ss += double(x[n * C + c]) * x[n * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    for (int64_t c = 0; c < C; c++) EXPECT_NEAR(out[n * C + c], x[n * C + c] * r * g[c], 1e-5);
  }
}

TEST(Ops, MatmulGradient) {
  const int64_t N = 7, IC = 13, OC = 9;
  auto x = randn(N * IC, 1), w = randn(OC * IC, 2), R = randn(N * OC, 3);
  std::vector<float> out(N * OC), dx(N * IC, 0.0f), dw(OC * IC, 0.0f);
  auto loss = [&] {
    ops::matmul_forward(out.data(), x.data(), w.data(), N, IC, OC);
    return dot(out.data(), R.data(), N * OC);
  };
  ops::matmul_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), N, IC, OC);
  EXPECT_LT(fd_check(loss, x.data(), N * IC, dx.data()), kTol);
  EXPECT_LT(fd_check(loss, w.data(), OC * IC, dw.data()), kTol);
}

TEST(Ops, RopeGradientAndInverse) {
  const int64_t B = 2, T = 5, H = 3, hd = 8, ld = H * hd + 4;  // padded rows: ld > H*hd
  std::vector<float> cs(T * hd / 2), sn(T * hd / 2);
  ops::rope_table(cs.data(), sn.data(), T, hd, 10000.0);
  auto x = randn(B * T * ld, 1), R = randn(B * T * ld, 2);
  auto loss = [&] {
    auto y = x;
    ops::rope_forward(y.data(), cs.data(), sn.data(), B, T, H, hd, ld, 0);
    return dot(y.data(), R.data(), B * T * ld);
  };
  auto dx = R;  // the gradient of a rotation is the inverse rotation of dout
  ops::rope_backward(dx.data(), cs.data(), sn.data(), B, T, H, hd, ld, 0);
  EXPECT_LT(fd_check(loss, x.data(), B * T * ld, dx.data()), kTol);
  // Position 0 is the identity; position p rotates pair (i, i+hd/2) by p * theta^(-2i/hd).
  auto y = x;
  ops::rope_forward(y.data(), cs.data(), sn.data(), B, T, H, hd, ld, 0);
  for (int64_t i = 0; i < H * hd; i++) EXPECT_EQ(y[i], x[i]);
  const int64_t t = 3, i = 1;
  const double a = t * std::pow(10000.0, -2.0 * i / hd);
  const float x1 = x[t * ld + i], x2 = x[t * ld + i + hd / 2];
  EXPECT_NEAR(y[t * ld + i], x1 * std::cos(a) - x2 * std::sin(a), 1e-5);
  EXPECT_NEAR(y[t * ld + i + hd / 2], x2 * std::cos(a) + x1 * std::sin(a), 1e-5);
}

struct AttnCase {
  int64_t B, T, H, Hkv, hd;
};

class AttentionOps : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionOps, FastMatchesReferenceAndGradient) {
  const AttnCase c = GetParam();
  const ops::AttnShape s{c.B, c.T, c.H, c.Hkv, c.hd};
  const int64_t N = c.B * c.T, HD = c.H * c.hd, att_n = c.B * c.H * c.T * c.T;
  auto qkv = randn(N * s.ld(), 1), R = randn(N * HD, 2);
  std::vector<float> o1(N * HD), o2(N * HD), a1(att_n), a2(att_n);
  ops::attention_forward(o1.data(), a1.data(), qkv.data(), s);
  ops::attention_forward_reference(o2.data(), a2.data(), qkv.data(), s);
  EXPECT_LT(rel_diff(o1.data(), o2.data(), N * HD), 1e-5);
  EXPECT_LT(rel_diff(a1.data(), a2.data(), att_n), 1e-5);

  std::vector<float> d1(N * s.ld(), 0.5f), d2(N * s.ld(), 0.5f), scratch(att_n);  // += check
  ops::attention_backward(d1.data(), scratch.data(), R.data(), qkv.data(), a1.data(), s);
  ops::attention_backward_reference(d2.data(), R.data(), qkv.data(), a2.data(), s);
  EXPECT_LT(rel_diff(d1.data(), d2.data(), N * s.ld()), 1e-5);
  for (auto& v : d1) v -= 0.5f;
  auto loss = [&] {
    ops::attention_forward_reference(o2.data(), a2.data(), qkv.data(), s);
    return dot(o2.data(), R.data(), N * HD);
  };
  EXPECT_LT(fd_check(loss, qkv.data(), N * s.ld(), d1.data(), 1e-3, 96), kTol);

  // Causality: changing the last token's q/k/v must not change earlier outputs.
  auto q2 = qkv;
  for (int64_t b = 0; b < c.B; b++) {
    for (int64_t j = 0; j < s.ld(); j++) q2[(b * c.T + c.T - 1) * s.ld() + j] += 1.0f;
  }
  ops::attention_forward(o2.data(), a2.data(), q2.data(), s);
  for (int64_t b = 0; b < c.B; b++) {
    for (int64_t t = 0; t + 1 < c.T; t++) {
      for (int64_t j = 0; j < HD; j++) {
        ASSERT_EQ(o1[(b * c.T + t) * HD + j], o2[(b * c.T + t) * HD + j]);
      }
    }
  }
}

TEST_P(AttentionOps, DecodeMatchesFullForward) {
  const AttnCase c = GetParam();
  const ops::AttnShape s{1, c.T, c.H, c.Hkv, c.hd};
  const int64_t T = c.T, HD = c.H * c.hd, KV = c.Hkv * c.hd;
  auto qkv = randn(T * s.ld(), 3);
  std::vector<float> full(T * HD), att(c.H * T * T);
  ops::attention_forward(full.data(), att.data(), qkv.data(), s);
  std::vector<float> kc(T * KV), vc(T * KV), q(T * HD), out(T * HD);
  for (int64_t t = 0; t < T; t++) {
    std::copy_n(qkv.data() + t * s.ld(), HD, q.data() + t * HD);
    std::copy_n(qkv.data() + t * s.ld() + HD, KV, kc.data() + t * KV);
    std::copy_n(qkv.data() + t * s.ld() + HD + KV, KV, vc.data() + t * KV);
  }
  const int64_t split = T / 2;  // a "prefill" chunk, then one token at a time
  ops::attention_decode(out.data(), q.data(), kc.data(), vc.data(), split, 0, c.H, c.Hkv, c.hd);
  for (int64_t t = split; t < T; t++) {
    ops::attention_decode(out.data() + t * HD, q.data() + t * HD, kc.data(), vc.data(), 1, t, c.H,
                          c.Hkv, c.hd);
  }
  EXPECT_LT(rel_diff(out.data(), full.data(), T * HD), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionOps,
                         ::testing::Values(AttnCase{2, 5, 2, 2, 4}, AttnCase{1, 7, 4, 2, 6},
                                           AttnCase{2, 9, 6, 1, 4}, AttnCase{1, 1, 2, 1, 4},
                                           AttnCase{1, 150, 2, 1, 8}));  // 3 row blocks

TEST(Ops, SwigluGradient) {
  const int64_t N = 4, F = 10;
  auto h13 = randn(N * 2 * F, 1, 2.0), R = randn(N * F, 2);
  std::vector<float> out(N * F), dh(N * 2 * F, 0.0f);
  auto loss = [&] {
    ops::swiglu_forward(out.data(), h13.data(), N, F);
    return dot(out.data(), R.data(), N * F);
  };
  ops::swiglu_backward(dh.data(), R.data(), h13.data(), N, F);
  EXPECT_LT(fd_check(loss, h13.data(), N * 2 * F, dh.data(), 1e-3, 200), kTol);
  loss();
  const float x = h13[0], gte = h13[F];
  EXPECT_NEAR(out[0], x / (1 + std::exp(-x)) * gte, 1e-5);
}

TEST(Ops, CrossEntropyGradientAndValue) {
  const int64_t N = 6, V = 17;
  auto z = randn(N * V, 1, 3.0);
  std::vector<int32_t> tg = {0, 16, 3, 3, 8, 11};
  std::vector<float> lse(N), losses(N), dz(N * V);
  auto loss = [&] {
    return ops::cross_entropy_forward(nullptr, lse.data(), z.data(), tg.data(), N, V);
  };
  const double mean =
      ops::cross_entropy_forward(losses.data(), lse.data(), z.data(), tg.data(), N, V);
  ops::cross_entropy_backward(dz.data(), z.data(), lse.data(), tg.data(), N, V, 1.0f / N);
  EXPECT_LT(fd_check(loss, z.data(), N * V, dz.data(), 1e-3, 200), kTol);
  double m = 0;
  for (int64_t n = 0; n < N; n++) {
    double s = 0;
    for (int64_t v = 0; v < V; v++) s += std::exp(double(z[n * V + v]));
    const double l = std::log(s) - z[n * V + tg[n]];
    EXPECT_NEAR(losses[n], l, 1e-5);
    m += l / N;
  }
  EXPECT_NEAR(mean, m, 1e-6);
  // Large logits must not overflow.
  std::vector<float> big = {1000.0f, 0.0f, -1000.0f};
  int32_t t0 = 0;
  float l1;
  EXPECT_NEAR(ops::cross_entropy_forward(nullptr, &l1, big.data(), &t0, 1, 3), 0.0, 1e-6);
}

TEST(Ops, BackwardAccumulates) {
  // Each backward must add to what the gradient buffer already holds.
  const int64_t N = 3, C = 8;
  auto x = randn(N * C, 1), g = randn(C, 2), R = randn(N * C, 3);
  std::vector<float> out(N * C), rstd(N), dx0(N * C, 0.0f), dg0(C, 0.0f), dx1(N * C, 1.0f),
      dg1(C, 2.0f);
  ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), g.data(), N, C, 1e-5f);
  ops::rmsnorm_backward(dx0.data(), dg0.data(), R.data(), x.data(), g.data(), rstd.data(), N, C);
  ops::rmsnorm_backward(dx1.data(), dg1.data(), R.data(), x.data(), g.data(), rstd.data(), N, C);
  for (int64_t i = 0; i < N * C; i++) EXPECT_NEAR(dx1[i], dx0[i] + 1.0f, 1e-5);
  for (int64_t i = 0; i < C; i++) EXPECT_NEAR(dg1[i], dg0[i] + 2.0f, 1e-5);
  std::vector<float> h13 = randn(N * 2 * C, 4), dh0(N * 2 * C, 0.0f), dh1(N * 2 * C, 1.0f);
  ops::swiglu_backward(dh0.data(), R.data(), h13.data(), N, C);
  ops::swiglu_backward(dh1.data(), R.data(), h13.data(), N, C);
  for (int64_t i = 0; i < N * 2 * C; i++) EXPECT_NEAR(dh1[i], dh0[i] + 1.0f, 1e-5);
}

// Issue 19: a row whose squares overflow float has no RMS scale: NaN (the scale was 0, every
// output 0, and a model of such weights reported the uniform loss ln V as its result). A large
// row whose squares fit keeps its ordinary scale.
TEST(Ops, RmsNormOfAnOverflowingRowIsNaN) {
  const int64_t C = 4;
  std::vector<float> g(C, 1.0f), out(2 * C), rstd(2);
  std::vector<float> x = {3e19f, -3e19f, 1e19f, 0.0f, 1e18f, 1e18f, -1e18f, 1e18f};
  ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), g.data(), 2, C, 1e-5f);
  EXPECT_TRUE(std::isnan(rstd[0]));
  for (int64_t c = 0; c < C; c++) EXPECT_TRUE(std::isnan(out[c])) << c;
  EXPECT_FLOAT_EQ(rstd[1], 1e-18f);
  EXPECT_FLOAT_EQ(out[C], 1.0f);
  std::vector<float> r(2);
  ops::depth_rstd(r.data(), x.data(), 2, C, 1, 1e-5f);
  EXPECT_TRUE(std::isnan(r[0]));
  EXPECT_FLOAT_EQ(r[1], 1e-18f);
}

TEST(Ops, ScalarMixGradientAndDeterminism) {
  const int64_t S = 3, n = 50;
  std::vector<std::vector<float>> v = {randn(n, 1), randn(n, 2, 3.0), randn(n, 3, 0.1)};
  std::vector<float> w = {0.5f, -1.25f, 2.0f};
  auto R = randn(n, 9);
  std::vector<float> out(n);
  auto loss = [&] {
    std::vector<const float*> src = {v[0].data(), v[1].data(), v[2].data()};
    ops::scalar_mix_forward(out.data(), src.data(), w.data(), S, n);
    return dot(out.data(), R.data(), n);
  };
  std::vector<std::vector<float>> g(S, std::vector<float>(n, 0.0f));
  std::vector<float*> dsrc = {g[0].data(), g[1].data(), g[2].data()};
  std::vector<const float*> src = {v[0].data(), v[1].data(), v[2].data()};
  std::vector<double> dw(S, 0.0), dw2(S, 0.0);
  ops::scalar_mix_backward(dsrc.data(), dw.data(), R.data(), src.data(), w.data(), S, n);
  for (int64_t i = 0; i < S; i++) EXPECT_LT(fd_check(loss, v[i].data(), n, g[i].data()), kTol);
  std::vector<float> dwf(dw.begin(), dw.end());
  EXPECT_LT(fd_check(loss, w.data(), S, dwf.data()), kTol);
  std::vector<float*> none = {nullptr, nullptr, nullptr};
  ops::scalar_mix_backward(none.data(), dw2.data(), R.data(), src.data(), w.data(), S, n);
  for (int64_t i = 0; i < S; i++) EXPECT_EQ(dw[i], dw2[i]);  // same order of summation every call
}

TEST(Ops, VectorExpMatchesStdExp) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.5f; x += 0.001953125f) {  // every 2^-9 over the range
    const double ref = std::exp(double(x));
    worst = std::max(worst, std::abs(double(vexpf(x)) - ref) / ref);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(vexpf(0.0f), 1.0f);
  EXPECT_GT(vexpf(-INFINITY), 0.0f);  // clamped, no NaN
  EXPECT_LT(vexpf(-INFINITY), 1e-37f);
  EXPECT_TRUE(std::isfinite(vexpf(INFINITY)));  // clamped, no overflow
  // NaN in, NaN out, without the undefined float -> int conversion of NaN that UBSan found (in
  // scripts/sanitize.sh, Faults.PoisonedCheckpointIsDetectedOnResume).
  EXPECT_TRUE(std::isnan(vexpf(NAN)));
  EXPECT_TRUE(std::isnan(vexpf(-NAN)));
  EXPECT_TRUE(std::isfinite(vexpf(1000.0f)));
}

// The multi-accumulator dots: close to a double reference at every length (vector body, 16-wide
// remainder, scalar tail), and dot2's two results bit-identical to dot()'s.
TEST(Ops, SimdDotsMatchReferenceAndEachOther) {
  for (int64_t n : {1, 7, 16, 33, 64, 100, 512, 1000}) {
    auto a = randn(n, 1), b = randn(n, 2), c = randn(n, 3);
    double ref_ab = 0, ref_cb = 0, mag = 0;
    for (int64_t i = 0; i < n; i++) {
      ref_ab += double(a[i]) * b[i];
      ref_cb += double(c[i]) * b[i];
      mag += std::abs(double(a[i]) * b[i]) + std::abs(double(c[i]) * b[i]);
    }
    const float ab = simd::dot(a.data(), b.data(), n);
    EXPECT_NEAR(ab, ref_ab, 1e-6 * mag) << "n " << n;
    float ab2, cb2;
    simd::dot2(a.data(), c.data(), b.data(), n, &ab2, &cb2);
    EXPECT_EQ(ab2, ab) << "n " << n;
    EXPECT_EQ(cb2, simd::dot(c.data(), b.data(), n)) << "n " << n;
    EXPECT_NEAR(cb2, ref_cb, 1e-6 * mag) << "n " << n;
  }
}
