#include "core/blas.hpp"

#include <oneapi/dnnl/dnnl.h>

#include <stdexcept>
#include <string>

#include "attnres/error.hpp"

namespace attnres {

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B,
                                ldb, beta, C, ldc);
  // Out of memory (oneDNN's scratch buffers, e.g. under `ulimit -v`) is the user's to fix; any
  // other failure is a programming error (bad leading dimensions), not bad user input.
  if (st == dnnl_out_of_memory) {
    throw Error("out of memory in a matrix product (" + std::to_string(M) + "x" +
                std::to_string(K) + " by " + std::to_string(K) + "x" + std::to_string(N) +
                "): oneDNN could not allocate its work space; raise the memory limit (ulimit -v) "
                "or use a smaller --batch-size / --seq-len / model");
  }
  if (st != dnnl_success)
    throw std::logic_error("dnnl_sgemm failed with status " + std::to_string(st));
}

void sgemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                     int64_t ldc) {
  for (int64_t i = 0; i < M; i++) {
    for (int64_t j = 0; j < N; j++) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; k++) {
        float a = trans_a ? A[k * lda + i] : A[i * lda + k];
        float b = trans_b ? B[j * ldb + k] : B[k * ldb + j];
        acc += static_cast<double>(a) * b;
      }
      float prev = (beta == 0.0f) ? 0.0f : beta * C[i * ldc + j];
      C[i * ldc + j] = static_cast<float>(alpha * acc) + prev;
    }
  }
}

}  // namespace attnres
