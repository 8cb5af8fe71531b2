// ATTNRES_HD marks a function that runs on both sides: __host__ __device__ under nvcc, nothing
// for the host compiler. The row math (src/ops/row_math.hpp) and the CUDA kernels' functors
// (src/cuda/row_kernels.hpp) use it.
#pragma once

#if defined(__CUDACC__)
#define ATTNRES_HD __host__ __device__
#else
#define ATTNRES_HD
#endif

// A loop the host compiler may vectorise (OpenMP SIMD; the order of a reduction's sums may
// change with it); nothing in device code.
#if defined(_OPENMP) && !defined(__CUDA_ARCH__)
#define ATTNRES_SIMD _Pragma("omp simd")
// (var names a variable in a pragma's clause: it cannot take parentheses)
#define ATTNRES_SIMD_SUM(var) \
  _Pragma(ATTNRES_STR(omp simd reduction(+ : var)))  // NOLINT(bugprone-macro-parentheses)
#define ATTNRES_STR(x) #x
#else
#define ATTNRES_SIMD
#define ATTNRES_SIMD_SUM(var)
#endif
