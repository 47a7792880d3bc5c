"""Sweep the INT4 kernels' tiles at a model's projection shapes on the GPU: the entries to add to
kernels/int4_gemv.py `TILES` (M = 1, the decode step) and `MATMUL_TILES` (M > 1).

    source bench/gpu_env.sh && python -m bench.int4_tiles --out-dir $OUT     # -> int4-tiles-cuda.json

The shapes are one layer's four fused projections of --preset (bench-285m: q|k|v with the input
norm, wo with the residual, gate|up with the norm and SwiGLU, w2 with the residual), random
codes with group size --group-size, each option as the decode step passes it (PDL as a model
built with Settings.from_env() runs it: on where the device allows it unless TINYLOOP_PDL=0; the
loop block's "evict_last"). Every candidate (`gemv_candidates`: the bytes and the
mma kernel over BLOCK_N, BLOCK_G, warps and stages; `matmul_candidates` for M = --rows) is first
checked against the torch reference (the kernel tests' tolerance; a failing or uncompilable tile
is recorded and skipped), then timed two ways:

- hot: a CUDA graph of --calls back-to-back calls on the same weights, replayed; the weights stay
  in L2 from one call to the next, as the shared block's do from one iteration to the next
  (bench-285m's INT4 block, 26 MB, fits the H200's L2), and PDL overlaps each call's start with
  the previous one's tail as in the step;
- cold: triton.testing.do_bench, which flushes the L2 before each call (the block's first
  iteration, and every layer outside the loop).

The hot time picks the tile (the decode step's slope is made of hot calls). Compiling is most of
a sweep's time, so --jobs worker processes compile every candidate first (each launches its
share once; Triton's on-disk cache then serves the timing process), and --budget-s stops timing
new candidates once spent (the JSON says which were skipped). The JSON holds every candidate's
times, the chosen tiles against the defaults, and the entries to paste (`tiles_entries`);
bench/quant_decode.py --tiles (and Settings.int4_tiles, through `load_tables`) reads the same file.
"""
from __future__ import annotations

import argparse
import importlib
import os
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton

from bench.common import hardware, write
from tinyloop.kernels._launch import use_pdl
from tinyloop.worker.model.settings import Settings

q4 = importlib.import_module("tinyloop.kernels.int4_gemv")


def shapes(preset: str) -> list[dict]:
    """One layer's fused projections of a preset: name, weight rows (N, or 2F with SwiGLU), K and
    the options the decode step passes."""
    from tinyloop.worker.model.config import PRESETS
    c = PRESETS[preset]
    hd = c.d_model // c.n_heads
    qkv = (c.n_heads + 2 * c.n_kv_heads) * hd
    return [
        {"name": "wqkv", "rows": qkv, "K": c.d_model, "norm": True, "swiglu": False, "residual": False},
        {"name": "wo", "rows": c.d_model, "K": c.n_heads * hd, "norm": False, "swiglu": False, "residual": True},
        {"name": "w13", "rows": 2 * c.d_ff, "K": c.d_model, "norm": True, "swiglu": True, "residual": False},
        {"name": "w2", "rows": c.d_model, "K": c.d_ff, "norm": False, "swiglu": False, "residual": True},
    ]


SMS_TWICE = 264  # two programs an SM of the H200's 132: the split mma tiles' least grid


def split_choices(rows: int, bn: int, steps: int) -> list[int]:
    """SPLIT_K for an mma tile: the least power of two that gives SMS_TWICE programs, and twice
    that, each at most the row's steps (no slice left without a step); 1 where the row blocks
    alone are enough."""
    blocks = -(-rows // bn)
    s = 1
    while blocks * s < SMS_TWICE and s < steps:
        s *= 2
    return sorted({min(s, steps), min(2 * s, steps)} if s > 1 else {1, min(2, steps)})


def gemv_candidates(K: int, G: int, bits: int, rows: int = 2048, kernels=q4.GEMV_KERNELS) -> list[tuple]:
    """M = 1 tiles to try for a projection of `rows` output rows: the bytes kernel (BLOCK_N rows x
    BLOCK_G groups a step) and, for INT4 with whole int32 words a group, the mma and the pairs
    kernels with the K splits that fill the SMs (`split_choices`); BLOCK_G no more than the row's
    groups; only the kernels named (the default tile always, the sweep's baseline)."""
    ng = K // G
    tiles = [("bytes", bn, bg, w, st, 1) for bn in (2, 4, 8) for bg in (4, 8) for w, st in ((4, 1), (4, 2))]
    tiles += [("bytes", 16, 4, 8, 1, 1), q4.default_tile(K, G)]
    if bits == 4 and G % 8 == 0:
        for bn, bg, w in [(bn, bg, w) for bn in (16, 32, 64) for bg in (1, 2, 4) for w in (4, 8)] + \
                [(128, 1, 8), (128, 2, 8)]:
            if bg <= triton.next_power_of_2(ng):
                tiles += [("mma", bn, bg, w, 1, s) for s in split_choices(rows, bn, -(-ng // bg))]
        for bn, bg, w in [(bn, bg, w) for bn in (32, 64, 128, 256) for bg in (1, 2, 4) for w in (4, 8)]:
            if bg <= triton.next_power_of_2(ng) and bn * bg <= 256:
                steps = -(-ng // bg)
                tiles += [("pairs", bn, bg, w, st, s) for s in split_choices(rows, bn, steps)
                          for st in ((1, 2) if steps // s > 1 else (1,))]
    keep = [t for t in dict.fromkeys(tiles) if t[2] <= triton.next_power_of_2(ng)]
    return [t for t in keep if t[0] in kernels or t == q4.default_tile(K, G)]


def matmul_candidates(M: int, N: int) -> list[tuple]:
    """M > 1 tiles: 16-row tiles for a batched step's lanes (M <= 16), wider ones beyond."""
    bms = (16,) if M <= 16 else (32, 64)
    return list(dict.fromkeys([(bm, bn, bk, w, st) for bm in bms for bn in (16, 32, 64) for bk in (128, 256)
                               for w, st in ((4, 3),)] + [q4.default_matmul_tile(M, N)]))


def rows_candidates(shape: dict, G: int, bits: int, pdl: bool, device_name: str) -> list[tuple]:
    """M > 1 as the pairs kernel's rows (each row of x the M = 1 launch's programs): the shape's
    M = 1 tile in the device's table, and it with half the K slices."""
    N = shape["rows"] // 2 if shape["swiglu"] else shape["rows"]
    key = (N, shape["K"], G, bits, shape["norm"], shape["swiglu"], shape["residual"], pdl)
    t = q4.TILES.get(device_name, {}).get(key)
    if t is None or t[0] != "pairs" or bits != 4:
        return []
    t = q4.as_tile(t)
    return list(dict.fromkeys([t, (*t[:5], max(1, t[5] // 2))]))


def make_weight(shape: dict, G: int, bits: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N, K = shape["rows"], shape["K"]
    qweight = torch.randint(0, 256, (N, K * bits // 8), generator=g, dtype=torch.uint8)
    scales = (torch.rand(N, K // G, generator=g) * 0.02 + 0.001).to(torch.float16)
    zeros = torch.randint(0, 1 << bits, (N, K // G), generator=g, dtype=torch.uint8)
    x = torch.randn(1, K, generator=g)
    nw = 1 + 0.1 * torch.randn(K, generator=g)
    res = torch.randn(1, N // 2 if shape["swiglu"] else N, generator=g)
    to = dict(device=device)
    return ((qweight.to(**to), scales.to(**to), zeros.to(**to)), x.to(device, torch.bfloat16),
            nw.to(device, torch.bfloat16), res.to(device, torch.bfloat16))


def call(shape, w, x, nw, res, G, bits, tile, M=1, pdl=None):
    """The projection as the decode step calls it, with tile (pdl: int4_gemv's)."""
    xs = x if M == 1 else x.expand(M, -1).contiguous()
    kw = dict(bits=bits, swiglu=shape["swiglu"], eviction_policy="evict_last", tile=tile, pdl=pdl)
    if shape["norm"]:
        kw["norm_weight"] = nw
    if shape["residual"]:
        kw["residual"] = res if M == 1 else res.expand(M, -1).contiguous()
    return lambda: q4.int4_gemv(xs, *w, G, **kw)


def check(fn, shape, w, x, nw, res, G, bits, M=1, tile=None) -> str | None:
    """None, or why the tile's output is off the reference (the kernel tests' tolerance; the
    reference rounds where the call on this tile does)."""
    xs = x if M == 1 else x.expand(M, -1).contiguous()
    kw = dict(bits=bits, swiglu=shape["swiglu"])
    if shape["norm"]:
        kw["norm_weight"] = nw
    if shape["residual"]:
        kw["residual"] = res if M == 1 else res.expand(M, -1).contiguous()
    ref = q4.int4_gemv_ref(xs, *w, G, tile=tile, **kw).float()
    y = fn().float()
    if not torch.isfinite(y).all():
        return "non-finite output"
    err = (y - ref).abs()
    if bool((err > 3.2e-2 + 1.6e-2 * ref.abs()).any()):
        return f"off the reference by up to {err.max().item():.3g}"
    return None


def hot_us(fn, calls: int, replays: int = 5) -> float:
    """Microseconds a call, `calls` back-to-back calls captured in one graph and replayed (min
    over replays): weights L2-resident after the first call."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / calls)
    del g
    return best


def cold_us(fn) -> float:
    """Microseconds a call with the L2 flushed before it (triton.testing.do_bench's median)."""
    return triton.testing.do_bench(fn, warmup=3, rep=15) * 1e3


def _compile(jobs: list) -> list:
    """Worker: launch each (shape, G, bits, tile, M, pdl) once, so that its kernel is compiled
    into Triton's on-disk cache; -> the jobs that failed, with why."""
    failed = []
    dev = torch.device("cuda")
    made = {}
    for shape, G, bits, tile, M, pdl in jobs:
        k = (shape["name"], G, bits)
        if k not in made:
            made[k] = make_weight(shape, G, bits, dev)
        try:
            call(shape, *made[k], G, bits, tile, M, pdl)()
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is a sweep result
            failed.append((shape["name"], bits, tile, M, f"{type(e).__name__}: {e}"[:300]))
    torch.cuda.synchronize()
    return failed


def precompile(jobs: list, n: int) -> dict:
    """Compile every job in n worker processes (round-robin chunks) -> {(name, bits, tile, M): why failed}."""
    if n <= 1 or not jobs:
        return {tuple(f[:4]): f[4] for f in _compile(jobs)}
    # jobs that compile the same kernel (options, bits, tile; N and K are not specialized on) go
    # to one worker, so that it compiles once and the others find it in the cache
    groups: dict[tuple, list] = {}
    for j in jobs:
        s, G, bits, tile, M, _ = j
        groups.setdefault((s["norm"], s["swiglu"], s["residual"], G, bits, tuple(tile), M > 1), []).append(j)
    chunks = [[] for _ in range(n)]
    for i, g in enumerate(sorted(groups.values(), key=len, reverse=True)):
        min(chunks, key=len).extend(g)
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        out = {}
        for failed in pool.map(_compile, chunks):
            out.update({tuple(f[:4]): f[4] for f in failed})
    return out


def entry(key: tuple, tile: tuple) -> str:
    return f"{tuple(key)!r}: {tuple(tile)!r},"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-285m")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--bits", type=int, nargs="+", default=[4], help="4, and 2 for dual-bit's INT2 copy")
    ap.add_argument("--rows", type=int, nargs="*", default=[4, 16], help="M > 1 row counts for the GEMM's tiles")
    ap.add_argument("--calls", type=int, default=20, help="calls a hot graph")
    ap.add_argument("--kernels", nargs="+", default=list(q4.GEMV_KERNELS), choices=q4.GEMV_KERNELS,
                    help="the M = 1 kernels whose tiles are swept")
    ap.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 1) - 2)), help="compile workers")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop timing new candidates after this")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("the sweep times the kernels: it needs a CUDA device")
    if any(b not in q4.BITS for b in args.bits):
        ap.error(f"--bits: each of {q4.BITS}, got {args.bits}")
    t_start = time.monotonic()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    pdl = use_pdl(dev, Settings.from_env().launch_pdl)  # as the model's INT4 launches take it
    G = args.group_size
    result = {"hardware": hardware(dev), "device_name": name, "preset": args.preset, "group_size": G, "pdl": pdl,
              "calls": args.calls, "gemv": [], "matmul": [], "skipped": [], "failed": []}
    work = []  # (shape, bits, M, candidates, table key): every M = 1 sweep first (the decode step's)
    for M in [1, *args.rows]:
        for bits in args.bits:
            for s in shapes(args.preset):
                N = s["rows"] // 2 if s["swiglu"] else s["rows"]
                flags = (s["norm"], s["swiglu"], s["residual"])
                if M == 1:
                    work.append((s, bits, 1, gemv_candidates(s["K"], G, bits, N, args.kernels), (N, s["K"], G, bits, *flags, pdl)))
                else:
                    work.append((s, bits, M, matmul_candidates(M, N) + rows_candidates(s, G, bits, pdl, name),
                                 (q4._m_bucket(M), N, s["K"], G, bits, *flags)))
    jobs = [(s, G, bits, t, M, pdl) for s, bits, M, cands, _ in work for t in cands]
    t0 = time.monotonic()
    try:
        failed = precompile(jobs, args.jobs)
    except Exception as e:  # noqa: BLE001 - the workers only warm the cache: the timing loop compiles anyway
        print(f"precompile failed ({type(e).__name__}: {e}); compiling in the timing loop")
        failed = {}
    result["compile_s"] = time.monotonic() - t0
    print(f"compiled {len(jobs)} candidates in {result['compile_s']:.0f}s ({len(failed)} failed)")

    chosen, chosen_mm = {}, {}
    for s, bits, M, cands, key in work:
        w, x, nw, res = make_weight(s, G, bits, dev)
        wbytes = sum(t.numel() * t.element_size() for t in w)
        default = q4.default_tile(s["K"], G) if M == 1 else q4.default_matmul_tile(M, key[1])
        rows = []
        for t in [default] + [c for c in cands if tuple(c) != tuple(default)]:
            rec = {"tile": list(t)}
            why = failed.get((s["name"], bits, t, M))
            if why is None and time.monotonic() - t_start > args.budget_s and tuple(t) != tuple(default):
                result["skipped"].append({"name": s["name"], "bits": bits, "M": M, "tile": list(t)})
                continue
            if why is None:
                fn = call(s, w, x, nw, res, G, bits, t, M, pdl)
                try:
                    why = check(fn, s, w, x, nw, res, G, bits, M, t)
                except Exception as e:  # noqa: BLE001
                    why = f"{type(e).__name__}: {e}"[:300]
            if why is not None:
                rec["error"] = why
                result["failed"].append({"name": s["name"], "bits": bits, "M": M, "tile": list(t), "why": why})
                rows.append(rec)
                continue
            try:
                rec["hot_us"] = hot_us(fn, args.calls)
                rec["cold_us"] = cold_us(fn)
            except Exception as e:  # noqa: BLE001 - a tile that cannot be timed is a sweep result
                rec.pop("hot_us", None)
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
                result["failed"].append({"name": s["name"], "bits": bits, "M": M, "tile": list(t),
                                         "why": rec["error"]})
                rows.append(rec)
                continue
            rec["hot_GBps"] = wbytes / rec["hot_us"] / 1e3
            rec["cold_GBps"] = wbytes / rec["cold_us"] / 1e3
            rows.append(rec)
        timed = [r for r in rows if "hot_us" in r]
        best = min(timed, key=lambda r: r["hot_us"]) if timed else None
        base = next((r for r in rows if r["tile"] == list(default) and "hot_us" in r), None)
        out = {"name": s["name"], "bits": bits, "M": M, "key": list(key), "weight_bytes": wbytes,
               "default": list(default), "candidates": rows}
        if best is not None:
            out["chosen"] = best["tile"]
            out["chosen_hot_us"], out["chosen_cold_us"] = best["hot_us"], best["cold_us"]
            if base is not None:
                out["default_hot_us"], out["default_cold_us"] = base["hot_us"], base["cold_us"]
                out["hot_speedup"] = base["hot_us"] / best["hot_us"]
            (chosen if M == 1 else chosen_mm)[tuple(key)] = tuple(best["tile"])
            print(f"{s['name']} bits={bits} M={M}: {tuple(best['tile'])} hot {best['hot_us']:.2f} us "
                  f"cold {best['cold_us']:.2f} us (default {tuple(default)} hot "
                  f"{base['hot_us'] if base else float('nan'):.2f} us)")
        result["gemv" if M == 1 else "matmul"].append(out)
        # quant_decode --tiles reads these two lists (the entries: the same, as the tables spell
        # them), written after every shape so that a sweep cut short still leaves its tiles
        result["tiles"] = [[list(k), list(t)] for k, t in chosen.items()]
        result["matmul_tiles"] = [[list(k), list(t)] for k, t in chosen_mm.items()]
        result["tiles_entries"] = [entry(k, t) for k, t in chosen.items()]
        result["matmul_tiles_entries"] = [entry(k, t) for k, t in chosen_mm.items()]
        result["elapsed_s"] = time.monotonic() - t_start
        write("int4-tiles-cuda", result, args.out_dir)

    print(f'TILES["{name}"] entries:')
    for line in result["tiles_entries"]:
        print("    " + line)
    print(f'MATMUL_TILES["{name}"] entries:')
    for line in result["matmul_tiles_entries"]:
        print("    " + line)


if __name__ == "__main__":
    main()
