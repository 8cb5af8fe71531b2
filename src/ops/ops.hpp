// Ops: plain forward/backward function pairs on host fp32 buffers, llm.c style.
//
// Conventions: N = B*T rows (tokens), C = width. Shapes are given in comments; all buffers are
// dense row-major unless a row stride ("ld") is passed. Every backward ACCUMULATES (+=) into the
// gradients of its inputs and parameters: in the AttnRes modes one source feeds many readers.
// The arithmetic of one row of the row ops is in row_math.hpp, shared with the CUDA kernels.
// Each op's simple reference is in tests/test_op_table.cpp (in double), which checks every op on
// every backend, and its backward by finite differences.
#pragma once

#include <cstdint>

#include "ops/row_math.hpp"  // AdamStep

namespace attnres::ops {

// ---- embedding (embedding.cpp) ----
// out (N,C) = wte[ids[n]]
void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N, int64_t C);
// dwte (V,C) += scatter of dout (N,C) by ids
void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C);

// ---- rmsnorm (rmsnorm.cpp) ----  y = x * rsqrt(mean(x^2) + eps) * g
// out (N,C), rstd (N) saved for backward, inp (N,C), g (C)
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* g, int64_t N,
                     int64_t C, float eps);
// dinp (N,C) +=, dg (C) +=, from dout (N,C), inp (N,C), g (C), rstd (N)
void rmsnorm_backward(float* dinp, float* dg, const float* dout, const float* inp, const float* g,
                      const float* rstd, int64_t N, int64_t C);

// ---- matmul (matmul.cpp) ----  Linear layer without bias; weights stored (OC, IC).
// out (N,OC) = inp (N,IC) @ w^T     (accumulate=false overwrites, true adds)
void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t IC, int64_t OC,
                    bool accumulate = false);
// dinp (N,IC) += dout @ w ; dw (OC,IC) += dout^T @ inp. Either may be null to skip it.
void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                     int64_t N, int64_t IC, int64_t OC);
// The same with bf16 operands (uint16_t bits, core/bf16.hpp: inp, w and dout already rounded),
// products summed in fp32 into the fp32 out / dinp / dw (core/blas.hpp gemm_bf16).
void matmul_forward_bf16(float* out, const uint16_t* inp, const uint16_t* w, int64_t N, int64_t IC,
                         int64_t OC, bool accumulate = false);
void matmul_backward_bf16(float* dinp, float* dw, const uint16_t* dout, const uint16_t* inp,
                          const uint16_t* w, int64_t N, int64_t IC, int64_t OC);

// ---- rope (rope.cpp) ----  rotate-half (GPT-NeoX / HF Llama) layout.
// Table of cos/sin: (T_max, hd/2) each, angle = p * theta^(-2i/hd).
void rope_table(float* cos_t, float* sin_t, int64_t T_max, int64_t hd, double theta);
// In place on x: rows n = b*T + t hold n_heads heads of hd at x + n*ld + h*hd; position pos0 + t.
void rope_forward(float* x, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                  int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0);
// In place on the gradient dx (the inverse rotation: RoPE is orthogonal).
void rope_backward(float* dx, const float* cos_t, const float* sin_t, int64_t B, int64_t T,
                   int64_t n_heads, int64_t hd, int64_t ld, int64_t pos0);

// ---- causal self-attention (attention.cpp) ----
// qkv (B,T,ld) holds per row q (H,hd) at offset 0, k (Hkv,hd) at H*hd, v (Hkv,hd) at (H+Hkv)*hd.
// out (B,T,H*hd); att (B,H,T,T) softmax probabilities saved for backward (upper triangle zero).
struct AttnShape {
  int64_t B, T, H, Hkv, hd;
  int64_t ld() const { return (H + 2 * Hkv) * hd; }
};
void attention_forward(float* out, float* att, const float* qkv, const AttnShape& s);
void attention_forward_reference(float* out, float* att, const float* qkv, const AttnShape& s);
// dqkv (B,T,ld) +=, from dout (B,T,H*hd), qkv, att. scratch: (B,H,T,T) floats.
void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                        const float* att, const AttnShape& s);
void attention_backward_reference(float* dqkv, const float* dout, const float* qkv,
                                  const float* att, const AttnShape& s);
// Decoding with a KV cache: q (n,H,hd) for positions pos0..pos0+n-1 attends to kc/vc
// (T_cache,Hkv,hd) rows 0..pos0+t. out (n,H*hd). scores: scratch of (pos0+n) floats per thread.
void attention_decode(float* out, const float* q, const float* kc, const float* vc, int64_t n,
                      int64_t pos0, int64_t H, int64_t Hkv, int64_t hd);

// ---- swiglu (swiglu.cpp) ----  out = silu(h1) * h3
// h13 (N,2F): h1 in columns [0,F), h3 in [F,2F) (one GEMM against the stacked [w1; w3]).
void swiglu_forward(float* out, const float* h13, int64_t N, int64_t F);
// dh13 (N,2F) +=, from dout (N,F), h13.
void swiglu_backward(float* dh13, const float* dout, const float* h13, int64_t N, int64_t F);

// ---- cross-entropy (cross_entropy.cpp) ----  fused log-softmax + negative log-likelihood
// losses (N) = -log softmax(logits)[target]; lse (N) log-sum-exp saved for backward. Returns mean.
double cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                             int64_t N, int64_t V);
// dlogits (N,V) = (softmax - onehot) * dloss. Writes (not accumulates): dlogits may alias logits
// (the logits are dead after the loss), which saves a (N,V) buffer.
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, int64_t N, int64_t V, float dloss);

// ---- depth attention (depth_attention.cpp): the AttnRes mix over sources (SPEC 2-4) ----
// Per token n, head slice h (dh = d/H channels), for sources i = 0..S-1:
//   s_i = rstd_i * (qg . v_i)  (key norm rms; qg = query * key-norm gain)  or  qg . v_i  (none)
//   a_i = softmax_i(s_i) or sigmoid(s_i);   x = sum_i a_i v_i   (values are the raw sources)
struct DepthSource {
  const float* v;     // (N,d) the source
  const float* rstd;  // (N,H) inverse RMS per head slice (key norm rms), else unused
  float* dv;          // (N,d) gradient accumulator (backward), may be null to drop it
  // (N,d) v rounded to bf16 (uint16_t bits), or null: where set, a device backend's depth ops
  // read it instead of v (bf16 storage of the sources; the CPU ops always read v).
  const uint16_t* vb = nullptr;
};
struct DepthMix {
  int64_t d = 0, H = 1;
  bool softmax = true;   // false: sigmoid gate
  bool key_norm = true;  // false: keys are the raw sources
  float eps = 1e-5f;     // of the key RMSNorm (used by the reference; the fast path takes rstd)
  int64_t dh() const { return d / H; }
};
// rstd (N,H) = 1 / sqrt(mean over each head slice of v^2 + eps), for v (N,d).
void depth_rstd(float* rstd, const float* v, int64_t N, int64_t d, int64_t H, float eps);
// x (N,d) = the mix; lse (N,H) = log-sum-exp of the scores (softmax; may be null for sigmoid).
// qg: (d) shared by every token when q_ld == 0, else row n at qg + n*q_ld (dynamic query).
// Tiled over tokens; scores live only per tile, so nothing of size (S,N,d) is materialised.
void depth_mix_forward(float* x, float* lse, const DepthSource* src, int64_t S, const float* qg,
                       int64_t q_ld, const DepthMix& m, int64_t N);
// Plain loops in double over explicit score arrays. The reference for tests.
void depth_mix_forward_reference(float* x, float* lse, const DepthSource* src, int64_t S,
                                 const float* qg, int64_t q_ld, const DepthMix& m, int64_t N);
// Backward of depth_mix_forward given dx (N,d), the forward's x and lse. Accumulates into every
// src[i].dv and into dqg: (d) summed over tokens when q_ld == 0, else (N,d) rows of stride d.
// Deterministic (per-thread partial sums are combined in thread order).
void depth_mix_backward(float* dqg, const float* dx, const float* x, const float* lse,
                        const DepthSource* src, int64_t S, const float* qg, int64_t q_ld,
                        const DepthMix& m, int64_t N);
// Backward BY SOURCE (Full AttnRes, static queries): instead of each mixer read-modify-writing
// the gradients of all its sources (3 passes over memory per mixer and source), the gradient of
// one source is formed once, when it is needed, from the K mixers that read it: one pass over each
// reader's dx. Reader k: its dx (N,d), forward lse (N,H), D = dx . x per head (N,H, from
// depth_dx_dot) and static query qg (d).
struct DepthReader {
  const float* dx;
  const float* lse;
  const float* D;
  const float* qg;
  int64_t dq_offset;  // where this reader's query gradient lives in each thread's dq block
};
// dv (N,d) = sum_k d loss / d v through reader k (OVERWRITTEN). dq + t * dq_stride + dq_offset_k
// (d) += reader k's query-gradient partial sum over the rows thread t handles; t < nthr, and the
// rows a thread handles depend only on N and nthr, so combining the blocks in thread order is
// deterministic.
void depth_source_backward(float* dv, const DepthSource& src, const DepthReader* rd, int64_t K,
                           float* dq, int64_t dq_stride, int nthr, const DepthMix& m, int64_t N);
// The same for G sources at once, every one read by all K readers: dv[g] (N,d) OVERWRITTEN with
// source g's gradient through them; each reader's dx is streamed once for the G sources.
void depth_sources_backward(float* const* dv, const DepthSource* src, int64_t G,
                            const DepthReader* rd, int64_t K, float* dq, int64_t dq_stride,
                            int nthr, const DepthMix& m, int64_t N);
// D (N,H) = dx . x over each head slice.
void depth_dx_dot(float* D, const float* dx, const float* x, const DepthMix& m, int64_t N);
// Two-phase computation (SPEC 4), softmax gate and per-token-independent queries only.
// Phase 1: K queries qg[k] (d) score the same S sources in ONE pass over them; o[k] (N,d) gets the
// normalised mix and lse[k] (N,H) its log-sum-exp.
void depth_mix_phase1(float* const* o, float* const* lse, const DepthSource* src, int64_t S,
                      const float* const* qg, int64_t K, const DepthMix& m, int64_t N);
// Diagnostics: wsum[i] += sum over tokens and heads of a_i (the depth-attention weights), for
// averaging by the caller. Plain and slow; not on the training path.
void depth_mix_weights(double* wsum, const DepthSource* src, int64_t S, const float* qg,
                       int64_t q_ld, const DepthMix& m, int64_t N);
// Phase 2: merges one more source p into a phase-1 result (o1, lse1):
//   x = o1 + sigmoid(s_p - lse1) * (p - o1),  lse = log(exp(lse1) + exp(s_p)).
// In place too (x == o1, lse == lse1): merging several sources one after another.
void depth_mix_phase2(float* x, float* lse, const float* o1, const float* lse1,
                      const DepthSource& p, const float* qg, const DepthMix& m, int64_t N);

// ---- scalar mix (scalar_mix.cpp): a weighted sum of sources with one weight per source ----
// (the `static` and `denseformer` residual modes). out (n) = sum_i w[i] * src[i] (n).
void scalar_mix_forward(float* out, const float* const* src, const float* w, int64_t S, int64_t n);
// dsrc[i] (n) += w[i] * dout (null entries skipped); dw[i] += sum_k dout[k] * src[i][k], summed in
// double with per-thread partials combined in thread order (deterministic).
void scalar_mix_backward(float* const* dsrc, double* dw, const float* dout, const float* const* src,
                         const float* w, int64_t S, int64_t n);
// The static residual's weights: w (S) = softmax(z (S)), in double; its backward
// dz (S) += a_i (da_i - sum_j a_j da_j), in double.
void softmax_small(float* w, const float* z, int64_t S);
void softmax_small_backward(float* dz, const float* a, const float* da, int64_t S);

// ---- gradient norm (adamw.cpp) ----  sum of x[i]^2 over n floats: chunks of 4096 in float with
// several vector accumulators, chunks combined in double in a fixed order (deterministic for a
// given thread count). grad_norm (attnres/optim.hpp) is its square root.
double sum_squares(const float* x, int64_t n);

// ---- AdamW (adamw.cpp) ----  torch.optim.AdamW's update (attnres/optim.hpp) of one tensor:
// step_size = lr / (1 - b1^t), inv_bc2_sqrt = 1 / sqrt(1 - b2^t); decay = 1 - lr wd or 1.
// p, m, v (n) updated from g (n). Splits the n elements over the threads of the enclosing OpenMP
// parallel region with no barrier at the end (one region can update every tensor).
void adamw_update_in_parallel(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                              const AdamStep& k);

}  // namespace attnres::ops
