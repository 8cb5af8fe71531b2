#!/usr/bin/env bash
# Installs everything attnres needs to build, test and run, from Debian 12's archive.
# Idempotent: skips apt entirely when every package is already installed.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libdnnl-dev            # oneDNN: dnnl_sgemm (fastest GEMM measured on this CPU)
  ocl-icd-opencl-dev     # oneDNN's CMake package looks for OpenCL (only a Recommends of libdnnl-dev)
  nlohmann-json3-dev     # JSON (configs, safetensors headers, metrics)
  libcli11-dev           # command-line parsing
  libsentencepiece-dev   # BPE tokenizer training and encoding
  libgtest-dev libgmock-dev libbenchmark-dev
  openmpi-bin libopenmpi-dev  # data-parallel training: mpirun -np N attnres train ...
  iproute2               # ip and tc: simulated hosts for multi-host runs (tools/netns_hosts.sh)
  fortunes               # the default demo corpus (/usr/share/games/fortunes)
  python3 python3-matplotlib  # plots of `attnres compare` reports
)
# Optional extras. `scripts/setup.sh --python`: PyTorch, to regenerate the parity fixtures
# (tools/gen_fixtures.py) and run the PyTorch benchmarks.
# `scripts/setup.sh --fuzz`: clang 14 with libFuzzer and the sanitizer runtimes (scripts/fuzz.sh).
# `scripts/setup.sh --lint`: clang-format 14 and clang-tidy 14 (scripts/lint.sh).
for arg in "$@"; do
  case "$arg" in
    --python) PACKAGES+=(python3-numpy python3-torch libopenblas0-pthread) ;;  # OpenBLAS: torch's BLAS
    --fuzz) PACKAGES+=(clang-14 libclang-rt-14-dev) ;;  # libclang-rt-14-dev: libclang_rt.fuzzer
    --lint) PACKAGES+=(clang-format-14 clang-tidy-14) ;;
    *) echo "[setup] unknown option '$arg' (use --python, --fuzz or --lint)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  echo "[setup] installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "[setup] dependencies present"
