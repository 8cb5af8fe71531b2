#!/usr/bin/env bash
# Prepares a GPU check on a device machine that cannot build attnres itself (no Debian -dev
# packages there, nothing can be fetched): builds the CUDA backend here (scripts/cuda_build.sh)
# and gathers the GPU test and benchmark binaries (test_cuda, test_backend, test_backend_model, test_op_table,
# cuda_bench) and the CLI (the tests run it) with every shared library they need beyond glibc,
# libstdc++ and CUDA's own (oneDNN, its OpenCL loader, GNU OpenMP, SentencePiece, the OpenMPI
# runtime the CLI links; a CUDA image has none of them) into .devcarry/bundle.tar.xz (git-ignored,
# stripped and compressed: about 12 MB; the device tool carries at most 64 MiB with the tree).
# Then run tools/device_check.sh there with .devcarry carried (device tool: carry [".devcarry"]).
set -euo pipefail
cd "$(dirname "$0")/.."
# Portable CPU code (kernels chosen at run time): the GPU machine's CPU may lack this one's AVX-512.
bash scripts/cuda_build.sh -DATTNRES_NATIVE=OFF
rm -rf .devcarry && mkdir -p .devcarry/lib
cp build-cuda/tests/test_cuda build-cuda/tests/test_backend build-cuda/tests/test_backend_model \
  build-cuda/tests/test_op_table \
  build-cuda/tests/cuda_bench build-cuda/attnres .devcarry/
for bin in .devcarry/test_cuda .devcarry/test_backend .devcarry/test_backend_model .devcarry/test_op_table \
           .devcarry/cuda_bench .devcarry/attnres; do
  for lib in $(ldd "$bin" | awk '/=>/ {print $3}'); do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|\
      libcudart.so*|libcublas.so*|libcublasLt.so*) ;;  # the machine's own
      *) cp -Lu "$lib" .devcarry/lib/ ;;
    esac
  done
done
exclude=$(git rev-parse --git-path info/exclude)  # also right in a git worktree
mkdir -p "$(dirname "$exclude")"
grep -qx '/.devcarry/' "$exclude" 2>/dev/null || echo '/.devcarry/' >> "$exclude"
# Symbols are not needed there; compressed, the bundle leaves room for the working tree within the
# 64 MiB a device call carries (device_check.sh unpacks it).
strip --strip-unneeded .devcarry/test_* .devcarry/cuda_bench .devcarry/attnres .devcarry/lib/* \
  2>/dev/null || true
tar -C .devcarry -cf - . | xz -T2 -6 > /tmp/devcarry_bundle.tar.xz
rm -rf .devcarry && mkdir .devcarry && mv /tmp/devcarry_bundle.tar.xz .devcarry/bundle.tar.xz
du -sh .devcarry
