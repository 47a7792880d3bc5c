"""Which of the looped block's weights to keep in L2 between iterations: batch-1 decode step
time (the captured graph, fed its own tokens) for each set of kept projections, every other
projection streamed (evict-first), against no hints at all, in interleaved rounds.

    source bench/gpu_env.sh && python -m bench.l2_keep --out-dir $OUT

A looped model reads its shared block once per iteration: weights that survive in L2 from one
iteration to the next are read from HBM once per token instead of L times. The H200's L2
(60 MB) holds part of bench-285m's 103 MB block, not all of it. Evict-last lines stay only in
the context's L2 set-aside (kernels/l2.py): each --set-aside size (MB; -1: the device's
maximum, 0: none, the default state) runs every variant.

    python -m bench.l2_keep --set-aside 0 -1 --loops 8"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import hardware, write
from bench.decode import bytes_per_token, ceilings, decode_rate, random_checkpoint
from tinyloop.kernels import l2
from tinyloop.worker import Model
from tinyloop.worker.config import PRESETS

VARIANTS = {
    "no hints": None,
    "stream all": (),
    "wo": ("wo",),
    "wqkv": ("wqkv",),
    "w2": ("w2",),
    "wqkv+wo": ("wqkv", "wo"),
    "w2+wo": ("w2", "wo"),
    "wqkv+w2": ("wqkv", "w2"),
    "w13": ("w13",),
    "wqkv+wo+w2": ("wqkv", "wo", "w2"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loops", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set-aside", type=float, nargs="+", default=[-1.0])
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    c = ceilings(dev)
    cfg = PRESETS["bench-285m"]
    m = Model(random_checkpoint("bench-285m", cfg), max_seq_len=4096, device="cuda", dtype="bfloat16",
              cuda_graphs=False)
    m.capture_graphs([max(args.loops)], lanes=[0])  # the engine's graphs; decode_rate captures each depth
    net = m._module
    block = net.loop[0].projections()
    sizes = {n: w.nbytes for n, w in block.items()}
    l2_bytes = torch.cuda.get_device_properties(dev).L2_cache_size
    print(f"L2 {l2_bytes / 1e6:.1f} MB; block projections (MB): "
          + ", ".join(f"{n} {b / 1e6:.1f}" for n, b in sizes.items()))
    max_aside = l2.max_set_aside(dev)
    print(f"max L2 set-aside {max_aside / 1e6:.1f} MB")
    asides = [max_aside if a < 0 else int(a * 1e6) for a in args.set_aside]
    rows = {(a, name, L): [] for a in asides for name in VARIANTS for L in args.loops}
    granted = {}
    t0 = time.time()
    for r in range(args.rounds):
        for a in asides:
            granted[a] = l2.set_aside(dev, a)
            for name, keep in VARIANTS.items():
                net.keep_in_l2(keep)
                for L in args.loops:
                    rows[a, name, L].append(decode_rate(m, L, args.context, 64))
                print(f"[round {r + 1}/{args.rounds}, {time.time() - t0:.0f}s] set-aside {granted[a] / 1e6:5.1f} MB "
                      f"{name:12s} " + "  ".join(f"L{L} {rows[a, name, L][-1]:.3f}" for L in args.loops), flush=True)
    net.keep_in_l2(None)
    l2.set_aside(dev, 0)
    results = []
    for (a, name, L), ms in rows.items():
        keep = VARIANTS[name]
        floor = bytes_per_token(cfg, L, args.context)["total"] / (c["copy_GBps"] * 1e6)
        results.append({"set_aside_bytes": granted[a], "variant": name, "keep": None if keep is None else list(keep),
                        "loops": L, "kept_MB": sum(sizes[n] for n in keep or ()) / 1e6, "ms_per_token": min(ms),
                        "ms_rounds": ms, "floor_ms": floor, "x_floor": min(ms) / floor})
    base = {L: min(rows[asides[0], "no hints", L]) for L in args.loops}
    for a in asides:
        for L in args.loops:
            print(f"set-aside {granted[a] / 1e6:.1f} MB, L={L} vs no hints at {granted[asides[0]] / 1e6:.1f} MB: "
                  + ", ".join(f"{n} {min(rows[a, n, L]) / base[L] - 1:+.1%}" for n in VARIANTS))
    write("l2-keep-cuda", {"command": "python -m bench.l2_keep " + " ".join(sys.argv[1:]), "hardware": hardware(dev), "ceilings": c,
                           "L2_bytes": l2_bytes, "max_set_aside_bytes": max_aside, "block_projection_bytes": sizes, "context": args.context,
                           "results": results}, args.out_dir)


if __name__ == "__main__":
    main()
