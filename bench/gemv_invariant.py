"""Batch-invariant projections (kernels/gemv.py, ``invariant=True``) against today's paths, per
row count M, on bench-285m's five projections and the embedded default model's, with the options
the decode step fuses there.

    source bench/gpu_env.sh && python -m bench.gemv_invariant --out-dir $OUT

invariant=True runs M rows through the M = 1 kernel, each program computing some of them in turn
on its row block, so each row is bit for bit its M = 1 call's; it does M times one row's FMAs on
the CUDA cores where the batched kernel (2 <= M <= 16) runs them on the tensor cores through
tl.dot. Per projection and M: microseconds of one call of the invariant gemv, of today's gemv
(the M = 1 kernel at M = 1, the batched kernel for 2..16, nothing past 16) and of
torch.nn.functional.linear (cuBLAS, the plain projection without the fused options, every M),
and the weight read's GB/s for each; "rows_bitwise" says whether every row of the invariant call
equals its M = 1 call (it must), "today_rows_bitwise" whether today's batched kernel's rows do
(they need not). Each time is a graph of back-to-back calls cycling through copies of the
weight: bench-285m's overflow the L2 (as bench/gemv.py times them), so every call reads its
weight from HBM; the default model's stay in it, as in its decode step. PDL and tiles as a model
built with Settings.from_env() launches them (pdl, gemv_tiles, autotune: TINYLOOP_PDL,
TINYLOOP_GEMV_TILES, TINYLOOP_AUTOTUNE; `tiles` in the JSON).

Variants of the invariant call (`variants` in each row, microseconds and whether its rows are
their M = 1 calls' bits): `rows=R` runs R rows of x per program (gemv's rows_per_program; the
default is `kernels.gemv.rows_per_program_of`'s). For a shape whose plain M = 1 tile loops over K
(bench-285m's q|k|v and gate|up), the invariant call takes a one-chunk tile instead
(`kernels.gemv.invariant_tile`; `tiles` in the JSON, the plain ones in `plain_tiles`): the
weights held in registers for all the rows of a program. `loop BNxBK` runs it on the plain
tile, reading the weights again for each row, and `one-chunk BN` on another one-chunk tile --
an M = 1 time is what that tile costs the invariant batch-1 step, an M > 1 time the batched one.
For a weight that stays in the L2 (the default model's), `tile BNxW` runs the invariant tile's
BLOCK_K on BLOCK_N = BN rows a program and W warps: such calls are bound by their latency and the
programs they launch, not by the weight read.
"""
from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F
import triton

from bench.common import gemv_tuning, hardware, write
from bench.decode import ceilings, graph_ms
from bench.gemv import SHAPES as GEMV_SHAPES
from tinyloop.kernels.gemv import MAX_ROWS, gemv
from tinyloop.worker.model.settings import Settings

gemv_mod = importlib.import_module("tinyloop.kernels.gemv")  # (the package exports the function gemv)

# (name, N, K, fusion): one bench-285m layer's projections and its head, as bench/gemv.py fuses
# them, and the embedded default model's (d 320, 5 heads of 64 and 1 kv head, SwiGLU 704, vocab
# 256: weights small enough to stay in the L2, where a call is bound by its latency)
SHAPES = [s for s in GEMV_SHAPES if s[0] != "ouro_head"] + [
    ("default.wqkv", 448, 320, "norm"), ("default.wo", 320, 320, "residual"),
    ("default.w13", 1408, 320, "norm+swiglu"), ("default.w2", 320, 704, "residual"),
    ("default.head", 256, 320, "norm")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--rows", default="1,2,4,5,8,16,32,64", help="row counts M, comma-separated")
    ap.add_argument("--calls", type=int, default=16, help="back-to-back calls per graph")
    ap.add_argument("--repeat", type=int, default=15, help="graph replays timed per measurement")
    ap.add_argument("--per", default="1,4,16,64", help="rows per program of the invariant variants, comma-separated")
    ap.add_argument("--one-chunk", default="2,4,8", help="BLOCK_N of the one-chunk tile variants, comma-separated "
                                                     "(shapes whose M = 1 tile loops over K)")
    ap.add_argument("--small-tiles", default="4x4,8x4,16x4,2x1,8x1",
                    help="BLOCK_NxNUM_WARPS of the tile variants of weights small enough to stay in the L2 "
                         "(the default model's), on the invariant tile's BLOCK_K, comma-separated")
    ap.add_argument("--shapes", default="", help="only the projections whose name starts with one of these "
                                                  "prefixes, comma-separated (default: all)")
    args = ap.parse_args()
    small_tiles = [tuple(int(v) for v in t.split("x")) for t in args.small_tiles.split(",") if t]
    if any(len(t) != 2 or min(t) < 1 for t in small_tiles):
        ap.error(f"--small-tiles takes BLOCK_NxNUM_WARPS pairs of positive integers, got {args.small_tiles!r}")
    prefixes = tuple(p for p in args.shapes.split(",") if p)
    pers = [int(p) for p in args.per.split(",") if p]
    one_chunk_bns = [int(b) for b in args.one_chunk.split(",") if b]
    if any(p < 1 for p in pers) or any(b < 1 for b in one_chunk_bns):
        ap.error(f"--per and --one-chunk take positive integers, got {pers} and {one_chunk_bns}")
    ms = [int(m) for m in args.rows.split(",") if m]
    if not ms or any(m < 1 for m in ms):
        ap.error(f"--rows: each M must be >= 1, got {ms}")
    dev = torch.device("cuda")
    c = ceilings(dev)
    settings = Settings.from_env()
    tuning = gemv_tuning(settings)
    pdl = gemv_mod.use_pdl(dev, settings.launch_pdl)  # as the model's projections launch

    def cuda_ms(fn, ws):
        """GPU ms of one call: a graph of args.calls back-to-back calls, replayed, cycling through
        the weight copies `ws` (bench-285m's together past the L2, so each call reads its weight from HBM)."""
        for w in ws[:2]:
            fn(w)  # compile outside the capture
        return graph_ms(lambda i: fn(ws[i % len(ws)]), args.calls, dev, args.repeat)

    results, tiles, plain_tiles = [], {}, {}
    header = (f"{'proj':5s} {'M':>3s} | {'invariant':>9s} {'today':>9s} {'F.linear':>9s} us | "
              f"{'inv/today':>9s} {'inv/linear':>10s} | inv GB/s | bitwise")
    print(header)
    for name, N, K, fusion in SHAPES:
        if prefixes and not name.startswith(prefixes):
            continue
        torch.manual_seed(0)
        # >= 300 MB of copies (5x the H200's L2), at least 2
        ws = [(torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
              for _ in range(min(args.calls, max(2, -(-300_000_000 // (N * K * 2)))))]
        mb = N * K * 2 / 1e6
        swiglu = "swiglu" in fusion
        out_n = N // 2 if swiglu else N
        nw = (1 + 0.1 * torch.randn(K, device=dev)).to(torch.bfloat16)
        key = (out_n, K, "norm" in fusion, swiglu, "residual" in fusion, pdl)
        tiles[name] = gemv_mod.tile(dev, *key, **tuning, invariant=True)
        plain_tiles[name] = plain = gemv_mod.tile(dev, *key, **tuning)
        tile_variants = {}  # label -> the tables of another tile for this shape's invariant call
        if plain is not None and plain[1] < K:
            tile_variants[f"loop {plain[0]}x{plain[1]}"] = ({key: plain}, {})  # the M = 1 call's tile
            for bn in one_chunk_bns:
                if tiles[name] is None or bn != tiles[name][0]:
                    tile_variants[f"one-chunk {bn}"] = ({key: (bn, triton.next_power_of_2(K), 4, 1)}, {})
        inv = tiles[name]
        if inv is not None and N * K * 2 < gemv_mod.SMALL_WEIGHT_BYTES:
            # a weight that stays in the L2: its calls are bound by latency and by the programs
            # they launch (every row of an M-row call takes programs of its own), so the row
            # block's height and the warps that reduce it are what the variants move
            for bn, warps in small_tiles:
                if (bn, warps) != (inv[0], inv[2]):
                    tile_variants[f"tile {bn}x{warps}"] = ({key: (bn, inv[1], warps, inv[3])}, {})
        for M in ms:
            x = torch.randn(M, 1, K, device=dev, dtype=torch.bfloat16)
            kw = {"swiglu": swiglu, "pdl": pdl, **tuning}
            if "norm" in fusion:
                kw["norm_weight"] = nw
            if "residual" in fusion:
                kw["residual"] = torch.randn(M, 1, out_n, device=dev, dtype=torch.bfloat16)

            def rows_equal(y, w=ws[0], kw=kw):
                """Every row of y equals the invariant M = 1 call (with gemv arguments kw) on that row alone."""
                return all(torch.equal(y[m:m + 1], gemv(
                    x[m:m + 1].clone(), w, invariant=True,
                    **dict(kw, residual=kw["residual"][m:m + 1].clone()) if "residual" in kw else kw))
                    for m in range(M))

            inv_ms = cuda_ms(lambda w: gemv(x, w, invariant=True, **kw), ws)
            rows_bitwise = rows_equal(gemv(x, ws[0], invariant=True, **kw))
            today_ms = today_bitwise = None
            if M <= MAX_ROWS:
                today_ms = cuda_ms(lambda w: gemv(x, w, **kw), ws)
                today_bitwise = rows_equal(gemv(x, ws[0], **kw))
            linear_ms = cuda_ms(lambda w: F.linear(x, w), ws)
            variants = {}
            for label, extra in [*[(f"rows={p}", {"rows_per_program": p}) for p in pers if p < M],
                                 *[(lbl, {"tables": t}) for lbl, t in tile_variants.items()]]:
                vkw = dict(kw, **extra)
                t_ms = cuda_ms(lambda w: gemv(x, w, invariant=True, **vkw), ws)
                single_kw = {k: v for k, v in vkw.items() if k != "rows_per_program"}
                variants[label] = {"ms": t_ms, "rows_bitwise": rows_equal(gemv(x, ws[0], invariant=True, **vkw),
                                                                          kw=single_kw)}
            results.append({
                "name": name, "N": N, "K": K, "fusion": fusion, "M": M, "weight_MB": mb,
                "invariant_ms": inv_ms, "today_ms": today_ms, "torch_linear_ms": linear_ms,
                "invariant_GBps": mb / inv_ms, "today_GBps": mb / today_ms if today_ms else None,
                "torch_GBps": mb / linear_ms, "rows_bitwise": rows_bitwise, "today_rows_bitwise": today_bitwise,
                "rows_per_program": gemv_mod.invariant_rows(M, out_n, K, *tiles[name][:2], ws[0])
                if tiles[name] is not None else None, "variants": variants})
            today = f"{today_ms * 1e3:9.1f}" if today_ms else f"{'-':>9s}"
            ratio = f"{inv_ms / today_ms:9.2f}" if today_ms else f"{'-':>9s}"
            print(f"{name:5s} {M:3d} | {inv_ms * 1e3:9.1f} {today} {linear_ms * 1e3:9.1f} us | {ratio} "
                  f"{inv_ms / linear_ms:10.2f} | {mb / inv_ms:8.0f} | {rows_bitwise}"
                  + ("" if today_bitwise is None or M == 1 else f" (today {today_bitwise})")
                  + "".join(f" | {lbl} {v['ms'] * 1e3:.1f}{'' if v['rows_bitwise'] else ' NOT BITWISE'}"
                            for lbl, v in variants.items()))
        del ws
    write("gemv-invariant-cuda", {"hardware": hardware(dev), "ceilings": c, "pdl": pdl,
                                  "tiles": tiles, "plain_tiles": plain_tiles, "rows": results}, args.out_dir)
    if not all(r["rows_bitwise"] and all(v["rows_bitwise"] for v in r["variants"].values()) for r in results):
        raise SystemExit("invariant rows differ from their M = 1 calls (see rows_bitwise)")


if __name__ == "__main__":
    main()
