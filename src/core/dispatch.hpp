// Run-time choice of instruction set for the hand-written kernels.
//
// The default build uses -march=native (ATTNRES_NATIVE=ON): every kernel is compiled for the
// build machine and this macro is empty. A portable build (-DATTNRES_NATIVE=OFF, for binaries
// that must run on other x86-64 machines) defines ATTNRES_RUNTIME_DISPATCH, and each kernel marked
// ATTNRES_KERNEL is then compiled three times, for x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and
// the x86-64 baseline (SSE2); the loader picks the best one the CPU supports (GCC/Clang
// target_clones + ifunc). GEMMs need none of this: oneDNN dispatches at run time itself.
#pragma once

#if defined(ATTNRES_RUNTIME_DISPATCH) && defined(__x86_64__) && defined(__GNUC__) && \
    !defined(__clang__)
#define ATTNRES_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTNRES_KERNEL
#endif
