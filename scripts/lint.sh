#!/usr/bin/env bash
# Lint stage of CI: every C++ file must be formatted as .clang-format says (clang-format 14), and
# the files of src/ must pass .clang-tidy's bug-finding checks (clang-tidy 14, against the
# compile commands of ./build, configured here if absent).
# Usage: scripts/lint.sh [--fix]   (--fix: reformat the files in place instead of checking)
set -euo pipefail
cd "$(dirname "$0")/.."
fix=0
for arg in "$@"; do
  case "$arg" in
    --fix) fix=1 ;;
    *) echo "[lint] unknown option '$arg' (use --fix)" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh --lint
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.h' '*.cc' '*.cu' '*.cuh')
if ((fix)); then
  clang-format-14 -i "${files[@]}"
  echo "[lint] reformatted ${#files[@]} files"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format-14 --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "[lint] not formatted as .clang-format says (fix: bash scripts/lint.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "[lint] ${#files[@]} files formatted"

[[ -f build/compile_commands.json ]] ||
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
mapfile -t srcs < <(git ls-files 'src/*.cpp')
# Headers are checked through the files that include them (.clang-tidy's HeaderFilterRegex).
run-clang-tidy-14 -quiet -p build -j "$(nproc)" "${srcs[@]/#/$PWD/}" >/tmp/attnres-tidy.log 2>&1 || {
  grep -E 'warning:|error:' /tmp/attnres-tidy.log | sort -u >&2
  echo "[lint] clang-tidy found the problems above (full log: /tmp/attnres-tidy.log)" >&2
  exit 1
}
echo "[lint] clang-tidy: ${#srcs[@]} files of src/ clean"
