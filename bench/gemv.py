"""Batch-1 projections of the decode step: the fused Triton GEMV against torch (cuBLAS) and the
copy bandwidth, per weight shape of bench-285m (and the Ouro-1.4B head).

    source bench/gpu_env.sh && python -m bench.gemv --out-dir $OUT

A decode step is these projections plus a few small kernels, so this is where its distance to
the bandwidth floor is decided. Each row: weight MB, ms and GB/s of the weight read for
torch.nn.functional.linear and for kernels/gemv.py with each fusion the layer uses there, plus
the autotuned config. Back-to-back calls in one graph, as in a decode step; the +pdl column
launches each call with programmatic dependent launch (TINYLOOP_PDL), so a call's weight
loads overlap the previous call's tail."""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import hardware, write
from bench.decode import ceilings, device_ms
from tinyloop.kernels.gemv import _gemv_tuned, gemv

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
    args = ap.parse_args()
    dev = torch.device("cuda")
    c = ceilings(dev)

    def cuda_ms(fn, ws, repeat, calls=24):
        """GPU time of one call: a graph of `calls` back-to-back calls, replayed (a single
        launch would time the host's launch cost instead), cycling through copies of the
        weight that together overflow the L2, so every call reads its weight from HBM."""
        for w in ws:
            fn(w)  # compile / autotune outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(ws[i % len(ws)])
        return device_ms(g.replay, dev, repeat=repeat) / calls

    rows = []
    for name, N, K, fusion in SHAPES:
        torch.manual_seed(0)
        ws = [(torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
              for _ in range(max(2, -(-400_000_000 // (N * K * 2))))]  # >= 400 MB: 8x the L2
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
        plain_ms = cuda_ms(lambda w: gemv(x, w, pdl=False), ws, repeat=30)
        fused_ms = cuda_ms(lambda w: gemv(x, w, pdl=False, **kw), ws, repeat=30)
        try:
            pdl_ms = cuda_ms(lambda w: gemv(x, w, pdl=True, **kw), ws, repeat=30)
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
    write("gemv-cuda", {"hardware": hardware(dev), "ceilings": c, "rows": rows,
                        "autotuned": {str(k): str(v) for k, v in _gemv_tuned.cache.items()}},
          args.out_dir)


if __name__ == "__main__":
    main()
