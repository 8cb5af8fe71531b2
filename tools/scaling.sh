#!/usr/bin/env bash
# Scaling study for docs/BENCHMARKS.md: how the training step time of each residual mode grows
# with sequence length (at 2048 tokens per step), width and depth. Each point is one
# `attnres bench` run (all modes side by side in that run). Usage: tools/scaling.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/scaling}"
mkdir -p "$OUT"
B=build/attnres
common="--modes prenorm,full,block --steps 3 --warmup 1 --decode-tokens 16 --vocab 8192"
for T in 256 512 1024 2048; do
  $B bench $common --d-model 512 --n-layer 8 --n-head 8 --seq-len $T --batch-size $((2048 / T)) \
    --block-size 4 --json "$OUT/T$T.json" > "$OUT/T$T.txt"
done
for d in 256 1024; do  # d 512 is the T 512 point above
  $B bench $common --d-model $d --n-layer 8 --n-head $((d / 64)) --seq-len 512 --batch-size 4 \
    --block-size 4 --json "$OUT/d$d.json" > "$OUT/d$d.txt"
done
for L in 4 16 32; do  # 8, 32, 64 sublayers (16 is the T 512 point); about 4-8 blocks
  $B bench $common --d-model 512 --n-layer $L --n-head 8 --seq-len 512 --batch-size 4 \
    --block-size $(((2 * L + 7) / 8)) --json "$OUT/L$L.json" > "$OUT/L$L.txt"
done
/usr/bin/env python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    r = json.load(open(f))
    c = r["config"]
    m = {x["mode"]: x for x in r["modes"]}
    p = m["prenorm"]
    rows.append((c["n_layer"] * 2, c["d_model"], r["seq_len"], r["batch_size"],
                 p["step_s"] * 1e3, m["full"]["step_s"] / p["step_s"], m["block"]["step_s"] / p["step_s"],
                 m["full"]["peak_rss_mib"] / p["peak_rss_mib"], m["block"]["peak_rss_mib"] / p["peak_rss_mib"],
                 c.get("block_size", "")))
print("| sublayers | d | T | B | prenorm step ms | full / prenorm time | block / prenorm time | full / prenorm memory | block / prenorm memory |")
print("|---|---|---|---|---|---|---|---|---|")
for r in sorted(rows):
    print("| %d | %d | %d | %d | %.0f | %.3f | %.3f | %.3f | %.3f |" % r[:9])
PY
