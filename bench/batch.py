"""Batched decode throughput on the GPU: B streams stepped together by the worker's Batcher.

    source bench/gpu_env.sh && python -m bench.batch --out-dir $OUT        # -> batch-cuda.json

For B = 1, 2, 4, 8 streams (lanes 0..B-1, as the actor's lane pool hands them out, lowest
first), each prefilled with its own random prompt of --context tokens, at L = --loops:

  graphs        Batcher.step on the captured batched stages (worker/runner/stages.py BatchStep,
                one graph set per lane-count bucket), sampling and the one host sync per step
                included: ms per step, tokens/s
  eager         the same Batcher on the same kernels without graphs (every op launched)
  alone         one stream's pipelined batch-1 decode (the fused GEMV graph), for the
                tokens/s a worker gets without batching

  fused         (--fused-rows N) graphs with batched steps of up to N lanes in the fused
                projections (Settings.fused_rows; the graphs run --base-fused-rows), same run:
                `fused_speedup`
  invariant     graphs, with batch-invariant kernels (Settings.batch_invariant; on CUDA unless
                --no-invariant): every row's projection and attention as the batch-1 step
                computes it, so each stream equals its run alone; its cost against graphs
                (`invariant_cost`, the same run)

  mixed         (--mixed-depths) stream i at depth MIXED_DEPTHS[i % n]: the whole-token step's
                ms and depth-weighted tokens/s (tokens x depth / --loops), and the sustained
                run (--sustained): every stream decoding until the first has that many tokens,
                with the batcher's interleaved launches and without (`sustained`), each
                against the plain step's tokens/s (`vs_plain`)

The graphs' model is built as a worker builds it (`Model(cuda_graphs=True)`: every graph
captured at load, `graph_capture_s` their seconds), with max(--batch) lanes.

and whether each batched stream's greedy tokens equal its stream decoded alone (the
batched projections are one GEMM, so bf16 rounding may part them after many tokens).
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from bench.common import hardware, write
from bench.decode import graph_seconds, random_checkpoint, sync
from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.decode import decode_steps
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.model.settings import Settings


def prompts(n: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(n)]


def batched(model: Model, ps: list[list[int]], loops: int | list[int], steps: int,
            interleave: bool = True) -> tuple[float, list[list[int]]]:
    """(ms per batched step, each stream's tokens): streams on lanes 0..len(ps)-1, stream i at
    depth loops (or loops[i % len(loops)]). Streams at several depths: a step is one launch, so
    the whole-token steps (interleave off) are the ones whose steps each decode every stream."""
    b = Batcher(model.runner, interleave=interleave)
    out = []
    depths = loops if isinstance(loops, list) else [loops]
    for lane, p in enumerate(ps):
        req = model.make_request(p, loops=depths[lane % len(depths)], max_tokens=steps + 1, stop_token_ids=[])
        ids, _ = b.join(model.start(req, lane))
        out.append(list(ids))
    return drain(model, b, out), out


def drain(model: Model, b: Batcher, out: list[list[int]]) -> float:
    """Step b until every stream is done, each stream's tokens appended to out[lane] -> ms per step."""
    sync(model.device)
    t = time.perf_counter()
    n = 0
    while b:
        for lane, (ids, _) in b.step().items():
            out[lane].extend(ids)
        n += 1
    sync(model.device)
    return (time.perf_counter() - t) * 1e3 / n


def sustained(model: Model, ps: list[list[int]], depths: list[int], loops: int, room: int,
              interleave: bool) -> dict:
    """Streams that all keep decoding, stream i at depths[i]: depth-weighted tokens/s (tokens x
    depth / loops) over the steps until the first stream reaches `room` tokens, with the
    batcher's interleaved launches on or off (the same streams, the same graphs). Every stream
    is busy throughout, as under a steady load, so a shallow stream's tokens count at its own
    pace, not at the deepest stream's."""
    b = Batcher(model.runner, interleave=interleave)
    counts = [0] * len(ps)
    for lane, p in enumerate(ps):
        req = model.make_request(p, loops=depths[lane], max_tokens=room, stop_token_ids=[])
        counts[lane] += len(b.join(model.start(req, lane))[0])
    sync(model.device)
    t = time.perf_counter()
    launches = 0
    done = False
    while not done:
        for lane, (ids, finish) in b.step().items():
            counts[lane] += len(ids)
            done |= finish is not None
        launches += 1
    sync(model.device)
    wall = time.perf_counter() - t
    for lane in list(b.states):
        b.leave(lane)
    b.step()  # lets go of the last step's buffers
    weighted = sum(c * d / loops for c, d in zip(counts, depths))
    return {"depth_weighted_tokens_per_s": weighted / wall, "tokens_per_s": sum(counts) / wall,
            "launches": launches, "tokens_by_depth": {str(d): sum(c for c, e in zip(counts, depths) if e == d)
                                                      for d in sorted(set(depths))}}


def alone(model: Model, p: list[int], loops: int, steps: int) -> tuple[float, list[int]]:
    """(ms per token, tokens) of one stream's pipelined decode on lane 0, prefill excluded."""
    st = model.start(model.make_request(p, loops=loops, max_tokens=steps + 1, stop_token_ids=[]), 0)
    sync(model.device)
    t = time.perf_counter()
    ids = [t for chunk in decode_steps(st) for t in chunk]
    sync(model.device)
    return (time.perf_counter() - t) * 1e3 / steps, ids


def alone_median(model: Model, ps: list[list[int]], args) -> tuple[float, list[list[int]]]:
    """(the median over prompts of each prompt's median ms per token alone, each prompt's tokens)."""
    ms, ids = [], []
    for p in ps:
        runs = [alone(model, p, args.loops, args.steps) for _ in range(args.repeat)]
        ms.append(sorted(r[0] for r in runs)[len(runs) // 2])
        ids.append(runs[0][1])
    return sorted(ms)[len(ms) // 2], ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-285m", help="random-init model preset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per stream")
    ap.add_argument("--steps", type=int, default=32, help="batched steps timed")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per figure (median)")
    ap.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the batch-invariant kernels (CUDA), same run")
    ap.add_argument("--fused-rows", type=int, default=0,
                    help="also time the graphs with decode steps of up to this many lanes in the fused "
                         "projections (Settings.fused_rows; CUDA), same run, against --base-fused-rows; 0: not")
    ap.add_argument("--base-fused-rows", type=int, default=1, help="the graphs' Settings.fused_rows")
    ap.add_argument("--mixed-depths", type=int, nargs="*", default=[],
                    help="also time each --batch size with stream i at depth MIXED_DEPTHS[i %% n] (graphs, "
                         "and the --fused-rows variant): ms per step and depth-weighted tokens/s "
                         "(tokens x depth / --loops)")
    ap.add_argument("--sustained", type=int, default=160,
                    help="with --mixed-depths: also the sustained mixed run, every stream decoding until the "
                         "first has this many tokens, interleaved and in whole-token steps (the same run)")
    ap.add_argument("--name", default="batch", help="the result file's name before -DEVICE.json "
                    "(batch-fused: the fused and mixed-depth A/B, its own report section)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = PRESETS[args.preset]
    path = random_checkpoint(args.preset, cfg)
    lanes = max(args.batch)
    longest = max(args.steps, args.sustained if args.mixed_depths else 0)
    kw = dict(max_seq_len=args.context + longest + 64, device=dev, dtype=dtype, n_slots=lanes,
              prefill_graph_len=args.context)
    base = Settings.from_env().replace(fused_rows=args.base_fused_rows)
    graphs = Model(path, cuda_graphs=cuda, settings=base, **kw)
    eager = Model(path, cuda_graphs=False, settings=base, **kw)
    fused = Model(path, cuda_graphs=True, settings=base.replace(fused_rows=args.fused_rows), **kw) \
        if cuda and args.fused_rows else None
    invariant = Model(path, cuda_graphs=True, settings=Settings.from_env().replace(batch_invariant=True), **kw) \
        if cuda and args.invariant else None
    result: dict = {"hardware": hardware(dev), "model": f"{args.preset} (random init, {str(dtype)[6:]})",
                    "loops": args.loops, "context": args.context, "steps": args.steps, "lanes": lanes,
                    "fused_rows": args.base_fused_rows}
    if args.mixed_depths and args.sustained:
        result["sustained"] = args.sustained
    if fused is not None:
        result["variant_fused_rows"] = args.fused_rows
    if cuda:
        result["graph_capture_s"] = graph_seconds(graphs)
        result["graphs"] = graphs.startup["graphs"]
        result["batch_buckets"] = sorted({b for kind, b, _ in graphs.runner.graphs.stages if kind == "batch"})
    ps = prompts(max(args.batch), args.context, cfg.vocab_size)
    result["alone_ms_per_token"], alone_ids = alone_median(graphs if cuda else eager, ps, args)
    models = (("graphs", graphs), ("eager", eager)) if cuda else (("eager", eager),)
    alone_of = {name: alone_ids for name, _ in models}
    if invariant is not None:
        models += (("invariant", invariant),)
        # the batch-1 step is the same launches with or without batch invariance: its cost here
        result["invariant_alone_ms_per_token"], alone_of["invariant"] = alone_median(invariant, ps, args)
        result["invariant_alone_cost"] = result["invariant_alone_ms_per_token"] / result["alone_ms_per_token"] - 1
        result["invariant_alone_equals_graphs_alone"] = alone_of["invariant"] == alone_ids
    if fused is not None:
        models += (("fused", fused),)
        alone_of["fused"] = alone_median(fused, ps, args)[1]
    rows = []
    for B in tqdm(args.batch, desc="batch"):
        row = {"streams": B}
        for name, m in models:
            runs = [batched(m, ps[:B], args.loops, args.steps) for _ in range(args.repeat)]
            ms = sorted(r[0] for r in runs)[len(runs) // 2]
            same = [a == b for a, b in zip(runs[0][1], alone_of[name])]
            row[name] = {"ms_per_step": ms, "tokens_per_s": B * 1e3 / ms,
                         "streams_equal_alone": sum(same)}
        if "invariant" in row:
            row["invariant_cost"] = row["invariant"]["ms_per_step"] / row["graphs"]["ms_per_step"] - 1
        if "fused" in row:
            row["fused_speedup"] = row["graphs"]["ms_per_step"] / row["fused"]["ms_per_step"]
        if args.mixed_depths and B > 1:
            depths = [args.mixed_depths[i % len(args.mixed_depths)] for i in range(B)]
            weight = sum(depths) / B / args.loops
            row["mixed"] = {"depths": depths}
            for name, m in models:
                if name in ("graphs", "fused") or not cuda:
                    ms = sorted(batched(m, ps[:B], depths, args.steps, interleave=False)[0]
                                for _ in range(args.repeat))[args.repeat // 2]
                    row["mixed"][name] = {"ms_per_step": ms, "depth_weighted_tokens_per_s": B * weight * 1e3 / ms,
                                          "vs_plain": B * weight * 1e3 / ms / row[name]["tokens_per_s"]}
                    if args.sustained:
                        for mode, on in (("interleaved", True), ("whole_token", False)):
                            runs = sorted((sustained(m, ps[:B], depths, args.loops, args.sustained, on)
                                           for _ in range(args.repeat)),
                                          key=lambda r: r["depth_weighted_tokens_per_s"])
                            run = runs[len(runs) // 2]
                            run["vs_plain"] = run["depth_weighted_tokens_per_s"] / row[name]["tokens_per_s"]
                            row["mixed"][name][f"sustained_{mode}"] = run
        row["speedup_vs_alone"] = row["graphs" if cuda else "eager"]["tokens_per_s"] / (1e3 / result["alone_ms_per_token"])
        rows.append(row)
        best = row["graphs" if cuda else "eager"]
        print(f"B={B}: {best['ms_per_step']:.3f} ms/step, {best['tokens_per_s']:.0f} tok/s "
              f"({row['speedup_vs_alone']:.2f}x one stream alone), streams equal alone: {best['streams_equal_alone']}/{B}")
        if "fused" in row:
            print(f"     fused_rows={args.fused_rows}: {row['fused']['ms_per_step']:.3f} ms/step "
                  f"({row['fused_speedup']:.2f}x)")
        for name, mx in (row.get("mixed") or {}).items():
            if name != "depths":
                print(f"     mixed depths, {name}: {mx['ms_per_step']:.3f} ms/step, depth-weighted "
                      f"{mx['depth_weighted_tokens_per_s']:.0f} tok/s ({mx['vs_plain']:.2f}x plain)")
                for mode in ("interleaved", "whole_token"):
                    if f"sustained_{mode}" in mx:
                        r = mx[f"sustained_{mode}"]
                        print(f"       sustained, {mode}: depth-weighted {r['depth_weighted_tokens_per_s']:.0f} tok/s "
                              f"({r['vs_plain']:.2f}x plain), {r['launches']} launches")
        if "invariant" in row:
            inv = row["invariant"]
            print(f"     invariant: {inv['ms_per_step']:.3f} ms/step ({row['invariant_cost']:+.1%}), "
                  f"streams equal alone: {inv['streams_equal_alone']}/{B}")
        result["rows"] = rows
        write(f"{args.name}-{dev.type}", result, args.out_dir)
    print(f"alone: {result['alone_ms_per_token']:.3f} ms/token")


if __name__ == "__main__":
    main()
