#!/usr/bin/env bash
# Installs clang 14 + libFuzzer (scripts/setup.sh --fuzz) and configures ./build-asan: clang,
# AddressSanitizer + UndefinedBehaviorSanitizer on every target, libFuzzer coverage on the parsers.
# One build serves both scripts/sanitize.sh (the test suite) and scripts/fuzz.sh (fuzz/ targets),
# so CI compiles the library once for both. Not meant to be run alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --fuzz
# GNU libgomp, not clang's libomp: oneDNN links libgomp, and one OpenMP runtime per process is
# what the normal build has too.
GOMP=$(gcc -print-file-name=libgomp.so)
# -O1: the sanitized build favours build time; the instrumented kernels are still fast enough.
# -ffp-contract=off: clang fuses a * b + c within an expression by default, differently in the
# host's and the emulated device's copy of the step's arithmetic, and the tests that compare the
# two bit for bit (BackendRuns.DeviceStepMatchesTheHostStep) then failed by 9e-6 on a Sapphire
# Rapids Xeon; this build checks memory and UB, not speed.
CXX=clang++-14 cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -ffp-contract=off" -DATTNRES_SANITIZE=ON -DATTNRES_FUZZ=ON \
  -DATTNRES_BUILD_BENCH=OFF -DOpenMP_CXX_FLAGS=-fopenmp=libgomp -DOpenMP_CXX_LIB_NAMES=gomp \
  -DOpenMP_gomp_LIBRARY="$GOMP" >/dev/null
