// The GPU's warp-per-row kernels (src/cuda/warp_kernels.cuh) run on the host, each warp's 32
// lanes as 32 threads (tests/warp_emulation.hpp), against the one-thread-per-index functors they
// replace (src/cuda/row_kernels.hpp, themselves checked against src/ops by test_cuda_rows): widths
// below, at and above the 32 lanes and not multiples of them, every register tile size, and each
// option of the depth mix. What this cannot see is the launch itself (grid, blocks, streams):
// the GPU tests cover that.
#include "warp_emulation.hpp"
// (the emulation first: it defines what the kernels expect from CUDA)
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda/row_kernels.hpp"
#include "cuda/warp_kernels.cuh"
#include "test_util.hpp"

using namespace attnres::cuda;
using attnres::testing::randn;
using attnres::testing::rel_diff;
using warp_emulation::run_warp;

namespace {

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_diff(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

// x rounded to bf16 bits (the sources' bf16 copies the depth kernels read where given).
std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); i++) b[i] = rows::float_to_bf16_bits(x[i]);
  return b;
}

// Runs Body<K> with the tile for dh, as the GPU launcher does; false when dh is too wide.
template <template <int> class Body, class... Args>
void run_tiled(int64_t dh, int64_t rows, const Args&... args) {
  ASSERT_TRUE(warp::with_tile<Body>(
      dh, [&](const auto& b) { run_warp(b, rows); }, args...));
}

}  // namespace

TEST(WarpKernels, RmsNormMatchesFunctor) {
  for (int64_t C : {5, 32, 77, 768}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t N = 6;
    const auto x = randn(N * C, 1, 2.0), g = randn(C, 2), dy = randn(N * C, 3);
    std::vector<float> ya(N * C), yb(N * C), ra(N), rb(N);
    rows::run_rows_host(rows::RmsNormForward{ya.data(), ra.data(), x.data(), g.data(), C, 1e-5f},
                        N);
    run_warp(warp::RmsNormForward{{yb.data(), rb.data(), x.data(), g.data(), C, 1e-5f}}, N);
    EXPECT_LT(rel(yb, ya), 1e-6);
    EXPECT_LT(rel(rb, ra), 1e-6);
    std::vector<float> da = randn(N * C, 4), db = da;  // accumulates
    rows::run_rows_host(
        rows::RmsNormBackwardInput{da.data(), dy.data(), x.data(), g.data(), ra.data(), C}, N);
    run_warp(warp::RmsNormBackwardInput{{db.data(), dy.data(), x.data(), g.data(), ra.data(), C}},
             N);
    EXPECT_LT(rel(db, da), 1e-5);
  }
}

TEST(WarpKernels, CrossEntropyMatchesFunctor) {
  for (int64_t V : {1, 3, 33, 1000}) {
    SCOPED_TRACE("V=" + std::to_string(V));
    const int64_t N = 5;
    auto logits = randn(N * V, 5, 3.0);
    if (V > 3) logits[V + 2] = -INFINITY;  // a masked logit adds nothing (and no NaN)
    std::vector<int32_t> t(N);
    for (int64_t n = 0; n < N; n++) t[n] = static_cast<int32_t>((7 * n + 1) % V);
    std::vector<float> la(N), lb(N), sa(N), sb(N);
    rows::run_rows_host(rows::CrossEntropyForward{la.data(), sa.data(), logits.data(), t.data(), V},
                        N);
    run_warp(warp::CrossEntropyForward{{lb.data(), sb.data(), logits.data(), t.data(), V}}, N);
    EXPECT_LT(rel(sb, sa), 1e-6);
    EXPECT_LT(rel(lb, la), 1e-5);
  }
}

TEST(WarpKernels, AttentionSoftmaxMatchesFunctor) {
  for (int64_t T : {1, 5, 33, 100}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const int64_t R = 2 * T;  // two (b, h) rows of T query positions
    const auto s = randn(R * T, 6, 2.0), dp = randn(R * T, 7);
    std::vector<float> pa = s, pb = s;
    rows::run_rows_host(rows::AttnSoftmaxForward{pa.data(), T}, R);
    run_warp(warp::AttnSoftmaxForward{{pb.data(), T}}, R);
    EXPECT_LT(rel(pb, pa), 1e-6);
    std::vector<float> ga = dp, gb = dp;
    rows::run_rows_host(rows::AttnSoftmaxBackward{ga.data(), pa.data(), T, 0.3f}, R);
    run_warp(warp::AttnSoftmaxBackward{{gb.data(), pa.data(), T, 0.3f}}, R);
    EXPECT_LT(rel(gb, ga), 1e-5);
  }
}

// Flash attention's D = rowsum(dO o O) per (sequence, position, head).
TEST(WarpKernels, AttentionRowDotMatchesFunctor) {
  for (int64_t hd : {16, 50, 128}) {
    SCOPED_TRACE("hd=" + std::to_string(hd));
    const int64_t B = 2, T = 5, H = 3, N = B * T * H;
    const auto o = randn(N * hd, 11), g = randn(N * hd, 12);
    std::vector<float> a(N), b(N, 9.0f);
    rows::run_rows_host(rows::AttnRowDot{a.data(), o.data(), g.data(), T, H, hd}, N);
    run_warp(warp::AttnRowDot{{b.data(), o.data(), g.data(), T, H, hd}}, N);
    EXPECT_LT(rel(b, a), 1e-5);
  }
}

// KV-cache decoding, one chunk of keys per warp: head dimensions below, at and above 32 lanes up
// to the 256-channel register tile, GQA, a prefill chunk at a later position (scores far apart:
// the online max moves), chunks of 3 keys (full, partial and empty ones).
TEST(WarpKernels, AttentionDecodeMatchesFunctor) {
  for (int64_t hd : {8, 32, 50, 256}) {
    SCOPED_TRACE("hd=" + std::to_string(hd));
    const int64_t H = 4, Hkv = 2, n = 3, pos0 = 5, P = pos0 + n, KC = 3, C = 3;
    const auto q = randn(n * H * hd, 8, 3.0), kc = randn(P * Hkv * hd, 9),
               vc = randn(P * Hkv * hd, 10);
    const int64_t R = n * H * C;
    std::vector<float> a(R * (hd + 2)), b(R * (hd + 2), 9.0f);
    rows::run_rows_host(
        rows::AttnDecodePartial{a.data(), q.data(), kc.data(), vc.data(), pos0, H, Hkv, hd, KC, C},
        R);
    run_warp(warp::AttnDecodePartial{{b.data(), q.data(), kc.data(), vc.data(), pos0, H, Hkv, hd,
                                      KC, C}},
             R);
    for (int64_t r = 0; r < R; r++) {  // m: -inf for an empty chunk, in both
      const float ma = a[r * (hd + 2) + hd], mb = b[r * (hd + 2) + hd];
      if (std::isinf(ma)) {
        EXPECT_EQ(mb, ma) << r;
      } else {
        EXPECT_NEAR(mb, ma, 1e-5 * (1 + std::abs(ma))) << r;
      }
      a[r * (hd + 2) + hd] = b[r * (hd + 2) + hd] = 0.0f;
    }
    EXPECT_LT(rel(b, a), 1e-5);
  }
}

// The depth mix forward and backward and the depth RMS for every register tile (dh from 5 to
// 1000), 1 or 3 heads, softmax or sigmoid gate, key norm or none, shared or per-token queries
// (every combination at dh 200, two opposite ones elsewhere: each emulated shuffle is costly).
TEST(WarpKernels, DepthMixMatchesFunctor) {
  const int64_t N = 3, S = 4;
  for (int64_t dh : {5, 200, 500, 700, 1000}) {
    for (int64_t H : {1, 3}) {
      if (H > 1 && dh > 200) continue;
      for (int opts = 0; opts < 8; opts++) {
        if (dh != 200 && opts != 3 && opts != 4) continue;
        const bool softmax = opts & 1, key_norm = opts & 2, dynamic = opts & 4;
        SCOPED_TRACE("H=" + std::to_string(H) + " dh=" + std::to_string(dh) +
                     (softmax ? " softmax" : " sigmoid") + (key_norm ? " rms" : " none") +
                     (dynamic ? " dynamic" : " static"));
        const int64_t d = dh * H;
        rows::Mix m;
        m.d = d;
        m.H = H;
        m.softmax = softmax;
        m.key_norm = key_norm;
        std::vector<std::vector<float>> v, r, dva, dvb;
        for (int64_t i = 0; i < S; i++) {
          v.push_back(randn(N * d, 10 + i, 1.0 + 0.3 * i));
          r.emplace_back(N * H);
          std::vector<float> rw(N * H);
          rows::run_rows_host(rows::DepthRstd{r[i].data(), v[i].data(), d, H, 1e-5f}, N * H);
          run_warp(warp::DepthRstd{{rw.data(), v[i].data(), d, H, 1e-5f}}, N * H);
          EXPECT_LT(rel(rw, r[i]), 1e-6);
          dva.push_back(randn(N * d, 20 + i));
          dvb.push_back(dva.back());
        }
        std::vector<rows::Source> sa(S), sb(S);
        std::vector<std::vector<uint16_t>> vb;  // with several heads: bf16 sources
        for (int64_t i = 0; i < S; i++) {
          vb.push_back(to_bf16(v[i]));
          const uint16_t* b = H > 1 ? vb[i].data() : nullptr;
          sa[i] = {v[i].data(), r[i].data(), dva[i].data(), b};
          sb[i] = {v[i].data(), r[i].data(), dvb[i].data(), b};
        }
        const int64_t q_ld = dynamic ? d : 0;
        const auto q = randn(dynamic ? N * d : d, 30, 0.2);
        std::vector<float> xa(N * d), xb(N * d, 9.0f), la(N * H), lb(N * H);
        rows::run_rows_host(
            rows::DepthMixForward{xa.data(), la.data(), sa.data(), S, q.data(), q_ld, m}, N * H);
        run_tiled<warp::DepthMixForward>(
            dh, N * H,
            rows::DepthMixForward{xb.data(), lb.data(), sb.data(), S, q.data(), q_ld, m});
        EXPECT_LT(rel(xb, xa), 1e-5);
        if (softmax) {
          EXPECT_LT(rel(lb, la), 1e-6);
        }
        const auto dx = randn(N * d, 31);
        std::vector<float> dqa(N * d, 0.5f), dqb = dqa;  // accumulates
        rows::run_rows_host(rows::DepthMixBackward{dqa.data(), dx.data(), xa.data(), la.data(),
                                                   sa.data(), S, q.data(), q_ld, m},
                            N * H);
        run_tiled<warp::DepthMixBackward>(
            dh, N * H,
            rows::DepthMixBackward{dqb.data(), dx.data(), xa.data(), la.data(), sb.data(), S,
                                   q.data(), q_ld, m});
        // (dq is a sum of terms that cancel: other summation orders differ by up to ~4e-5)
        EXPECT_LT(rel(dqb, dqa), 2e-4);
        for (int64_t i = 0; i < S; i++) EXPECT_LT(rel(dvb[i], dva[i]), 1e-5) << "source " << i;
      }
    }
  }
}

// The by-source backward (Full AttnRes) and its dx . x, for every tile size and option.
TEST(WarpKernels, BySourceBackwardMatchesFunctor) {
  const int64_t N = 3, K = 3;
  for (int64_t dh : {5, 200, 500, 700, 1000}) {
    for (int64_t H : {1, 3}) {
      if (H > 1 && dh > 200) continue;
      for (int opts = 0; opts < 4; opts++) {
        if (dh != 200 && opts != 3) continue;
        const bool softmax = opts & 1, key_norm = opts & 2;
        SCOPED_TRACE("H=" + std::to_string(H) + " dh=" + std::to_string(dh) +
                     (softmax ? " softmax" : " sigmoid") + (key_norm ? " rms" : " none"));
        const int64_t d = dh * H;
        rows::Mix m;
        m.d = d;
        m.H = H;
        m.softmax = softmax;
        m.key_norm = key_norm;
        const auto v = randn(N * d, 40, 1.5), q = randn(K * d, 41, 0.2);
        std::vector<float> r(N * H);
        rows::run_rows_host(rows::DepthRstd{r.data(), v.data(), d, H, 1e-5f}, N * H);
        std::vector<std::vector<float>> dx, x, lse, D;
        std::vector<rows::Reader> rd;
        for (int64_t k = 0; k < K; k++) {
          dx.push_back(randn(N * d, 50 + k));
          x.push_back(randn(N * d, 60 + k));
          lse.push_back(randn(N * H, 70 + k));
          D.emplace_back(N * H);
          std::vector<float> Dw(N * H);
          rows::run_rows_host(rows::DepthDxDot{D[k].data(), dx[k].data(), x[k].data(), m}, N * H);
          run_warp(warp::DepthDxDot{{Dw.data(), dx[k].data(), x[k].data(), m}}, N * H);
          EXPECT_LT(rel(Dw, D[k]), 1e-5);
        }
        for (int64_t k = 0; k < K; k++) {
          rd.push_back({dx[k].data(), lse[k].data(), D[k].data(), q.data() + k * d});
        }
        std::vector<float> dva(N * d), dvb(N * d, 7.0f), sa(H * K * N), sb(H * K * N);
        const auto vb = to_bf16(v);  // with several heads: a bf16 source
        const rows::Source src{v.data(), r.data(), nullptr, H > 1 ? vb.data() : nullptr};
        std::vector<float> wa(N * d), wb(N * d);  // the values used, written out (bf16 case)
        rows::run_rows_host(rows::DepthSourceBackward{dva.data(), sa.data(), src, rd.data(), K, N,
                                                      m, H > 1 ? wa.data() : nullptr},
                            N * H);
        run_tiled<warp::DepthSourceBackward>(
            dh, N * H,
            rows::DepthSourceBackward{dvb.data(), sb.data(), src, rd.data(), K, N, m,
                                      H > 1 ? wb.data() : nullptr});
        EXPECT_LT(rel(dvb, dva), 1e-5);
        EXPECT_EQ(wb, wa);
        if (H > 1) {
          for (int64_t i = 0; i < N * d; i++) {
            ASSERT_EQ(wa[i], rows::bf16_bits_to_float(vb[i])) << i;
          }
        }
        EXPECT_LT(rel(sb, sa), 1e-5);
      }
    }
  }
}

// Two-phase Block AttnRes: phase 1 with 6 queries (groups of 4 and 2, as the launcher splits
// them) and phase 2, for every tile size.
TEST(WarpKernels, TwoPhaseMatchesFunctor) {
  const int64_t N = 3, S = 3, K = 6;
  for (int64_t H : {1, 2}) {
    for (int64_t dh : {7, 200, 400, 640, 1000}) {
      for (bool key_norm : {true, false}) {
        if (H > 1 && dh > 200) continue;
        SCOPED_TRACE("H=" + std::to_string(H) + " dh=" + std::to_string(dh) +
                     (key_norm ? " rms" : " none"));
        const int64_t d = dh * H;
        rows::Mix m;
        m.d = d;
        m.H = H;
        m.key_norm = key_norm;
        std::vector<std::vector<float>> v, r;
        for (int64_t i = 0; i <= S; i++) {  // source S: the partial sum of phase 2
          v.push_back(randn(N * d, 40 + i, 1.0 + 0.5 * i));
          r.emplace_back(N * H);
          rows::run_rows_host(rows::DepthRstd{r[i].data(), v[i].data(), d, H, 1e-5f}, N * H);
        }
        std::vector<rows::Source> src(S);
        std::vector<std::vector<uint16_t>> vb;  // with two heads: bf16 sources
        for (int64_t i = 0; i <= S; i++) vb.push_back(to_bf16(v[i]));
        for (int64_t i = 0; i < S; i++) {
          src[i] = {v[i].data(), r[i].data(), nullptr, H > 1 ? vb[i].data() : nullptr};
        }
        std::vector<std::vector<float>> q, oa, ob, la, lb;
        rows::DepthMixPhase1 fa{}, fb{};
        for (int64_t k = 0; k < K; k++) {
          q.push_back(randn(d, 50 + k, 0.3));
          oa.emplace_back(N * d);
          ob.emplace_back(N * d);
          la.emplace_back(N * H);
          lb.emplace_back(N * H);
        }
        for (int64_t k = 0; k < K; k++) {
          fa.o[k] = oa[k].data();
          fa.lse[k] = la[k].data();
          fb.o[k] = ob[k].data();
          fb.lse[k] = lb[k].data();
          fa.q[k] = fb.q[k] = q[k].data();
        }
        fa.K = fb.K = K;
        fa.src = fb.src = src.data();
        fa.S = fb.S = S;
        fa.m = fb.m = m;
        rows::run_rows_host(fa, N * H);
        for (int64_t k0 = 0; k0 < K; k0 += warp::kQueries) {
          const int64_t kn = std::min<int64_t>(warp::kQueries, K - k0);
          run_tiled<warp::DepthMixPhase1>(dh, N * H, fb, k0, kn);
        }
        for (int64_t k = 0; k < K; k++) {
          EXPECT_LT(rel(ob[k], oa[k]), 1e-5) << "query " << k;
          EXPECT_LT(rel(lb[k], la[k]), 1e-5) << "query " << k;
        }
        const rows::Source p{v[S].data(), r[S].data(), nullptr, H > 1 ? vb[S].data() : nullptr};
        std::vector<float> xa(N * d), xb(N * d), ya(N * H), yb(N * H);
        rows::run_rows_host(rows::DepthMixPhase2{xa.data(), ya.data(), oa[1].data(), la[1].data(),
                                                 p, q[1].data(), m},
                            N * H);
        run_warp(warp::DepthMixPhase2{{xb.data(), yb.data(), oa[1].data(), la[1].data(), p,
                                       q[1].data(), m}},
                 N * H);
        EXPECT_LT(rel(xb, xa), 1e-6);
        EXPECT_LT(rel(yb, ya), 1e-6);
      }
    }
  }
}
