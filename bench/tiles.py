"""Sweep a model's batch-1 projection tiles in its captured decode step: a tiles file the fused
projections take with Settings.gemv_tiles (TINYLOOP_GEMV_TILES), and the entries to add to
kernels/gemv.py `TILES` for this device.

    source bench/gpu_env.sh && python -m bench.tiles --model default --loops 8 --out-dir $OUT
    source bench/gpu_env.sh && python -m bench.tiles --model ouro-1.4b --loops 4 --out-dir $OUT

--model: `default` (the embedded default model) or a preset of worker/model/config.py (random
weights), built with Settings.from_env() (its pdl and gemv_tiles; TINYLOOP_AUTOTUNE is refused:
the sweep compares fixed tiles and times autotuning itself). Every tile the sweep tries reaches
the step's launches as gemv's explicit `tables` argument: the model's fused projections are
handed gemv bound to a table of the sweep's own (`use_tiles`); nothing in kernels/gemv.py
changes. The step's projections are the (N, K, norm, swiglu, residual, pdl) keys its M = 1
launches look up in that table (`projections`: one step on a table that records them). Each
starts from the tile it runs with now (the model's gemv_tiles entry, else TILES', else
`default_tile`'s). One projection at a time, every candidate (`candidates`: `_CONFIGS`, the
default tile and one-chunk tiles, K tile no wider than the padded K) takes its place in a
freshly captured step (`bench.decode.decode_runner`: a runner of the sweep's own over the
model's weights and cache, with that depth's decode graph alone, captured anew for each
figure), and the step's ms per token (`bench.decode.decode_rate`, min of --best-of runs at
--context tokens) decides; the winner stays for the projections after it. Then three sets run
interleaved for --rounds rounds: the tiles before the sweep, the swept tiles, and per-process
autotuning of the shapes no table holds (gemv's `autotune`, Settings.autotune: what untabled
shapes ran with before fixed tiles). The JSON holds every candidate's time, each set's step time
per round, and the chosen tiles as "tiles" in kernels/gemv.py `load_tables`' format, so the JSON
itself runs as TINYLOOP_GEMV_TILES; the swept tiles are printed as TILES entries too. A tile
fixed in a table is what makes every worker process sum each row the same way
(kernels/gemv.py), so the sweep runs offline, once per device and model.
"""
from __future__ import annotations

import argparse
import functools
import importlib

import torch
import triton
from tqdm import tqdm

from bench.common import hardware, write
from bench.decode import ceilings, decode_rate, decode_runner, random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.model.quant import route_gemv
from tinyloop.worker.model.settings import Settings

gemv_mod = importlib.import_module("tinyloop.kernels.gemv")  # (the package exports the function gemv)


class Lookups(dict):
    """An M = 1 tiles table (key -> tile) that records, in order, every key a launch asks it
    for (`kernels.gemv.table_entry` asks `key in` first)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.asked: list[tuple] = []

    def __contains__(self, key) -> bool:
        if key not in self.asked:
            self.asked.append(key)
        return super().__contains__(key)


def use_tiles(m: Model, tables, autotune: bool = False) -> None:
    """The model's fused projections on gemv with these `tables` ((M = 1 entries, M > 1
    entries), taken before the code's tables; None: the code's alone) and autotune, with the
    pdl and batch-invariant form of the model's own ops."""
    ops = m.runner.ops
    launch = functools.partial(gemv_mod.gemv, pdl=ops.pdl, tables=tables, autotune=autotune,
                               **({"invariant": True} if ops.invariant else {}))
    m._module.use_gemv(route_gemv(launch))


def step_ms(m: Model, loops: int, context: int, steps: int, best_of: int) -> float:
    """The step captured afresh (so the projections' current tables reach its launches), min of
    best_of runs; its graph is dropped after."""
    runner = decode_runner(m, [loops])
    try:
        return min(decode_rate(runner, loops, context, steps, repeat=3) for _ in range(best_of))
    finally:
        del runner
        torch.cuda.empty_cache()


def projections(m: Model, loops: int, context: int) -> list[tuple]:
    """The (N, K, norm, swiglu, residual, pdl) keys the step's M = 1 launches look up, in launch
    order (the model's projections are left on the recording table: `use_tiles` them after)."""
    asked = Lookups()
    use_tiles(m, (asked, {}))
    step_ms(m, loops, context, 2, 1)
    return list(asked.asked)


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


def tiles_file(chosen: dict[tuple, tuple]) -> list[list]:
    """The chosen tiles as a tiles file's "tiles" entries (kernels/gemv.py `load_tables`)."""
    return [[list(k), list(t)] for k, t in chosen.items()]


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
    settings = Settings.from_env()
    if settings.autotune:
        ap.error("unset TINYLOOP_AUTOTUNE: the sweep compares fixed tiles (and times autotuning itself)")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    path = None if args.model == "default" else random_checkpoint(args.model, PRESETS[args.model])
    # the tables the model runs with now (Settings.gemv_tiles), before the code's
    base = gemv_mod.load_tables(settings.gemv_tiles) if settings.gemv_tiles else None
    result = {"hardware": hardware(dev), "ceilings": ceilings(dev), "device_name": name, "model": args.model,
              "loops": args.loops, "context": args.context, "gemv_tiles": settings.gemv_tiles, "sweep": [],
              "rounds": []}
    out_name = f"tiles-{args.model}-cuda"
    # no graphs of the model's own: each figure captures its step afresh (one lane: no batch graphs)
    with Model(path, max_seq_len=args.context + args.steps + 8, device=dev, dtype="bfloat16", n_slots=1,
               cuda_graphs=False, settings=settings) as m:
        keys = projections(m, args.loops, args.context)
        start = {k: gemv_mod.tile(dev, *k, tables=base) for k in keys}
        chosen = dict(start)
        bar = tqdm(total=sum(len(candidates(k[1])) for k in keys), desc="tiles", unit="step")
        for key in keys:
            times = {}
            for t in candidates(key[1]):
                use_tiles(m, ({**chosen, key: t}, {}))
                times[t] = step_ms(m, args.loops, args.context, args.steps, args.best_of)
                bar.update()
            chosen[key] = min(times, key=times.get)
            tqdm.write(f"{key}: {chosen[key]} {times[chosen[key]]:.4f} ms (from {start[key]} "
                       f"{times[start[key]]:.4f} ms)")
            result["sweep"].append({"key": list(key), "start": list(start[key]), "chosen": list(chosen[key]),
                                    "ms": {repr(t): v for t, v in times.items()}})
            write(out_name, result, args.out_dir)
        bar.close()

        # (tables, autotune) of each set: "before" is the model as built
        sets = {"before": (base, False), "swept": ((chosen, {}), False), "autotuned": (base, True)}
        for r in range(args.rounds):
            row = {"round": r, "ms": {}}
            for set_name, (tables, autotune) in sets.items():
                use_tiles(m, tables, autotune)
                row["ms"][set_name] = step_ms(m, args.loops, args.context, args.steps, args.best_of)
            tqdm.write(f"round {r}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in row["ms"].items()))
            result["rounds"].append(row)
    result["best_ms"] = {k: min(row["ms"][k] for row in result["rounds"]) for k in sets}
    result["autotuned_tiles"] = {repr(k[:7]): str(v) for k, v in gemv_mod._gemv_tuned.cache.items()}
    result["tiles"] = tiles_file(chosen)  # the JSON runs as TINYLOOP_GEMV_TILES
    result["tiles_entries"] = [f"{tuple(k)!r}: {tuple(v)!r}," for k, v in chosen.items()]
    write(out_name, result, args.out_dir)
    print(f'TILES["{name}"] entries ({args.model}):')
    for line in result["tiles_entries"]:
        print("    " + line)


if __name__ == "__main__":
    main()
