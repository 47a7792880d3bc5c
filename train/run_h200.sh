#!/usr/bin/env bash
# Train a candidate for the embedded default model (preset bpe-8m) on one GPU, from the
# repository root (~9.5 min wall on an H200):
#
#   source bench/gpu_env.sh && bash train/run_h200.sh
#
# Writes to $OUT (default ./out): default.tinyloop (fp16), train_log.jsonl, model_card.json,
# model-card.md, packages.json (the .py bytes of every installed package).
#
# Corpus: this interpreter's stdlib and every installed package holding at least MIN_PKG_MB of
# .py sources (each capped at --package-mb), except HELDOUT, held out whole. The held-out
# package is one the CI machine installs too (a dependency of torch), so the CI test of the
# shipped model reads the same package's code, never seen in training. The BPE merges are learnt
# from a strided 40 MB sample of the training split. MINUTES (default: what is left of a
# 9.5-minute budget after the corpus is built) bounds the training loop. A run longer than one
# call's limit continues in the next: INIT=<the last call's default.tinyloop> (carried back).
set -euo pipefail
OUT="${OUT:-out}"
PRESET="${PRESET:-bpe-8m}"
HELDOUT="${HELDOUT:-networkx}"
MIN_PKG_MB="${MIN_PKG_MB:-0.3}"
BUDGET_S="${BUDGET_S:-570}"
mkdir -p "$OUT"
t0=$(date +%s)
python -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
mapfile -t PKGS < <(python -m tinyloop.train.corpus --list-packages --min-mb "$MIN_PKG_MB" \
    --exclude "$HELDOUT" --json "$OUT/packages.json")
echo "training packages (${#PKGS[@]}): ${PKGS[*]}"
common=(--preset "$PRESET" --tokenizer bpe --vocab-size 2048 --bpe-sample-mb 40
        --packages "${PKGS[@]}" --heldout-packages "$HELDOUT" --package-mb 25 --corpus-mb 40
        --corpus-dir /tmp/tinyloop-corpus --batch-size 128 --seq-len 512 --lr 2e-3 --warmup-steps 200
        --max-train-loops 16 --depth-weighting deep)
# INIT=<a .tinyloop carried here> continues that run (its weights, config and tokenizer).
[[ -n "${INIT:-}" ]] && common+=(--init "$INIT")
# One step first: builds and caches the corpus and the BPE ids, so the budget left is known.
python -m tinyloop.cli train "${common[@]}" --steps 1 --no-progress --out /tmp/warm.tinyloop
MINUTES="${MINUTES:-$(python -c "print(round(($BUDGET_S - ($(date +%s) - $t0) - 75) / 60, 2))")}"
echo "training for $MINUTES minutes"
python -m tinyloop.cli train "${common[@]}" --minutes "$MINUTES" --eval-every 500 \
    --out "$OUT/default.tinyloop" --log "$OUT/train_log.jsonl" --card "$OUT/model_card.json" \
    --card-loops 1 2 4 8 12 16 "$@"
python -m tinyloop.train.card "$OUT/model_card.json" -o "$OUT/model-card.md" || true
ls -l "$OUT"
