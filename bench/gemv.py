"""Batch-1 projections of the decode step: the fused Triton GEMV against torch (cuBLAS) and the
copy bandwidth, per weight shape of bench-285m (and the Ouro-1.4B head); and the same
projections for M = 4, 8, 16 rows (a batched decode step's lanes) on gemv's batched kernel.

    source bench/gpu_env.sh && python -m bench.gemv --out-dir $OUT

A decode step is these projections plus a few small kernels, so this is where its distance to
the bandwidth floor is decided. Each row: weight MB, ms and GB/s of the weight read for
torch.nn.functional.linear and for kernels/gemv.py with each fusion the layer uses there.
Back-to-back calls in one graph, as in a decode step; the +pdl column
launches each call with programmatic dependent launch (the `pdl` the engine passes with
Settings.pdl on), so a call's weight loads overlap the previous call's tail.

"batched_rows" (beside "rows", whose fields are unchanged): per projection and M, the same
weight read by F.linear on the (M, 1, K) input, by the model's unfused ops for that fusion
(kernels.rms_norm before F.linear, F.silu(gate) * up after it, + residual), and by gemv's
M-row kernel plain, fused, and fused with PDL; GB/s count the weight read alone (x and y are
a few KB). The calls take their tiles as a model built with Settings.from_env() does (its
gemv_tiles before the code's tables, its autotune: TINYLOOP_GEMV_TILES, TINYLOOP_AUTOTUNE).
"tiles" holds the tile of each call; with autotune on, "autotuned" and "autotuned_batched" hold
the autotuners' picks per key."""
from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F

from bench.common import gemv_tuning, hardware, write
from bench.decode import ceilings, graph_ms
from tinyloop.kernels.gemv import gemv
from tinyloop.kernels.rmsnorm import rms_norm

gemv_mod = importlib.import_module("tinyloop.kernels.gemv")  # (the package exports the function gemv)

# (name, N, K, fusion): the projections of one bench-285m layer, its head, the Ouro-1.4B head
SHAPES = [
    ("wqkv", 6144, 2048, "norm"),
    ("wo", 2048, 2048, "residual"),
    ("w13", 11264, 2048, "norm+swiglu"),
    ("w2", 2048, 5632, "residual"),
    ("head", 32000, 2048, "norm"),
    ("ouro_head", 49152, 2048, "norm"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--rows", default="4,8,16",
                    help="row counts M (2..16) timed on the batched kernel, comma-separated; '' for none")
    args = ap.parse_args()
    ms = [int(m) for m in args.rows.split(",") if m]
    if any(not 2 <= m <= 16 for m in ms):
        ap.error(f"--rows: each M must be in 2..16, got {ms}")
    dev = torch.device("cuda")
    c = ceilings(dev)
    tuning = gemv_tuning()  # the tables and autotune a model built from the environment passes

    def cuda_ms(fn, ws, repeat, calls=24):
        """GPU time of one call: a graph of `calls` back-to-back calls, replayed (a single
        launch would time the host's launch cost instead), cycling through copies of the
        weight that together overflow the L2, so every call reads its weight from HBM."""
        for w in ws:
            fn(w)  # compile / autotune outside the capture
        return graph_ms(lambda i: fn(ws[i % len(ws)]), calls, dev, repeat)

    def weights(N, K):
        torch.manual_seed(0)
        return [(torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
                for _ in range(max(2, -(-400_000_000 // (N * K * 2))))]  # >= 400 MB: 8x the L2

    def time_rows(name, N, K, fusion, M, ws):
        """One projection at M rows: F.linear, the unfused ops, gemv's batched kernel."""
        x = torch.randn(M, 1, K, device=dev, dtype=torch.bfloat16)
        out_n = N // 2 if "swiglu" in fusion else N
        mb = N * K * 2 / 1e6
        floor_ms = mb / (c["copy_GBps"] * 1e-3) / 1e3
        nw = torch.ones(K, device=dev, dtype=torch.bfloat16)
        kw = {}
        if "norm" in fusion:
            kw["norm_weight"] = nw
        if "swiglu" in fusion:
            kw["swiglu"] = True
        if "residual" in fusion:
            kw["residual"] = torch.randn(M, 1, out_n, device=dev, dtype=torch.bfloat16)

        def unfused(w):
            h = rms_norm(x, nw, 1e-6) if "norm" in fusion else x
            y = F.linear(h, w)
            if "swiglu" in fusion:
                gate, up = y.chunk(2, -1)
                y = F.silu(gate) * up
            return kw["residual"] + y if "residual" in fusion else y

        torch_ms = cuda_ms(lambda w: F.linear(x, w), ws, repeat=30)
        unfused_ms = cuda_ms(unfused, ws, repeat=30)
        plain_ms = cuda_ms(lambda w: gemv(x, w, pdl=False, **tuning), ws, repeat=30)
        fused_ms = cuda_ms(lambda w: gemv(x, w, pdl=False, **tuning, **kw), ws, repeat=30)
        try:
            pdl_ms, pdl_error = cuda_ms(lambda w: gemv(x, w, pdl=True, **tuning, **kw), ws, repeat=30), None
        except Exception as e:  # noqa: BLE001 -- recorded, not fatal
            pdl_ms, pdl_error = None, repr(e)
        best = min(t for t in (fused_ms, pdl_ms) if t is not None)
        print(f"  M={M:<2d} torch {torch_ms * 1e3:6.1f} us | unfused[{fusion}] {unfused_ms * 1e3:6.1f} us | "
              f"gemv {plain_ms * 1e3:6.1f} us | fused {fused_ms * 1e3:6.1f} us | +pdl "
              + (f"{pdl_ms * 1e3:6.1f} us" if pdl_ms else pdl_error)
              + f" | {best / floor_ms:4.2f}x floor, {unfused_ms / best:4.2f}x faster than unfused")
        return {"name": name, "N": N, "K": K, "M": M, "fusion": fusion, "weight_MB": mb, "floor_ms": floor_ms,
                "torch_linear_ms": torch_ms, "torch_unfused_ms": unfused_ms, "gemv_ms": plain_ms,
                "gemv_fused_ms": fused_ms, "gemv_fused_pdl_ms": pdl_ms, "pdl_error": pdl_error,
                "torch_GBps": mb / torch_ms, "torch_unfused_GBps": mb / unfused_ms, "gemv_GBps": mb / plain_ms,
                "gemv_fused_GBps": mb / fused_ms, "gemv_fused_pdl_GBps": mb / pdl_ms if pdl_ms else None}

    def save():
        payload = {"hardware": hardware(dev), "ceilings": c, "rows": rows, "tiles": {}}
        for name, N, K, fusion in SHAPES:  # the fixed tiles the calls ran (or null: autotuned)
            n, flags = (N // 2 if "swiglu" in fusion else N), [f in fusion for f in ("norm", "swiglu", "residual")]
            for pdl in (False, True):
                payload["tiles"][f"{name} pdl={pdl}"] = gemv_mod.tile(dev, n, K, *flags, pdl, **tuning)
            if ms:  # one tile for every M = 2..16 (its PDL mode in it)
                payload["tiles"][f"{name} M=2..16"] = gemv_mod.rows_tile(dev, n, K, *flags, **tuning)
        if tuning["autotune"]:
            payload["autotuned"] = {str(k): str(v) for k, v in gemv_mod._gemv_tuned.cache.items()}
            payload["autotuned_batched"] = {str(k): str(v) for k, v in gemv_mod._gemv_rows_tuned.cache.items()}
        if ms:
            payload["batched_rows"] = batched_rows
        write("gemv-cuda", payload, args.out_dir)

    rows, batched_rows = [], []
    for name, N, K, fusion in SHAPES:
        ws = weights(N, K)
        x = torch.randn(1, 1, K, device=dev, dtype=torch.bfloat16)
        out_n = N // 2 if "swiglu" in fusion else N
        kw = {}
        if "norm" in fusion:
            kw["norm_weight"] = torch.ones(K, device=dev, dtype=torch.bfloat16)
        if "swiglu" in fusion:
            kw["swiglu"] = True
        if "residual" in fusion:
            kw["residual"] = torch.randn(1, 1, out_n, device=dev, dtype=torch.bfloat16)
        mb = N * K * 2 / 1e6
        torch_ms = cuda_ms(lambda w: F.linear(x, w), ws, repeat=30)
        plain_ms = cuda_ms(lambda w: gemv(x, w, pdl=False, **tuning), ws, repeat=30)
        fused_ms = cuda_ms(lambda w: gemv(x, w, pdl=False, **tuning, **kw), ws, repeat=30)
        try:
            pdl_ms = cuda_ms(lambda w: gemv(x, w, pdl=True, **tuning, **kw), ws, repeat=30)
        except Exception as e:  # noqa: BLE001 -- recorded, not fatal: PDL is opt-in
            pdl_ms, pdl_error = None, repr(e)
        else:
            pdl_error = None
        floor_ms = mb / (c["copy_GBps"] * 1e-3) / 1e3
        rows.append({"name": name, "N": N, "K": K, "fusion": fusion, "weight_MB": mb, "floor_ms": floor_ms,
                     "torch_linear_ms": torch_ms, "gemv_ms": plain_ms, "gemv_fused_ms": fused_ms,
                     "gemv_fused_pdl_ms": pdl_ms, "pdl_error": pdl_error,
                     "torch_GBps": mb / torch_ms, "gemv_GBps": mb / plain_ms, "gemv_fused_GBps": mb / fused_ms})
        print(f"{name:10s} {N:6d}x{K:<5d} {mb:6.1f} MB  floor {floor_ms * 1e3:6.1f} us | torch {torch_ms * 1e3:6.1f} us "
              f"({mb / torch_ms:5.0f} GB/s) | gemv {plain_ms * 1e3:6.1f} us ({mb / plain_ms:5.0f} GB/s) | "
              f"fused[{fusion}] {fused_ms * 1e3:6.1f} us | +pdl " + (f"{pdl_ms * 1e3:6.1f} us" if pdl_ms else pdl_error))
        del ws
    save()  # the batch-1 rows first: the batched pass below autotunes afresh and may run long
    for name, N, K, fusion in SHAPES if ms else []:
        print(f"{name:10s} {N:6d}x{K:<5d} batched")
        ws = weights(N, K)
        for M in ms:
            batched_rows.append(time_rows(name, N, K, fusion, M, ws))
        del ws
        save()


if __name__ == "__main__":
    main()
