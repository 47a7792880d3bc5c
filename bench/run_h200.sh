#!/usr/bin/env bash
# Every GPU check and benchmark of the fast path in one command, from the repository root on
# the H200 (offline image: the project is mapped by bench/gpu_env.sh, not pip-installed):
#
#   bash bench/run_h200.sh [steps...]      # steps: tests gemv profile decode batch prefill warmstart
#                                          #   speculative startup (default: all); tiles, load, families, kv, quant,
#                                          #   int4-tune, exit, interleave, load-ab, hops on demand (load: the service under load; carry .whl for
#                                          #   Ray; hops: bench/ray_hop.py, the service's hops with no model, on the host's CPU, Ray too; kv: the KV cache modes' decode speed and quality; quant: INT4 against
#                                          #   bf16; int4-tune: the INT4 GPU tests, tile sweep and decode A/B;
#                                          #   exit: early exit's sweep, bench/early_exit.py; profile-exit: where an exit step's time goes;
#                                          #   profile-exit-batch: where a batch of exit streams' time goes; sampling: sampled against greedy
#                                          #   decoding (bench/sampling.py); spec-batch: speculative streams' rounds shared
#                                          #   against their own rounds in turn (bench/spec_batch.py); invariant: the
#                                          #   batch-invariant kernels' GPU tests and benches; load-ab: load over the worker
#                                          #   channel and over Ray, same run; load-gil: the time to first token against --gil-switch-ms;
#                                          #   load-order: the mixed burst with --prefill-order arrival and longest, same run;
#                                          #   invariant-rows: the invariant projection's rows a program, its GPU tests, its
#                                          #   bench, the batched step's invariant A/B and batch-1 decode; sampled-rounds: the
#                                          #   sampler's uniforms kernel and sampled device rounds' GPU tests, the
#                                          #   speculative bench at temperatures 0 and 0.8; profile-spec: where a
#                                          #   speculative round's time goes, its kernels by name; fused-sampler:
#                                          #   the fused sampler's GPU tests and its sampling / speculative A/B;
#                                          #   profile-batch: where a batched step's time goes, GPU busy against wall;
#                                          #   attention-tiles: the decode attention's split tile by batch size and context)
#
# BASE=<an older checkout> adds the same-run baseline of a change: steps base-decode,
# base-batch and base-load run that checkout's decode / batch / load benchmarks into $OUT/base
# (BASE_COMMIT names it).
#
# Pass TINYLOOP_COMMIT=<commit> from the calling side when the host's copy of .git may be stale:
# the JSONs record it. PACK_LOGS=1 packs the logs into logs.tgz at the end (fewer files to fetch).
#
# Each step has its own time limit and log under $OUT (default ./out), and its JSON lands there
# too, so one step failing or running long does not lose the others.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
source bench/gpu_env.sh
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # the service's wheels (../shared/gpu/wheels.sh), carried for service runs
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests gemv profile decode batch prefill warmstart speculative startup)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

run() {  # run NAME SECONDS CMD...: time-limited, logged, never aborts the script
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$OUT/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
}

for s in "${steps[@]}"; do
    case $s in
        # -v: each test named in tests.log as it ends, so a run cut short by its limit still says
        # which failed (about 6 minutes on an H100)
        tests) run tests "${TESTS_S:-420}" python -m pytest -m gpu ${TEST_PATHS:-tests/kernels tests/worker/test_gpu_engine.py tests/worker/test_gpu_sampling.py tests/worker/test_l2_policy.py tests/worker/test_rope_tables.py tests/test_bench.py} -v --tb=short -rf -p no:cacheprovider ;;
        gemv) run gemv 90 python -m bench.gemv --out-dir "$OUT" ;;
        profile) run profile "${PROFILE_S:-90}" python -m bench.profile_decode --out-dir "$OUT" ${PROFILE_ARGS:-} ;;
        families) run families "${FAMILIES_S:-420}" python -m bench.families --out-dir "$OUT" ${FAMILIES_ARGS:-} ;;
        decode) run decode "${DECODE_S:-240}" python -m bench.decode --out-dir "$OUT" ${DECODE_ARGS:-} ;;
        batch) run batch "${BATCH_S:-120}" python -m bench.batch --out-dir "$OUT" ;;
        interleave)  # mixed depths in-process: interleaved launches against whole-token steps, same run
            run interleave "${BATCH_S:-200}" python -m bench.batch --batch 16 64 --mixed-depths 4 8 16 32 \
                --no-invariant --repeat 3 --sustained 160 --name batch-interleave --out-dir "$OUT" ;;
        prefill) run prefill 90 python -m bench.prefill --out-dir "$OUT" ;;
        warmstart) run warmstart 120 python -m bench.warmstart --preset bench-285m --device cuda --prefix 128 1024 3072 4000 --out-dir "$OUT" ;;
        speculative) run speculative 120 python -m bench.speculative --device cuda --repeat 3 --out-dir "$OUT" ;;
        sampling) run sampling 240 python -m bench.sampling --out-dir "$OUT" ;;
        spec-batch) run spec-batch "${SPECB_S:-240}" python -m bench.spec_batch --out-dir "$OUT" ${SPECB_ARGS:-} ;;
        load) run load "${LOAD_S:-480}" python -m bench.load --out-dir "$OUT" ${LOAD_ARGS:-} ;;
        load-ab)  # the service under load over the worker channel (load-cuda.json) and, same run, over
                  # Ray streaming calls (ray/load-cuda.json): the channel's A/B. About 5 minutes.
            mkdir -p "$OUT/ray"
            run load "${LOAD_S:-300}" python -m bench.load --out-dir "$OUT" ${LOAD_ARGS:-}
            run load-ray "${LOAD_S:-300}" python -m bench.load --out-dir "$OUT/ray" --no-worker-channel ${LOAD_ARGS:-} ;;
        load-order)  # the mixed burst with prompts prefilled in arrival order and, same run, with the
                     # most decode work first (--prefill-order longest): the prefill order's A/B
            for o in arrival longest; do
                mkdir -p "$OUT/order-$o"
                run "load-order-$o" "${LOAD_S:-240}" python -m bench.load --out-dir "$OUT/order-$o" --concurrency 64 \
                    --sustained-s 0 --prefill-order "$o" ${LOAD_ARGS:-}
            done ;;
        load-gil)  # the time to first token against the interpreter switch interval of the serve and
                   # worker processes (--gil-switch-ms: 5 is Python's default), one-token probes
            for g in ${GIL_VALUES:-5 0.05}; do
                mkdir -p "$OUT/gil-$g"
                run "load-gil-$g" "${LOAD_S:-150}" python -m bench.load --out-dir "$OUT/gil-$g" --concurrency 1 \
                    --mixed 0 --gil-switch-ms "$g" ${LOAD_ARGS:-}
            done ;;
        hops) run hops "${HOPS_S:-120}" python -m bench.ray_hop --calls 200 --out-dir "$OUT" ;;
        startup) run startup "${STARTUP_S:-300}" python -m bench.startup --preset bench-285m --lanes 1 8 64 --max-seq-len 4096 --out-dir "$OUT" ;;
        base-decode|base-batch)
            what=${s#base-}
            mkdir -p "$OUT/base"
            args="--out-dir $(cd "$OUT/base" && pwd)"
            [ "$what" = decode ] && args="$args ${DECODE_ARGS:-}"
            run "$s" "${BASE_S:-150}" bash -c "cd '$BASE' && unset PYTHONPATH && source bench/gpu_env.sh && TINYLOOP_COMMIT='${BASE_COMMIT:-}' python -m bench.$what $args" ;;
        base-load)  # the service under load from the checkout in BASE into $OUT/base (carry .whl): by
            # default the plain and mixed bursts and the closed loops at 64 streams (no probes), what a
            # scheduling change moves
            mkdir -p "$OUT/base"
            run base-load "${BASE_LOAD_S:-240}" bash -c "cd '$BASE' && export PYTHONPATH=/tmp/site && source bench/gpu_env.sh && \
                TINYLOOP_COMMIT='${BASE_COMMIT:-}' python -m bench.load --out-dir '$(cd "$OUT/base" && pwd)' \
                ${BASE_LOAD_ARGS:---concurrency 64 --probes 0}" ;;
        generate-ab)  # Model.generate of the checkout in BASE against this tree's, alternated (bench/generate_ab.py)
            run generate-ab "${GENAB_S:-300}" python -m bench.generate_ab --tree "base=$BASE" --tree head=. \
                --out-dir "$OUT" ${GENAB_ARGS:-} ;;
        quant) run quant "${QUANT_S:-420}" python -m bench.quant_decode --out-dir "$OUT" ${QUANT_ARGS:---batch 1 4 8 16} ;;
        int4-tune)  # the INT4 kernels' GPU tests; the tile sweep (hot and cold, into int4-tiles-cuda.json with
                    # the TILES entries to paste); decode at L = 1..16 in bf16, INT4 on the code's tables
                    # (`int4`) and on the swept tiles (`int4-tuned`), one run. About 6 minutes.
            run int4-tests "${TESTS_S:-150}" python -m pytest -m gpu tests/kernels/test_kernel_int4_gemv.py -q -p no:cacheprovider
            run int4-tiles "${SWEEP_S:-200}" python -m bench.int4_tiles --out-dir "$OUT" --budget-s "${BUDGET_S:-150}" ${SWEEP_ARGS:-}
            formats=(bf16 int4); tiles=()
            if [ -s "$OUT/int4-tiles-cuda.json" ] && grep -q '"tiles_entries"' "$OUT/int4-tiles-cuda.json"; then
                formats+=(int4-tuned); tiles=(--tiles "$OUT/int4-tiles-cuda.json")
            fi
            run quant-decode "${DECODE_S:-150}" python -m bench.quant_decode --out-dir "$OUT" --loops 1 2 4 8 16 \
                --formats "${formats[@]}" "${tiles[@]}" ;;
        tiles)  # the bf16 projections' tiles swept in the decode step: tiles-<model>-cuda.json is a tiles file
                # that TINYLOOP_GEMV_TILES runs (Settings.gemv_tiles), with the TILES entries to paste
            run tiles 300 python -m bench.tiles --model "${TILES_MODEL:-default}" --out-dir "$OUT" ;;
        profile-exit) run profile-exit "${PROFILE_S:-120}" python -m bench.profile_exit --out-dir "$OUT" ${PROFILE_EXIT_ARGS:-} ;;
        profile-exit-batch) run profile-exit-batch "${PROFILE_S:-120}" python -m bench.profile_exit_batch --out-dir "$OUT" \
            ${PROFILE_EXIT_BATCH_ARGS:---cprofile 40} ;;
        exit) run early-exit "${EXIT_S:-540}" python -m bench.early_exit --device cuda --out-dir "$OUT" ${EXIT_ARGS:-} ;;
        invariant)  # batch-invariant kernels and greedy speculative rounds on the device: their GPU tests
                    # (bitwise equality), the speculative bench, the round's profile, the projection per M
            run invariant-tests "${TESTS_S:-330}" python -m pytest -m gpu tests/kernels/test_kernel_gemv.py \
                tests/kernels/test_kernel_rope_decode_attention.py tests/worker/test_gpu_invariant.py tests/worker/test_gpu_engine.py -q -p no:cacheprovider
            run speculative "${SPEC_S:-150}" python -m bench.speculative --device cuda --repeat 3 --out-dir "$OUT" ${SPEC_ARGS:-}
            run profile-speculative 45 python -m bench.profile_speculative --out-dir "$OUT"
            run gemv-invariant 45 python -m bench.gemv_invariant --out-dir "$OUT" ;;
        kv) run kv-decode "${KV_S:-420}" python -m bench.kv_decode --out-dir "$OUT" ${KV_ARGS:-}
            run kv-quality 240 python -m bench.kv_quality --device cuda --out-dir "$OUT" ;;
        invariant-rows)  # the invariant projection's row loop (kernels/gemv.py, ROW_LOOP): every row its invariant
                         # M = 1 call's bits at any rows a program, the rows and tiles swept, the batched step with
                         # and without invariant kernels, and the plain batch-1 decode step it must leave alone
            run invariant-rows-tests "${TESTS_S:-100}" python -m pytest -m gpu tests/kernels/test_kernel_gemv.py \
                -k invariant -q -p no:cacheprovider
            run gemv-invariant "${GI_S:-100}" python -m bench.gemv_invariant --out-dir "$OUT"
            run batch "${BATCH_S:-100}" python -m bench.batch --batch 1 2 4 8 16 --repeat 2 --out-dir "$OUT"
            run decode "${DECODE_S:-60}" python -m bench.decode --loops 8 --skip-compile --out-dir "$OUT" ;;
        sampled-rounds)  # the sampler's counter-based uniforms in one launch, sampled chain rounds on the device
                         # against the host-driven ones, then the speculative bench (greedy and temperature 0.8)
            run sampled-rounds-tests "${TESTS_S:-90}" python -m pytest -m gpu tests/worker/test_gpu_sampling.py \
                tests/worker/test_gpu_invariant.py -k "uniforms or sampled_rounds or sampler_graph or own_samplers" \
                -q -p no:cacheprovider
            run speculative "${SPEC_S:-150}" python -m bench.speculative --device cuda --repeat 3 --draft-loops 2 \
                --draft-ahead 4 6 --k-branches 1 2 --out-dir "$OUT" ;;
        fused-sampler)  # the fused sampler (kernels/sample_rows.py, Settings.fused_sampler): its kernel tests and
                        # the fused paths' tests on the GPU, then the sampling bench (graphs, ops one by one,
                        # fused), and the speculative bench and the sampled round's profile with it off and on
            run fused-sampler-tests "${TESTS_S:-240}" python -m pytest -m "" tests/kernels/test_kernel_sample_rows.py \
                tests/worker/test_sampling.py tests/worker/test_device_rounds.py -k "fused or rows or bad" -q -p no:cacheprovider
            run sampling "${SAMPLING_S:-240}" python -m bench.sampling --out-dir "$OUT"
            for f in 0 1; do
                mkdir -p "$OUT/fused-$f"
                TINYLOOP_FUSED_SAMPLER=$f run "speculative-fused-$f" "${SPEC_S:-150}" python -m bench.speculative \
                    --device cuda --repeat 3 --draft-loops 2 --draft-ahead 4 --k-branches 1 --out-dir "$OUT/fused-$f"
                TINYLOOP_FUSED_SAMPLER=$f run "profile-speculative-fused-$f" "${PROFILE_S:-60}" \
                    python -m bench.profile_speculative --out-dir "$OUT/fused-$f"
            done ;;
        attention-tiles) run attention-tiles "${ATTN_S:-180}" python -m bench.attention_tiles --out-dir "$OUT" ${ATTN_ARGS:-} ;;
        profile-batch) run profile-batch "${PROFILE_S:-90}" python -m bench.profile_batch --out-dir "$OUT" ${PROFILE_BATCH_ARGS:-} ;;
        profile-spec) run profile-speculative "${PROFILE_S:-60}" python -m bench.profile_speculative --out-dir "$OUT" ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done
if [ "${PACK_LOGS:-0}" = 1 ]; then
    (cd "$OUT" && tar czf logs.tgz ./*.log gpu.txt && rm -f ./*.log gpu.txt)
fi
