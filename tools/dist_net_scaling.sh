#!/usr/bin/env bash
# The simulated-network half of tools/dist_scaling.sh (`tools/dist_scaling.sh net`, which see):
# every configuration on 1 host (shared memory) and on simulated hosts over links shaped to each
# of RATES; tokens/s at each run's median step time (the first step excluded); rounds
# interleaved, each figure the median round. One rank per host, 1 thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-3}"
OUT="$(realpath -m "${2:-runs/dist_net_scaling}")"
RATES="${RATES:-10gbit 1gbit}"
DATA="$(realpath "${DATA:-../shared/data/tinyshakespeare.txt}")"
B="$(pwd)/build/attnres --threads 1"
[[ $(id -u) -eq 0 ]] || { echo "dist_scaling net: needs root (network namespaces)" >&2; exit 77; }
bash tools/netns_hosts.sh check || exit $?
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$OUT"
common="train --data $DATA --steps 20 --eval-every 0 --eval-batches 1 --log-every 1 --sample-tokens 0 --seq-len 256"
# data parallel: 3.2 M parameters (a 12.6 MB gradient) in buckets of 1 MiB, 1024 tokens per rank
dp="$common --n-layer 4 --d-model 256 --n-head 4 --batch-size 8 --grad-bucket-mib 1"
# pipeline: block AttnRes, 4 stages of one block on 2 ranks (cached sends less than naive)
pp="$common --residual block --block-size 4 --n-layer 8 --d-model 256 --n-head 4 --batch-size 4 --grad-accum 4 --virtual-stages 2"
# pipeline x data parallel: pipelines of 2 ranks, 2 of them on 4 ranks
ppdp="$common --residual block --block-size 4 --n-layer 8 --d-model 256 --n-head 4 --batch-size 8 --grad-accum 4 --pipeline 2"

configs=(  # name|ranks|options
  "dp2_overlap|2|$dp"
  "dp2_after|2|$dp --grad-overlap false"
  "dp4_overlap|4|$dp"
  "dp4_after|4|$dp --grad-overlap false"
  "pp2_cached|2|$pp --pipeline 2"
  "pp2_naive|2|$pp --pipeline 2 --pipeline-comm naive"
  "ppdp4|4|$ppdp"
)

median_tps() {  # metrics.jsonl -> tokens/s at the median step time, or "failed"
  python3 - "$1" <<'PY' 2>/dev/null || echo failed
import json, statistics, sys
rows = [j for j in map(json.loads, open(sys.argv[1])) if "elapsed_s" in j and "loss" in j]
dt = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
print(round((rows[1]["tokens"] - rows[0]["tokens"]) / statistics.median(dt)))
PY
}

run_one() {  # where (shm|RATE), name, ranks, options
  local where=$1 name=$2 ranks=$3 opts=$4 dir="$OUT/$1_$2"
  rm -rf "$dir"
  if [[ $where == shm ]]; then
    mpirun -np "$ranks" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 $B $opts --out "$dir" > "$dir.log" 2>&1 || true
  else
    bash tools/netns_hosts.sh run --hosts "$ranks" --rate "$where" -- sh -c \
      "mpirun -np $ranks --oversubscribe --bind-to none \$ATTNRES_MPI_NET --host \$ATTNRES_HOSTS $B $opts --out $dir" \
      > "$dir.log" 2>&1 || true
  fi
  echo "$where $name $(median_tps "$dir/metrics.jsonl")" >> "$OUT/results.txt"
}

: > "$OUT/results.txt"
for ((r = 1; r <= ROUNDS; r++)); do
  for c in "${configs[@]}"; do
    IFS='|' read -r name ranks opts <<< "$c"
    for where in shm $RATES; do run_one "$where" "$name" "$ranks" "$opts"; done
  done
  echo "round $r of $ROUNDS done" >&2
done
python3 - "$OUT/results.txt" "$RATES" "$(nproc)" <<'PY'
import collections, statistics, sys
res = collections.defaultdict(list)
for line in open(sys.argv[1]):
    where, name, tps = line.split()
    res[(where, name)].append(tps)
rates = sys.argv[2].split()
print(f"{sys.argv[3]} cores; one rank per host, 1 thread each; tokens/s (median round); "
      "'vs 1 host': the same ranks over shared memory on one host")
print()
print("| configuration | 1 host (shared memory) | " +
      " | ".join(f"{r} link | vs 1 host" for r in rates) + " |")
print("|---|---|" + "---|---|" * len(rates))
def med(v):
    ok = [float(x) for x in v if x != "failed"]
    return statistics.median(ok) if ok else None
names = dict.fromkeys(n for _, n in res)
for name in names:
    base = med(res[("shm", name)])
    cells = [f"{base:,.0f}" if base else "failed"]
    for r in rates:
        m = med(res[(r, name)])
        cells += [f"{m:,.0f}" if m else "failed",
                  f"{m / base:.2f}" if m and base else "-"]
    print(f"| {name} | " + " | ".join(cells) + " |")
PY
