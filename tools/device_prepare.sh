#!/usr/bin/env bash
# Prepares a GPU check on a device machine that cannot build attnres itself (no Debian -dev
# packages there, nothing can be fetched): builds the CUDA backend here (scripts/cuda_build.sh)
# and gathers the GPU test and benchmark binaries with the shared libraries they need that a CUDA
# image may lack (oneDNN, its OpenCL loader, GNU OpenMP) into .devcarry/ (git-ignored, about
# 40 MB). Then run tools/device_check.sh there with .devcarry carried (device tool: carry
# [".devcarry"]).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/cuda_build.sh
rm -rf .devcarry && mkdir -p .devcarry/lib
cp build-cuda/tests/test_cuda build-cuda/tests/cuda_bench .devcarry/
for lib in $(ldd build-cuda/tests/test_cuda | awk '/=>/ {print $3}'); do
  case "$(basename "$lib")" in
    libdnnl.so*|libOpenCL.so*|libgomp.so*|libsentencepiece*.so*|libprotobuf*.so*)
      cp -L "$lib" .devcarry/lib/ ;;
  esac
done
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
du -sh .devcarry
