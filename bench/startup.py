"""Worker start-up: loading the model and capturing its CUDA graphs, by part, per lane count.

    source bench/gpu_env.sh && python -m bench.startup --preset bench-285m --lanes 1 8 64 --out-dir $OUT

A worker reports healthy (and the gateway listens) only once its model is loaded and every
graph is captured (worker/runner/runner.py `Runner.capture`: the batch-1 decode step of each
depth, the prefill stages of each prompt-length bucket, the verify stages of each node bucket
and the batched decode stages of each lane-count bucket), so this is what a deployment's
startup probe has to allow (deploy/). --lanes: the worker's cache lanes (`Model(n_slots=...)`,
the actor's `lanes`). Graphs depend on the buckets, and only the row counts depend on the lane
count: every run captures the same graphs but the batched stages (their buckets: powers of
two up to the lane count, and the count) and the multi-row prefills (`prefill<rows>`, the
row counts up to the lane count), which grow with log2 of the lanes; `same_graphs_but_lanes`
checks it.

Per run: `Model.startup` (load_s, the *_graphs_s parts, graphs, graph_bytes: the graph pool's
bytes, lanes), the graphs by kind and the batch buckets, the GPU memory allocated and reserved
once it stands, and the wall time. --preset: a preset of worker/model/config.py (random
weights, written once) or `default` (the embedded default model). On CPU nothing is captured:
a smoke run of the load.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from bench.common import hardware, write
from bench.decode import random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.config import PRESETS

KINDS = ("decode", "prefill", "verify", "batch")


def by_lanes(kind: str) -> bool:
    """Whether a graph kind's count grows with the lanes: rows of a batched step or of a
    multi-row prefill (`prefill4`, ...)."""
    return kind in ("batch", "interleaved") or kind.removeprefix("prefill").isdigit()


def graphs_by_kind(m: Model) -> tuple[dict[str, int], list[int]]:
    """The runner's captured graphs by kind, and the lane-count buckets of the batched ones."""
    g = m.runner.graphs
    if g is None:
        return {}, []
    kinds = {k: 0 for k in KINDS}
    kinds["decode"] = len(g.decode)
    for kind, _, _ in g.stages:
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds, sorted({bucket for kind, bucket, _ in g.stages if kind == "batch"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", "--model", dest="preset", default="bench-285m",
                    help="a preset of worker/model/config.py, or `default` (the embedded model)")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 64], help="cache lanes per worker, one run each")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.preset != "default" and args.preset not in PRESETS:
        ap.error(f"--preset: `default` or one of {sorted(PRESETS)}, got {args.preset!r}")
    if any(n < 1 for n in args.lanes):
        ap.error(f"--lanes: each must be >= 1, got {args.lanes}")
    dev = torch.device(args.device)
    path = None if args.preset == "default" else random_checkpoint(args.preset, PRESETS[args.preset])
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    result = {"hardware": hardware(dev), "model": args.preset, "dtype": dtype, "max_seq_len": args.max_seq_len,
              "runs": []}
    for lanes in tqdm(args.lanes, desc="start-up", unit="worker"):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        with Model(path, max_seq_len=args.max_seq_len, device=dev, dtype=dtype, n_slots=lanes) as m:
            wall = time.perf_counter() - t
            kinds, buckets = graphs_by_kind(m)
            run = {"lanes": lanes, "cache_lanes": m.n_slots, "wall_s": wall, **m.startup,
                   "graphs_by_kind": kinds, "batch_buckets": buckets,
                   "graphs_less_lanes": m.startup["graphs"] - sum(v for k, v in kinds.items() if by_lanes(k))}
            if dev.type == "cuda":
                run["memory_allocated_GB"] = torch.cuda.memory_allocated(dev) / 1e9
                run["memory_reserved_GB"] = torch.cuda.memory_reserved(dev) / 1e9
        result["runs"].append(run)
        # every run captures the same graphs but the rows' (the parts that grow with the lanes)
        result["same_graphs_but_lanes"] = len({(r["graphs_less_lanes"], tuple((k, v) for k, v in
                                                r["graphs_by_kind"].items() if not by_lanes(k)))
                                               for r in result["runs"]}) == 1
        parts = ", ".join(f"{k} {v:.1f}" for k, v in run.items() if k.endswith("_s") and k != "wall_s")
        tqdm.write(f"{lanes} lane(s): {run['wall_s']:.1f} s, {run['graphs']} graphs "
                   f"({run['graphs_less_lanes']} + {run['graphs'] - run['graphs_less_lanes']} by rows, batched "
                   f"in buckets {buckets}), "
                   f"{run['graph_bytes'] / 1e9:.2f} GB graph pool; {parts}")
        write(f"startup-{args.preset}-{dev.type}", result, args.out_dir)
    if not result["same_graphs_but_lanes"]:
        print("WARNING: the runs captured different graphs besides the rows' stages: "
              + ", ".join(f"{r['lanes']} lanes: {r['graphs_by_kind']}" for r in result["runs"]))


if __name__ == "__main__":
    main()
