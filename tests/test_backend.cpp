// Every backend (attnres/backend.hpp) against the CPU ops (src/ops) on the same inputs, at fp32
// tolerances, through the Backend interface the model uses: "cpu" (its wiring of the ops: the
// device-memory conventions of the scalar mixes and the by-source backward), "cuda-host" (the
// CUDA kernels emulated on the host) on every machine, "cuda" on a GPU (skipped, with the reason,
// in builds without CUDA and on machines without a usable GPU). The CPU's bf16 products run
// natively or widened to fp32 (gemm_bf16), depending on the CPU. Whole models: test_backend_model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attnres/backend.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "backend/backend.hpp"
#include "cuda/table_cache.hpp"
#include "ops/ops.hpp"
#include "test_util.hpp"

using namespace attnres;
using attnres::testing::randn;
using attnres::testing::rel_diff;

namespace {

Backend* g_be = nullptr;  // the backend of the running test

// A buffer on the running test's backend, from host values or zeros.
template <class T>
struct DBuf : DevBuf<T> {
  explicit DBuf(const std::vector<T>& h) {
    this->on(g_be);
    this->upload(h.data(), h.size());
  }
  explicit DBuf(int64_t n) { this->on(g_be).resize(static_cast<size_t>(n)); }
};
using Buf = DBuf<float>;
using IBuf = DBuf<int32_t>;
Buf up(const std::vector<float>& h) { return Buf(h); }
Buf zeros(int64_t n) { return Buf(n); }

// fp32 -> bf16 -> fp32, round to nearest even (as the GPU's conversion).
float cuda_bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

ops::DepthMix depth_mix(int64_t d, int64_t H, bool softmax = true, bool key_norm = true) {
  ops::DepthMix m;
  m.d = d;
  m.H = H;
  m.softmax = softmax;
  m.key_norm = key_norm;
  return m;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_diff(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

std::vector<int32_t> ids(int64_t n, int64_t V) {
  std::vector<int32_t> r(n);
  for (int64_t i = 0; i < n; i++) r[i] = static_cast<int32_t>((i * 7919 + 13) % V);
  return r;
}

class BackendOps : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    try {
      // (the CPU: a backend of its own, whose precision the tests may change)
      keep_ = GetParam() == std::string("cpu") ? make_cpu_backend() : make_backend(GetParam());
    } catch (const Error& e) {
      GTEST_SKIP() << "no " << GetParam() << " test: " << e.what();
    }
    be = keep_.get();
    g_be = be;
  }
  // Whether the backend offers bf16 matmuls.
  bool offers_bf16() const {
    try {
      be->set_matmul_precision(MatmulPrecision::bf16);
    } catch (const Error&) {
      return false;
    }
    be->set_matmul_precision(MatmulPrecision::fp32);
    return true;
  }
  std::shared_ptr<Backend> keep_;
  Backend* be = nullptr;
};

}  // namespace

// The pointer-table cache: one upload per distinct table, the same copy for equal bytes (even at
// another host address), a fresh one when the bytes change.
TEST(TableCache, UploadsEachDistinctTableOnce) {
  struct CountingExec {
    int uploads = 0, live = 0;
    void* alloc(size_t bytes) {
      live++;
      return ::operator new(bytes);
    }
    void release(void* p, size_t) noexcept {
      live--;
      ::operator delete(p);
    }
    void upload(void* d, const void* h, size_t bytes) {
      uploads++;
      std::memcpy(d, h, bytes);
    }
    void synchronize() {}
  } x;
  {
    cuda::TableCache<CountingExec> cache(x);
    const std::vector<const float*> a = {nullptr, reinterpret_cast<const float*>(64)};
    const std::vector<const float*> a2 = a, b = {nullptr, reinterpret_cast<const float*>(128)};
    const void* da = cache.get(a.data(), sizeof(float*) * a.size());
    EXPECT_EQ(cache.get(a2.data(), sizeof(float*) * a2.size()), da);
    EXPECT_EQ(x.uploads, 1);
    const void* db = cache.get(b.data(), sizeof(float*) * b.size());
    EXPECT_NE(db, da);
    EXPECT_EQ(x.uploads, 2);
    EXPECT_EQ(std::memcmp(db, b.data(), sizeof(float*) * b.size()), 0);
    EXPECT_EQ(cache.size(), 2u);
  }
  EXPECT_EQ(x.live, 0);  // everything released
}

// The gradient reducer: direct for host memory, staged on request, NCCL refused for host memory.
TEST(DeviceReducer, PicksAMethodForTheMemory) {
  dist::SingleCommunicator comm;
  auto host = make_backend("cuda-host");
  EXPECT_EQ(dist::make_device_reducer(comm, *host)->method(), "direct");
  EXPECT_EQ(dist::make_device_reducer(comm, *cpu_backend())->method(), "direct");
  ::setenv("ATTNRES_DEVICE_REDUCE", "staged", 1);
  auto staged = dist::make_device_reducer(comm, *host);
  EXPECT_EQ(staged->method(), "staged");
  std::vector<float> x = {1, 2, 3};
  staged->allreduce_sum(x.data(), 3);  // one rank: unchanged
  EXPECT_EQ(x, (std::vector<float>{1, 2, 3}));
  ::setenv("ATTNRES_DEVICE_REDUCE", "nccl", 1);
  try {
    dist::make_device_reducer(comm, *host);
    ADD_FAILURE() << "NCCL on host memory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs GPU memory"), std::string::npos) << e.what();
  }
  ::setenv("ATTNRES_DEVICE_REDUCE", "fast", 1);
  EXPECT_THROW(dist::make_device_reducer(comm, *host), Error);
  ::unsetenv("ATTNRES_DEVICE_REDUCE");
}

TEST_P(BackendOps, MemoryAndElementwise) {
  // DevBuf: zeroed, resize keeps contents and zeroes the new part, round trips exactly.
  const auto a = randn(5000, 90), b = randn(5000, 91);
  Buf ga(a), gb(b), gz(7);
  EXPECT_EQ(gz.download(), std::vector<float>(7, 0.0f));
  ga.resize(6000);
  auto back = ga.download();
  EXPECT_EQ(std::vector<float>(back.begin(), back.begin() + 5000), a);
  EXPECT_EQ(std::vector<float>(back.begin() + 5000, back.end()), std::vector<float>(1000, 0.0f));
  ga.resize(5000);
  std::vector<float> sum(5000), prod(5000), sc = a;
  for (int i = 0; i < 5000; i++) {
    sum[i] = a[i] + b[i];
    prod[i] = a[i] * b[i];
    sc[i] *= 0.25f;
  }
  Buf gs(5000), gp(5000);
  be->add(gs.data(), ga.data(), gb.data(), 5000);
  EXPECT_EQ(gs.download(), sum);
  be->mul(gp.data(), ga.data(), gb.data(), 5000);
  EXPECT_EQ(gp.download(), prod);
  be->add_product(gb.data(), ga.data(), Buf(b).data(), 5000);
  // (fused into an FMA or not, as the backend's compiler chose: cuda-host is compiled without
  // contraction, the CPU ops with it)
  const std::vector<float> got = gb.download();
  for (int i = 0; i < 5000; i++) {
    const float unfused = b[i] + prod[i], fused = std::fma(a[i], b[i], b[i]);
    EXPECT_TRUE(got[i] == unfused || got[i] == fused) << i << ": " << got[i];
  }
  be->scale(ga.data(), 0.25f, 5000);
  EXPECT_EQ(ga.download(), sc);
  double ss = 0;
  for (float x : b) ss += double(x) * x;
  Buf gb2(b);
  // (the CPU sums chunks of 4096 in float, ops.hpp; the device kernels in double)
  EXPECT_NEAR(be->sum_squares(gb2.data(), 5000), ss, (be->is_cpu() ? 1e-6 : 1e-9) * ss);
  be->copy(gs.data(), gb2.data(), sizeof(float) * 5000);
  EXPECT_EQ(gs.download(), b);
  be->zero(gs.data(), sizeof(float) * 100);
  EXPECT_EQ(gs.download()[99], 0.0f);
  EXPECT_EQ(gs.download()[100], b[100]);
}

TEST_P(BackendOps, MatmulMatchesCpu) {
  const int64_t N = 67, IC = 48, OC = 80;
  const auto x = randn(N * IC, 1), w = randn(OC * IC, 2), dy = randn(N * OC, 3);
  std::vector<float> y(N * OC), dx = randn(N * IC, 4), dw = randn(OC * IC, 5);
  Buf gx(x), gw(w), gdy(dy), gy(N * OC), gdx(dx), gdw(dw);
  ops::matmul_forward(y.data(), x.data(), w.data(), N, IC, OC);
  be->matmul_forward(gy.data(), gx.data(), gw.data(), N, IC, OC);
  EXPECT_LT(rel(gy.download(), y), 1e-5);
  ops::matmul_forward(y.data(), x.data(), w.data(), N, IC, OC, /*accumulate=*/true);
  be->matmul_forward(gy.data(), gx.data(), gw.data(), N, IC, OC, /*accumulate=*/true);
  EXPECT_LT(rel(gy.download(), y), 1e-5);
  ops::matmul_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), N, IC, OC);
  be->matmul_backward(gdx.data(), gdw.data(), gdy.data(), gx.data(), gw.data(), N, IC, OC);
  EXPECT_LT(rel(gdx.download(), dx), 1e-5);
  EXPECT_LT(rel(gdw.download(), dw), 1e-5);
}

// bf16 GEMMs: the CPU sgemm on bf16-rounded operands to fp32 rounding (the products of bf16 values
// are exact in fp32; only the order of the additions differs), fp32 to bf16's ~3 digits. The
// shared CPU backend stays fp32 (a bf16 CPU backend is one of its own).
TEST_P(BackendOps, Bf16MatmulMatchesRoundedCpu) {
  if (!offers_bf16()) GTEST_SKIP() << GetParam() << " has no bf16 matmuls";
  const int64_t N = 67, IC = 48, OC = 80;
  const auto x = randn(N * IC, 1), w = randn(OC * IC, 2), dy = randn(N * OC, 3);
  auto round = [](std::vector<float> v) {
    for (float& f : v) f = cuda_bf16_round(f);
    return v;
  };
  const auto xr = round(x), wr = round(w), dyr = round(dy);
  std::vector<float> y(N * OC), y32(N * OC), dx = randn(N * IC, 4), dw = randn(OC * IC, 5);
  Buf gx(x), gw(w), gdy(dy), gy(N * OC), gdx(dx), gdw(dw);
  be->set_matmul_precision(MatmulPrecision::bf16);
  ops::matmul_forward(y.data(), xr.data(), wr.data(), N, IC, OC);
  ops::matmul_forward(y32.data(), x.data(), w.data(), N, IC, OC);
  be->matmul_forward(gy.data(), gx.data(), gw.data(), N, IC, OC);
  EXPECT_LT(rel(gy.download(), y), 1e-5);
  EXPECT_LT(rel(gy.download(), y32), 1e-2);
  EXPECT_GT(rel(gy.download(), y32), 1e-5);  // it did round
  ops::matmul_forward(y.data(), xr.data(), wr.data(), N, IC, OC, /*accumulate=*/true);
  be->matmul_forward(gy.data(), gx.data(), gw.data(), N, IC, OC, /*accumulate=*/true);
  EXPECT_LT(rel(gy.download(), y), 1e-5);
  ops::matmul_backward(dx.data(), dw.data(), dyr.data(), xr.data(), wr.data(), N, IC, OC);
  be->matmul_backward(gdx.data(), gdw.data(), gdy.data(), gx.data(), gw.data(), N, IC, OC);
  EXPECT_LT(rel(gdx.download(), dx), 1e-5);
  EXPECT_LT(rel(gdw.download(), dw), 1e-5);
  be->set_matmul_precision(MatmulPrecision::fp32);
  EXPECT_THROW(make_backend("cpu")->set_matmul_precision(MatmulPrecision::bf16), Error);
  EXPECT_THROW(parse_precision("fp16"), Error);
}

// A memo carries the forward's bf16 copies to the backward: the same results bit for bit as
// rounding again; used once, and only for the operands it was made from.
TEST_P(BackendOps, MatmulMemoGivesTheSameResults) {
  if (!offers_bf16()) GTEST_SKIP() << GetParam() << " has no bf16 matmuls";
  const int64_t N = 37, IC = 48, OC = 24;
  const auto x = randn(N * IC, 21), w = randn(OC * IC, 22), dy = randn(N * OC, 23),
             x2 = randn(N * IC, 24);
  be->set_matmul_precision(MatmulPrecision::bf16);
  // forward on x, then the backward on `back` (x or another input) with the memo or none.
  auto run = [&](MatmulMemo* memo, const std::vector<float>& back) {
    Buf gx(x), gw(w), gdy(dy), gy(N * OC), gdx(N * IC), gdw(OC * IC), gb(back);
    be->matmul_forward(gy.data(), gx.data(), gw.data(), N, IC, OC, false, memo);
    if (memo) {
      EXPECT_TRUE(memo->valid);
    }
    const float* bx = back == x ? gx.data() : gb.data();
    be->matmul_backward(gdx.data(), gdw.data(), gdy.data(), bx, gw.data(), N, IC, OC, memo);
    if (memo) {
      EXPECT_FALSE(memo->valid);  // used once
    }
    return std::make_tuple(gy.download(), gdx.download(), gdw.download());
  };
  for (const auto* back : {&x, &x2}) {  // the memo's operands, then others: ignored
    MatmulMemo memo;
    const auto plain = run(nullptr, *back), kept = run(&memo, *back);
    EXPECT_EQ(std::get<0>(kept), std::get<0>(plain));
    EXPECT_EQ(std::get<1>(kept), std::get<1>(plain));
    EXPECT_EQ(std::get<2>(kept), std::get<2>(plain));
  }
  be->set_matmul_precision(MatmulPrecision::fp32);
}

// The LM head's backward from the loss in one op: with fp32 products exactly the two ops it
// replaces; with bf16 products (the gradient rounded as it is formed, never stored in fp32) the
// same results as rounding the fp32 gradient first, bit for bit, with the memo or without.
TEST_P(BackendOps, HeadBackwardMatchesTheTwoOps) {
  const int64_t N = 29, IC = 40, V = 53;
  const auto x = randn(N * IC, 31), w = randn(V * IC, 32, 0.3), logits = randn(N * V, 33, 2.0);
  const auto tg = ids(N, V);
  std::vector<float> lse(N);
  for (int64_t n = 0; n < N; n++) {
    double z = 0, mx = logits[n * V];
    for (int64_t j = 0; j < V; j++) mx = std::max(mx, double(logits[n * V + j]));
    for (int64_t j = 0; j < V; j++) z += std::exp(logits[n * V + j] - mx);
    lse[n] = static_cast<float>(mx + std::log(z));
  }
  for (const auto p : {MatmulPrecision::fp32, MatmulPrecision::bf16}) {
    SCOPED_TRACE(p == MatmulPrecision::bf16 ? "bf16" : "fp32");
    if (p == MatmulPrecision::bf16 && !offers_bf16()) continue;
    be->set_matmul_precision(p);
    auto run = [&](bool fused, bool memo_on) {
      Buf gx(x), gw(w), gl(logits), glse(lse), gy(N * V), gdx(randn(N * IC, 34)),
          gdw(randn(V * IC, 35));
      IBuf gt(tg);
      MatmulMemo memo;
      MatmulMemo* mm = memo_on ? &memo : nullptr;
      be->matmul_forward(gy.data(), gx.data(), gw.data(), N, IC, V, false, mm);
      if (fused) {
        be->head_backward(gdx.data(), gdw.data(), gl.data(), glse.data(), gt.data(), N, V, 1.0f / N,
                          gx.data(), gw.data(), IC, mm);
      } else {
        be->cross_entropy_backward(gl.data(), gl.data(), glse.data(), gt.data(), N, V, 1.0f / N);
        be->matmul_backward(gdx.data(), gdw.data(), gl.data(), gx.data(), gw.data(), N, IC, V, mm);
      }
      return std::make_pair(gdx.download(), gdw.download());
    };
    for (bool memo_on : {false, true}) {
      const auto two = run(false, memo_on), one = run(true, memo_on);
      EXPECT_EQ(one.first, two.first);
      EXPECT_EQ(one.second, two.second);
    }
  }
  be->set_matmul_precision(MatmulPrecision::fp32);
}

TEST_P(BackendOps, RowKernelsMatchCpu) {
  const int64_t N = 70, C = 64, V = 37, F = 96;
  // embedding
  const auto wte = randn(V * C, 6), dout = randn(N * C, 7);
  const auto id = ids(N, V);
  IBuf gid(id);
  {
    std::vector<float> a(N * C), da = randn(V * C, 8);
    Buf gw(wte), ga(N * C), gdout(dout), gda(da);
    ops::embedding_forward(a.data(), id.data(), wte.data(), N, C);
    be->embedding_forward(ga.data(), gid.data(), gw.data(), N, C);
    EXPECT_EQ(ga.download(), a);
    ops::embedding_backward(da.data(), dout.data(), id.data(), N, C);
    be->embedding_backward(gda.data(), gdout.data(), gid.data(), N, C);
    EXPECT_LT(rel(gda.download(), da), 1e-6);
    // With the ids' host copy (no read-back): the same sums, in the same order.
    Buf gdb(randn(V * C, 8));
    be->embedding_backward(gdb.data(), gdout.data(), gid.data(), N, C, id.data());
    EXPECT_EQ(gdb.download(), gda.download());
  }
  // rmsnorm
  {
    const auto x = randn(N * C, 9, 2.0), g = randn(C, 10);
    std::vector<float> y(N * C), r(N), dx = randn(N * C, 11), dg = randn(C, 12);
    Buf gx(x), gg(g), gy(N * C), gr(N), gdx(dx), gdg(dg), gdy(dout);
    ops::rmsnorm_forward(y.data(), r.data(), x.data(), g.data(), N, C, 1e-5f);
    be->rmsnorm_forward(gy.data(), gr.data(), gx.data(), gg.data(), N, C, 1e-5f);
    EXPECT_LT(rel(gy.download(), y), 1e-5);
    ops::rmsnorm_backward(dx.data(), dg.data(), dout.data(), x.data(), g.data(), r.data(), N, C);
    be->rmsnorm_backward(gdx.data(), gdg.data(), gdy.data(), gx.data(), gg.data(), gr.data(), N, C);
    EXPECT_LT(rel(gdx.download(), dx), 1e-5);
    EXPECT_LT(rel(gdg.download(), dg), 1e-5);
  }
  // swiglu
  {
    const auto h = randn(N * 2 * F, 13), dy = randn(N * F, 14);
    std::vector<float> y(N * F), dh = randn(N * 2 * F, 15);
    Buf gh(h), gy(N * F), gdy(dy), gdh(dh);
    ops::swiglu_forward(y.data(), h.data(), N, F);
    be->swiglu_forward(gy.data(), gh.data(), N, F);
    EXPECT_LT(rel(gy.download(), y), 1e-5);
    ops::swiglu_backward(dh.data(), dy.data(), h.data(), N, F);
    be->swiglu_backward(gdh.data(), gdy.data(), gh.data(), N, F);
    EXPECT_LT(rel(gdh.download(), dh), 1e-5);
  }
  // rope, in place on q|k|v rows
  {
    const int64_t B = 2, T = N / 2, H = 4, hd = 16, ld = 6 * hd;
    std::vector<float> cs(T * hd / 2), sn(cs.size());
    ops::rope_table(cs.data(), sn.data(), T, hd, 10000.0);
    std::vector<float> x = randn(B * T * ld, 16);
    Buf gx(x), gc(cs), gs(sn);
    ops::rope_forward(x.data(), cs.data(), sn.data(), B, T - 3, H, hd, ld, 3);  // positions 3..
    be->rope_forward(gx.data(), gc.data(), gs.data(), B, T - 3, H, hd, ld, 3);
    EXPECT_LT(rel(gx.download(), x), 1e-6);
    ops::rope_backward(x.data(), cs.data(), sn.data(), B, T, H, hd, ld, 0);
    be->rope_backward(gx.data(), gc.data(), gs.data(), B, T, H, hd, ld, 0);
    EXPECT_LT(rel(gx.download(), x), 1e-6);
  }
  // cross-entropy (the backward in place, as the model runs it)
  {
    const auto logits = randn(N * V, 17, 3.0);
    const auto t = ids(N, V);
    std::vector<float> loss(N), lse(N), dl(N * V);
    Buf gl(logits), glse(N);
    IBuf gt(t);
    const double mean =
        ops::cross_entropy_forward(loss.data(), lse.data(), logits.data(), t.data(), N, V);
    EXPECT_NEAR(be->cross_entropy_forward(glse.data(), gl.data(), gt.data(), N, V), mean,
                1e-5 * std::abs(mean));
    EXPECT_LT(rel(glse.download(), lse), 1e-6);
    ops::cross_entropy_backward(dl.data(), logits.data(), lse.data(), t.data(), N, V, 0.5f);
    be->cross_entropy_backward(gl.data(), gl.data(), glse.data(), gt.data(), N, V, 0.5f);
    EXPECT_LT(rel(gl.download(), dl), 1e-5);
  }
}

TEST_P(BackendOps, DepthMixMatchesCpu) {
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
        ops::DepthMix gm;
        gm.d = d;
        gm.H = H;
        gm.softmax = softmax;
        const int64_t q_ld = dynamic ? d : 0;
        const auto q = randn(dynamic ? N * d : d, 20);
        std::vector<std::vector<float>> v, r, dv;
        std::vector<Buf> gv, gr, gdv;
        for (int64_t i = 0; i < S; i++) {
          v.push_back(randn(N * d, 30 + i, 1.0 + i));
          r.emplace_back(N * H);
          dv.push_back(randn(N * d, 40 + i));
          gv.push_back(up(v[i]));
          gr.push_back(zeros(N * H));
          gdv.push_back(up(dv[i]));
          ops::depth_rstd(r[i].data(), v[i].data(), N, d, H, 1e-5f);
          be->depth_rstd(gr[i].data(), gv[i].data(), N, d, H, 1e-5f);
          EXPECT_LT(rel(gr[i].download(), r[i]), 1e-5);
        }
        std::vector<ops::DepthSource> os;
        std::vector<ops::DepthSource> gs;
        for (int64_t i = 0; i < S; i++) {
          os.push_back({v[i].data(), r[i].data(), dv[i].data()});
          gs.push_back({gv[i].data(), gr[i].data(), gdv[i].data()});
        }
        std::vector<float> x(N * d), lse(N * H);
        Buf gq(q), gx(N * d), glse(N * H);
        ops::depth_mix_forward(x.data(), lse.data(), os.data(), S, q.data(), q_ld, om, N);
        be->depth_mix_forward(gx.data(), glse.data(), gs.data(), S, gq.data(), q_ld, gm, N);
        EXPECT_LT(rel(gx.download(), x), 1e-5);
        const auto dx = randn(N * d, 50);
        std::vector<float> dq = randn(dynamic ? N * d : d, 51);
        Buf gdx(dx), gdq(dq);
        ops::depth_mix_backward(dq.data(), dx.data(), x.data(), lse.data(), os.data(), S, q.data(),
                                q_ld, om, N);
        be->depth_mix_backward(gdq.data(), gdx.data(), gx.data(), glse.data(), gs.data(), S,
                               gq.data(), q_ld, gm, N);
        EXPECT_LT(rel(gdq.download(), dq), 1e-4);
        for (int64_t i = 0; i < S; i++) EXPECT_LT(rel(gdv[i].download(), dv[i]), 1e-5) << i;
      }
    }
  }
}

// The by-source backward of Full AttnRes (one source's gradient from all its readers, and their
// query gradients) and the dx . x it needs, against the CPU ops, for 1, 2 and 4 heads.
TEST_P(BackendOps, BySourceBackwardMatchesCpu) {
  const int64_t N = 130, d = 64, S = 5, K = 4;
  for (bool softmax : {true, false}) {
    for (bool key_norm : {true, false}) {
      for (int64_t H : {1, 2, 4}) {
        SCOPED_TRACE(std::string(softmax ? "softmax" : "sigmoid") + (key_norm ? " rms" : "") +
                     " H=" + std::to_string(H));
        const ops::DepthMix m = depth_mix(d, H, softmax, key_norm);
        std::vector<std::vector<float>> v, r;
        std::vector<Buf> gv, gr;
        std::vector<ops::DepthSource> os, gs;
        for (int64_t i = 0; i < S; i++) {
          v.push_back(randn(N * d, 300 + i, 1.0 + 0.3 * i));
          r.emplace_back(N * H);
          ops::depth_rstd(r[i].data(), v[i].data(), N, d, H, 1e-5f);
          gv.push_back(up(v[i]));
          gr.push_back(up(r[i]));
        }
        for (int64_t i = 0; i < S; i++) {
          os.push_back({v[i].data(), r[i].data(), nullptr});
          gs.push_back({gv[i].data(), gr[i].data(), nullptr});
        }
        // K readers, each mixing all S sources with its own query, with its own upstream dx.
        const auto q = randn(K * d, 310, 0.5);
        std::vector<std::vector<float>> lse(K, std::vector<float>(N * H)), D(K, lse[0]);
        std::vector<Buf> glse, gD, gdx;
        std::vector<std::vector<float>> dx;
        Buf gq(q);
        std::vector<ops::DepthReader> ord, grd;
        for (int64_t k = 0; k < K; k++) {
          std::vector<float> x(N * d);
          ops::depth_mix_forward(x.data(), lse[k].data(), os.data(), S, q.data() + k * d, 0, m, N);
          dx.push_back(randn(N * d, 320 + k));
          ops::depth_dx_dot(D[k].data(), dx[k].data(), x.data(), m, N);
          Buf gx(x);
          glse.push_back(up(lse[k]));
          gdx.push_back(up(dx[k]));
          gD.push_back(zeros(N * H));
          be->depth_dx_dot(gD[k].data(), gdx[k].data(), gx.data(), m, N);
          EXPECT_LT(rel(gD[k].download(), D[k]), 1e-5) << k;
        }
        for (int64_t k = 0; k < K; k++) {
          ord.push_back({dx[k].data(), lse[k].data(), D[k].data(), q.data() + k * d, k * d});
          grd.push_back({gdx[k].data(), glse[k].data(), gD[k].data(), gq.data() + k * d, 0});
        }
        const int64_t i = 2;
        std::vector<float> dv(N * d), dq(K * d, 0.0f);
        ops::depth_source_backward(dv.data(), os[i], ord.data(), K, dq.data(), K * d, 1, m, N);
        const auto dq0 = randn(K * d, 330);    // the device adds into dq
        Buf gdv(randn(N * d, 331)), gdq(dq0);  // and overwrites dv
        be->depth_source_backward(gdv.data(), gs[i], grd.data(), K, gdq.data(), m, N);
        EXPECT_LT(rel(gdv.download(), dv), 1e-5);
        std::vector<float> want(dq0);
        for (int64_t j = 0; j < K * d; j++) want[j] += dq[j];
        EXPECT_LT(rel(gdq.download(), want), 1e-5);
      }
    }
  }
}

// bf16 storage of the depth sources: given a source's bf16 copy (vb), every depth op reads it
// instead of v: it computes what the CPU ops compute on the rounded values (v itself is left
// unrounded, so an op that read v would be off by the rounding, ~1e-3).
TEST_P(BackendOps, DepthOpsReadTheBf16Sources) {
  if (!offers_bf16()) GTEST_SKIP() << GetParam() << " has no bf16 matmuls";
  if (be->is_cpu()) GTEST_SKIP() << "the CPU's depth ops read the fp32 sources (bf16 storage off)";
  const int64_t N = 70, d = 64, S = 4, H = 2;
  const ops::DepthMix m = depth_mix(d, H);
  std::vector<std::vector<float>> v, vr, r;
  std::vector<Buf> gv, gr;
  std::vector<DBuf<uint16_t>> gvb;
  std::vector<ops::DepthSource> os, gs;
  for (int64_t i = 0; i < S; i++) {
    v.push_back(randn(N * d, 400 + i, 1.0 + 0.5 * i));
    vr.push_back(v[i]);
    for (float& f : vr[i]) f = cuda_bf16_round(f);
    r.emplace_back(N * H);  // (from the fp32 values, as the model computes it)
    ops::depth_rstd(r[i].data(), v[i].data(), N, d, H, 1e-5f);
    gv.push_back(up(v[i]));
    gr.push_back(up(r[i]));
    gvb.emplace_back(N * d);
    be->to_bf16(gvb[i].data(), gv[i].data(), N * d);
  }
  std::vector<std::vector<float>> dv(S, std::vector<float>(N * d, 0.0f));
  std::vector<Buf> gdv;
  for (int64_t i = 0; i < S; i++) gdv.push_back(zeros(N * d));
  for (int64_t i = 0; i < S; i++) {
    os.push_back({vr[i].data(), r[i].data(), dv[i].data()});
    gs.push_back({gv[i].data(), gr[i].data(), gdv[i].data(), gvb[i].data()});
  }
  const auto q = randn(2 * d, 410, 0.5);
  Buf gq(q);
  // forward and backward
  std::vector<float> x(N * d), lse(N * H);
  Buf gx(N * d), glse(N * H);
  ops::depth_mix_forward(x.data(), lse.data(), os.data(), S, q.data(), 0, m, N);
  be->depth_mix_forward(gx.data(), glse.data(), gs.data(), S, gq.data(), 0, m, N);
  EXPECT_LT(rel(gx.download(), x), 1e-5);
  const auto dx = randn(N * d, 411);
  Buf gdx(dx);
  std::vector<float> dq(d, 0.0f);
  Buf gdq(d);
  ops::depth_mix_backward(dq.data(), dx.data(), x.data(), lse.data(), os.data(), S, q.data(), 0, m,
                          N);
  be->depth_mix_backward(gdq.data(), gdx.data(), gx.data(), glse.data(), gs.data(), S, gq.data(), 0,
                         m, N);
  EXPECT_LT(rel(gdq.download(), dq), 1e-4);
  for (int64_t i = 0; i < S; i++) EXPECT_LT(rel(gdv[i].download(), dv[i]), 1e-5) << i;
  // two-phase: phase 1 over sources 0..2, phase 2 merging source 3
  {
    std::vector<float> o(N * d), l1(N * H), x2(N * d), l2(N * H);
    Buf go(N * d), gl1(N * H), gx2(N * d), gl2(N * H);
    float* oo = o.data();
    float* ol = l1.data();
    const float* oq = q.data();
    float* goo = go.data();
    float* gol = gl1.data();
    const float* gqq = gq.data();
    ops::depth_mix_phase1(&oo, &ol, os.data(), S - 1, &oq, 1, m, N);
    be->depth_mix_phase1(&goo, &gol, gs.data(), S - 1, &gqq, 1, m, N);
    EXPECT_LT(rel(go.download(), o), 1e-5);
    ops::depth_mix_phase2(x2.data(), l2.data(), o.data(), l1.data(), os[S - 1], q.data(), m, N);
    be->depth_mix_phase2(gx2.data(), gl2.data(), go.data(), gl1.data(), gs[S - 1], gq.data(), m, N);
    EXPECT_LT(rel(gx2.download(), x2), 1e-5);
  }
  // by source: source 1 read by two readers
  {
    std::vector<float> D(N * H), sdv(N * d), sdq(2 * d, 0.0f);
    ops::depth_dx_dot(D.data(), dx.data(), x.data(), m, N);
    Buf gD(D), gsdv(N * d), gsdq(2 * d);
    const ops::DepthReader ord[2] = {{dx.data(), lse.data(), D.data(), q.data(), 0},
                                     {dx.data(), lse.data(), D.data(), q.data() + d, d}};
    const ops::DepthReader grd[2] = {{gdx.data(), glse.data(), gD.data(), gq.data(), 0},
                                     {gdx.data(), glse.data(), gD.data(), gq.data() + d, 0}};
    ops::depth_source_backward(sdv.data(), os[1], ord, 2, sdq.data(), 2 * d, 1, m, N);
    be->depth_source_backward(gsdv.data(), gs[1], grd, 2, gsdq.data(), m, N);
    EXPECT_LT(rel(gsdv.download(), sdv), 1e-5);
    EXPECT_LT(rel(gsdq.download(), sdq), 1e-5);
  }
}

// Two-phase Block AttnRes: phase 1 (K queries over the same sources; K = 18 takes two launches of
// at most 16) and phase 2 (merging a partial sum) against the CPU ops.
TEST_P(BackendOps, TwoPhaseDepthMixMatchesCpu) {
  const int64_t N = 150, d = 64, S = 4;
  for (int64_t H : {1, 2}) {
    for (bool key_norm : {true, false}) {
      for (int64_t K : {3, 18}) {
        SCOPED_TRACE("H=" + std::to_string(H) + (key_norm ? " rms" : " none") +
                     " K=" + std::to_string(K));
        ops::DepthMix m;
        m.d = d;
        m.H = H;
        m.key_norm = key_norm;
        std::vector<std::vector<float>> v, r;
        std::vector<Buf> gv, gr;
        std::vector<ops::DepthSource> os, gs;
        for (int64_t i = 0; i <= S; i++) {  // source S is the partial sum of phase 2
          v.push_back(randn(N * d, 100 + i, 1.0 + 0.5 * i));
          r.emplace_back(N * H);
          ops::depth_rstd(r[i].data(), v[i].data(), N, d, H, 1e-5f);
          gv.push_back(up(v[i]));
          gr.push_back(up(r[i]));
          os.push_back({v[i].data(), r[i].data(), nullptr});
          gs.push_back({gv[i].data(), gr[i].data(), nullptr});
        }
        std::vector<std::vector<float>> q, o, l;
        std::vector<Buf> gq, go, gl;
        std::vector<float*> op, lp, gop, glp;
        std::vector<const float*> qp, gqp;
        for (int64_t k = 0; k < K; k++) {
          q.push_back(randn(d, 200 + k, 0.5));
          o.emplace_back(N * d);
          l.emplace_back(N * H);
          gq.push_back(up(q[k]));
          go.push_back(zeros(N * d));
          gl.push_back(zeros(N * H));
        }
        for (int64_t k = 0; k < K; k++) {
          op.push_back(o[k].data());
          lp.push_back(l[k].data());
          qp.push_back(q[k].data());
          gop.push_back(go[k].data());
          glp.push_back(gl[k].data());
          gqp.push_back(gq[k].data());
        }
        ops::depth_mix_phase1(op.data(), lp.data(), os.data(), S, qp.data(), K, m, N);
        be->depth_mix_phase1(gop.data(), glp.data(), gs.data(), S, gqp.data(), K, m, N);
        for (int64_t k = 0; k < K; k++) {
          EXPECT_LT(rel(go[k].download(), o[k]), 1e-5) << k;
          EXPECT_LT(rel(gl[k].download(), l[k]), 1e-5) << k;
        }
        std::vector<float> x(N * d), lse(N * H);
        Buf gx(N * d), glse(N * H);
        ops::depth_mix_phase2(x.data(), lse.data(), o[1].data(), l[1].data(), os[S], q[1].data(), m,
                              N);
        be->depth_mix_phase2(gx.data(), glse.data(), go[1].data(), gl[1].data(), gs[S],
                             gq[1].data(), m, N);
        EXPECT_LT(rel(gx.download(), x), 1e-5);
        EXPECT_LT(rel(glse.download(), lse), 1e-5);
      }
    }
  }
}

TEST_P(BackendOps, AttentionAndAdamWMatchCpu) {
  for (int64_t Hkv : {int64_t{2}, int64_t{8}}) {
    const ops::AttnShape s{3, 64, 8, Hkv, 32};
    const int64_t N = s.B * s.T, att_n = s.B * s.H * s.T * s.T;
    const auto qkv = randn(N * s.ld(), 60), dout = randn(N * s.H * s.hd, 61);
    std::vector<float> out(N * s.H * s.hd), att(att_n), dqkv = randn(N * s.ld(), 62),
                                                        scratch(att_n);
    Buf gqkv(qkv), gout(out.size()), gatt(att_n), gdout(dout), gdqkv(dqkv), gscratch(att_n);
    const ops::AttnShape gs{s.B, s.T, s.H, s.Hkv, s.hd};
    ops::attention_forward(out.data(), att.data(), qkv.data(), s);
    be->attention_forward(gout.data(), gatt.data(), gqkv.data(), gs);
    EXPECT_LT(rel(gout.download(), out), 1e-5);
    EXPECT_LT(rel(gatt.download(), att), 1e-5);
    ops::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s);
    be->attention_backward(gdqkv.data(), gscratch.data(), gdout.data(), gqkv.data(), gout.data(),
                           gatt.data(), gs);
    EXPECT_LT(rel(gdqkv.download(), dqkv), 1e-5);
  }
  const int64_t n = 10000;
  std::vector<float> p = randn(n, 63), g = randn(n, 64), m = randn(n, 65), v(n, 0.01f);
  Buf gp(p), gg(g), gm(m), gv(v);
  const ops::AdamStep k{0.9f, 0.95f, 1e-3f, 1.2f, 1e-8f, 0.5f};
  for (int64_t i = 0; i < n; i++) {  // the documented update, element by element
    const float gi = g[i] * k.grad_scale;
    m[i] = k.b1 * m[i] + (1 - k.b1) * gi;
    v[i] = k.b2 * v[i] + (1 - k.b2) * gi * gi;
    p[i] = p[i] * 0.999f - k.step_size * m[i] / (std::sqrt(v[i]) * k.inv_bc2_sqrt + k.eps);
  }
  be->adamw_update(gp.data(), gg.data(), gm.data(), gv.data(), n, 0.999f, k);
  EXPECT_LT(rel(gp.download(), p), 1e-6);
  EXPECT_LT(rel(gm.download(), m), 1e-6);
  EXPECT_LT(rel(gv.download(), v), 1e-6);
}

// The static and DenseFormer residuals' scalar mixes (more sources than one launch takes, more
// elements than partial sums) and the dynamic queries' row-broadcast and column-sum helpers.
TEST_P(BackendOps, ScalarMixAndRowHelpersMatchCpu) {
  const int64_t S = 40, n = 10007;
  std::vector<std::vector<float>> src, dsrc;
  std::vector<Buf> gsrc, gdsrc;
  for (int64_t i = 0; i < S; i++) {
    src.push_back(randn(n, 90 + i));
    dsrc.push_back(randn(n, 190 + i));
    gsrc.emplace_back(src.back());
    gdsrc.emplace_back(dsrc.back());
  }
  const auto w = randn(S, 89), dout = randn(n, 88);
  std::vector<const float*> sp, gsp;
  std::vector<float*> dp, gdp;
  for (int64_t i = 0; i < S; i++) {
    sp.push_back(src[i].data());
    gsp.push_back(gsrc[i].data());
    dp.push_back(i == 3 ? nullptr : dsrc[i].data());  // a source with no gradient
    gdp.push_back(i == 3 ? nullptr : gdsrc[i].data());
  }
  std::vector<float> out(n);
  Buf gout(n), gdout(dout);
  ops::scalar_mix_forward(out.data(), sp.data(), w.data(), S, n);
  {  // the weights in the backend's memory (no host round trip), and the static residual's
     // softmax over its logits and its backward
    Buf gw(w), gda(S);
    be->scalar_mix_forward(gout.data(), gsp.data(), gw.data(), S, n);
    EXPECT_LT(rel(gout.download(), out), 1e-5);
    std::vector<double> dw(S, 0.0);
    ops::scalar_mix_backward(dp.data(), dw.data(), dout.data(), sp.data(), w.data(), S, n);
    be->scalar_mix_backward(gdp.data(), gda.data(), gdout.data(), gsp.data(), gw.data(), S, n);
    const std::vector<float> da = gda.download();
    for (int64_t i = 0; i < S; i++) {
      EXPECT_NEAR(da[i], dw[i], 1e-6 * (1 + std::abs(dw[i]))) << i;
      EXPECT_LT(rel(gdsrc[i].download(), dsrc[i]), 1e-6) << i;
    }
    Buf ga(S), gdz(S);
    be->softmax_small(ga.data(), gw.data(), S);
    double mx = w[0], sum = 0, dot = 0;
    for (float z : w) mx = std::max(mx, double(z));
    for (float z : w) sum += std::exp(z - mx);
    std::vector<float> a(S), dz(S);
    for (int64_t i = 0; i < S; i++) a[i] = static_cast<float>(std::exp(w[i] - mx) / sum);
    EXPECT_LT(rel(ga.download(), a), 1e-6);
    const std::vector<float> dz0 = randn(S, 87);
    Buf gdz0(dz0);
    be->softmax_small_backward(gdz0.data(), ga.data(), gda.data(), S);
    for (int64_t i = 0; i < S; i++) dot += double(a[i]) * da[i];
    for (int64_t i = 0; i < S; i++) dz[i] = dz0[i] + static_cast<float>(a[i] * (da[i] - dot));
    EXPECT_LT(rel(gdz0.download(), dz), 1e-5);
  }
  const int64_t N = 150, C = 33;
  const auto x = randn(N * C, 60), row = randn(C, 61);
  std::vector<float> y = x, z(N * C), cs = randn(C, 62);
  Buf gy(x), gz(N * C), grow(row), gcs(cs);
  for (int64_t r = 0; r < N; r++) {
    for (int64_t c = 0; c < C; c++) {
      y[r * C + c] += row[c];
      z[r * C + c] = y[r * C + c] * row[c];
    }
  }
  for (int64_t c = 0; c < C; c++) {
    double s = 0;
    for (int64_t r = 0; r < N; r++) s += z[r * C + c];
    cs[c] += static_cast<float>(s);
  }
  be->add_row(gy.data(), grow.data(), N, C);
  be->mul_row(gz.data(), gy.data(), grow.data(), N, C);
  be->column_sum_add(gcs.data(), gz.data(), N, C);
  EXPECT_LT(rel(gy.download(), y), 1e-7);
  EXPECT_LT(rel(gz.download(), z), 1e-7);
  EXPECT_LT(rel(gcs.download(), cs), 1e-5);
}

// bf16 attention over several 64-row tiles (the GPU's flash kernels cross tiles, GQA groups and
// partial last tiles here): out and each of dq, dk, dv separately within bf16 rounding of fp32.
TEST_P(BackendOps, Bf16AttentionAcrossTilesStaysNearFp32) {
  if (!offers_bf16()) GTEST_SKIP() << GetParam() << " has no bf16 matmuls";
  for (int64_t hd : {64, 128}) {
    SCOPED_TRACE("hd=" + std::to_string(hd));
    const ops::AttnShape s{2, 150, 4, 2, hd};
    const int64_t N = s.B * s.T, ld = s.ld(), HD = s.H * s.hd, att_n = s.B * s.H * s.T * s.T;
    const auto qkv = randn(N * ld, 110), dout = randn(N * HD, 111), dqkv0 = randn(N * ld, 112);
    std::vector<float> out(N * HD), att(att_n), scratch(att_n), dqkv = dqkv0;
    ops::attention_forward(out.data(), att.data(), qkv.data(), s);
    ops::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s);
    be->set_matmul_precision(MatmulPrecision::bf16);
    const int64_t st = be->attention_state_floats(s);
    Buf gqkv(qkv), gout(N * HD), gatt(st), gdout(dout), gdqkv(dqkv0), gscratch(st);
    be->attention_forward(gout.data(), gatt.data(), gqkv.data(), s);
    be->attention_backward(gdqkv.data(), gscratch.data(), gdout.data(), gqkv.data(), gout.data(),
                           gatt.data(), s);
    be->set_matmul_precision(MatmulPrecision::fp32);
    EXPECT_LT(rel(gout.download(), out), 1e-2);
    const std::vector<float> got = gdqkv.download();
    std::vector<float> ref[3], dev[3];  // dq, dk, dv: what the backward added
    for (int64_t n = 0; n < N; n++) {
      for (int64_t c = 0; c < ld; c++) {
        const int part = c < HD ? 0 : c < HD + s.Hkv * s.hd ? 1 : 2;
        ref[part].push_back(dqkv[n * ld + c] - dqkv0[n * ld + c]);
        dev[part].push_back(got[n * ld + c] - dqkv0[n * ld + c]);
      }
    }
    for (int part = 0; part < 3; part++) EXPECT_LT(rel(dev[part], ref[part]), 2e-2) << part;
  }
}

// The decoder's ops: attention of new queries against a KV cache (long enough for several chunks
// of keys; a prefill longer than one launch's queries), and strided row copies.
TEST_P(BackendOps, DecodeOpsMatchCpu) {
  for (auto [hd, n] : {std::pair<int64_t, int64_t>{16, 3}, {64, 3}, {16, 40}}) {
    SCOPED_TRACE("hd=" + std::to_string(hd) + " n=" + std::to_string(n));
    const int64_t H = 4, Hkv = 2, pos0 = 70, P = pos0 + n;
    const auto q = randn(n * H * hd, 80, 2.0), kc = randn(P * Hkv * hd, 81),
               vc = randn(P * Hkv * hd, 82);
    std::vector<float> out(n * H * hd);
    ops::attention_decode(out.data(), q.data(), kc.data(), vc.data(), n, pos0, H, Hkv, hd);
    Buf gq(q), gk(kc), gv(vc), gout(n * H * hd);
    be->attention_decode(gout.data(), gq.data(), gk.data(), gv.data(), n, pos0, H, Hkv, hd);
    EXPECT_LT(rel(gout.download(), out), 1e-5);
  }
  const int64_t rows = 5, src_ld = 11, dst_ld = 7, w = 4;
  const auto src = randn(rows * src_ld, 83);
  std::vector<float> dst = randn(rows * dst_ld, 84);
  Buf gsrc(src), gdst(dst);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t c = 0; c < w; c++) dst[r * dst_ld + 2 + c] = src[r * src_ld + 3 + c];
  }
  be->copy_rows(gdst.data() + 2, sizeof(float) * dst_ld, gsrc.data() + 3, sizeof(float) * src_ld,
                sizeof(float) * w, rows);
  EXPECT_EQ(gdst.download(), dst);
}

// Attention with bf16 GEMM operands against a direct loop reference that rounds where the bf16
// path does: q, k, v, dout, the probabilities P and the score gradients dS are rounded to bf16 as
// GEMM operands, every product accumulates in fp32/double, the softmax and its backward stay fp32.
// Rounding P or dS can land on the other side of a tie by the order of additions: 1e-4.
TEST_P(BackendOps, Bf16AttentionMatchesRoundedReference) {
  if (!offers_bf16()) GTEST_SKIP() << GetParam() << " has no bf16 matmuls";
  if (be->is_cpu())
    GTEST_SKIP() << "the CPU's attention computes in fp32 (bf16 is its linear layers')";
  const ops::AttnShape s{2, 24, 4, 2, 16};
  const int64_t T = s.T, ld = s.ld(), HD = s.H * s.hd, G = s.H / s.Hkv, N = s.B * T;
  const int64_t att_n = s.B * s.H * T * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  const auto qkv = randn(N * ld, 70), dout = randn(N * HD, 71), dqkv0 = randn(N * ld, 72);
  auto R = [](float f) { return cuda_bf16_round(f); };
  // Element c of head h's q / kv head's k, v at (b, t).
  auto Q = [&](const std::vector<float>& x, int64_t b, int64_t t, int64_t h, int64_t c) -> float {
    return x[(b * T + t) * ld + h * s.hd + c];
  };
  auto koff = [&](int64_t h) { return (s.H + h / G) * s.hd; };
  auto voff = [&](int64_t h) { return (s.H + s.Hkv + h / G) * s.hd; };
  std::vector<float> P(att_n, 0.0f), out(N * HD, 0.0f), dqkv = dqkv0;
  for (int64_t b = 0; b < s.B; b++) {
    for (int64_t h = 0; h < s.H; h++) {
      float* p = P.data() + (b * s.H + h) * T * T;
      for (int64_t t = 0; t < T; t++) {
        std::vector<float> row(t + 1);
        float mx = -INFINITY, z = 0.0f;
        for (int64_t u = 0; u <= t; u++) {
          double acc = 0.0;
          for (int64_t c = 0; c < s.hd; c++) {
            acc += double(R(Q(qkv, b, t, h, c))) * R(qkv[(b * T + u) * ld + koff(h) + c]);
          }
          row[u] = scale * static_cast<float>(acc);
          mx = std::max(mx, row[u]);
        }
        for (int64_t u = 0; u <= t; u++) z += row[u] = std::exp(row[u] - mx);
        for (int64_t u = 0; u <= t; u++) p[t * T + u] = row[u] / z;
        for (int64_t c = 0; c < s.hd; c++) {  // out = round(P) round(v)
          double acc = 0.0;
          for (int64_t u = 0; u <= t; u++) {
            acc += double(R(p[t * T + u])) * R(qkv[(b * T + u) * ld + voff(h) + c]);
          }
          out[(b * T + t) * HD + h * s.hd + c] = static_cast<float>(acc);
        }
      }
      // Backward: dP = round(dout) round(v)^T; dS = scale P (dP - sum P dP); dq += round(dS)
      // round(k), dk += round(dS)^T round(q), dv += round(P)^T round(dout).
      for (int64_t t = 0; t < T; t++) {
        std::vector<float> dp(t + 1);
        float dot = 0.0f;
        for (int64_t u = 0; u <= t; u++) {
          double acc = 0.0;
          for (int64_t c = 0; c < s.hd; c++) {
            acc += double(R(dout[(b * T + t) * HD + h * s.hd + c])) *
                   R(qkv[(b * T + u) * ld + voff(h) + c]);
          }
          dp[u] = static_cast<float>(acc);
          dot += p[t * T + u] * dp[u];
        }
        for (int64_t u = 0; u <= t; u++) {
          const float ds = R(scale * p[t * T + u] * (dp[u] - dot)), pr = R(p[t * T + u]);
          for (int64_t c = 0; c < s.hd; c++) {
            dqkv[(b * T + t) * ld + h * s.hd + c] += ds * R(qkv[(b * T + u) * ld + koff(h) + c]);
            dqkv[(b * T + u) * ld + koff(h) + c] += ds * R(Q(qkv, b, t, h, c));
            dqkv[(b * T + u) * ld + voff(h) + c] += pr * R(dout[(b * T + t) * HD + h * s.hd + c]);
          }
        }
      }
    }
  }
  std::vector<float> out32(N * HD), att32(att_n), scratch32(att_n), dqkv32 = dqkv0;
  ops::attention_forward(out32.data(), att32.data(), qkv.data(), s);
  ops::attention_backward(dqkv32.data(), scratch32.data(), dout.data(), qkv.data(), att32.data(),
                          s);
  Buf gqkv(qkv), gout(N * HD), gatt(att_n), gdout(dout), gdqkv(dqkv0), gscratch(att_n);
  be->set_matmul_precision(MatmulPrecision::bf16);
  // The GPU keeps the rows' log-sum-exp instead (flash attention: other rounding points, so only
  // bf16 tolerances against fp32; its kernels' own test is test_flash_attention).
  const bool flash = be->attention_state_floats(s) == s.B * s.H * T;
  be->attention_forward(gout.data(), gatt.data(), gqkv.data(), s);
  be->attention_backward(gdqkv.data(), gscratch.data(), gdout.data(), gqkv.data(), gout.data(),
                         gatt.data(), s);
  be->set_matmul_precision(MatmulPrecision::fp32);
  if (!flash) {
    EXPECT_LT(rel(gatt.download(), P), 1e-5);
    EXPECT_LT(rel(gout.download(), out), 1e-4);
    EXPECT_LT(rel(gdqkv.download(), dqkv), 1e-4);
  }
  EXPECT_LT(rel(gout.download(), out32), 2e-2);
  EXPECT_GT(rel(gout.download(), out32), 1e-4);  // it did round
  EXPECT_LT(rel(gdqkv.download(), dqkv32), 2e-2);
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendOps, ::testing::Values("cpu", "cuda-host", "cuda"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });
