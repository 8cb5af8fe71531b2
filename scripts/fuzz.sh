#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang 14, ASan + UBSan) into ./build-asan and runs each for
# a bounded time from its seed corpus fuzz/corpus/<target>. Any crash, sanitizer report, leak,
# timeout or out-of-memory fails the script; the input is saved as build-asan/artifacts/<target>-*.
# Usage: scripts/fuzz.sh [seconds-per-target (default 20)] [target ...]
#        scripts/fuzz.sh --seeds   (regenerate fuzz/corpus/ with the engine's writers)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/configure-asan.sh  # the sanitized build scripts/sanitize.sh uses too
if [[ "${1:-}" == "--seeds" ]]; then
  cmake --build build-asan --target fuzz_make_seeds -j "$(nproc)"
  ASAN_OPTIONS=detect_leaks=0 build-asan/fuzz/fuzz_make_seeds fuzz/corpus
  exit 0
fi
cmake --build build-asan --target fuzzers -j "$(nproc)"

SECS=${1:-20}
shift || true
TARGETS=("$@")
((${#TARGETS[@]})) || TARGETS=(fuzz_safetensors fuzz_config fuzz_tokenizer fuzz_token_cache fuzz_corpus)
mkdir -p build-asan/artifacts
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export OMP_NUM_THREADS=1  # one input at a time; threads would only add noise
failed=()
for t in "${TARGETS[@]}"; do
  work="build-asan/corpus/$t"  # new inputs go here; the committed seeds stay read-only
  mkdir -p "$work"
  extra=()
  # The corpus reader must also cope with long lines: let its inputs grow to 256 KiB.
  [[ "$t" == fuzz_corpus ]] && extra=(-max_len=262144)
  echo "[fuzz] $t for ${SECS}s"
  # -rss_limit_mb / -malloc_limit_mb: a hostile size must never turn into a huge allocation.
  if ! build-asan/fuzz/"$t" "$work" "fuzz/corpus/$t" -max_total_time="$SECS" -timeout=10 \
      -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 "${extra[@]}" \
      -artifact_prefix="build-asan/artifacts/$t-" >"build-asan/$t.log" 2>&1; then
    tail -n 60 "build-asan/$t.log"
    failed+=("$t")
  fi
  grep -E "^stat::number_of_executed_units|^stat::new_units_added" "build-asan/$t.log" |
    tr '\n' ' ' | sed "s/^/[fuzz] $t: /"
  echo
done
if ((${#failed[@]})); then
  echo "[fuzz] FAILED: ${failed[*]} (inputs in build-asan/artifacts/; logs in build-asan/<target>.log)"
  exit 1
fi
echo "[fuzz] all targets ran ${SECS}s without a finding"
