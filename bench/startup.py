"""Worker start-up: loading the model and capturing its CUDA graphs, by part, per lane count.

    source bench/gpu_env.sh && python -m bench.startup --model bench-285m --lanes 1 4 --out-dir $OUT

A worker reports healthy (and the gateway listens) only once its model is loaded and every
graph is captured (worker/graphs.py: the decode step of each depth on each lane, the prefill
and speculative stages of each lane, the batched stages), so this is what a deployment's
startup probe has to allow (deploy/). --lanes counts a worker's request lanes; its model gets
one more, as the actor's does (lane 0 is the batcher's). Per run: `Model.startup` (seconds by
part, graph count), the GPU memory allocated and reserved once it stands, and the wall time.
--model: `default` (the embedded default model) or a preset of worker/config.py (random
weights, written once). On CPU nothing is captured: a smoke run of the load.
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="`default` or a preset of worker/config.py")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 4], help="request lanes per worker")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.model != "default" and args.model not in PRESETS:
        ap.error(f"--model: `default` or one of {sorted(PRESETS)}, got {args.model!r}")
    if any(n < 1 for n in args.lanes):
        ap.error(f"--lanes: each must be >= 1, got {args.lanes}")
    dev = torch.device(args.device)
    path = None if args.model == "default" else random_checkpoint(args.model, PRESETS[args.model])
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    result = {"hardware": hardware(dev), "model": args.model, "dtype": dtype, "max_seq_len": args.max_seq_len,
              "runs": []}
    for lanes in tqdm(args.lanes, desc="start-up", unit="worker"):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        with Model(path, max_seq_len=args.max_seq_len, device=dev, dtype=dtype, n_slots=lanes + 1) as m:
            run = {"lanes": lanes, "cache_lanes": lanes + 1, "wall_s": time.perf_counter() - t, **m.startup}
            if dev.type == "cuda":
                run["memory_allocated_GB"] = torch.cuda.memory_allocated(dev) / 1e9
                run["memory_reserved_GB"] = torch.cuda.memory_reserved(dev) / 1e9
        result["runs"].append(run)
        tqdm.write(f"{lanes} lane(s): {run['wall_s']:.1f} s, {run['graphs']} graphs, "
                   + ", ".join(f"{k} {v:.1f}" for k, v in run.items() if k.endswith("_s") and k != "wall_s"))
        write(f"startup-{args.model}-{dev.type}", result, args.out_dir)


if __name__ == "__main__":
    main()
