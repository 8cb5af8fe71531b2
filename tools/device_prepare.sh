#!/usr/bin/env bash
# Prepares a GPU check on a device machine that cannot build attnres itself (no Debian -dev
# packages there, nothing can be fetched): builds the CUDA backend here (scripts/cuda_build.sh)
# and gathers the GPU test and benchmark binaries (test_cuda, test_backend, test_backend_model,
# cuda_bench) with the shared libraries they need that a CUDA
# image may lack (oneDNN, its OpenCL loader, GNU OpenMP) into .devcarry/ (git-ignored, about
# 40 MB). Then run tools/device_check.sh there with .devcarry carried (device tool: carry
# [".devcarry"]).
set -euo pipefail
cd "$(dirname "$0")/.."
# Portable CPU code (kernels chosen at run time): the GPU machine's CPU may lack this one's AVX-512.
bash scripts/cuda_build.sh -DATTNRES_NATIVE=OFF
rm -rf .devcarry && mkdir -p .devcarry/lib
cp build-cuda/tests/test_cuda build-cuda/tests/test_backend build-cuda/tests/test_backend_model \
  build-cuda/tests/cuda_bench build-cuda/attnres .devcarry/
for lib in $(ldd build-cuda/tests/test_cuda | awk '/=>/ {print $3}'); do
  case "$(basename "$lib")" in
    libdnnl.so*|libOpenCL.so*|libgomp.so*|libsentencepiece*.so*|libprotobuf*.so*)
      cp -L "$lib" .devcarry/lib/ ;;
  esac
done
exclude=$(git rev-parse --git-path info/exclude)  # also right in a git worktree
mkdir -p "$(dirname "$exclude")"
grep -qx '/.devcarry/' "$exclude" 2>/dev/null || echo '/.devcarry/' >> "$exclude"
du -sh .devcarry
