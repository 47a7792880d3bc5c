"""Pick the batch-1 GEMV's tile per projection in the decode step's chain, not alone.

    source bench/gpu_env.sh && python -m bench.tune_gemv --out-dir $OUT [--table kernels/gemv_tuned.json]

The autotuner (kernels/gemv.py) times each projection back to back with itself. In a decode
step each one starts (programmatic dependent launch) while a different one drains, and the
small ones (wo, w2: 8 and 23 MB) lose a third of their time to ramp-up and tail, so the
isolated pick is not the step's best. This times one CUDA graph of a bench-285m step's
projections -- two prelude layers and the shared block eight times (L = 8), each layer
wqkv (norm) -> wo (+ residual) -> w13 (norm, SwiGLU) -> w2 (+ residual), then the head --
with the attention left out, and descends one projection at a time over a grid of tiles
(BLOCK_N x BLOCK_K x warps, then the winner's num_stages), keeping the others fixed.

The JSON holds the chain's floor (its weight bytes at the copy rate), the chain with the
autotuner's picks, every candidate's time, and the chain with the winners; --table stores the
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
from bench.decode import ceilings, device_ms
import tinyloop.kernels.gemv  # noqa: F401  (the module: the package exports the function under its name)
G = sys.modules["tinyloop.kernels.gemv"]

D, F, HEADS_DIM, VOCAB = 2048, 5632, 6144, 32000  # bench-285m: d_model, d_ff, q|k|v rows, vocab
PROJECTIONS = {  # name: (N, K, flags) as gemv() sees them
    "wqkv": (HEADS_DIM, D, dict(NORM=True, SWIGLU=False, RESIDUAL=False)),
    "wo": (D, D, dict(NORM=False, SWIGLU=False, RESIDUAL=True)),
    "w13": (F, D, dict(NORM=True, SWIGLU=True, RESIDUAL=False)),
    "w2": (D, F, dict(NORM=False, SWIGLU=False, RESIDUAL=True)),
}


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
    ap.add_argument("--passes", type=int, default=1, help="rounds of the descent over the projections")
    ap.add_argument("--table", default=None,
                    help="store the winners for this GPU in this table file (kernels/gemv_tuned.json: gemv uses them)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    c = ceilings(dev)
    torch.manual_seed(0)
    bf16 = dict(device=dev, dtype=torch.bfloat16)

    def layer():
        return {"wqkv": torch.randn(HEADS_DIM, D, **bf16) / D ** 0.5, "wo": torch.randn(D, D, **bf16) / D ** 0.5,
                "w13": torch.randn(2 * F, D, **bf16) / D ** 0.5, "w2": torch.randn(D, F, **bf16) / F ** 0.5,
                "n1": torch.ones(D, **bf16), "n2": torch.ones(D, **bf16)}

    prelude, block = [layer(), layer()], layer()
    layers = prelude + [block] * args.loops
    head, norm = torch.randn(VOCAB, D, **bf16) / D ** 0.5, torch.ones(D, **bf16)
    x0 = torch.randn(1, 1, D, **bf16)
    chain_bytes = sum(w.numel() * 2 for lw in layers for k, w in lw.items() if k[0] == "w") + head.numel() * 2
    floor_ms = chain_bytes / (c["copy_GBps"] * 1e6)

    def chain():
        x = x0
        for lw in layers:
            qkv = G.gemv(x, lw["wqkv"], norm_weight=lw["n1"])
            h = G.gemv(qkv[..., :D], lw["wo"], residual=x)  # stands in for the attention output
            f = G.gemv(h, lw["w13"], norm_weight=lw["n2"], swiglu=True)
            x = G.gemv(f, lw["w2"], residual=h)
        return G.gemv(x, head, norm_weight=norm)

    def chain_ms() -> float:
        chain()  # compile (and autotune) outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        ms = device_ms(g.replay, dev, repeat=50, warmup=10)
        del g
        return ms

    table = G.tuned_table(torch.cuda.get_device_name(dev))
    table.clear()  # start from the autotuner's picks
    pdl = G.use_pdl(dev)
    keys = {name: G.tuned_key(N, K, flags, pdl) for name, (N, K, flags) in PROJECTIONS.items()}
    t0 = time.perf_counter()
    autotuned_ms = chain_ms()
    print(f"chain floor {floor_ms * 1e3:.1f} us, autotuned {autotuned_ms * 1e3:.1f} us", flush=True)
    trials = []
    best_ms = autotuned_ms
    for rnd in range(args.passes):
        for name, key in keys.items():
            grid = candidates()
            results = []
            for i, cfg in enumerate(grid):
                table[key] = cfg
                try:
                    ms = chain_ms()
                except Exception as e:  # a tile this shape cannot take (out of resources)
                    print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
                    continue
                results.append((ms, cfg))
                trials.append({"pass": rnd, "projection": name, "config": cfg, "chain_ms": ms})
            best = min(results)
            for stages in (2, 3):  # the winning tile with the loads pipelined deeper
                cfg = best[1][:3] + [stages]
                table[key] = cfg
                ms = chain_ms()
                results.append((ms, cfg))
                trials.append({"pass": rnd, "projection": name, "config": cfg, "chain_ms": ms})
            best = min(results)
            table[key] = best[1]
            best_ms = best[0]
            print(f"pass {rnd} {name}: best {best[1]} chain {best[0] * 1e3:.1f} us "
                  f"({len(results)} configs, {time.perf_counter() - t0:.0f} s)", flush=True)
    final_ms = chain_ms()
    winners = {name: table[key] for name, key in keys.items()}
    print(f"chain: autotuned {autotuned_ms * 1e3:.1f} us -> tuned {final_ms * 1e3:.1f} us "
          f"(floor {floor_ms * 1e3:.1f} us): {winners}")
    gpu = torch.cuda.get_device_name(dev)
    if args.table:
        path = Path(args.table)
        data = json.loads((path if path.exists() else G.TUNED_FILE).read_text()) if (
            path.exists() or G.TUNED_FILE.exists()) else {}
        data.setdefault("source", "bench/tune_gemv.py: the decode step's chain of projections, bench-285m shapes")
        data.setdefault("gpus", {})[gpu] = {key: table[key] for key in keys.values()}
        path.write_text(json.dumps(data, indent=1) + "\n")
    write("gemv-tune-cuda", {"hardware": hardware(dev), "ceilings": c, "loops": args.loops,
                             "chain_MB": chain_bytes / 1e6, "floor_ms": floor_ms,
                             "autotuned_ms": autotuned_ms, "tuned_ms": final_ms, "last_descent_ms": best_ms,
                             "winners": winners, "keys": keys, "trials": trials}, args.out_dir)


if __name__ == "__main__":
    main()
