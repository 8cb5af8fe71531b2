#!/usr/bin/env bash
# Data-parallel throughput on this machine, for README/docs/BENCHMARKS.md: the same training run
# (global batch B) as 1 process with 1 thread, 1 process with all cores' threads, and N MPI ranks
# with cores/N threads each. Each run's figure is tokens per step / its median step time; rounds
# are interleaved and the table shows each layout's median round.
# Usage: tools/dist_scaling.sh [ROUNDS] [OUT_DIR]
#        tools/dist_scaling.sh net [ROUNDS] [OUT_DIR]    (root: simulated hosts, see below)
# env: RANKS (default 2); EXTRA (more train options); QUIET=L waits before each round until the
# 1-minute load average is below L (on a shared machine).
#
# `net`: the same kind of runs on simulated hosts (tools/netns_hosts.sh: one rank per network
# namespace, TCP over veth links shaped to each of RATES), against the same ranks on one host
# (shared memory), so that the difference is the network's: data parallel with the gradient sum
# overlapped with the backward pass and after it, a pipeline with cached and naive block
# communication, and pipeline x data parallel. env: RATES (default "10gbit 1gbit"), DATA (corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == net ]]; then
  shift
  exec bash tools/dist_net_scaling.sh "$@"
fi
ROUNDS="${1:-3}"
OUT="${2:-runs/dist_scaling}"
RANKS="${RANKS:-2}"
CORES=$(nproc)
B=build/attnres
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$OUT"
args="train --steps 30 --n-layer 4 --d-model 256 --n-head 4 --seq-len 256 --batch-size 8
      --eval-every 0 --eval-batches 1 --log-every 1 --sample-tokens 0 ${EXTRA:-}"
run() {  # name, command prefix...
  local name=$1; shift
  rm -rf "$OUT/$name"
  "$@" $args --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  # tokens/s at the run's median step time (from the per-step elapsed times; robust to other
  # users' jobs that share the machine for part of a run); the first step is excluded
  python3 - "$OUT/$name/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [j for j in map(json.loads, open(sys.argv[1])) if "elapsed_s" in j and "loss" in j]
dt = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
tokens = rows[1]["tokens"] - rows[0]["tokens"]
print(round(tokens / statistics.median(dt)))
PY
}
declare -A res
loads=""
for ((r = 1; r <= ROUNDS; r++)); do
  if [[ -n "${QUIET:-}" ]]; then  # wait (up to 5 min) for the 1-minute load to fall below QUIET
    for ((w = 0; w < 60; w++)); do
      awk -v l="$(cut -d' ' -f1 /proc/loadavg)" -v q="$QUIET" 'BEGIN { exit !(l < q) }' && break
      sleep 5
    done
  fi
  loads+="$(cut -d' ' -f1 /proc/loadavg) "  # other users' load shows here (the machine is shared)
  res[r1t1]+="$(run r1t1 $B --threads 1) "
  res[r1tN]+="$(run r1tN $B --threads "$CORES") "
  res[rNt]+="$(run rNt mpirun -np "$RANKS" --oversubscribe -x OMP_NUM_THREADS=$((CORES / RANKS > 0 ? CORES / RANKS : 1)) $B) "
  echo "round $r of $ROUNDS done" >&2
done
python3 - "$CORES" "$RANKS" "${res[r1t1]}" "${res[r1tN]}" "${res[rNt]}" "$loads" <<'PY'
import statistics, sys
cores, ranks = int(sys.argv[1]), int(sys.argv[2])
print("1-minute load average before each round:", " / ".join(sys.argv[6].split()))
print()
rows = [("1 rank x 1 thread", sys.argv[3]), (f"1 rank x {cores} threads", sys.argv[4]),
        (f"{ranks} ranks x {max(1, cores // ranks)} thread(s) (MPI)", sys.argv[5])]
base = statistics.median(float(x) for x in rows[0][1].split())
print("| layout | tokens/s (median round) | all rounds | vs 1 thread |")
print("|---|---|---|---|")
for name, vals in rows:
    v = [float(x) for x in vals.split()]
    m = statistics.median(v)
    print(f"| {name} | {m:,.0f} | {' / '.join(f'{x:,.0f}' for x in v)} | {m / base:.2f}x |")
PY
