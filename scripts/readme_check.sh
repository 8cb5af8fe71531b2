#!/usr/bin/env bash
# Checks that the README (and the other pages given) name only commands that exist: for every
# `attnres SUBCOMMAND` in their
# code (indented or fenced blocks, <pre> blocks and `backtick` spans; after a prompt, mpirun,
# an environment assignment, `cd x &&` or a pipe; with global options such as --threads N before
# the subcommand), `attnres SUBCOMMAND --help` must print that subcommand's own usage; every
# scripts/... or tools/... path it names must exist, and a script (.sh, .py or no extension)
# must be executable with a #! line. Run by the test suite (CTest: ReadmeCheck.*).
#
#   bash scripts/readme_check.sh [path/to/attnres] [README.md [docs/PAGE.md ...]]
set -euo pipefail
here=$(pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
abs() { [[ "$1" == /* ]] && echo "$1" || echo "$here/$1"; }
cli=$(abs "${1:-$root/build/attnres}")
pages=()
for p in "${@:2}"; do pages+=("$(abs "$p")"); done
((${#pages[@]} > 0)) || pages=("$root/README.md")
[[ -x "$cli" ]] || { echo "readme_check: no attnres binary at '$cli' (build first: bash scripts/build.sh)" >&2; exit 2; }
for p in "${pages[@]}"; do
  [[ -f "$p" ]] || { echo "readme_check: no page at '$p'" >&2; exit 2; }
done
command -v python3 >/dev/null || { echo "readme_check: needs python3 (scripts/setup.sh installs it)" >&2; exit 2; }
cd "$root"

# The commands and paths each page's code names, one per line: "cmd WORD PAGE" or "path PATH PAGE".
names=$(python3 - "${pages[@]}" <<'PY'
import os, re, sys
for page in sys.argv[1:]:
  text = open(page, encoding="utf-8", errors="replace").read()
  code, fence, pre = [], "", False
  for line in text.splitlines():
      s = line.strip()
      m = re.match(r"(```+|~~~+)", s)
      if m and (not fence or s.startswith(fence)):
          fence = "" if fence else m.group(1)
          continue
      fenced = bool(fence)
      if "<pre>" in s:
          pre = True
          s = s.split("<pre>", 1)[1]
      if pre:
          end = "</pre>" in s
          code.append(s.split("</pre>", 1)[0])
          pre = not end
          continue
      if fenced or line.startswith("    ") or line.startswith("\t"):
          code.append(s)
      else:
          code += re.findall(r"`([^`]+)`", line)
          code += [t for t in re.findall(r"\]\(([^)\s]+)\)", line)]  # [text](scripts/x.sh)
  if fence:
      print("unclosed - " + page)
  out = set()
  for c in code:
      c = re.sub(r"^\$\s+", "", c.strip())
      toks = [t for t in re.split(r"\s+|&&|\|\||[;|()]", c) if t]
      for i, t in enumerate(toks):
          if os.path.basename(t) == "attnres":
              j = i + 1
              while j < len(toks) and toks[j].startswith("-"):
                  j += 2 if toks[j] in ("--threads", "--config") else 1
              if j < len(toks) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", toks[j]):
                  out.add("cmd " + toks[j] + " " + page)
          p = t.lstrip("`'\"[").rstrip(",.;:`'\"[]")
          if re.match(r"^(\./)?(scripts|tools)/", p):
              out.add("path " + re.sub(r"^\./", "", p) + " " + page)
  print("\n".join(sorted(out)))
PY
)
fail=0
n_subs=0
n_files=0
while read -r kind name page; do
  doc=$(basename "$page")
  if [[ $kind == unclosed ]]; then
    echo "$doc has a code fence that is never closed" >&2
    fail=1
    continue
  fi
  [[ -n "$kind" ]] || continue
  if [[ $kind == cmd ]]; then
    n_subs=$((n_subs + 1))
    # The command's own help, not the main help (its usage line names the command). Read whole
    # first: grep -q would stop reading and make a long help die of SIGPIPE.
    help=$("$cli" "$name" --help 2>/dev/null) || help=""
    if ! grep -qE "^Usage: [^ ]*attnres $name( |\$)" <<<"$help"; then
      echo "$doc names 'attnres $name', but '$cli $name --help' is not that command's help" >&2
      fail=1
    fi
    continue
  fi
  n_files=$((n_files + 1))
  if [[ "/$name/" == */../* ]]; then
    echo "$doc names '$name', a path that leaves scripts/ or tools/ (no '..')" >&2
    fail=1
  elif [[ ! -e "$name" ]]; then
    echo "$doc names '$name', which does not exist" >&2
    fail=1
  elif [[ -f "$name" && ( "$name" == *.sh || "$name" == *.py || "$(basename "$name")" != *.* ) ]]; then
    if [[ ! -x "$name" ]] || ! head -1 "$name" | grep -q '^#!'; then
      echo "$doc names '$name', which is not an executable script (chmod +x, and a #! line)" >&2
      fail=1
    fi
  fi
done <<<"$names"
for flag in --help --version; do
  "$cli" "$flag" >/dev/null 2>&1 || { echo "'$cli $flag' fails" >&2; fail=1; }
done
((fail == 0)) || exit 1
((n_subs + n_files > 0)) || { echo "readme_check: found no attnres command and no scripts/tools path in ${pages[*]} (parser broken?)" >&2; exit 1; }
echo "readme_check: $n_subs subcommand and $n_files scripts/tools path mentions in ${#pages[@]} page(s) all exist"
