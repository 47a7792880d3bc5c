#!/usr/bin/env bash
# Train the embedded default model on one GPU (~8 min of training, ~8.5 min wall), from the
# repository root, with the project installed first (package-dir mapping defeats PYTHONPATH):
#
#   source bench/gpu_env.sh && CORPUS_TAR=.corpus/stdlib.tar.gz bash train/run_h200.sh
#
# Writes to $OUT (default ./out): default.tinyloop (fp16), train_log.jsonl, model_card.json,
# model-card.md. Override MINUTES / PRESET, or append `tinyloop train` flags as arguments.
#
# Corpus. Without CORPUS_TAR it is built from this machine's own stdlib (cached in /tmp). The GPU
# image's Python ships no test suites, so its stdlib is only ~10 MB of .py: the model sees it
# ~15 times in 8 minutes, overfits, and held-out loss stops falling with depth. CORPUS_TAR names
# a tarball of a fuller stdlib's .py files (test suites included, ~31 MB for Python 3.11), made
# on a CI machine, whose Python does ship them, and carried here; it is unpacked to
# /tmp/stdlib-src and passed as --corpus-root, so the held-out split is the CI machine's too.
# Make it from the repository root (an optional PYTHON_VERSION file at the top of the tree names
# the version in the model card):
#
#   D=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])'); mkdir -p .corpus
#   python -c 'import sys; print(sys.version.split()[0])' > .corpus/PYTHON_VERSION
#   (cd "$D" && find . -name '*.py' -not -path '*-packages*' -not -path '*__pycache__*' | sort) > /tmp/py.txt
#   tar czf .corpus/stdlib.tar.gz -C "$D" -T /tmp/py.txt -C .corpus PYTHON_VERSION
set -euo pipefail
OUT="${OUT:-out}"
MINUTES="${MINUTES:-8}"
PRESET="${PRESET:-default}"
mkdir -p "$OUT"
corpus_args=()
if [[ -n "${CORPUS_TAR:-}" ]]; then
    rm -rf /tmp/stdlib-src && mkdir -p /tmp/stdlib-src
    tar xzf "$CORPUS_TAR" -C /tmp/stdlib-src
    corpus_args=(--corpus-root /tmp/stdlib-src)
fi
python -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
python -m tinyloop.cli train --preset "$PRESET" --minutes "$MINUTES" \
    --batch-size 64 --seq-len 512 --lr 2e-3 --warmup-steps 200 --max-train-loops 12 --eval-every 500 \
    --corpus-dir /tmp/tinyloop-corpus "${corpus_args[@]}" --out "$OUT/default.tinyloop" \
    --log "$OUT/train_log.jsonl" --card "$OUT/model_card.json" --card-loops 1 2 4 8 16 "$@"
python -m tinyloop.train.card "$OUT/model_card.json" -o "$OUT/model-card.md"
ls -l "$OUT"
