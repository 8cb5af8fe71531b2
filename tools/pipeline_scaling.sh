#!/usr/bin/env bash
# Pipeline-parallel throughput and traffic on this machine, for README/docs/BENCHMARKS.md: one
# Block AttnRes training run (global batch B x M micro-batches) as 1 process (1 thread; all
# cores' threads), as 2 MPI ranks in data parallel, and as a 2-rank pipeline with 1 and 2 virtual
# stages per rank, cached and naive block communication. Rounds are interleaved; the table shows
# each layout's median round (tokens per step / median step time) and the bytes per step the
# pipeline sent between stages (from the run's own report).
# Usage: tools/pipeline_scaling.sh [ROUNDS] [OUT_DIR]    env: EXTRA (more train options)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-3}"
OUT="${2:-runs/pipeline_scaling}"
CORES=$(nproc)
B=build/attnres
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$OUT"
args="train --steps 12 --n-layer 8 --d-model 256 --n-head 4 --seq-len 256 --batch-size 4
      --grad-accum 8 --residual block --block-size 2 --eval-every 0 --eval-batches 1
      --log-every 1 --sample-tokens 0 ${EXTRA:-}"
MPI=(mpirun -np 2 --oversubscribe -x OMP_NUM_THREADS=$((CORES / 2 > 0 ? CORES / 2 : 1)))
run() {  # name, "extra train options", command prefix...
  local name=$1 extra=$2; shift 2
  rm -rf "$OUT/$name"
  "$@" $args $extra --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  python3 - "$OUT/$name/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [j for j in map(json.loads, open(sys.argv[1])) if "elapsed_s" in j and "loss" in j]
dt = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
print(round((rows[1]["tokens"] - rows[0]["tokens"]) / statistics.median(dt)))
PY
}
names=(r1t1 r1tN dp2 pp2v1 pp2v2 pp2v2naive)
declare -A res
for ((r = 1; r <= ROUNDS; r++)); do
  res[r1t1]+="$(run r1t1 "" $B --threads 1) "
  res[r1tN]+="$(run r1tN "" $B --threads "$CORES") "
  res[dp2]+="$(run dp2 "" "${MPI[@]}" $B) "
  res[pp2v1]+="$(run pp2v1 "--pipeline 2" "${MPI[@]}" $B) "
  res[pp2v2]+="$(run pp2v2 "--pipeline 2 --virtual-stages 2" "${MPI[@]}" $B) "
  res[pp2v2naive]+="$(run pp2v2naive "--pipeline 2 --virtual-stages 2 --pipeline-comm naive" \
                      "${MPI[@]}" $B) "
  echo "round $r of $ROUNDS done" >&2
done
for n in "${names[@]}"; do
  sent=$(grep -o 'pipeline: sent [0-9.]* MiB' "$OUT/$n.log" | grep -o '[0-9.]*' || true)
  bubble=$(grep -o 'bubble [0-9]*%' "$OUT/$n.log" | grep -o '[0-9]*%' || true)
  echo "$n|${res[$n]}|${sent:--}|${bubble:--}"
done > "$OUT/results.txt"
python3 - "$OUT/results.txt" <<'PY'
import statistics, sys
label = {"r1t1": "1 rank x 1 thread", "r1tN": "1 rank x all threads",
         "dp2": "2 ranks, data parallel", "pp2v1": "2 ranks, pipeline, V=1 (cached)",
         "pp2v2": "2 ranks, pipeline, V=2, cached", "pp2v2naive": "2 ranks, pipeline, V=2, naive"}
rows = [l.strip().split("|") for l in open(sys.argv[1]) if l.strip()]
base = statistics.median(float(x) for x in rows[1][1].split())
print("| layout | tokens/s (median round) | all rounds | vs 1 process | MiB sent per step | bubble |")
print("|---|---|---|---|---|---|")
for name, vals, sent, bubble in rows:
    v = [float(x) for x in vals.split()]
    m = statistics.median(v)
    rounds = " / ".join(f"{x:,.0f}" for x in v)
    print(f"| {label[name]} | {m:,.0f} | {rounds} | {m / base:.2f}x | {sent} | {bubble} |")
PY
