"""A decode step's cost against the cache's allocated length: the same prompt and outputs on
models whose lanes hold 128, 512 and 2048 positions (the last is `tinyloop serve`'s default).

    python -m bench.context                 # CPU, the embedded model: bench/results/context-cpu.json
    python -m bench.context --device cuda --model bench-285m

Per allocated length: one stream's per-token time (`Model.stream`, greedy) and a batch of as
many streams as the model has lanes (`Model.generate_batch`), tokens per second. The step reads
only the positions a lane holds, so the rows should match whatever the allocation.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from tqdm import tqdm

from bench.common import hardware, write


def per_token_ms(model, prompt, loops, max_tokens) -> float:
    req = model.make_request(prompt, loops=loops, max_tokens=max_tokens)
    gen = model.stream(req)
    next(gen)  # the first token: prefill and its decision
    t0, n = time.perf_counter(), 0
    for ids in gen:
        n += len(ids)
    return 1e3 * (time.perf_counter() - t0) / max(1, n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (the embedded model), a preset, or a model file")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)

    from tinyloop.worker.api import Model
    from tinyloop.worker.model import checkpoint
    from tinyloop.worker.model.config import PRESETS
    from tinyloop.worker.model.default_model import default_model_path
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "default":
            path = default_model_path()
        elif args.model in PRESETS:
            path = os.path.join(tmp, f"{args.model}.tinyloop")
            checkpoint.save(checkpoint.init_model(PRESETS[args.model], 0, std=0.3), path)
        else:
            path = args.model
        prompt = [(7 * i + 3) % 256 for i in range(args.prompt_tokens)]
        rows = []
        for S in tqdm(args.lengths, desc="allocated lengths"):
            with Model(path, max_seq_len=S, device=args.device) as m:
                per_token_ms(m, prompt, args.loops, 4)  # warm-up
                one = min(per_token_ms(m, prompt, args.loops, args.max_tokens) for _ in range(3))
                prompts = [[(t + i) % 256 for t in prompt] for i in range(m.n_slots)]
                t0 = time.perf_counter()
                outs = m.generate_batch(prompts, per_lane_loops=[args.loops] * len(prompts),
                                        max_tokens=args.max_tokens)
                wall = time.perf_counter() - t0
                tokens = sum(len(o) - len(p) for o, p in zip(outs, prompts))
                rows.append({"max_seq_len": S, "lanes": m.n_slots, "per_token_ms": one,
                             "batch_tokens_per_s": tokens / wall, "batch_streams": len(prompts)})
        dev = torch.device(args.device)
        write(f"context-{dev.type}", {
            "hardware": hardware(dev),
            "workload": {"model": args.model, "loops": args.loops, "prompt_tokens": args.prompt_tokens,
                         "max_tokens": args.max_tokens, "greedy": True},
            "rows": rows,
            "spread": max(r["per_token_ms"] for r in rows) / min(r["per_token_ms"] for r in rows),
        }, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
