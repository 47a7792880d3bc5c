#!/usr/bin/env bash
# Train the embedded default model on one GPU (~8 min of training, ~8.5 min wall), from the
# repository root, with the project installed first (package-dir mapping defeats PYTHONPATH):
#
#   source bench/gpu_env.sh && bash train/run_h200.sh
#
# Writes to $OUT (default ./out): default.tinyloop (fp16), train_log.jsonl, model_card.json,
# model-card.md. The corpus is built here from this machine's own stdlib (cached in /tmp).
# Override MINUTES / PRESET, or append `tinyloop train` flags as arguments.
set -euo pipefail
OUT="${OUT:-out}"
MINUTES="${MINUTES:-8}"
PRESET="${PRESET:-default}"
mkdir -p "$OUT"
python -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
python -m tinyloop.cli train --preset "$PRESET" --minutes "$MINUTES" \
    --batch-size 64 --seq-len 512 --lr 2e-3 --warmup-steps 200 --max-train-loops 12 --eval-every 500 \
    --corpus-dir /tmp/tinyloop-corpus --out "$OUT/default.tinyloop" --log "$OUT/train_log.jsonl" \
    --card "$OUT/model_card.json" --card-loops 1 2 4 8 16 "$@"
python -m tinyloop.train.card "$OUT/model_card.json" -o "$OUT/model-card.md"
ls -l "$OUT"
