#!/usr/bin/env bash
# Copies the main job's report (from `bash scripts/demo.sh`) into docs/, where the README shows
# it: docs/compare/report.md and its PNG plots. Usage: scripts/update_docs.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="${1:-runs/compare}"
[[ -f "$RUN/results.json" ]] || { echo "no $RUN/results.json: run bash scripts/demo.sh first" >&2; exit 1; }
mkdir -p docs/compare
rm -f docs/compare/*.png
cp "$RUN"/*.png "$RUN/report.md" "$RUN/results.json" docs/compare/
echo "updated docs/compare from $RUN"
