"""Pick the batch-1 GEMV's tile per projection in the captured decode step, not alone.

    source bench/gpu_env.sh && python -m bench.tune_gemv --out-dir $OUT [--table kernels/gemv_tuned.json]

The autotuner (kernels/gemv.py) times each projection back to back with itself. In a decode
step each one starts (programmatic dependent launch) while a different kernel drains -- the
previous projection or the attention -- and the small ones (wo, w2: 8 and 23 MB) lose a third
of their time to ramp-up and tail, so the isolated pick need not be the step's best. This
times the captured bench-285m decode step at L = 8 (context 128, the engine's own graph, as
bench/decode.py does) per candidate tile of one projection at a time -- wqkv (norm), wo
(+ residual), w13 (norm, SwiGLU), w2 (+ residual) -- keeping the others fixed: a grid of
BLOCK_N x BLOCK_K x warps, then the winner's num_stages.

The JSON holds the step's floor (weight bytes at the copy rate), the step with the
autotuner's picks, every candidate's time, and the step with the winners; --table stores the
winners for this GPU in a table file; in kernels/gemv_tuned.json gemv() launches them instead
of autotuning.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.common import hardware, write
from bench.decode import bytes_per_token, ceilings, decode_rate, random_checkpoint
import tinyloop.kernels.gemv  # noqa: F401  (the module: the package exports the function under its name)
from tinyloop.worker import Model
from tinyloop.worker.config import PRESETS
from tinyloop.worker.graphs import DecodeGraphs

G = sys.modules["tinyloop.kernels.gemv"]


def projections(cfg) -> dict:
    """name: (N, K, flags) of each projection of a layer, as gemv() sees them."""
    D, F, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    qkv = hd * (cfg.n_heads + 2 * cfg.n_kv_heads)
    return {"wqkv": (qkv, D, dict(NORM=True, SWIGLU=False, RESIDUAL=False)),
            "wo": (D, cfg.n_heads * hd, dict(NORM=False, SWIGLU=False, RESIDUAL=True)),
            "w13": (F, D, dict(NORM=True, SWIGLU=True, RESIDUAL=False)),
            "w2": (D, F, dict(NORM=False, SWIGLU=False, RESIDUAL=True))}


def candidates() -> list[list[int]]:
    """[BLOCK_N, BLOCK_K, warps, 1]: tiles of 1K to 8K weights (fewer leave the SMs short of
    loads in flight, more spill the fp32 accumulator)."""
    out = []
    for bn in (1, 2, 4, 8, 16):
        for bk in (256, 512, 1024, 2048):
            if 1024 <= bn * bk <= 8192:
                out += [[bn, bk, w, 1] for w in (4, 8)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--passes", type=int, default=1, help="rounds of the descent over the projections")
    ap.add_argument("--table", default=None,
                    help="store the winners for this GPU in this table file (kernels/gemv_tuned.json: gemv uses them)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    c = ceilings(dev)
    cfg = PRESETS["bench-285m"]
    L, T = args.loops, args.context
    m = Model(random_checkpoint("bench-285m", cfg), max_seq_len=4096, device="cuda", dtype="bfloat16",
              cuda_graphs=False)
    e = m.engine
    e.graphs = DecodeGraphs(e)
    floor_ms = bytes_per_token(cfg, L, T)["total"] / (c["copy_GBps"] * 1e6)

    def step_ms() -> float:
        e.graphs.graphs.clear()  # recapture: the graph holds the kernels launched at capture
        return min(decode_rate(m, L, T, 64) for _ in range(2))

    gpu = torch.cuda.get_device_name(dev)
    table = G.tuned_table(gpu)
    table.clear()  # start from the autotuner's picks
    pdl = G.use_pdl(dev)
    keys = {name: G.tuned_key(N, K, flags, pdl) for name, (N, K, flags) in projections(cfg).items()}
    t0 = time.perf_counter()
    autotuned_ms = step_ms()
    print(f"L={L}: floor {floor_ms * 1e3:.1f} us, step with the autotuner's picks {autotuned_ms * 1e3:.1f} us",
          flush=True)
    trials = []
    for rnd in range(args.passes):
        for name, key in keys.items():
            results = []

            def trial(cfg_):
                table[key] = cfg_
                try:
                    ms = step_ms()
                except Exception as ex:  # a tile this shape cannot take (out of resources)
                    print(f"  {name} {cfg_}: {type(ex).__name__}", flush=True)
                    return
                results.append((ms, cfg_))
                trials.append({"pass": rnd, "projection": name, "config": cfg_, "step_ms": ms})

            for cfg_ in candidates():
                trial(cfg_)
            best = min(results)
            for stages in (2, 3):  # the winning tile with the loads pipelined deeper
                trial(best[1][:3] + [stages])
            best = min(results)
            table[key] = best[1]
            print(f"pass {rnd} {name}: best {best[1]} step {best[0] * 1e3:.1f} us "
                  f"({len(results)} configs, {time.perf_counter() - t0:.0f} s)", flush=True)
    tuned_ms = step_ms()
    winners = {name: table[key] for name, key in keys.items()}
    print(f"step: autotuned {autotuned_ms * 1e3:.1f} us -> tuned {tuned_ms * 1e3:.1f} us "
          f"(floor {floor_ms * 1e3:.1f} us): {winners}")
    if args.table:
        path = Path(args.table)
        src = path if path.exists() else G.TUNED_FILE
        data = json.loads(src.read_text()) if src.exists() else {}
        data["source"] = "bench/tune_gemv.py: the captured bench-285m decode step (L = 8, context 128)"
        data.setdefault("gpus", {})[gpu] = {key: table[key] for key in keys.values()}
        path.write_text(json.dumps(data, indent=1) + "\n")
    write("gemv-tune-cuda", {"hardware": hardware(dev), "ceilings": c, "loops": L, "context": T,
                             "floor_ms": floor_ms, "autotuned_ms": autotuned_ms, "tuned_ms": tuned_ms,
                             "winners": winners, "keys": keys, "trials": trials}, args.out_dir)
    m.close()


if __name__ == "__main__":
    main()
