"""Sweep a model's batch-1 projection tiles in its captured decode step: the entries to add to
kernels/gemv.py `TILES` for this device.

    source bench/gpu_env.sh && python -m bench.tiles --model default --loops 8 --out-dir $OUT
    source bench/gpu_env.sh && python -m bench.tiles --model ouro-1.4b --loops 4 --out-dir $OUT

--model: `default` (the embedded default model) or a preset of worker/model/config.py (random
weights). The step's projections are found by recording the tiles its launches ask for
(`gemv.tile`: shape and options). Each starts from the tile it runs with now (TILES', else
`default_tile`'s). One projection at a time, every candidate (`candidates`: `_CONFIGS`, the
default tile and one-chunk tiles, K tile no wider than the padded K) takes its place in a
freshly captured step (`bench.decode.decode_runner`: a runner of the sweep's own over the
model's weights and cache, with that depth's decode graph alone, captured anew for each
figure), and the step's ms per token (`bench.decode.decode_rate`, min of
--best-of runs at --context tokens) decides; the winner stays for the projections after it.
Then three sets run interleaved for --rounds rounds: the tiles before the sweep, the swept
tiles, and per-process autotuning (TINYLOOP_AUTOTUNE=1, what untabled shapes ran with before
fixed tiles). The JSON holds every candidate's time, the chosen tiles, and each set's step time
per round; the swept tiles are printed as TILES entries. A tile fixed in TILES is what makes
every worker process sum each row the same way (kernels/gemv.py), so the sweep runs offline,
once per device and model.
"""
from __future__ import annotations

import argparse
import importlib
import os

import torch
import triton
from tqdm import tqdm

from bench.common import hardware, write
from bench.decode import ceilings, decode_rate, decode_runner, random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.config import PRESETS

gemv_mod = importlib.import_module("tinyloop.kernels.gemv")  # (the package exports the function gemv)


def step_ms(m: Model, loops: int, context: int, steps: int, best_of: int) -> float:
    """The step captured afresh (so the current tiles reach its launches), min of best_of runs;
    its graph is dropped after."""
    runner = decode_runner(m, [loops])
    try:
        return min(decode_rate(runner, loops, context, steps, repeat=3) for _ in range(best_of))
    finally:
        del runner
        torch.cuda.empty_cache()


def projections(m: Model, loops: int, context: int) -> list[tuple]:
    """The (N, K, norm, swiglu, residual, pdl) keys the step's M = 1 launches look up."""
    keys, real = [], gemv_mod.tile

    def record(device, N, K, norm, swiglu, residual, pdl):
        if (N, K, norm, swiglu, residual, pdl) not in keys:
            keys.append((N, K, norm, swiglu, residual, pdl))
        return real(device, N, K, norm, swiglu, residual, pdl)
    gemv_mod.tile = record
    try:
        step_ms(m, loops, context, 2, 1)
    finally:
        gemv_mod.tile = real
    return keys


# One-chunk tiles (BLOCK_K = the padded K, every weight of a program loaded before its PDL wait):
# the row blocks tried for each K up to ONE_CHUNK_MAX_K, keeping a program's tile of each weight
# matrix (BLOCK_N x the padded K, bf16; SwiGLU loads two) within 32 KB. On the H200 they won
# bench-285m's wo, w2 and head (kernels/gemv.py TILES), which no 1024-wide config of _CONFIGS
# reaches at K = 2048 or 5632.
ONE_CHUNK_MAX_K = 8192
ONE_CHUNK_ROWS = (1, 2, 4, 8)


def candidates(K: int) -> list[tuple[int, int, int, int]]:
    """The tiles the sweep tries for a projection of K columns: _CONFIGS' and the default tile
    whose K tile fits the padded K, and the one-chunk tiles (4 warps, one stage) of that K."""
    padded = triton.next_power_of_2(max(K, 16))
    tiles = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in gemv_mod._CONFIGS]
    if padded <= ONE_CHUNK_MAX_K:
        tiles += [(bn, padded, 4, 1) for bn in ONE_CHUNK_ROWS if bn * padded * 2 <= 32768]
    return sorted({t for t in tiles + [gemv_mod.default_tile(K)] if t[1] <= padded})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="`default` or a preset of worker/model/config.py")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per timed run")
    ap.add_argument("--best-of", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the before / swept / autotuned sets")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.model != "default" and args.model not in PRESETS:
        ap.error(f"--model: `default` or one of {sorted(PRESETS)}, got {args.model!r}")
    if not torch.cuda.is_available():
        ap.error("the sweep times the captured step: it needs a CUDA device")
    if gemv_mod.autotuning():
        ap.error("unset TINYLOOP_AUTOTUNE: the sweep compares fixed tiles (and times autotuning itself)")
    dev = torch.device("cuda")
    name = gemv_mod._device_name(dev)
    path = None if args.model == "default" else random_checkpoint(args.model, PRESETS[args.model])
    table = gemv_mod.TILES.setdefault(name, {})
    before = dict(table)
    result = {"hardware": hardware(dev), "ceilings": ceilings(dev), "device_name": name, "model": args.model,
              "loops": args.loops, "context": args.context, "sweep": [], "rounds": []}
    out_name = f"tiles-{args.model}-cuda"
    # no graphs of the model's own: each figure captures its step afresh (one lane: no batch graphs)
    with Model(path, max_seq_len=args.context + args.steps + 8, device=dev, dtype="bfloat16", n_slots=1,
               cuda_graphs=False) as m:
        keys = projections(m, args.loops, args.context)
        start = {k: table.get(k) or gemv_mod.default_tile(k[1]) for k in keys}
        chosen = dict(start)
        bar = tqdm(total=sum(len(candidates(k[1])) for k in keys), desc="tiles", unit="step")
        for key in keys:
            times = {}
            for t in candidates(key[1]):
                table.update(chosen)
                table[key] = t
                times[t] = step_ms(m, args.loops, args.context, args.steps, args.best_of)
                bar.update()
            chosen[key] = min(times, key=times.get)
            tqdm.write(f"{key}: {chosen[key]} {times[chosen[key]]:.4f} ms (from {start[key]} "
                       f"{times[start[key]]:.4f} ms)")
            result["sweep"].append({"key": list(key), "start": list(start[key]), "chosen": list(chosen[key]),
                                    "ms": {repr(t): v for t, v in times.items()}})
            write(out_name, result, args.out_dir)
        bar.close()

        sets = {"before": start, "swept": chosen, "autotuned": None}
        for r in range(args.rounds):
            row = {"round": r, "ms": {}}
            for set_name, tiles in sets.items():
                table.clear()
                table.update(before)
                if tiles is None:
                    os.environ["TINYLOOP_AUTOTUNE"] = "1"
                    gemv_mod.autotuning.cache_clear()
                else:
                    table.update(tiles)
                try:
                    row["ms"][set_name] = step_ms(m, args.loops, args.context, args.steps, args.best_of)
                finally:
                    os.environ.pop("TINYLOOP_AUTOTUNE", None)
                    gemv_mod.autotuning.cache_clear()
            tqdm.write(f"round {r}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in row["ms"].items()))
            result["rounds"].append(row)
        table.clear()
        table.update(before)
    result["best_ms"] = {k: min(row["ms"][k] for row in result["rounds"]) for k in sets}
    result["autotuned_tiles"] = {repr(k[:7]): str(v) for k, v in gemv_mod._gemv_tuned.cache.items()}
    result["tiles_entries"] = [f"{tuple(k)!r}: {tuple(v)!r}," for k, v in chosen.items()]
    write(out_name, result, args.out_dir)
    print(f'TILES["{name}"] entries ({args.model}):')
    for line in result["tiles_entries"]:
        print("    " + line)


if __name__ == "__main__":
    main()
