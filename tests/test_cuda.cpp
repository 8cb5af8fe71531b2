// The CUDA backend on a GPU: every device kernel against the CPU ops (src/ops) on the same inputs,
// at fp32 tolerances. Skipped, with the reason, in builds without CUDA (-DATTNRES_CUDA=ON, see
// scripts/cuda_build.sh) and on machines without a usable GPU; the kernels' arithmetic is also
// checked on the host by tests/test_cuda_rows.cpp everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attnres/cuda.hpp"
#include "ops/ops.hpp"
#include "test_util.hpp"

#ifdef ATTNRES_WITH_CUDA
#include "cuda/device.hpp"
#include "cuda/row_kernels.hpp"
#endif

using namespace attnres;
using attnres::testing::randn;
using attnres::testing::rel_diff;

#define SKIP_WITHOUT_GPU()                                                     \
  do {                                                                         \
    std::string why;                                                           \
    if (cuda::device_count(&why) == 0) GTEST_SKIP() << "no GPU test: " << why; \
  } while (0)

TEST(Cuda, ReportsWhatThisBuildAndMachineOffer) {
  std::string why;
  const int n = cuda::device_count(&why);
  if (!cuda::compiled()) {
    EXPECT_EQ(n, 0);
    EXPECT_NE(why.find("-DATTNRES_CUDA=ON"), std::string::npos) << why;
  } else if (n == 0) {
    EXPECT_FALSE(why.empty());
  }
  std::printf("CUDA: %s\n", cuda::describe_device().c_str());
}

#ifdef ATTNRES_WITH_CUDA

namespace {

using cuda::DeviceVec;

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_diff(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

std::vector<int32_t> ids(int64_t n, int64_t V) {
  std::vector<int32_t> r(n);
  for (int64_t i = 0; i < n; i++) r[i] = static_cast<int32_t>((i * 7919 + 13) % V);
  return r;
}

}  // namespace

TEST(Cuda, MatmulMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 67, IC = 48, OC = 80;
  const auto x = randn(N * IC, 1), w = randn(OC * IC, 2), dy = randn(N * OC, 3);
  std::vector<float> y(N * OC), dx = randn(N * IC, 4), dw = randn(OC * IC, 5);
  DeviceVec<float> gx(x), gw(w), gdy(dy), gy(N * OC), gdx(dx), gdw(dw);
  ops::matmul_forward(y.data(), x.data(), w.data(), N, IC, OC);
  cuda::dev::matmul_forward(gy.data(), gx.data(), gw.data(), N, IC, OC);
  EXPECT_LT(rel(gy.download(), y), 1e-5);
  ops::matmul_forward(y.data(), x.data(), w.data(), N, IC, OC, /*accumulate=*/true);
  cuda::dev::matmul_forward(gy.data(), gx.data(), gw.data(), N, IC, OC, /*accumulate=*/true);
  EXPECT_LT(rel(gy.download(), y), 1e-5);
  ops::matmul_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), N, IC, OC);
  cuda::dev::matmul_backward(gdx.data(), gdw.data(), gdy.data(), gx.data(), gw.data(), N, IC, OC);
  EXPECT_LT(rel(gdx.download(), dx), 1e-5);
  EXPECT_LT(rel(gdw.download(), dw), 1e-5);
}

// bf16 conversion bit-exact with the host functor; the bf16 GEMM within bf16 rounding of fp32.
TEST(Cuda, Bf16ConversionAndGemm) {
  SKIP_WITHOUT_GPU();
  for (const int64_t IC : {int64_t{128}, int64_t{100}}) {  // and one not a multiple of 8
    SCOPED_TRACE("IC=" + std::to_string(IC));
    const int64_t N = 96, OC = 64;
    const auto x = randn(N * IC, 81), w = randn(OC * IC, 82);
    DeviceVec<float> gx(x), gw(w), gy(N * OC), gback(N * IC);
    DeviceVec<uint16_t> bx(N * IC), bw(OC * IC);
    cuda::dev::to_bf16(bx.data(), gx.data(), N * IC);
    cuda::dev::to_bf16(bw.data(), gw.data(), OC * IC);
    std::vector<uint16_t> want(N * IC);
    for (int64_t i = 0; i < N * IC; i++) want[i] = cuda::rows::float_to_bf16_bits(x[i]);
    EXPECT_EQ(bx.download(), want);
    cuda::dev::from_bf16(gback.data(), bx.data(), N * IC);
    EXPECT_LT(rel(gback.download(), x), 4e-3);
    std::vector<float> y(N * OC);
    ops::matmul_forward(y.data(), x.data(), w.data(), N, IC, OC);
    cuda::dev::matmul_forward_bf16(gy.data(), bx.data(), bw.data(), N, IC, OC);
    EXPECT_LT(rel(gy.download(), y), 1e-2);
  }
}

TEST(Cuda, RowKernelsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 70, C = 64, V = 37, F = 96;
  // embedding
  const auto wte = randn(V * C, 6), dout = randn(N * C, 7);
  const auto id = ids(N, V);
  DeviceVec<int32_t> gid(id);
  {
    std::vector<float> a(N * C), da = randn(V * C, 8);
    DeviceVec<float> gw(wte), ga(N * C), gdout(dout), gda(da);
    ops::embedding_forward(a.data(), id.data(), wte.data(), N, C);
    cuda::dev::embedding_forward(ga.data(), gid.data(), gw.data(), N, C);
    EXPECT_EQ(ga.download(), a);
    ops::embedding_backward(da.data(), dout.data(), id.data(), N, C);
    cuda::dev::embedding_backward(gda.data(), gdout.data(), gid.data(), N, C);
    EXPECT_LT(rel(gda.download(), da), 1e-6);
  }
  // rmsnorm
  {
    const auto x = randn(N * C, 9, 2.0), g = randn(C, 10);
    std::vector<float> y(N * C), r(N), dx = randn(N * C, 11), dg = randn(C, 12);
    DeviceVec<float> gx(x), gg(g), gy(N * C), gr(N), gdx(dx), gdg(dg), gdy(dout);
    ops::rmsnorm_forward(y.data(), r.data(), x.data(), g.data(), N, C, 1e-5f);
    cuda::dev::rmsnorm_forward(gy.data(), gr.data(), gx.data(), gg.data(), N, C, 1e-5f);
    EXPECT_LT(rel(gy.download(), y), 1e-5);
    ops::rmsnorm_backward(dx.data(), dg.data(), dout.data(), x.data(), g.data(), r.data(), N, C);
    cuda::dev::rmsnorm_backward(gdx.data(), gdg.data(), gdy.data(), gx.data(), gg.data(), gr.data(),
                                N, C);
    EXPECT_LT(rel(gdx.download(), dx), 1e-5);
    EXPECT_LT(rel(gdg.download(), dg), 1e-5);
  }
  // swiglu
  {
    const auto h = randn(N * 2 * F, 13), dy = randn(N * F, 14);
    std::vector<float> y(N * F), dh = randn(N * 2 * F, 15);
    DeviceVec<float> gh(h), gy(N * F), gdy(dy), gdh(dh);
    ops::swiglu_forward(y.data(), h.data(), N, F);
    cuda::dev::swiglu_forward(gy.data(), gh.data(), N, F);
    EXPECT_LT(rel(gy.download(), y), 1e-5);
    ops::swiglu_backward(dh.data(), dy.data(), h.data(), N, F);
    cuda::dev::swiglu_backward(gdh.data(), gdy.data(), gh.data(), N, F);
    EXPECT_LT(rel(gdh.download(), dh), 1e-5);
  }
  // rope, in place on q|k|v rows
  {
    const int64_t B = 2, T = N / 2, H = 4, hd = 16, ld = 6 * hd;
    std::vector<float> cs(T * hd / 2), sn(cs.size());
    ops::rope_table(cs.data(), sn.data(), T, hd, 10000.0);
    std::vector<float> x = randn(B * T * ld, 16);
    DeviceVec<float> gx(x), gc(cs), gs(sn);
    ops::rope_forward(x.data(), cs.data(), sn.data(), B, T - 3, H, hd, ld, 3);  // positions 3..
    cuda::dev::rope_forward(gx.data(), gc.data(), gs.data(), B, T - 3, H, hd, ld, 3);
    EXPECT_LT(rel(gx.download(), x), 1e-6);
    ops::rope_backward(x.data(), cs.data(), sn.data(), B, T, H, hd, ld, 0);
    cuda::dev::rope_backward(gx.data(), gc.data(), gs.data(), B, T, H, hd, ld, 0);
    EXPECT_LT(rel(gx.download(), x), 1e-6);
  }
  // cross-entropy (the backward in place, as the model runs it)
  {
    const auto logits = randn(N * V, 17, 3.0);
    const auto t = ids(N, V);
    std::vector<float> loss(N), lse(N), dl(N * V);
    DeviceVec<float> gl(logits), gloss(N), glse(N);
    DeviceVec<int32_t> gt(t);
    ops::cross_entropy_forward(loss.data(), lse.data(), logits.data(), t.data(), N, V);
    cuda::dev::cross_entropy_forward(gloss.data(), glse.data(), gl.data(), gt.data(), N, V);
    EXPECT_LT(rel(gloss.download(), loss), 1e-5);
    ops::cross_entropy_backward(dl.data(), logits.data(), lse.data(), t.data(), N, V, 0.5f);
    cuda::dev::cross_entropy_backward(gl.data(), gl.data(), glse.data(), gt.data(), N, V, 0.5f);
    EXPECT_LT(rel(gl.download(), dl), 1e-5);
  }
}

TEST(Cuda, DepthMixMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 300, d = 64, S = 6;
  for (bool softmax : {true, false}) {
    for (bool dynamic : {false, true}) {
      for (int64_t H : {1, 4}) {
        SCOPED_TRACE(std::string(softmax ? "softmax" : "sigmoid") + (dynamic ? " dynamic" : "") +
                     " H=" + std::to_string(H));
        ops::DepthMix om;
        om.d = d;
        om.H = H;
        om.softmax = softmax;
        cuda::dev::DepthMix gm;
        gm.d = d;
        gm.H = H;
        gm.softmax = softmax;
        const int64_t q_ld = dynamic ? d : 0;
        const auto q = randn(dynamic ? N * d : d, 20);
        std::vector<std::vector<float>> v, r, dv;
        std::vector<DeviceVec<float>> gv, gr, gdv;
        for (int64_t i = 0; i < S; i++) {
          v.push_back(randn(N * d, 30 + i, 1.0 + i));
          r.emplace_back(N * H);
          dv.push_back(randn(N * d, 40 + i));
          gv.emplace_back(v[i]);
          gr.emplace_back(N * H);
          gdv.emplace_back(dv[i]);
          ops::depth_rstd(r[i].data(), v[i].data(), N, d, H, 1e-5f);
          cuda::dev::depth_rstd(gr[i].data(), gv[i].data(), N, d, H, 1e-5f);
          EXPECT_LT(rel(gr[i].download(), r[i]), 1e-5);
        }
        std::vector<ops::DepthSource> os;
        std::vector<cuda::dev::DepthSource> gs;
        for (int64_t i = 0; i < S; i++) {
          os.push_back({v[i].data(), r[i].data(), dv[i].data()});
          gs.push_back({gv[i].data(), gr[i].data(), gdv[i].data()});
        }
        std::vector<float> x(N * d), lse(N * H);
        DeviceVec<float> gq(q), gx(N * d), glse(N * H);
        ops::depth_mix_forward(x.data(), lse.data(), os.data(), S, q.data(), q_ld, om, N);
        cuda::dev::depth_mix_forward(gx.data(), glse.data(), gs.data(), S, gq.data(), q_ld, gm, N);
        EXPECT_LT(rel(gx.download(), x), 1e-5);
        const auto dx = randn(N * d, 50);
        std::vector<float> dq = randn(dynamic ? N * d : d, 51);
        DeviceVec<float> gdx(dx), gdq(dq);
        ops::depth_mix_backward(dq.data(), dx.data(), x.data(), lse.data(), os.data(), S, q.data(),
                                q_ld, om, N);
        cuda::dev::depth_mix_backward(gdq.data(), gdx.data(), gx.data(), glse.data(), gs.data(), S,
                                      gq.data(), q_ld, gm, N);
        EXPECT_LT(rel(gdq.download(), dq), 1e-4);
        for (int64_t i = 0; i < S; i++) EXPECT_LT(rel(gdv[i].download(), dv[i]), 1e-5) << i;
      }
    }
  }
}

TEST(Cuda, AttentionAndAdamWMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (int64_t Hkv : {int64_t{2}, int64_t{8}}) {
    const ops::AttnShape s{3, 64, 8, Hkv, 32};
    const int64_t N = s.B * s.T, att_n = s.B * s.H * s.T * s.T;
    const auto qkv = randn(N * s.ld(), 60), dout = randn(N * s.H * s.hd, 61);
    std::vector<float> out(N * s.H * s.hd), att(att_n), dqkv = randn(N * s.ld(), 62),
                                                        scratch(att_n);
    DeviceVec<float> gqkv(qkv), gout(out.size()), gatt(att_n), gdout(dout), gdqkv(dqkv),
        gscratch(att_n);
    const cuda::dev::AttnShape gs{s.B, s.T, s.H, s.Hkv, s.hd};
    ops::attention_forward(out.data(), att.data(), qkv.data(), s);
    cuda::dev::attention_forward(gout.data(), gatt.data(), gqkv.data(), gs);
    EXPECT_LT(rel(gout.download(), out), 1e-5);
    EXPECT_LT(rel(gatt.download(), att), 1e-5);
    ops::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s);
    cuda::dev::attention_backward(gdqkv.data(), gscratch.data(), gdout.data(), gqkv.data(),
                                  gatt.data(), gs);
    EXPECT_LT(rel(gdqkv.download(), dqkv), 1e-5);
  }
  const int64_t n = 10000;
  std::vector<float> p = randn(n, 63), g = randn(n, 64), m = randn(n, 65), v(n, 0.01f);
  DeviceVec<float> gp(p), gg(g), gm(m), gv(v);
  const cuda::dev::AdamStep k{0.9f, 0.95f, 1e-3f, 1.2f, 1e-8f, 0.5f};
  for (int64_t i = 0; i < n; i++) {  // the documented update, element by element
    const float gi = g[i] * k.grad_scale;
    m[i] = k.b1 * m[i] + (1 - k.b1) * gi;
    v[i] = k.b2 * v[i] + (1 - k.b2) * gi * gi;
    p[i] = p[i] * 0.999f - k.step_size * m[i] / (std::sqrt(v[i]) * k.inv_bc2_sqrt + k.eps);
  }
  cuda::dev::adamw_update(gp.data(), gg.data(), gm.data(), gv.data(), n, 0.999f, k);
  EXPECT_LT(rel(gp.download(), p), 1e-6);
  EXPECT_LT(rel(gm.download(), m), 1e-6);
  EXPECT_LT(rel(gv.download(), v), 1e-6);
}

#endif  // ATTNRES_WITH_CUDA
