#!/usr/bin/env bash
# One command: install dependencies, build, and run the main job — `attnres compare`: train the
# PreNorm baseline, Full AttnRes and Block AttnRes side by side (3 seeds each, ~15 minutes on 2
# cores) on the default corpus (Debian's `fortunes`, or the file/directory given as $1), then write
# runs/compare/report.md with its table and plots. Extra arguments go to `attnres compare`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh >/dev/null
DATA="${1:-/usr/share/games/fortunes}"
shift || true
exec ./build/attnres compare --preset small --data "$DATA" --out runs/compare "$@"
