// The GPU's flash attention kernels (src/cuda/flash_attention.cuh) on the host: each block runs
// on 32 threads per warp (warp_emulation.hpp's run_block: warp shuffles and barriers, and the
// block's __syncthreads) with the WMMA tile operations emulated (wmma_emulation.hpp), against the
// CPU ops (src/ops, fp32, probabilities materialised) and a direct log-sum-exp. The kernels'
// operands are bf16, so the tolerances are bf16's (~3 digits); a wrong mask, tile offset, head or
// transpose is off by O(1). Shapes with a partial last tile, GQA and MHA, and every supported head
// dimension.
#include <gtest/gtest.h>

#include <cmath>
#include <new>
#include <vector>

#include "warp_emulation.hpp"
#include "wmma_emulation.hpp"

#include "cuda/flash_attention.cuh"
#include "cuda/row_kernels.hpp"
#include "ops/ops.hpp"
#include "test_util.hpp"

using namespace attnres;
using namespace attnres::cuda;
using attnres::testing::randn;
using attnres::testing::rel_diff;

namespace {

// A block's shared memory, aligned as the kernels' dynamic shared memory is.
template <int HD>
struct Shared {
  flash::Smem<HD>* m = new (std::align_val_t(128)) flash::Smem<HD>();
  ~Shared() { ::operator delete(m, std::align_val_t(128)); }
};

template <int HD, class Body>
void run(const Body& body, int64_t units) {
  Shared<HD> s;
  warp_emulation::run_block([&](int64_t u, int w, int lane) { body(u, w, lane, *s.m); }, units,
                            flash::kWarps);
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  return rel_diff(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

// per_head: GQA's dK, dV per query head, then summed (rows::GqaSum), as the GPU runs it.
template <int HD>
void check_shape(int64_t B, int64_t T, int64_t H, int64_t Hkv, uint64_t seed,
                 bool per_head = false) {
  SCOPED_TRACE("B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H) +
               " Hkv " + std::to_string(Hkv) + " hd " + std::to_string(HD) +
               (per_head ? " per head" : ""));
  const ops::AttnShape s{B, T, H, Hkv, HD};
  const int64_t N = B * T, ld = s.ld(), HDs = H * HD;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const auto qkv = randn(N * ld, seed), dout = randn(N * HDs, seed + 1),
             dqkv0 = randn(N * ld, seed + 2);
  // CPU reference (fp32).
  std::vector<float> out(N * HDs), att(B * H * T * T), scratch(att.size()), dqkv = dqkv0;
  ops::attention_forward(out.data(), att.data(), qkv.data(), s);
  ops::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s);
  std::vector<float> lse(B * H * T);  // log sum_u<=t exp(scale q_t k_u), directly
  for (int64_t b = 0; b < B; b++) {
    for (int64_t h = 0; h < H; h++) {
      const int64_t kh = h / (H / Hkv);
      for (int64_t t = 0; t < T; t++) {
        std::vector<double> x(t + 1);
        double mx = -1e300, z = 0.0;
        for (int64_t u = 0; u <= t; u++) {
          double d = 0.0;
          for (int64_t c = 0; c < HD; c++) {
            d += double(qkv[(b * T + t) * ld + h * HD + c]) *
                 qkv[(b * T + u) * ld + (H + kh) * HD + c];
          }
          x[u] = scale * d;
          mx = std::max(mx, x[u]);
        }
        for (double v : x) z += std::exp(v - mx);
        lse[(b * H + h) * T + t] = static_cast<float>(mx + std::log(z));
      }
    }
  }
  // The kernels.
  std::vector<float> fout(N * HDs, 7.0f), flse(B * H * T), fd(B * H * T), fdqkv = dqkv0;
  flash::Args a{};
  a.qkv = qkv.data();
  a.out = fout.data();
  a.dout = dout.data();
  a.dqkv = fdqkv.data();
  a.lse = flse.data();
  a.dsum = fd.data();
  a.B = B, a.T = T, a.H = H, a.Hkv = Hkv, a.ld = ld, a.scale = scale;
  run<HD>([&](int64_t u, int w, int lane,
              flash::Smem<HD>& m) { flash::forward_block<HD>(a, u, w, lane, m); },
          flash::query_units(a));
  EXPECT_LT(rel(fout, out), 1e-2);
  EXPECT_GT(rel(fout, out), 1e-6);  // the operands were rounded to bf16
  EXPECT_LT(rel(flse, lse), 1e-2);
  rows::run_rows_host(rows::AttnRowDot{fd.data(), fout.data(), dout.data(), T, H, HD}, N * H);
  std::vector<float> shares(per_head ? 2 * B * H * T * HD : 0, 5.0f);
  if (per_head) {
    a.dk_part = shares.data();
    a.dv_part = shares.data() + B * H * T * HD;
  }
  run<HD>([&](int64_t u, int w, int lane,
              flash::Smem<HD>& m) { flash::backward_kv_block<HD>(a, u, w, lane, m); },
          flash::key_units(a));
  if (per_head) {
    rows::run_rows_host(rows::GqaSum{fdqkv.data(), a.dk_part, a.dv_part, T, H, Hkv, HD, ld},
                        B * T * Hkv * HD);
  }
  run<HD>([&](int64_t u, int w, int lane,
              flash::Smem<HD>& m) { flash::backward_q_block<HD>(a, u, w, lane, m); },
          flash::query_units(a));
  // The gradient's parts separately: a part the kernels miss or double shows.
  std::vector<float> ref[3], got[3];
  for (int64_t n = 0; n < N; n++) {
    for (int64_t c = 0; c < ld; c++) {
      const int part = c < H * HD ? 0 : c < (H + Hkv) * HD ? 1 : 2;
      ref[part].push_back(dqkv[n * ld + c] - dqkv0[n * ld + c]);
      got[part].push_back(fdqkv[n * ld + c] - dqkv0[n * ld + c]);
    }
  }
  const char* names[3] = {"dq", "dk", "dv"};
  for (int part = 0; part < 3; part++) {
    SCOPED_TRACE(names[part]);
    EXPECT_LT(rel(got[part], ref[part]), 2e-2);
  }
}

}  // namespace

// Shapes: several 64-row tiles with a partial last one and empty warps in it, exactly one tile,
// fewer rows than a warp's 16; GQA and MHA.
TEST(FlashAttention, MatchesTheCpuOps) {
  check_shape<16>(2, 150, 4, 2, 10);  // GQA, 3 tiles, the last with 22 rows
  check_shape<32>(1, 64, 2, 2, 20);   // MHA, one full tile
  check_shape<64>(2, 80, 2, 1, 30);   // one kv head for two query heads, 2 tiles
  check_shape<128>(1, 9, 2, 2, 40);   // the widest head, a part of one warp's rows
  check_shape<16>(2, 150, 4, 2, 50, /*per_head=*/true);  // GQA by query head, then summed
  check_shape<32>(1, 70, 6, 2, 60, /*per_head=*/true);
}

TEST(FlashAttention, SupportsTheTensorCoreHeadSizes) {
  for (int64_t hd : {16, 32, 64, 128}) EXPECT_TRUE(flash::supported(hd));
  for (int64_t hd : {8, 24, 48, 96, 256}) EXPECT_FALSE(flash::supported(hd));
}
