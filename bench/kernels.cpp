// Google Benchmark micro-benchmarks of the kernels, each beside its simple reference where one
// exists, with achieved GFLOP/s or GB/s as counters. Build: the `attnres_kernels_bench` target;
// run: build/bench/attnres_kernels_bench [--benchmark_filter=REGEX].
// Shapes are those of the d 512 / T 512 benchmark model (docs/BENCHMARKS.md).
#include <omp.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/bf16.hpp"
#include "core/blas.hpp"
#include "core/rng.hpp"
#include "core/vmath.hpp"
#include "ops/ops.hpp"

using namespace attnres;

namespace {

std::vector<float> randv(int64_t n, uint64_t seed, double scale = 1.0) {
  Rng r(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * r.normal());
  return v;
}

void BM_Sgemm(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto A = randv(n * n, 1), B = randv(n * n, 2);
  std::vector<float> C(n * n);
  for (auto _ : st) sgemm(false, true, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
  st.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Sgemm)->Arg(512)->Arg(2048)->Unit(benchmark::kMillisecond);

// Linear layer of the model: (N = 2048 tokens) x (512 -> 1536) as in the fused qkv projection.
void BM_MatmulForward(benchmark::State& st) {
  const int64_t N = 2048, IC = 512, OC = 1536;
  auto x = randv(N * IC, 1), w = randv(OC * IC, 2);
  std::vector<float> y(N * OC);
  for (auto _ : st) ops::matmul_forward(y.data(), x.data(), w.data(), N, IC, OC);
  st.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * N * IC * OC, benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}
BENCHMARK(BM_MatmulForward)->Unit(benchmark::kMillisecond);

// The three products of a linear layer (N = 2048 tokens, IC -> OC) in fp32 (sgemm) and in bf16
// (gemm_bf16 on rounded copies, the rounding of both operands timed too, as the CPU backend does
// without a memo): forward out = x w^T, backward dx += dy w, dw += dy^T x.
// Args: {which (0 fwd, 1 dx, 2 dw), bf16, IC, OC}.
void BM_LinearProducts(benchmark::State& st) {
  const int64_t which = st.range(0), N = 2048, IC = st.range(2), OC = st.range(3);
  const bool bf16 = st.range(1) != 0;
  const auto x = randv(N * IC, 1), w = randv(OC * IC, 2), dy = randv(N * OC, 3);
  std::vector<float> out(static_cast<size_t>(std::max(N * OC, std::max(N * IC, OC * IC))));
  std::vector<uint16_t> xb(x.size()), wb(w.size()), dyb(dy.size());
  to_bf16_host(xb.data(), x.data(), N * IC);  // (the copies a memo holds for the backward)
  to_bf16_host(wb.data(), w.data(), OC * IC);
  for (auto _ : st) {
    if (!bf16) {
      if (which == 0)
        sgemm(false, true, N, OC, IC, 1.0f, x.data(), IC, w.data(), IC, 0.0f, out.data(), OC);
      if (which == 1)
        sgemm(false, false, N, IC, OC, 1.0f, dy.data(), OC, w.data(), IC, 1.0f, out.data(), IC);
      if (which == 2)
        sgemm(true, false, OC, IC, N, 1.0f, dy.data(), OC, x.data(), IC, 1.0f, out.data(), IC);
      continue;
    }
    if (which == 0) {
      to_bf16_host(xb.data(), x.data(), N * IC);
      to_bf16_host(wb.data(), w.data(), OC * IC);
      gemm_bf16(false, true, N, OC, IC, xb.data(), IC, wb.data(), IC, 0.0f, out.data(), OC);
    } else if (which == 1) {
      to_bf16_host(dyb.data(), dy.data(), N * OC);
      gemm_bf16(false, false, N, IC, OC, dyb.data(), OC, wb.data(), IC, 1.0f, out.data(), IC);
    } else {
      gemm_bf16(true, false, OC, IC, N, dyb.data(), OC, xb.data(), IC, 1.0f, out.data(), IC);
    }
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * N * IC * OC, benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}
BENCHMARK(BM_LinearProducts)
    ->ArgsProduct({{0, 1, 2}, {0, 1}, {512}, {1536, 512, 2816}})
    ->ArgNames({"which", "bf16", "IC", "OC"})
    ->Unit(benchmark::kMillisecond);

// Decoding's product: one row times a transposed weight, fp32 sgemm against bf16 (the weight
// rounded once, as a decoder keeps it). Args: {bf16, IC, OC}.
void BM_DecodeProduct(benchmark::State& st) {
  const bool bf16 = st.range(0) != 0;
  const int64_t IC = st.range(1), OC = st.range(2);
  const auto x = randv(IC, 1), w = randv(OC * IC, 2);
  std::vector<uint16_t> xb(x.size()), wb(w.size());
  to_bf16_host(wb.data(), w.data(), OC * IC);
  std::vector<float> out(OC);
  for (auto _ : st) {
    if (bf16) {
      to_bf16_host(xb.data(), x.data(), IC);
      gemm_bf16(false, true, 1, OC, IC, xb.data(), IC, wb.data(), IC, 0.0f, out.data(), OC);
    } else {
      sgemm(false, true, 1, OC, IC, 1.0f, x.data(), IC, w.data(), IC, 0.0f, out.data(), OC);
    }
  }
  st.counters["GB/s"] = benchmark::Counter((bf16 ? 2.0 : 4.0) * IC * OC,
                                           benchmark::Counter::kIsIterationInvariantRate,
                                           benchmark::Counter::kIs1000);
}
BENCHMARK(BM_DecodeProduct)
    ->ArgsProduct({{0, 1}, {512}, {8192, 2816}})
    ->ArgNames({"bf16", "IC", "OC"})
    ->Unit(benchmark::kMicrosecond);

// One row block of the CPU attention (64 query rows against r1 keys, head dim 64, the bench
// model's shapes), fp32 sgemm against bf16 (the probabilities rounded per call, q/k/v once per
// layer so not timed): scores S = q k^T, then out = P v. Decides whether bf16 attention pays:
// these products are small, so a per-call overhead would eat the faster multiply. Args: {bf16, r1}.
void BM_AttentionBlockProducts(benchmark::State& st) {
  const bool bf16 = st.range(0) != 0;
  const int64_t M = 64, hd = 64, r1 = st.range(1), ld = 3 * 512;
  const auto q = randv(M * ld, 1), k = randv(r1 * ld, 2), v = randv(r1 * ld, 3);
  std::vector<float> S(M * r1), out(M * hd);
  std::vector<uint16_t> qb(q.size()), kb(k.size()), vb(v.size()), Pb(S.size());
  to_bf16_host(qb.data(), q.data(), M * ld);
  to_bf16_host(kb.data(), k.data(), r1 * ld);
  to_bf16_host(vb.data(), v.data(), r1 * ld);
  for (auto _ : st) {
    if (bf16) {
      gemm_bf16(false, true, M, r1, hd, qb.data(), ld, kb.data(), ld, 0.0f, S.data(), r1);
      to_bf16_host(Pb.data(), S.data(), M * r1);
      gemm_bf16(false, false, M, hd, r1, Pb.data(), r1, vb.data(), ld, 0.0f, out.data(), hd);
    } else {
      sgemm(false, true, M, r1, hd, 1.0f, q.data(), ld, k.data(), ld, 0.0f, S.data(), r1);
      sgemm(false, false, M, hd, r1, 1.0f, S.data(), r1, v.data(), ld, 0.0f, out.data(), hd);
    }
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(4.0 * M * r1 * hd, benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AttentionBlockProducts)
    ->ArgsProduct({{0, 1}, {64, 256, 512}})
    ->ArgNames({"bf16", "r1"})
    ->Unit(benchmark::kMicrosecond);

void BM_Attention(benchmark::State& st) {
  const ops::AttnShape s{4, 512, 8, 8, 64};
  const int64_t N = s.B * s.T;
  auto qkv = randv(N * s.ld(), 3);
  std::vector<float> out(N * s.H * s.hd), att(s.B * s.H * s.T * s.T), dq(N * s.ld()),
      scratch(att.size());
  auto dout = randv(N * s.H * s.hd, 4);
  const bool backward = st.range(0) == 1;
  ops::attention_forward(out.data(), att.data(), qkv.data(), s);
  for (auto _ : st) {
    if (backward) {
      ops::attention_backward(dq.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s);
    } else {
      ops::attention_forward(out.data(), att.data(), qkv.data(), s);
    }
  }
  // Causal work actually done: about half of 4 B H T^2 hd (forward), twice that backward.
  const double flops = (backward ? 2.0 : 1.0) * 2.0 * s.B * s.H * double(s.T) * s.T * s.hd;
  st.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Attention)->Arg(0)->Arg(1)->ArgNames({"backward"})->Unit(benchmark::kMillisecond);

// One depth mixer over S sources (Full AttnRes reads up to 2 L + 1 of them), width d (512: the
// bench model; 128: the deep, narrow models of the fidelity studies, 32 sublayers).
void BM_DepthMix(benchmark::State& st) {
  const int64_t N = 2048, S = st.range(0), d = st.range(3);
  const bool backward = st.range(1) == 1, reference = st.range(2) == 1;
  std::vector<std::vector<float>> v, r, g;
  std::vector<ops::DepthSource> src;
  ops::DepthMix m;
  m.d = d;
  for (int64_t i = 0; i < S; i++) {
    v.push_back(randv(N * d, 10 + i));
    r.emplace_back(N);
    g.emplace_back(N * d, 0.0f);
    ops::depth_rstd(r.back().data(), v.back().data(), N, d, 1, 1e-5f);
  }
  for (int64_t i = 0; i < S; i++) src.push_back({v[i].data(), r[i].data(), g[i].data()});
  auto q = randv(d, 5, 0.1), dx = randv(N * d, 6);
  std::vector<float> x(N * d), lse(N), dq(d);
  ops::depth_mix_forward(x.data(), lse.data(), src.data(), S, q.data(), 0, m, N);
  for (auto _ : st) {
    if (backward) {
      ops::depth_mix_backward(dq.data(), dx.data(), x.data(), lse.data(), src.data(), S, q.data(),
                              0, m, N);
    } else if (reference) {
      ops::depth_mix_forward_reference(x.data(), lse.data(), src.data(), S, q.data(), 0, m, N);
    } else {
      ops::depth_mix_forward(x.data(), lse.data(), src.data(), S, q.data(), 0, m, N);
    }
  }
  // Bytes the kernel must move: each source read once (+ its gradient read and written backward).
  const double bytes = (backward ? 3.0 : 1.0) * S * N * d * sizeof(float);
  st.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate,
                                           benchmark::Counter::kIs1000);
}
BENCHMARK(BM_DepthMix)
    ->Args({9, 0, 0, 512})
    ->Args({9, 0, 1, 512})
    ->Args({9, 1, 0, 512})
    ->Args({17, 0, 0, 512})
    ->Args({17, 1, 0, 512})
    ->Args({33, 0, 0, 128})
    ->Args({33, 1, 0, 128})
    ->ArgNames({"sources", "backward", "reference", "d"})
    ->Unit(benchmark::kMillisecond);

// Every forward depth mix of a Full AttnRes model with L sublayers (mixers 0..L over 1..L+1
// sources; N 2048 tokens, d 128: the deep, narrow bench model at L = 32), one mixer at a time
// (group 1) or in groups of G sharing one pass over the older sources (phase 1, then phase 2
// merging each newer source: the router's prepare_grouped). Args: {L, G}.
void BM_FullDepthForward(benchmark::State& st) {
  const int64_t N = 2048, d = 128, L = st.range(0), G = st.range(1);
  ops::DepthMix m;
  m.d = d;
  std::vector<std::vector<float>> v, r;
  std::vector<ops::DepthSource> src;
  for (int64_t i = 0; i <= L; i++) {
    v.push_back(randv(N * d, 10 + i));
    r.emplace_back(N);
    ops::depth_rstd(r.back().data(), v.back().data(), N, d, 1, 1e-5f);
  }
  for (int64_t i = 0; i <= L; i++) src.push_back({v[i].data(), r[i].data(), nullptr});
  const auto q = randv((L + 1) * d, 5, 0.1);
  std::vector<std::vector<float>> x(L + 1, std::vector<float>(N * d)),
      lse(L + 1, std::vector<float>(N));
  std::vector<std::vector<float>> o(G, std::vector<float>(N * d)), ol(G, std::vector<float>(N));
  for (auto _ : st) {
    for (int64_t l = 0; l <= L; l++) {
      const int64_t k = l % G;
      if (G == 1) {
        ops::depth_mix_forward(x[l].data(), lse[l].data(), src.data(), l + 1, q.data() + l * d, 0,
                               m, N);
      } else if (k == 0) {
        const int64_t K = std::min(G, L + 1 - l);
        std::vector<float*> po(K), pl(K);
        std::vector<const float*> pq(K);
        for (int64_t j = 0; j < K; j++) {
          po[j] = j == 0 ? x[l].data() : o[j].data();
          pl[j] = j == 0 ? lse[l].data() : ol[j].data();
          pq[j] = q.data() + (l + j) * d;
        }
        ops::depth_mix_phase1(po.data(), pl.data(), src.data(), l + 1, pq.data(), K, m, N);
      } else {
        const float* ob = o[k].data();
        const float* lb = ol[k].data();
        for (int64_t j = l - k + 1; j <= l; j++) {
          ops::depth_mix_phase2(x[l].data(), lse[l].data(), ob, lb, src[j], q.data() + l * d, m, N);
          ob = x[l].data();
          lb = lse[l].data();
        }
      }
    }
    benchmark::DoNotOptimize(x.back().data());
  }
}
// Every backward depth mix of a Full AttnRes model with L sublayers, by source as the model runs
// it (depth_source_backward: source j's gradient from readers j+1..L, each reader's dx streamed
// once per source), or in groups of G sources sharing one pass over the readers' dx
// (depth_sources_backward); N 2048 tokens, d 128 (the deep, narrow model at L = 32). Args: {L, G}.
void BM_FullDepthBackward(benchmark::State& st) {
  const int64_t N = 2048, d = 128, L = st.range(0), G = st.range(1);
  ops::DepthMix m;
  m.d = d;
  std::vector<std::vector<float>> v, r, dx, x, lse, D;
  for (int64_t i = 0; i <= L; i++) {
    v.push_back(randv(N * d, 10 + i));
    r.emplace_back(N);
    ops::depth_rstd(r.back().data(), v.back().data(), N, d, 1, 1e-5f);
  }
  std::vector<ops::DepthSource> src;
  for (int64_t i = 0; i <= L; i++) src.push_back({v[i].data(), r[i].data(), nullptr});
  const auto q = randv((L + 1) * d, 5, 0.1);
  for (int64_t l = 0; l <= L; l++) {  // each mixer's forward output, lse and dx . x
    x.emplace_back(N * d);
    lse.emplace_back(N);
    D.emplace_back(N);
    dx.push_back(randv(N * d, 100 + l));
    ops::depth_mix_forward(x[l].data(), lse[l].data(), src.data(), l + 1, q.data() + l * d, 0, m,
                           N);
    ops::depth_dx_dot(D[l].data(), dx[l].data(), x[l].data(), m, N);
  }
  const int nthr = omp_get_max_threads();
  std::vector<std::vector<float>> dv(G, std::vector<float>(N * d));
  std::vector<float> tmp(N * d), dq(static_cast<size_t>(nthr) * (L + 1) * d);
  auto readers = [&](int64_t from, int64_t to) {  // mixers from..to
    std::vector<ops::DepthReader> rd;
    for (int64_t l = from; l <= to; l++) {
      rd.push_back({dx[l].data(), lse[l].data(), D[l].data(), q.data() + l * d, l * d});
    }
    return rd;
  };
  for (auto _ : st) {
    // Sources L..0 as the backward meets them; a group's head j takes readers j+1..L for sources
    // j..j-G+1 in one pass; each later member adds the readers inside the group.
    for (int64_t j = L; j >= 0; j--) {
      const int64_t head = std::min(L, j + (L - j) % G), i = head - j;
      if (i == 0) {
        const int64_t n = std::min(G, j + 1);
        std::vector<float*> out;
        for (int64_t g = 0; g < n; g++) out.push_back(dv[g].data());
        std::vector<ops::DepthSource> s(src.begin() + (j - n + 1), src.begin() + j + 1);
        std::reverse(s.begin(), s.end());  // (source j first)
        const auto rd = readers(j + 1, L);
        if (!rd.empty()) {
          ops::depth_sources_backward(out.data(), s.data(), n, rd.data(),
                                      static_cast<int64_t>(rd.size()), dq.data(), (L + 1) * d, nthr,
                                      m, N);
        }
      } else {
        const auto rd = readers(j + 1, head);
        ops::depth_source_backward(tmp.data(), src[j], rd.data(), static_cast<int64_t>(rd.size()),
                                   dq.data(), (L + 1) * d, nthr, m, N);
        float* part = dv[i].data();
        for (int64_t c = 0; c < N * d; c++) part[c] += tmp[c];
      }
    }
    benchmark::DoNotOptimize(dv[0].data());
  }
}
BENCHMARK(BM_FullDepthBackward)
    ->Args({32, 1})
    ->Args({32, 2})
    ->Args({32, 4})
    ->Args({32, 8})
    ->ArgNames({"L", "G"})
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_FullDepthForward)
    ->Args({32, 1})
    ->Args({32, 2})
    ->Args({32, 3})
    ->Args({32, 4})
    ->Args({32, 6})
    ->ArgNames({"L", "G"})
    ->Unit(benchmark::kMillisecond);

// The bandwidth the depth mix is bound by: S arrays of (N,d) floats summed into one, source by
// source in tiles as the mix reads them (the same bytes as a forward mixer, no scoring).
void BM_StreamSum(benchmark::State& st) {
  const int64_t N = 2048, S = st.range(0), d = st.range(1);
  std::vector<std::vector<float>> v;
  for (int64_t i = 0; i < S; i++) v.push_back(randv(N * d, 10 + i));
  std::vector<float> x(N * d);
  for (auto _ : st) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      for (int64_t i = 0; i < S; i++) {
        const float* s = v[i].data();
        for (int64_t k = n0 * d; k < (n0 + 32) * d; k++) x[k] = i ? x[k] + s[k] : s[k];
      }
    }
    benchmark::DoNotOptimize(x.data());
  }
  st.counters["GB/s"] = benchmark::Counter(double(S) * N * d * sizeof(float),
                                           benchmark::Counter::kIsIterationInvariantRate,
                                           benchmark::Counter::kIs1000);
}
BENCHMARK(BM_StreamSum)->Args({17, 512})->Args({33, 128})->Unit(benchmark::kMillisecond);

void BM_Exp(benchmark::State& st) {
  const int64_t n = 1 << 20;
  auto x = randv(n, 7, 5.0);
  std::vector<float> y(n);
  const bool vec = st.range(0) == 1;
  for (auto _ : st) {
    if (vec) {
#pragma omp simd
      for (int64_t i = 0; i < n; i++) y[i] = vexpf(x[i]);
    } else {
      for (int64_t i = 0; i < n; i++) y[i] = std::exp(x[i]);
    }
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["Gexp/s"] = benchmark::Counter(
      double(n), benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Exp)->Arg(0)->Arg(1)->ArgNames({"vexpf"});

void BM_Swiglu(benchmark::State& st) {
  const int64_t N = 2048, F = 1376;
  auto h13 = randv(N * 2 * F, 8);
  std::vector<float> out(N * F);
  for (auto _ : st) ops::swiglu_forward(out.data(), h13.data(), N, F);
  st.counters["GB/s"] =
      benchmark::Counter(3.0 * N * F * sizeof(float), benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Swiglu)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
