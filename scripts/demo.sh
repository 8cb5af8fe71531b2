#!/usr/bin/env bash
# One command: install dependencies, build, and run the main job — train a small model on the
# default corpus (Debian's `fortunes`, or the file/directory given as $1), then print its
# validation loss and a sample. Extra arguments are passed to `attnres train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh >/dev/null
DATA="${1:-/usr/share/games/fortunes}"
shift || true
exec ./build/attnres train --data "$DATA" --out runs/demo \
  --tokenizer bpe --vocab-size 2048 \
  --n-layer 4 --d-model 128 --n-head 4 --seq-len 128 --batch-size 16 \
  --steps 1500 --lr 3e-3 --warmup 50 --eval-every 200 --save-every 200 \
  --prompt "The meaning of life is" "$@"
