"""Tile sweep of the batch-invariant projection (kernels/gemv.py ``invariant=True``: the tl.dot
kernel over 16-row tiles, one fixed tile per shape for every M) on a model's projections.

    source bench/gpu_env.sh && python -m bench.invariant_tiles --out-dir $OUT

For each projection of bench-285m (weights read from HBM: each call cycles through copies of
the weight that overflow the L2) and of the embedded default model (its weights stay in L2:
timed hot), and each candidate tile: microseconds of one call at every M of --rows, whether
every row equals the M = 1 call of that row (it must, for every tile), and beside them the
decode step's own M = 1 launch (today's tuned GEMV tile) and cuBLAS. The tile kept for a shape
is the fastest at M = 1 among those within --slack of the fastest at the largest M (the batch-1
step is the goal that binds; the batched rows must not fall far behind); the JSON holds the
INVARIANT_TILES entries to paste (`entries`).
"""
from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F

from bench.common import hardware, write
from bench.decode import ceilings, device_ms
from bench.gemv import SHAPES as GEMV_SHAPES

gemv_mod = importlib.import_module("tinyloop.kernels.gemv")  # (the package exports the function gemv)

# (name, N, K, fusion): bench-285m's layer and head as bench/gemv.py fuses them, then the
# embedded default model's (d 320, 5 heads of 64, one K/V head, SwiGLU 704, 256 bytes)
BENCH = [s for s in GEMV_SHAPES if s[0] != "ouro_head"]
DEFAULT = [("d_wqkv", 448, 320, "norm"), ("d_wo", 320, 320, "residual"), ("d_w13", 1408, 320, "norm+swiglu"),
           ("d_w2", 320, 704, "residual"), ("d_head", 256, 320, "norm")]

# (BLOCK_N, BLOCK_K, num_warps, num_stages)
CANDIDATES = [(8, 256, 4, 4), (8, 512, 4, 3), (8, 512, 4, 4), (8, 1024, 4, 2), (16, 128, 4, 6),
              (16, 256, 4, 4), (16, 256, 4, 6), (16, 512, 4, 3), (16, 512, 4, 4), (16, 512, 8, 4),
              (32, 128, 4, 6), (32, 256, 4, 4), (32, 256, 8, 4), (32, 512, 8, 3), (64, 128, 4, 5),
              (64, 256, 8, 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--rows", default="1,5,8,64", help="row counts M, comma-separated")
    ap.add_argument("--calls", type=int, default=16, help="back-to-back calls per graph")
    ap.add_argument("--repeat", type=int, default=10, help="graph replays timed per measurement")
    ap.add_argument("--slack", type=float, default=0.15,
                    help="a kept tile is within this fraction of the best time at the largest M")
    ap.add_argument("--shapes", default="bench,default", help="bench (bench-285m), default, or both")
    args = ap.parse_args()
    ms = sorted({int(m) for m in args.rows.split(",") if m})
    if not ms or ms[0] != 1:
        ap.error(f"--rows: M = 1 and larger row counts, got {ms}")
    dev = torch.device("cuda")
    c = ceilings(dev)
    pdl = gemv_mod.use_pdl(dev)
    shapes = [*(BENCH if "bench" in args.shapes else []), *(DEFAULT if "default" in args.shapes else [])]

    def cuda_ms(fn, ws):
        for w in ws[:2]:
            fn(w)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(args.calls):
                fn(ws[i % len(ws)])
        return device_ms(g.replay, dev, repeat=args.repeat) / args.calls

    results, entries = [], {}
    for name, N, K, fusion in shapes:
        torch.manual_seed(0)
        cold = not name.startswith("d_")
        copies = max(2, -(-300_000_000 // (N * K * 2))) if cold else 1
        ws = [(torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16) for _ in range(copies)]
        swiglu = "swiglu" in fusion
        out_n = N // 2 if swiglu else N
        nw = (1 + 0.1 * torch.randn(K, device=dev)).to(torch.bfloat16)
        flags = dict(NORM="norm" in fusion, SWIGLU=swiglu, RESIDUAL="residual" in fusion, EVICT="")
        xs = {M: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for M in ms}
        res = {M: torch.randn(M, out_n, device=dev, dtype=torch.bfloat16) for M in ms}

        def kw(M):
            k = {"swiglu": swiglu}
            if flags["NORM"]:
                k["norm_weight"] = nw
            if flags["RESIDUAL"]:
                k["residual"] = res[M]
            return k

        def inv(M, w, t):
            y = torch.empty(M, out_n, device=dev, dtype=torch.bfloat16)
            return gemv_mod._gemv_invariant(xs[M], w, nw if flags["NORM"] else None,
                                            res[M] if flags["RESIDUAL"] else None, y, None, M, out_n, K,
                                            1e-6, pdl, flags, tile=t)

        base = {"today_M1_ms": cuda_ms(lambda w: gemv_mod.gemv(xs[1], w, **kw(1)), ws),
                "today_tile": gemv_mod.tile(dev, out_n, K, flags["NORM"], swiglu, flags["RESIDUAL"], pdl),
                "cublas_ms": {M: cuda_ms(lambda w: F.linear(xs[M], w), ws) for M in ms}}
        print(f"{name}: today's M = 1 GEMV {base['today_M1_ms'] * 1e3:.1f} us; cuBLAS "
              + " ".join(f"M={M} {t * 1e3:.1f}" for M, t in base["cublas_ms"].items()))
        rows = []
        for t in CANDIDATES:
            bn, bk, warps, stages = t
            smem = bn * bk * 2 * stages * (2 if swiglu else 1) + 16 * bk * 2 * stages
            if smem > 200_000:
                continue
            try:
                times = {M: cuda_ms(lambda w: inv(M, w, t), ws) for M in ms}
            except Exception as e:  # a tile that does not compile or fit: recorded, not kept
                rows.append({"tile": t, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"  {t}: {type(e).__name__}")
                continue
            big = inv(ms[-1], ws[0], t)
            bitwise = all(torch.equal(big[m:m + 1], _one(inv, xs, ms[-1], m, ws[0], t, res))
                          for m in sorted({0, 1, min(5, ms[-1] - 1), ms[-1] - 1}))
            rows.append({"tile": t, "ms": times, "bitwise": bitwise})
            print(f"  {t}: " + " ".join(f"M={M} {v * 1e3:6.1f}" for M, v in times.items()) + f" us  bitwise {bitwise}")
        ok = [r for r in rows if "ms" in r and r["bitwise"]]
        kept = None
        if ok:
            best_big = min(r["ms"][ms[-1]] for r in ok)
            near = [r for r in ok if r["ms"][ms[-1]] <= best_big * (1 + args.slack)]
            kept = min(near, key=lambda r: r["ms"][ms[0]])
            key = (out_n, K, flags["NORM"], swiglu, flags["RESIDUAL"], pdl)
            entries[str(key)] = kept["tile"]
            print(f"  kept {kept['tile']}: M=1 {kept['ms'][ms[0]] * 1e3:.1f} us against today's "
                  f"{base['today_M1_ms'] * 1e3:.1f}")
        results.append({"name": name, "N": N, "K": K, "fusion": fusion, "weight_MB": N * K * 2 / 1e6,
                        "hbm": cold, **base, "candidates": rows, "kept": kept})
        del ws
    write("invariant-tiles-cuda", {"hardware": hardware(dev), "ceilings": c, "pdl": pdl, "rows_M": ms,
                                   "shapes": results, "entries": entries}, args.out_dir)
    if any(not r["bitwise"] for s in results for r in s["candidates"] if "ms" in r):
        raise SystemExit("a tile's rows differ from their M = 1 calls (see bitwise)")


def _one(inv, xs, M, m, w, t, res):
    """The M = 1 invariant call on row m of xs[M] (its residual row too)."""
    x1, saved = xs[1], res[1]
    xs[1], res[1] = xs[M][m:m + 1].clone(), res[M][m:m + 1].clone()
    try:
        return inv(1, w, t)
    finally:
        xs[1], res[1] = x1, saved


if __name__ == "__main__":
    main()
