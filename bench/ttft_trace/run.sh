#!/usr/bin/env bash
# Where the service's time to first token goes, hop by hop, on a GPU host (carry .whl):
#
#   bash bench/ttft_trace/run.sh        # from the repository root, in a scratch copy of the tree
#
# Applies trace.patch (timestamps at each hop of a Generate stream: client, gateway handler,
# worker channel, actor, step thread, back), serves bench-285m (random bf16), sends 60
# one-at-a-time streams (128-token prompts, 128 tokens, L = 8) with probe.py and prints the
# median of each hop (report.py), into $OUT/ttft-path-cuda.json. The patch edits the tree: run it in a
# copy, never commit it.
set -euo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
patch -p1 < bench/ttft_trace/trace.patch > /dev/null
source bench/gpu_env.sh
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
rm -rf /tmp/ttft-trace
CK=$(python -c "from bench.decode import random_checkpoint; from tinyloop.worker.model.config import PRESETS; \
print(random_checkpoint('load-bench-285m', PRESETS['bench-285m']))" 2>/dev/null | tail -1)
python -m tinyloop.cli serve --model "$CK" --lanes 128 --max-seq-len 512 --device cuda --port 50777 \
    --metrics-port 50778 > "$OUT/serve.log" 2>&1 &
for _ in $(seq 120); do grep -q "listening" "$OUT/serve.log" && break; sleep 1; done
python bench/ttft_trace/probe.py 127.0.0.1:50777 async > /dev/null  # warm-up
for mode in async async-sleep sync; do
    line=$(python bench/ttft_trace/probe.py 127.0.0.1:50777 "$mode" | tail -1); echo "$line"
    set -- $line; python3 bench/ttft_trace/report.py /tmp/ttft-trace "${@: -2}" --run "$mode" --json "$OUT/ttft-path-cuda.json"
done
kill %1
