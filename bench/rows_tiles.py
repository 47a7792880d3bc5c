"""The M = 2..64 projection kernel's tiles on the GPU: a sweep of kernels/gemv.py's batched kernel
per projection of bench-285m (its fusion on), against cuBLAS and the unfused ops it replaces.

    source bench/gpu_env.sh && python -m bench.rows_tiles --out-dir $OUT     # -> rows-tiles-cuda.json

Per projection and M (--rows): torch.nn.functional.linear alone ("cublas"), the unfused ops of a
batched step without the fused projections ("unfused": kernels.rms_norm, F.linear, SiLU·up, the
residual add), gemv as a model built with Settings.from_env() launches it ("table": its pdl, and
its gemv_tiles' entry, else ROWS_TILES', else the default tile of M's BLOCK_M), and
each tile of TILES launched plain; the three best plain tiles also with PDL ("wait": the wait first;
"prefetch": the first weight tile loaded before it). Weights are read from HBM (calls cycle
through copies that overflow the L2), back to back in one captured graph, as in a decode step.
µs per call; ROWS_TILES takes each shape's best (tile, mode) from here."""
from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F
import triton
from tqdm import tqdm

from bench.common import gemv_tuning, hardware, write
from bench.decode import ceilings, graph_ms
from tinyloop.kernels.gemv import gemv
from tinyloop.kernels.rmsnorm import rms_norm
from tinyloop.worker.model.settings import Settings

gemv_mod = importlib.import_module("tinyloop.kernels.gemv")  # (the package exports the function gemv)

# (name, N, K, fusion): bench-285m's projections as a batched decode step runs them
SHAPES = [("wqkv", 6144, 2048, "norm"), ("wo", 2048, 2048, "residual"), ("w13", 11264, 2048, "norm+swiglu"),
          ("w2", 2048, 5632, "residual"), ("head", 32000, 2048, "norm")]
TILES = [(16, 128, 4, 4), (16, 256, 4, 4), (16, 256, 4, 6), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4),
         (32, 128, 4, 6), (32, 256, 8, 4), (64, 64, 4, 6), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3),
         (64, 128, 8, 4), (128, 64, 4, 6), (128, 128, 4, 4), (128, 128, 8, 4)]
MODES = {"plain": (False, False), "wait": (False, True), "prefetch": (True, True)}
TOLERANCE = 0.25  # max abs error against the unfused ops' bf16 result (outputs of order 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--rows", default="4,16,32,64", help="row counts M (2..64), comma-separated")
    args = ap.parse_args()
    Ms = [int(m) for m in args.rows.split(",")]
    if any(not 2 <= m <= gemv_mod.MAX_FUSED_ROWS for m in Ms):
        ap.error(f"--rows: each M must be in 2..{gemv_mod.MAX_FUSED_ROWS}, got {Ms}")
    dev = torch.device("cuda")
    c = ceilings(dev)
    settings = Settings.from_env()
    tuning = gemv_tuning(settings)  # the model's tiles (its tables, autotune) and its pdl
    model_launch = dict(tuning, pdl=settings.launch_pdl)
    out = {"hardware": hardware(dev), "ceilings": c, "tolerance": TOLERANCE, "shapes": {}}

    def cuda_us(fn, ws, calls=24):
        for w in ws:
            fn(w)  # compile outside the capture
        return graph_ms(lambda i: fn(ws[i % len(ws)]), calls, dev) * 1e3

    bar = tqdm(total=len(SHAPES) * len(Ms), desc="rows tiles")
    for name, N, K, fusion in SHAPES:
        torch.manual_seed(0)
        ws = [(torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
              for _ in range(max(2, -(-400_000_000 // (N * K * 2))))]
        n = N // 2 if "swiglu" in fusion else N
        flags = dict(NORM="norm" in fusion, SWIGLU="swiglu" in fusion, RESIDUAL="residual" in fusion)
        shape = {"N": N, "K": K, "fusion": fusion, "floor_us": N * K * 2 / (c["copy_GBps"] * 1e3), "M": {}}
        nw = (1 + 0.1 * torch.randn(K, device=dev)).to(torch.bfloat16)
        for M in Ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            resid = torch.randn(M, n, device=dev, dtype=torch.bfloat16)
            kw = dict(model_launch, **({"norm_weight": nw} if flags["NORM"] else {}))
            if flags["SWIGLU"]:
                kw["swiglu"] = True
            if flags["RESIDUAL"]:
                kw["residual"] = resid

            def unfused(w):
                h = rms_norm(x, nw, 1e-6) if flags["NORM"] else x
                y = F.linear(h, w)
                if flags["SWIGLU"]:
                    gate, up = y.chunk(2, -1)
                    y = F.silu(gate) * up
                return resid + y if flags["RESIDUAL"] else y
            ref = unfused(ws[0]).float()
            bm = gemv_mod.rows_block(M)
            table_tile = gemv_mod.rows_tile(dev, n, K, *flags.values(), bm, **tuning)
            row = {"block_m": bm, "table_tile": list(table_tile or []),
                   "cublas_us": cuda_us(lambda w: F.linear(x, w), ws), "unfused_us": cuda_us(unfused, ws),
                   "table_us": cuda_us(lambda w: gemv(x, w, **kw), ws)}
            row["table_err"] = (gemv(x, ws[0], **kw).float() - ref).abs().max().item()
            y = torch.empty(M, n, device=dev, dtype=torch.bfloat16)

            def launch(w, t, mode):
                prefetch, pdl = MODES[mode]
                bn, bk, warps, stages = t
                gemv_mod._gemv_rows_kernel[(triton.cdiv(n, bn),)](
                    x, w, nw, resid, y, M, n, K, w.stride(0), 1e-6, 16, **flags, EVICT="", DOT_F32=False,
                    BLOCK_M=bm, PREFETCH=prefetch, PDL=pdl, BLOCK_N=bn, BLOCK_K=bk,
                    num_warps=warps, num_stages=stages, launch_pdl=pdl)

            def trial(t, mode):
                try:
                    launch(ws[0], t, mode)
                    err = (y.float() - ref).abs().max().item()
                    return {"tile": list(t), "mode": mode, "us": cuda_us(lambda w: launch(w, t, mode), ws), "err": err}
                except Exception as e:  # noqa: BLE001 -- a tile that does not compile (shared memory) is recorded
                    return {"tile": list(t), "mode": mode, "error": repr(e)[:200]}
            trials = [trial(t, "plain") for t in TILES]
            good = sorted((r for r in trials if r.get("err", 1e9) < TOLERANCE), key=lambda r: r["us"])
            trials += [trial(tuple(r["tile"]), mode) for r in good[:3] for mode in ("wait", "prefetch")]
            ok = sorted((r for r in trials if r.get("err", 1e9) < TOLERANCE), key=lambda r: r["us"])
            row["trials"], row["best"] = trials, ok[0] if ok else None
            shape["M"][str(M)] = row
            b = row["best"]
            tqdm.write(f"{name} M={M:2d}: cublas {row['cublas_us']:.1f} us, unfused {row['unfused_us']:.1f}, "
                       f"table {row['table_us']:.1f} {row['table_tile']}, best {b['us']:.1f} {b['tile']} {b['mode']}"
                       if b else f"{name} M={M}: no tile within tolerance")
            bar.update()
        out["shapes"][name] = shape
        write("rows-tiles-cuda", out, args.out_dir)


if __name__ == "__main__":
    main()
