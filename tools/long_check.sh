#!/usr/bin/env bash
# The long-run independent check (issue 17; tools/long_check.py): each residual mode trained by
# attnres and by PyTorch (tools/reference_model.py, float32, torch.optim.AdamW) from the same
# initial weights, tokens and batch order; prints both validation curves and the
# AttnRes-minus-PreNorm gaps of each, and writes OUT/long_check.json.
#
#   bash tools/long_check.sh DATA OUT [attnres train options...]
#   e.g. bash tools/long_check.sh corpus.txt runs/long --n-layer 16 --d-model 128 --n-head 4 \
#          --seq-len 128 --batch-size 16 --steps 600 --lr 2e-3 --warmup 100 --eval-every 100 \
#          --tokenizer bpe --vocab-size 2048
#
# Settings (environment): MODES (default prenorm,full,block), BLOCK_SIZE (default 4), SEED
# (default 1337: the batch order and the init draw), PY (default /usr/bin/python3: Debian's
# python3-torch, scripts/setup.sh --python), ATTNRES (default build/attnres). The attnres and
# PyTorch runs of every mode go side by side, one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
(($# >= 2)) || { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
data=$1
out=$2
shift 2
args=("$@")
MODES=${MODES:-prenorm,full,block}
BLOCK_SIZE=${BLOCK_SIZE:-4}
SEED=${SEED:-1337}
PY=${PY:-/usr/bin/python3}
ATTNRES=${ATTNRES:-build/attnres}
[[ -x "$ATTNRES" ]] || { echo "long_check: no $ATTNRES (bash scripts/build.sh)" >&2; exit 2; }
"$PY" -c 'import torch, numpy' 2>/dev/null ||
  { echo "long_check: $PY lacks torch/numpy (bash scripts/setup.sh --python)" >&2; exit 2; }
mkdir -p "$out"
# The data and the resolved model config (vocabulary size) come from a one-step probe run.
probe_args=()
while (($#)); do
  case "$1" in
    --steps) shift ;;
    --steps=*) ;;
    *) probe_args+=("$1") ;;
  esac
  shift
done
set -- "${args[@]}"
"$ATTNRES" train --data "$data" --out "$out/probe" --seed "$SEED" "${probe_args[@]}" --steps 1 \
  >"$out/probe.log"
"$PY" tools/long_check.py init --train-config "$out/probe/train_config.json" --modes "$MODES" \
  --block-size "$BLOCK_SIZE" --seed "$SEED" --out "$out/init"
# Every run at once, one thread each (the PyTorch runs are the slow ones).
pids=()
for m in ${MODES//,/ }; do
  extra=()
  [[ $m == block ]] && extra=(--block-size "$BLOCK_SIZE")
  OMP_NUM_THREADS=1 "$ATTNRES" --threads 1 train --data "$data" --out "$out/engine_$m" \
    --residual "$m" "${extra[@]}" --seed "$SEED" --init-from "$out/init/$m.safetensors" "$@" \
    >"$out/engine_$m.log" 2>&1 &
  engine=$!
  pids+=("$engine")
  # The PyTorch run reads the attnres run's train_config.json and tokens.bin: wait for them.
  while [[ ! -s "$out/engine_$m/tokens.bin" || ! -s "$out/engine_$m/train_config.json" ]]; do
    kill -0 "$engine" 2>/dev/null || { echo "long_check: attnres $m failed:" >&2; tail -5 "$out/engine_$m.log" >&2; exit 1; }
    sleep 1
  done
  "$PY" tools/long_check.py train --run "$out/engine_$m" --init "$out/init/$m.safetensors" \
    --out "$out/torch_$m.jsonl" --threads 1 >"$out/torch_$m.log" 2>&1 &
  pids+=("$!")
done
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
((failed == 0)) || { echo "long_check: a run failed (see $out/*.log)" >&2; exit 1; }
for m in ${MODES//,/ }; do
  echo "[long_check] $m: $(grep '^done' "$out/engine_$m.log" | cut -c1-90); torch: $(tail -1 "$out/torch_$m.log")"
done
"$PY" tools/long_check.py table "$out" --modes "$MODES"
