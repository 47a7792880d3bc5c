"""Sampled decoding against greedy decoding, with the sampler's graphs on and off, same run.

    source bench/gpu_env.sh && python -m bench.sampling --out-dir $OUT    # -> sampling-cuda.json

On the embedded default model (or --model) at L = --loops, prompts of --context random tokens:

  alone     one stream's pipelined decode (what `generate` and a worker's idle lane run), ms
            per token and tokens/s, for greedy and for sampling (temperature 0.8, top-k 50,
            top-p 0.95)
  batched   B = --batch streams stepped together by the worker's Batcher: all greedy, all on
            one sampler, and every stream on its own sampler (temperatures, top-k, top-p and
            repetition penalties that differ per stream), ms per step and tokens/s

each on a model whose sampling replays one captured graph per row bucket
(Settings.sampler_graphs, the default), on one that launches the sampling ops one by one
(`sampler_graphs=False`), and on one whose sampler graphs hold the fused launches
(`fused_sampler=True`: kernels/sample_rows.py), all with CUDA graphs for the model's own steps.
`equal`: whether the first two models' tokens agree, stream by stream (they must: the same ops
either way); `fused_equal`: whether the fused model's do (they may differ where a draw lands
within the sums' last bits of a boundary).
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.batch import drain, prompts
from bench.common import hardware, write
from bench.decode import sync
from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.decode import decode_steps
from tinyloop.worker.model.settings import Settings

SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.95)
# one sampler per stream, cycled: the parameter mixes a shared worker sees
MIXED = [dict(temperature=0.8, top_k=50, top_p=0.95), dict(temperature=1.0, top_k=0),
         dict(temperature=0.6, top_k=20, repetition_penalty=1.2), dict(temperature=0.0),
         dict(temperature=1.3, top_k=100, top_p=0.8), dict(temperature=0.9, top_k=5)]


def alone(m: Model, p: list[int], args, sampling: dict) -> tuple[float, list[int]]:
    """(ms per token, tokens) of one stream's decode on lane 0, prefill excluded."""
    st = m.start(m.make_request(p, loops=args.loops, max_tokens=args.tokens + 1, stop_token_ids=[], seed=3,
                                **sampling), 0)
    sync(m.device)
    t = time.perf_counter()
    ids = [t for chunk in decode_steps(st) for t in chunk]
    sync(m.device)
    return (time.perf_counter() - t) * 1e3 / args.tokens, ids


def batched(m: Model, ps: list[list[int]], args, samplers: list[dict]) -> tuple[float, list[list[int]]]:
    """(ms per batched step, each stream's tokens): stream i on lane i with samplers[i]."""
    b = Batcher(m.runner)
    out = []
    for lane, (p, s) in enumerate(zip(ps, samplers)):
        req = m.make_request(p, loops=args.loops, max_tokens=args.tokens + 1, stop_token_ids=[], seed=lane, **s)
        ids, _ = b.join(m.start(req, lane))
        out.append(list(ids))
    return drain(m, b, out), out


def median(runs):
    return sorted(r[0] for r in runs)[len(runs) // 2], runs[0][1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model file (default: the embedded default model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    kw = dict(max_seq_len=args.context + args.tokens + 64, device=dev, n_slots=args.batch)
    unfused = Settings.from_env().replace(fused_sampler=False)
    models = {"sampler_graphs": Model(args.model, settings=unfused.replace(sampler_graphs=True), **kw),
              "sampler_eager": Model(args.model, settings=unfused.replace(sampler_graphs=False), **kw),
              "fused_sampler": Model(args.model, settings=Settings.from_env().replace(sampler_graphs=True,
                                                                                      fused_sampler=True), **kw)}
    first = models["sampler_graphs"]
    ps = prompts(args.batch, args.context, first.config.vocab_size)
    result: dict = {"hardware": hardware(dev), "model": first.path, "loops": args.loops, "context": args.context,
                    "tokens": args.tokens, "batch": args.batch, "sampled": SAMPLED, "mixed": MIXED,
                    "cuda_graphs": first.runner.graphs is not None}
    ids: dict = {}
    for name, m in models.items():
        row = {}
        for kind, s in (("greedy", {}), ("sampled", SAMPLED)):
            ms, ids[name, "alone", kind] = median([alone(m, ps[0], args, s) for _ in range(args.repeat)])
            row[f"alone_{kind}"] = {"ms_per_token": ms, "tokens_per_s": 1e3 / ms}
        for kind, samplers in (("greedy", [{}] * args.batch), ("sampled", [SAMPLED] * args.batch),
                               ("mixed", [MIXED[i % len(MIXED)] for i in range(args.batch)])):
            ms, ids[name, "batched", kind] = median([batched(m, ps, args, samplers) for _ in range(args.repeat)])
            row[f"batched_{kind}"] = {"ms_per_step": ms, "tokens_per_s": args.batch * 1e3 / ms}
        result[name] = row
        print(name, {k: round(v.get("tokens_per_s", 0)) for k, v in row.items()})
    result["equal"] = {f"{where}_{kind}": ids["sampler_graphs", where, kind] == ids["sampler_eager", where, kind]
                       for (_, where, kind) in ids if _ == "sampler_graphs"}
    result["fused_equal"] = {f"{where}_{kind}": ids["sampler_graphs", where, kind] == ids["fused_sampler", where, kind]
                             for (_, where, kind) in ids if _ == "sampler_graphs"}
    g = result["sampler_graphs"]
    result["sampled_vs_greedy_alone"] = g["alone_sampled"]["tokens_per_s"] / g["alone_greedy"]["tokens_per_s"]
    result["sampled_vs_greedy_batched"] = g["batched_sampled"]["tokens_per_s"] / g["batched_greedy"]["tokens_per_s"]
    result["mixed_vs_greedy_batched"] = g["batched_mixed"]["tokens_per_s"] / g["batched_greedy"]["tokens_per_s"]
    result["graphs_vs_eager_sampled_alone"] = (g["alone_sampled"]["tokens_per_s"]
                                               / result["sampler_eager"]["alone_sampled"]["tokens_per_s"])
    f = result["fused_sampler"]
    result["fused_vs_graphs_sampled_alone"] = f["alone_sampled"]["tokens_per_s"] / g["alone_sampled"]["tokens_per_s"]
    result["fused_vs_graphs_mixed_batched"] = f["batched_mixed"]["tokens_per_s"] / g["batched_mixed"]["tokens_per_s"]
    print({k: v for k, v in result.items() if k.endswith(("alone", "batched")) or k == "equal"})
    for m in models.values():
        m.close()
    write(f"sampling-{dev.type}", result, args.out_dir)


if __name__ == "__main__":
    main()
