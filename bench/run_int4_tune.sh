#!/usr/bin/env bash
# INT4 tiles on the H200 in one run, from the repository root (offline image: bench/gpu_env.sh
# maps the project):
#
#   OUT=/path/to/out bash bench/run_int4_tune.sh
#
# 1. the INT4 kernels' GPU tests (parity and exact weights at bench-285m's shapes, both kernels);
# 2. bench/int4_tiles.py: every candidate tile of bench-285m's four fused projections timed hot
#    (L2-resident, the loop's case) and cold -> $OUT/int4-tiles-cuda.json (the TILES entries to
#    paste are in it and at the end of its log);
# 3. bench/quant_decode.py at L = 1, 2, 4, 8, 16: bf16, INT4 on the code's tables (`int4`) and
#    INT4 on the swept tiles (`int4-tuned`), one run -> $OUT/quant-decode-cuda.json.
#
# Each step has a time limit and a log under $OUT; a step failing does not stop the next (without
# a sweep JSON the decode runs bf16 and int4 alone). About 6 minutes in all; the limits (seconds):
# TESTS_S, SWEEP_S, DECODE_S; the sweep stops timing new candidates after BUDGET_S.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
source bench/gpu_env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

run() {  # run NAME SECONDS CMD...: time-limited, logged, never aborts the script
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-30}" "$OUT/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
}

run int4-tests "${TESTS_S:-150}" python -m pytest -m gpu tests/kernels/test_kernel_int4_gemv.py -q -p no:cacheprovider
run int4-tiles "${SWEEP_S:-200}" python -m bench.int4_tiles --out-dir "$OUT" --budget-s "${BUDGET_S:-150}"
formats=(bf16 int4)
tiles=()
if [ -s "$OUT/int4-tiles-cuda.json" ] && grep -q '"tiles_entries"' "$OUT/int4-tiles-cuda.json"; then
    formats+=(int4-tuned)
    tiles=(--tiles "$OUT/int4-tiles-cuda.json")
fi
run quant-decode "${DECODE_S:-150}" python -m bench.quant_decode --out-dir "$OUT" --loops 1 2 4 8 16 \
    --formats "${formats[@]}" "${tiles[@]}"
