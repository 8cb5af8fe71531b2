// The one place GEMMs happen. Row-major single-precision GEMM on oneDNN's dnnl_sgemm (measured the
// fastest library on the target CPU; see README "Dependencies"), plus a naive reference used by
// tests.
#pragma once

#include <cstdint>

namespace attnres {

// C (M,N) = alpha * op(A) (M,K) * op(B) (K,N) + beta * C, all row-major with leading dimensions.
// op(X) = X^T when trans_X is true (then A is stored (K,M), B is stored (N,K)).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Error unless the address space a kernel's generation may take (oneDNN's JIT, whose own
// allocation failures crash) can still be had: called before generating one.
void require_kernel_headroom();

// Makes oneDNN generate its GEMM kernels now, while the process has memory to spare. oneDNN
// JIT-compiles them on the first sgemm and does not check that the code buffer could be mapped:
// under a tight address-space limit (ulimit -v) a first product late in a run, after the model and
// activations took the memory, died of SIGSEGV. Commands that compute call this before they
// allocate; it throws an out-of-memory Error when even the kernels do not fit. Idempotent.
void prepare_gemm();

// Same contract, plain loops in double accumulation. Slow; the reference for tests.
void sgemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                     int64_t ldc);

// C (M,N) = op(A) op(B) + beta C with A and B bf16 (uint16_t bits, core/bf16.hpp) and C fp32:
// the bf16 values multiplied exactly and summed in fp32. On a CPU with AVX512-BF16 (or AMX),
// oneDNN's matmul primitive (one per shape, created on first use); elsewhere the operands are
// widened to fp32 for sgemm (same products, no faster than fp32). beta is 0 or 1.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint16_t* A,
               int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc);
// The widened path of gemm_bf16 on any CPU (tests compare both paths with the reference).
void gemm_bf16_widened(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                       const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                       float* C, int64_t ldc);
// Whether this CPU multiplies bf16 natively (oneDNN's effective ISA includes AVX512-BF16).
bool cpu_has_bf16();
// gemm_bf16's contract in plain loops with double accumulation; the reference for tests.
void gemm_bf16_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                         const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                         float* C, int64_t ldc);

}  // namespace attnres
