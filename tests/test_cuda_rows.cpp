// The CUDA backend's row kernels (src/cuda/row_kernels.hpp) run on the host, every index in turn,
// against the CPU ops: their arithmetic and indexing are verified on every machine, GPU or not.
// (tests/test_cuda.cpp runs the same functors as real kernels where a GPU is present.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attnres/optim.hpp"
#include "attnres/params.hpp"
#include "cuda/row_kernels.hpp"
#include "ops/ops.hpp"
#include "test_util.hpp"

using namespace attnres;
namespace rows = attnres::cuda::rows;
using attnres::testing::randn;
using attnres::testing::rel_diff;

namespace {

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_diff(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

std::vector<int32_t> ids(int64_t n, int64_t V, uint64_t seed) {
  std::vector<int32_t> r(n);
  for (int64_t i = 0; i < n; i++) r[i] = static_cast<int32_t>((i * 7919 + seed * 104729) % V);
  return r;
}

}  // namespace

TEST(CudaRows, EmbeddingMatchesCpu) {
  const int64_t N = 37, C = 24, V = 11;
  const auto wte = randn(V * C, 1), dout = randn(N * C, 2);
  const auto id = ids(N, V, 3);
  std::vector<float> a(N * C), b(N * C);
  ops::embedding_forward(a.data(), id.data(), wte.data(), N, C);
  rows::run_rows_host(rows::EmbeddingForward{b.data(), id.data(), wte.data(), C}, N * C);
  EXPECT_EQ(a, b);
  std::vector<float> da = randn(V * C, 4), db = da;  // accumulates
  ops::embedding_backward(da.data(), dout.data(), id.data(), N, C);
  // Rows grouped by id, as RowBackend::embedding_backward does: the same additions in the same
  // order, so the result is bit-identical.
  std::vector<int32_t> perm(N), start, tok;
  for (int64_t n = 0; n < N; n++) perm[n] = static_cast<int32_t>(n);
  std::stable_sort(perm.begin(), perm.end(), [&](int32_t x, int32_t y) { return id[x] < id[y]; });
  for (int64_t k = 0; k < N; k++) {
    if (k == 0 || id[perm[k]] != id[perm[k - 1]]) {
      start.push_back(static_cast<int32_t>(k));
      tok.push_back(id[perm[k]]);
    }
  }
  start.push_back(static_cast<int32_t>(N));
  const int32_t G = static_cast<int32_t>(tok.size());
  // launched over N * C indices as the backend does: those past the G groups must do nothing
  rows::run_rows_host(rows::EmbeddingBackwardGrouped{db.data(), dout.data(), perm.data(),
                                                     start.data(), tok.data(), &G, C},
                      N * C);
  EXPECT_EQ(da, db);
}

TEST(CudaRows, RmsNormMatchesCpu) {
  const int64_t N = 29, C = 48;
  const auto x = randn(N * C, 5, 3.0), g = randn(C, 6), dy = randn(N * C, 7);
  std::vector<float> ya(N * C), yb(N * C), ra(N), rb(N);
  ops::rmsnorm_forward(ya.data(), ra.data(), x.data(), g.data(), N, C, 1e-5f);
  rows::run_rows_host(rows::RmsNormForward{yb.data(), rb.data(), x.data(), g.data(), C, 1e-5f}, N);
  EXPECT_LT(rel(ya, yb), 1e-6);
  EXPECT_LT(rel(ra, rb), 1e-6);
  std::vector<float> dxa = randn(N * C, 8), dxb = dxa, dga = randn(C, 9), dgb = dga;
  ops::rmsnorm_backward(dxa.data(), dga.data(), dy.data(), x.data(), g.data(), ra.data(), N, C);
  rows::run_rows_host(
      rows::RmsNormBackwardInput{dxb.data(), dy.data(), x.data(), g.data(), ra.data(), C}, N);
  const int64_t R = 4, K = (N + R - 1) / R;  // chunks of 4 rows, the last one short
  std::vector<float> part(K * C);
  rows::run_rows_host(
      rows::RmsNormGainPartial{part.data(), dy.data(), x.data(), ra.data(), N, C, R}, K * C);
  rows::run_rows_host(rows::ColumnSumAdd{dgb.data(), part.data(), K, C}, C);
  EXPECT_LT(rel(dxa, dxb), 1e-5);
  EXPECT_LT(rel(dga, dgb), 1e-5);
}

TEST(CudaRows, SwigluMatchesCpu) {
  const int64_t N = 13, F = 40;
  const auto h13 = randn(N * 2 * F, 10, 2.0), dy = randn(N * F, 11);
  std::vector<float> a(N * F), b(N * F);
  ops::swiglu_forward(a.data(), h13.data(), N, F);
  rows::run_rows_host(rows::SwigluForward{b.data(), h13.data(), F}, N * F);
  EXPECT_LT(rel(a, b), 1e-6);
  std::vector<float> da = randn(N * 2 * F, 12), db = da;
  ops::swiglu_backward(da.data(), dy.data(), h13.data(), N, F);
  rows::run_rows_host(rows::SwigluBackward{db.data(), dy.data(), h13.data(), F}, N * F);
  EXPECT_LT(rel(da, db), 1e-6);
}

TEST(CudaRows, RopeMatchesCpu) {
  const int64_t B = 2, T = 9, H = 3, hd = 8, ld = 5 * hd, pos0 = 4;
  std::vector<float> cs((pos0 + T) * hd / 2), sn(cs.size());
  ops::rope_table(cs.data(), sn.data(), pos0 + T, hd, 10000.0);
  for (float sign : {1.0f, -1.0f}) {
    std::vector<float> a = randn(B * T * ld, 13), b = a;
    if (sign > 0) {
      ops::rope_forward(a.data(), cs.data(), sn.data(), B, T, H, hd, ld, pos0);
    } else {
      ops::rope_backward(a.data(), cs.data(), sn.data(), B, T, H, hd, ld, pos0);
    }
    rows::run_rows_host(rows::Rope{b.data(), cs.data(), sn.data(), T, H, hd, ld, pos0, sign},
                        B * T * H * hd / 2);
    EXPECT_LT(rel(a, b), 1e-6) << sign;
  }
}

TEST(CudaRows, CrossEntropyMatchesCpu) {
  const int64_t N = 17, V = 33;
  const auto logits = randn(N * V, 14, 4.0);
  const auto t = ids(N, V, 15);
  std::vector<float> la(N), lb(N), sa(N), sb(N);
  ops::cross_entropy_forward(la.data(), sa.data(), logits.data(), t.data(), N, V);
  rows::run_rows_host(rows::CrossEntropyForward{lb.data(), sb.data(), logits.data(), t.data(), V},
                      N);
  EXPECT_LT(rel(la, lb), 1e-5);
  EXPECT_LT(rel(sa, sb), 1e-6);
  std::vector<float> da(N * V), db = logits;  // in place, as the model does
  ops::cross_entropy_backward(da.data(), logits.data(), sa.data(), t.data(), N, V, 0.25f);
  rows::run_rows_host(
      rows::CrossEntropyBackward{db.data(), {db.data(), sa.data(), t.data(), V, 0.25f}}, N * V);
  EXPECT_LT(rel(da, db), 1e-5);
}

// The fused depth mix (AttnRes) and its backward against src/ops, over the variants the model
// uses: softmax or sigmoid gate, key norm or none, one or two heads, shared or per-token query.
TEST(CudaRows, DepthMixMatchesCpu) {
  const int64_t N = 19, d = 16, S = 5;
  for (bool softmax : {true, false}) {
    for (bool key_norm : {true, false}) {
      for (int64_t H : {1, 2}) {
        for (bool dynamic : {false, true}) {
          SCOPED_TRACE(std::string(softmax ? "softmax" : "sigmoid") +
                       (key_norm ? " rms" : " none") + " H=" + std::to_string(H) +
                       (dynamic ? " dynamic" : " static"));
          ops::DepthMix om;
          om.d = d;
          om.H = H;
          om.softmax = softmax;
          om.key_norm = key_norm;
          rows::Mix rm;
          rm.d = d;
          rm.H = H;
          rm.softmax = softmax;
          rm.key_norm = key_norm;
          const int64_t q_ld = dynamic ? d : 0;
          const auto q = randn(dynamic ? N * d : d, 20, 0.7);
          std::vector<std::vector<float>> v, r(S, std::vector<float>(N * H));
          for (int64_t i = 0; i < S; i++) {
            v.push_back(randn(N * d, 30 + i, 1.0 + i));  // sources of different scales
            ops::depth_rstd(r[i].data(), v[i].data(), N, d, H, 1e-5f);
          }
          std::vector<std::vector<float>> dva(S), dvb(S);
          std::vector<ops::DepthSource> os;
          std::vector<rows::Source> rs;
          for (int64_t i = 0; i < S; i++) {
            dva[i] = randn(N * d, 40 + i);  // accumulates
            dvb[i] = dva[i];
            os.push_back({v[i].data(), r[i].data(), dva[i].data()});
            rs.push_back({v[i].data(), r[i].data(), i == 2 ? nullptr : dvb[i].data()});
          }
          os[2].dv = nullptr;  // a source whose gradient is dropped
          std::vector<float> xa(N * d), xb(N * d), la(N * H), lb(N * H);
          ops::depth_mix_forward(xa.data(), la.data(), os.data(), S, q.data(), q_ld, om, N);
          rows::run_rows_host(
              rows::DepthMixForward{xb.data(), lb.data(), rs.data(), S, q.data(), q_ld, rm}, N * H);
          EXPECT_LT(rel(xa, xb), 1e-5);
          if (softmax) {
            EXPECT_LT(rel(la, lb), 1e-5);
          }

          const auto dx = randn(N * d, 50);
          std::vector<float> dqa = dynamic ? randn(N * d, 51) : randn(d, 51), dqb = dqa;
          ops::depth_mix_backward(dqa.data(), dx.data(), xa.data(), la.data(), os.data(), S,
                                  q.data(), q_ld, om, N);
          std::vector<float> dq_rows(N * d, 0.0f);
          rows::run_rows_host(
              rows::DepthMixBackward{dynamic ? dqb.data() : dq_rows.data(), dx.data(), xa.data(),
                                     la.data(), rs.data(), S, q.data(), q_ld, rm},
              N * H);
          if (!dynamic) {
            const int64_t R = 7, K = (N + R - 1) / R;
            std::vector<float> part(K * d);
            rows::run_rows_host(rows::ColumnPartial{part.data(), dq_rows.data(), N, d, R}, K * d);
            rows::run_rows_host(rows::ColumnSumAdd{dqb.data(), part.data(), K, d}, d);
          }
          EXPECT_LT(rel(dqa, dqb), 1e-4);
          for (int64_t i = 0; i < S; i++) EXPECT_LT(rel(dva[i], dvb[i]), 1e-5) << "source " << i;
        }
      }
    }
  }
  // The rstd kernel itself.
  const auto v = randn(N * d, 60, 5.0);
  std::vector<float> ra(N * 2), rb(N * 2);
  ops::depth_rstd(ra.data(), v.data(), N, d, 2, 1e-5f);
  rows::run_rows_host(rows::DepthRstd{rb.data(), v.data(), d, 2, 1e-5f}, N * 2);
  EXPECT_LT(rel(ra, rb), 1e-6);
}

// AdamW's element update against the optimizer class (decayed and undecayed tensors, clipping
// scale, three steps so the bias corrections change).
TEST(CudaRows, AdamWMatchesOptimizer) {
  ParamLayout layout;
  layout.add("w", {7, 5}, true);
  layout.add("g", {5}, false);
  AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.weight_decay = 0.1;
  AdamW opt(layout, cfg);
  const int64_t n = layout.total();
  std::vector<float> pa = randn(n, 80), pb = pa, m(n, 0.0f), v(n, 0.0f);
  for (int step = 1; step <= 3; step++) {
    const auto g = randn(n, 90 + step);
    const double lr = cfg.lr * step / 3.0;
    const float scale = 0.7f;
    opt.step(pa.data(), g.data(), lr, scale);
    const double bc1 = 1.0 - std::pow(cfg.beta1, step);
    const double bc2 = std::sqrt(1.0 - std::pow(cfg.beta2, step));
    for (const ParamEntry& e : layout.entries()) {
      rows::AdamW k{pb.data() + e.offset,
                    g.data() + e.offset,
                    m.data() + e.offset,
                    v.data() + e.offset,
                    static_cast<float>(cfg.beta1),
                    static_cast<float>(cfg.beta2),
                    static_cast<float>(lr / bc1),
                    static_cast<float>(1.0 / bc2),
                    static_cast<float>(cfg.eps),
                    scale,
                    e.decay ? static_cast<float>(1.0 - lr * cfg.weight_decay) : 1.0f};
      rows::run_rows_host(k, e.numel);
    }
    EXPECT_LT(rel(pa, pb), 1e-6) << "step " << step;
  }
}

// bf16 rounding: exact cases computed by hand (ties to even, carry into the exponent, overflow to
// infinity, NaN stays NaN), and every float's round trip within half a bf16 ulp.
TEST(CudaRows, Bf16RoundsToNearestEven) {
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return rows::float_to_bf16_bits(f);
  };
  EXPECT_EQ(bits(0x3f800000u), 0x3f80);           // 1.0 exactly
  EXPECT_EQ(bits(0x3f808000u), 0x3f80);           // halfway, even below: stays
  EXPECT_EQ(bits(0x3f818000u), 0x3f82);           // halfway, odd below: rounds up to even
  EXPECT_EQ(bits(0x3f808001u), 0x3f81);           // just above halfway: up
  EXPECT_EQ(bits(0x3fff8000u), 0x4000);           // carry into the exponent (1.99.. -> 2.0)
  EXPECT_EQ(bits(0x7f7fffffu), 0x7f80);           // FLT_MAX rounds to +inf
  EXPECT_EQ(bits(0xff800000u), 0xff80);           // -inf stays
  EXPECT_EQ(bits(0x7fc00001u) & 0x7fc0, 0x7fc0);  // NaN stays NaN
  EXPECT_EQ(bits(0x7f800001u) & 0x7f80, 0x7f80);  // signalling NaN: still NaN, not inf
  EXPECT_NE(bits(0x7f800001u), 0x7f80);
  const auto x = randn(10000, 99, 100.0);
  std::vector<uint16_t> b(x.size());
  std::vector<float> y(x.size());
  rows::run_rows_host(rows::ToBf16{b.data(), x.data()}, static_cast<int64_t>(x.size()));
  rows::run_rows_host(rows::FromBf16{y.data(), b.data()}, static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); i++) {
    ASSERT_LE(std::abs(y[i] - x[i]), std::abs(x[i]) * (1.0f / 256)) << x[i];  // 2^-8 relative
  }
}
