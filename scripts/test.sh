#!/usr/bin/env bash
# One command: install dependencies, build, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
# Serial on purpose: the tests themselves use every core (OpenMP), and parallel jobs would
# fight over them.
cd build && ctest --output-on-failure
