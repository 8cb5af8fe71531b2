#!/usr/bin/env bash
# Builds the library, the CLI and the whole test suite with AddressSanitizer + UndefinedBehavior-
# Sanitizer (GCC) into ./build-asan and runs ctest there; any sanitizer report fails its test.
# Usage: scripts/sanitize.sh [extra ctest args, e.g. -R Safetensors]
# Tests too slow under the sanitizers skip themselves there (ATTNRES_SKIP_UNDER_SANITIZERS in
# tests/test_util.hpp, with the reason); docs/RELIABILITY.md lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# -O1: the sanitizer build favours build time; the instrumented kernels are still fast enough.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1" -DATTNRES_SANITIZE=ON -DATTNRES_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j "$(nproc)"
# halt_on_error: the first report fails the test; detect_leaks: leaks are bugs too.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:strict_string_checks=1:check_initialization_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
cd build-asan && ctest --output-on-failure "$@"
