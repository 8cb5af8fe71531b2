#!/usr/bin/env bash
# The GPU check for a lent device machine (one short run; well under 8 minutes): the CUDA tests
# (every backend op against the CPU ops, whole models and a training run against the CPU model)
# and the GPU benchmark, then a short table last.
# Uses the binaries tools/device_prepare.sh put in .devcarry/ (carry it); without them it builds
# with scripts/cuda_build.sh, which needs the project's build dependencies on that machine.
# Copies its logs to $OUT when set (the device tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
if [[ -f .devcarry/bundle.tar.xz ]]; then  # tools/device_prepare.sh's bundle
  tar -C .devcarry -xJf .devcarry/bundle.tar.xz || { echo "device_check: bad bundle"; exit 1; }
fi
if [[ -x .devcarry/test_cuda ]]; then
  BIN=.devcarry
  # The tests run the CLI from where it was built (build-cuda/attnres): put it there.
  mkdir -p build-cuda && cp .devcarry/attnres build-cuda/attnres
  export LD_LIBRARY_PATH="$PWD/.devcarry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
else
  bash scripts/cuda_build.sh || { echo "device_check: the CUDA build failed"; exit 1; }
  BIN=build-cuda/tests
fi
LOG=${OUT:-/tmp}/device_check
mkdir -p "$LOG"
# A binary that cannot start (a missing shared library) would fail every test: say so first.
if ! build-cuda/attnres --version > "$LOG/version.txt" 2>&1; then
  echo "device_check: the attnres CLI does not start:"; cat "$LOG/version.txt"
  ldd build-cuda/attnres | grep "not found"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
  > "$LOG/gpu.txt" 2>&1 || echo "nvidia-smi failed" > "$LOG/gpu.txt"
lscpu | grep -E "^Model name|^Flags" | sed 's/^Flags: */cpu flags: /' | cut -c1-400 \
  > "$LOG/cpu.txt" 2>&1 || true
tests_rc=0
for t in test_cuda test_backend test_backend_model test_op_table; do
  timeout 180 "$BIN/$t" >> "$LOG/test_cuda.txt" 2>&1 || tests_rc=1
done
# bf16 attention picks batched GEMMs or the flash kernels by shape (src/cuda/row_backend.hpp):
# the tests' small shapes take the GEMMs, so run the GPU's tests again with the flash kernels.
for t in test_backend test_backend_model; do
  ATTNRES_FLASH_ATTENTION=1 timeout 120 "$BIN/$t" --gtest_filter='*/cuda:*/cuda_*-*/cuda_host*' \
    >> "$LOG/test_cuda.txt" 2>&1 || tests_rc=1
done
timeout 240 "$BIN/cuda_bench" > "$LOG/cuda_bench.txt" 2>&1
bench_rc=$?
# PyTorch eager / torch.compile on the same depth-mix shape (the machine's python3 has torch).
timeout 120 python3 tools/depth_mix_torch.py --compile --attention > "$LOG/torch_depth_mix.txt" 2>&1 ||
  echo "depth_mix_torch.py failed (exit $?)" >> "$LOG/torch_depth_mix.txt"
cat "$LOG/test_cuda.txt" | grep -E "^\[  (FAILED|SKIPPED) |Expected|actual|Which is" | head -40
echo
echo "=== device_check ($((SECONDS - t0)) s) ==="
echo "gpu: $(cat "$LOG/gpu.txt")"
cat "$LOG/cpu.txt"
# (A test of the CPU backend skips what the CPU does not offer: only the GPU's skips count.)
skipped=$(grep -E '^\[  SKIPPED \] .*\([0-9]+ ms\)$' "$LOG/test_cuda.txt" | grep -cv '/cpu (')
echo "tests: $(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$LOG/test_cuda.txt" | tr '\n' ' ')" \
     "(failed: $tests_rc); skipped: $skipped"
echo "bench (exit $bench_rc):"
cat "$LOG/cuda_bench.txt"
echo "PyTorch on the same depth mix and attention:"
cat "$LOG/torch_depth_mix.txt"
# On the GPU machine a skipped GPU test means the GPU was not usable: that is a failed check.
if (( skipped > 0 )); then echo "device_check: FAILED: GPU tests skipped (no usable GPU)"; exit 1; fi
exit $(( tests_rc != 0 || bench_rc != 0 ))
