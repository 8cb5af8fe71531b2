#!/usr/bin/env bash
# Checks that the README names only commands that exist: for every `attnres SUBCOMMAND` in its
# code (indented blocks and `backtick` spans), `attnres SUBCOMMAND --help` exits 0; every
# scripts/... or tools/... file it names exists, and is executable where it is a script.
# Run by the test suite (CTest: ReadmeCheck.CommandsExist).
#
#   bash scripts/readme_check.sh [path/to/attnres] [path/to/README.md]
set -euo pipefail
cd "$(dirname "$0")/.."
cli=${1:-build/attnres}
readme=${2:-README.md}
[[ -x "$cli" ]] || { echo "readme_check: no attnres binary at '$cli' (build first: bash scripts/build.sh)" >&2; exit 2; }
[[ -f "$readme" ]] || { echo "readme_check: no README at '$readme'" >&2; exit 2; }

# The README's code: indented lines of code blocks (indentation removed), and the contents of
# `...` spans.
code=$( {
  grep -E '^    ' "$readme" | sed 's/^    //' || true
  grep -oE '`[^`]+`' "$readme" | tr -d '`' || true
} )
fail=0
checked=0

# A command: `attnres WORD` at the start of a code line or span, or `build/attnres WORD` anywhere
# (global options such as --threads N may come between).
subs=$(grep -oE '(^ *|build/)attnres( --[a-z-]+( [^ -][^ ]*)?)* [a-z][a-z-]+' <<<"$code" |
  awk '{print $NF}' | sort -u)
for s in $subs; do
  # The command's own help, not the main help (its usage line names the command).
  # (read whole first: grep -q would stop reading and make a long help die of SIGPIPE)
  help=$("$cli" "$s" --help 2>/dev/null) || help=""
  if grep -qE "^Usage: [^ ]*attnres $s( |\$)" <<<"$help"; then
    checked=$((checked + 1))
  else
    echo "README names 'attnres $s', but '$cli $s --help' fails" >&2
    fail=1
  fi
done
for flag in --help --version; do
  "$cli" "$flag" >/dev/null 2>&1 || { echo "'$cli $flag' fails" >&2; fail=1; }
done

files=$(grep -oE '(^|[^A-Za-z0-9_./-])(scripts|tools)/[A-Za-z0-9_.-]+\.(sh|py)' <<<"$code" |
  sed -E 's#^[^st]*##' | sort -u)
for f in $files; do
  if [[ ! -f "$f" ]]; then
    echo "README names '$f', which does not exist" >&2
    fail=1
  elif [[ ! -x "$f" ]]; then
    echo "README names '$f', which is not executable (chmod +x, and a #! line)" >&2
    fail=1
  elif ! head -1 "$f" | grep -q '^#!'; then
    echo "README names '$f', which has no #! line" >&2
    fail=1
  else
    checked=$((checked + 1))
  fi
done
((fail == 0)) || exit 1
n_subs=$(wc -w <<<"$subs")
n_files=$(wc -w <<<"$files")
((n_subs > 0 && n_files > 0)) || { echo "readme_check: found no commands in $readme (parser broken?)" >&2; exit 1; }
echo "readme_check: $n_subs subcommands and $n_files scripts named by $readme all exist"
