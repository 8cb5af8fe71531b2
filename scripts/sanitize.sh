#!/usr/bin/env bash
# Builds the library, the CLI and the whole test suite with AddressSanitizer + UndefinedBehavior-
# Sanitizer (clang 14, -fno-sanitize-recover=undefined) into ./build-asan and runs ctest there;
# any sanitizer report (including a leak) fails its test.
# Usage: scripts/sanitize.sh [extra ctest args, e.g. -R Safetensors]
# No test is skipped: the whole suite takes ~30 s here (clang -O1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/configure-asan.sh
cmake --build build-asan -j "$(nproc)"
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:strict_string_checks=1:check_initialization_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# Parallel: under the sanitizers most tests are dominated by process start and serial code.
cd build-asan && ctest --output-on-failure -j "$(nproc)" "$@"
