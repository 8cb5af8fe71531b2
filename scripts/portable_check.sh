#!/usr/bin/env bash
# Builds the portable configuration (-DATTNRES_NATIVE=OFF: kernels cloned for AVX-512 / AVX2 /
# SSE2 and chosen at load time, see src/core/dispatch.hpp) into build-portable and runs the kernel
# tests there, so the run-time-dispatch build never rots. Assumes scripts/setup.sh has run.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-portable -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTNRES_NATIVE=OFF \
  -DATTNRES_BUILD_BENCH=OFF >/dev/null
cmake --build build-portable -j "$(nproc)" --target test_ops test_depth_attention test_train
for t in test_ops test_depth_attention test_train; do
  GOMP_SPINCOUNT=3000 "build-portable/tests/$t" --gtest_brief=1
done
echo "[portable] dispatch build passed"
