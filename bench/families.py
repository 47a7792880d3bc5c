"""Batch-1 decode of the public looped model families at their published shapes, against the
bandwidth floor, on the GPU.

    source bench/gpu_env.sh && python -m bench.families --out-dir $OUT   # -> families-cuda.json

Each model is a random bf16 checkpoint of the preset (worker/model/config.py): the shapes and
the per-layer math the Hugging Face loader builds for Ouro-1.4B, Ouro-2.6B (sandwich norms, a
norm at the end of every UT step) and Huginn-0125 (prelude, a 4-layer recurrent block with input
injection, coda); the `ouro-1.4b` preset keeps a final norm before the head, which Ouro does not
have (one d-vector more per token). Served as a worker serves it (`Model(cuda_graphs=True)`, one cache lane): the
captured batch-1 decode graph at each depth replayed in a loop, each replay fed its own greedy
token (bench/decode.py `decode_rate`), after a prompt of --context random tokens.

The floor is bench/decode.py's: every weight byte a token reads (the loop block once per
iteration, the adapter before each iteration), the head and the K/V it attends to, over the
device's copy bandwidth. A model's row is written as it completes, so a partial run reports.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc

import torch
from tqdm import tqdm

from bench.common import hardware, write
from bench.decode import bytes_per_token, ceilings, decode_rate, random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.config import PRESETS

# (preset, depths): Ouro's default is 4 UT steps (its config's total_ut_steps), 8 is the deeper
# per-request depth this runtime allows; Huginn's mean_recurrence is 32.
DEFAULT_RUNS = (("ouro-1.4b", (4, 8)), ("ouro-2.6b", (4, 8)), ("huginn-3.5b", (32,)))


def parse_runs(items: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """["ouro-1.4b:4,8", ...] -> [("ouro-1.4b", (4, 8)), ...]; a preset must exist."""
    runs = []
    for item in items:
        name, _, depths = item.partition(":")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
        try:
            loops = tuple(int(x) for x in depths.split(",")) if depths else (PRESETS[name].default_loops,)
        except ValueError:
            raise ValueError(f"{item!r}: depths must be integers, e.g. {name}:4,8") from None
        if any(L < 1 for L in loops):
            raise ValueError(f"{item!r}: depths must be >= 1")
        runs.append((name, loops))
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=[f"{n}:{','.join(map(str, d))}" for n, d in DEFAULT_RUNS],
                    help="preset:depths, e.g. ouro-1.4b:4,8")
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache while decoding")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    runs = parse_runs(args.runs)
    dev = torch.device("cuda")
    c = ceilings(dev)
    result = {"hardware": hardware(dev), "ceilings": c, "context": args.context, "models": {}}
    for name, loops in tqdm(runs, desc="models", unit="model"):
        cfg = dataclasses.replace(PRESETS[name], max_loops=max(max(loops), PRESETS[name].default_loops))
        path = random_checkpoint(name, cfg)
        row = {"params": cfg.n_params(), "depths": {}}
        with Model(path, max_seq_len=args.context + args.steps * 8 + 64, device="cuda", dtype="bfloat16",
                   n_slots=1, cuda_graphs=True, prefill_graph_len=0) as m:
            row["graph_capture_s"] = sum(v for k, v in m.startup.items() if k.endswith("_graphs_s"))
            for L in loops:
                b = bytes_per_token(cfg, L, args.context)
                floor_ms = b["total"] / (c["copy_GBps"] * 1e6)
                ms = decode_rate(m.runner, L, args.context, args.steps)
                row["depths"][str(L)] = {"floor_ms": floor_ms, "graph_ms": ms, "vs_floor": ms / floor_ms,
                                         "achieved_GBps": b["total"] / (ms * 1e6), "bytes_per_token": b}
                tqdm.write(f"{name} L={L}: {ms:.3f} ms/token, floor {floor_ms:.3f} ms ({ms / floor_ms:.2f}x)")
        result["models"][name] = row
        write("families-cuda", result, args.out_dir)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
