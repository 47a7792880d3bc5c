"""Early exit: quality against compute over a sweep of exit rules, on one model.

    python -m bench.early_exit                       # CPU, the embedded model: bench/results/early-exit-cpu.json
    python -m bench.early_exit --device cuda --out-dir out     # the H200 run (full settings)

For full depth L (no exit) and each (criterion, threshold) of the sweep, in one run:

    iterations_per_token   mean iterations per decoded token (the generate runs' usage)
    tok_s_b1               tokens/s of one stream (batch 1), greedy, --tokens tokens per prompt
                           (each tokens/s figure: the best of --repeat timed runs)
    tok_s_batched          tokens/s of --streams streams decoding together (one batched step each),
                           prefill and first tokens included (generate_batch's wall)
    tok_s_batched_decode   the same tokens but the first ones over the wall from the batch's
                           first decode step on (its prefill excluded)
    agreement              share of the --tokens greedy tokens equal to full depth's, position by
                           position, over the prompts; first_divergence: the mean first position
                           where they differ (--tokens when they never do)
    bpb                    held-out bits per byte under teacher forcing with the rule active:
                           each held-out sequence's first --bpb-prompt tokens prefilled at full
                           depth, then one decode step (with the rule) per true token; the NLL of
                           every next true token, in bits, over the bytes those tokens spell
    bpb_delta_pct          bpb against full depth's, in percent
    iterations_per_token_tf  the same mean over the teacher-forced steps
    batched_warm_runs      the batched runs made before the timed ones: until one captured no
                           graph (at least 3), as a worker that has served the workload a while;
                           batched_captures_timed: graphs captured inside the timed runs (0 when steady)

Prompts are held-out text (the training corpus's held-out files), encoded with the model's own
tokenizer, so any default model works. --preset runs a random-weight model of a preset instead
(an Ouro shape: the gate path's cost against full depth; its quality figures mean nothing).
The skipped iterations' K/V are filled by --cache
(both policies compared when given both). On CUDA the steps run the runner's captured batch
graphs where they cover them (early_exit.py in worker/runner says how a step runs).
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from bench.common import hardware, warm_until_steady, write

SWEEP = {"latent": [0.2, 0.1, 0.07, 0.05, 0.03],
         "kl": [0.03, 0.01, 3e-3, 1e-3, 3e-4],
         "argmax": [1, 2, 3, 4],      # patience (the threshold is unused)
         "gate": [0.3, 0.5, 0.7, 0.9, 1.0]}  # 1.0: only the last iteration reaches it (the gate's cost)


def heldout_sequences(model, n: int, length: int, offset: int = 256, per_doc: int = 16) -> list[list[int]]:
    """n sequences of `length` tokens of held-out text, encoded with the model's tokenizer: each
    document's first window past byte `offset` first, then the documents' second windows (the
    tokens after the first), and so on up to `per_doc` windows a document, so that a small
    held-out split still gives many streams."""
    from train.corpus import heldout_docs
    windows = []
    for _, doc in heldout_docs():
        ids = model.tokenizer.encode(doc[offset:offset + 8 * length * per_doc].decode("utf-8", "replace"))
        windows.append([ids[k * length:(k + 1) * length] for k in range(min(per_doc, len(ids) // length))])
    out = [w[k] for k in range(per_doc) for w in windows if len(w) > k]
    if len(out) < n:
        raise ValueError(f"the held-out documents hold only {len(out)} windows of {length} tokens past byte "
                         f"{offset} ({per_doc} a document at most), {n} asked")
    return out[:n]


def rules(criteria: list[str], caches: list[str], sweep: dict) -> list[dict | None]:
    out: list[dict | None] = [None]
    for c in criteria:
        for v in sweep[c]:
            for cache in caches:
                out.append({"criterion": c, "patience": int(v), "cache": cache} if c == "argmax" else
                           {"criterion": c, "threshold": float(v), "cache": cache})
    return out


@torch.no_grad()
def teacher_forced_bits(model, seqs: list[list[int]], prompt: int, L: int, rule) -> tuple[float, float, list[int]]:
    """(bits, bytes, iterations per step) of the held-out sequences decoded teacher-forced with
    the rule, all sequences in one batched step per position."""
    runner = model.runner
    exit_rule = None if rule is None else model.make_request(seqs[0][:prompt], loops=L, max_tokens=1,
                                                             early_exit=rule).early_exit
    lanes = [runner.lanes.acquire() for _ in seqs]
    try:
        logps = [[] for _ in seqs]
        for i, (lane, s) in enumerate(zip(lanes, seqs)):
            logps[i].append(torch.log_softmax(runner.prefill(lane, s[:prompt], L).logits.float(), -1))
        depths = []
        for pos in range(prompt, len(seqs[0]) - 1):
            out = runner.decode(lanes, [s[pos] for s in seqs], [pos] * len(seqs), [L] * len(seqs),
                                exits=None if exit_rule is None else [exit_rule] * len(seqs))
            lp = torch.log_softmax(out.logits.float(), -1)
            for i in range(len(seqs)):
                logps[i].append(lp[i:i + 1].clone())
            depths.extend(out.depths if exit_rule is not None else [L] * len(seqs))
            runner.release(out)
    finally:
        for lane in lanes:
            runner.lanes.release(lane)
    bits = nbytes = 0.0
    for s, lp in zip(seqs, logps):
        lp = torch.cat(lp)                                        # (n, V): predicts s[prompt:]
        target = torch.tensor(s[prompt:], device=lp.device)
        bits += float(-lp.gather(-1, target[:, None]).sum()) / math.log(2)
        nbytes += len(model.tokenizer.decode(s[prompt:]).encode("utf-8"))
    return bits, nbytes, depths


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or a model file")
    ap.add_argument("--preset", default=None,
                    help="a random-weight model of this preset instead (e.g. ouro-2.6b: the gate path's cost)")
    ap.add_argument("--override", nargs="*", default=[], help="preset fields, key=int (e.g. n_loop_layers=8)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--loops", type=int, default=None, help="full depth L (default: the model's max_loops)")
    ap.add_argument("--criteria", nargs="+", default=None,
                    help="default: gate where the model has one, then latent, kl, argmax")
    ap.add_argument("--cache", nargs="+", default=["copy", "recompute"], choices=["copy", "recompute"])
    ap.add_argument("--min-loops", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=None, help="batch-1 prompts (agreement, tok/s)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt")
    ap.add_argument("--streams", type=int, default=None, help="streams of the batched run")
    ap.add_argument("--bpb-seqs", type=int, default=None)
    ap.add_argument("--bpb-prompt", type=int, default=64)
    ap.add_argument("--bpb-tokens", type=int, default=None, help="teacher-forced tokens per sequence")
    ap.add_argument("--sweep", nargs="+", default=[],
                    help="criterion=v1,v2,... (thresholds; argmax: patiences) in place of SWEEP's")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed runs of each kind (batch 1 over the prompts, the batched run): the best")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="", help="a benchmark of its own: early-exit-<tag>-<device>.json (an Ouro shape's "
                    "gate: --tag ouro)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    prompts_n = args.prompts or (8 if cuda else 2)
    streams = args.streams or (64 if cuda else 4)
    bpb_seqs = args.bpb_seqs or (16 if cuda else 2)
    bpb_tokens = args.bpb_tokens or (256 if cuda else 32)
    from tinyloop.worker.api import Model
    from tinyloop.worker.model.default_model import default_model_path
    path = default_model_path() if args.model == "default" else args.model
    if args.preset:
        import dataclasses

        from bench.decode import random_checkpoint
        from tinyloop.worker.model.config import PRESETS
        cfg = dataclasses.replace(PRESETS[args.preset], **{k: int(v) for k, v in (o.split("=") for o in args.override)})
        path = random_checkpoint(f"{args.preset}-exit", cfg)
        args.model = f"{args.preset} (random init{', ' + ' '.join(args.override) if args.override else ''})"
    seq_len = max(args.prompt_tokens + args.tokens, args.bpb_prompt + bpb_tokens) + 1
    t0 = time.perf_counter()
    model = Model(path, max_seq_len=seq_len, device=args.device, n_slots=max(streams, bpb_seqs))
    load_s = time.perf_counter() - t0
    cfg = model.config
    L = args.loops or cfg.max_loops
    criteria = args.criteria or (["gate"] if cfg.exit_gate else []) + ["latent", "kl", "argmax"]
    sweep = dict(SWEEP)
    for item in args.sweep:
        name, _, values = item.partition("=")
        sweep[name] = [float(v) for v in values.split(",")]
    texts = heldout_sequences(model, max(prompts_n, streams) + bpb_seqs,
                              max(args.prompt_tokens, args.bpb_prompt + bpb_tokens + 1))
    prompts = [t[:args.prompt_tokens] for t in texts[:max(prompts_n, streams)]]
    bpb_texts = [t[:args.bpb_prompt + bpb_tokens + 1] for t in texts[-bpb_seqs:]]
    rows, full = [], None
    from bench.profile_exit_batch import FirstStep
    from tinyloop.worker.generation.batcher import Batcher
    first_step = FirstStep(Batcher)  # where a batched run's decode begins
    for rule in rules(criteria, args.cache, sweep):
        if rule is not None and args.min_loops > 1:
            rule = {**rule, "min_loops": args.min_loops}
        kw = {} if rule is None else {"early_exit": rule}
        # warm-up (kernels, allocations, the exit checks' graphs) of both paths timed below
        model.generate(prompts[0], loops=L, max_tokens=4, **kw)
        # the whole batched run until it captures nothing: the captures of its launches' sequences
        # happen here (a launch's stage sequence depends on which rows end where, and passes on
        # measured time, so a sequence fuses once it has come back often: graphs.FUSE_AFTER)
        warm_runs = warm_until_steady(lambda: model.generate_batch(prompts[:streams], per_lane_loops=[L] * streams,
                                                                   max_tokens=args.tokens, **kw), model)
        secs = math.inf  # the best of --repeat passes over the prompts (one host hiccup skews no figure)
        for _ in range(args.repeat):
            outs, took = [], 0.0
            for p in prompts[:prompts_n]:
                sync(dev)
                t = time.perf_counter()
                g = model.generate(p, loops=L, max_tokens=args.tokens, **kw)
                sync(dev)
                took += time.perf_counter() - t
                outs.append(g)
            secs = min(secs, took)
        gen = [g[len(p):] for g, p in zip(outs, prompts)]
        batch_s = decode_s = math.inf
        captures = model.graph_captures
        for _ in range(args.repeat):
            sync(dev)
            first_step.reset()
            t = time.perf_counter()
            batch = model.generate_batch(prompts[:streams], per_lane_loops=[L] * streams, max_tokens=args.tokens,
                                         **kw)
            sync(dev)
            end = time.perf_counter()
            batch_s, decode_s = min(batch_s, end - t), min(decode_s, end - (first_step.at or t))
        bits, nbytes, tf_depths = teacher_forced_bits(model, bpb_texts, args.bpb_prompt, L, rule)
        row = {"rule": rule, "loops": L,
               "iterations_per_token": (sum(g.stats.get("iterations_per_token", L) for g in outs) / len(outs)),
               "iterations_histogram": [sum(col) for col in zip(*[g.stats.get(
                   "iterations_histogram", [0] * (L - 1) + [g.stats["completion_tokens"] - 1]) for g in outs])],
               "tok_s_b1": sum(len(x) for x in gen) / secs,
               "tok_s_batched": sum(len(g) - len(p) for g, p in zip(batch, prompts)) / batch_s,
               "tok_s_batched_decode": sum(len(g) - len(p) - 1 for g, p in zip(batch, prompts)) / decode_s,
               "batched_warm_runs": warm_runs, "batched_captures_timed": model.graph_captures - captures,
               "batched_iterations_per_token": sum(g.stats.get("iterations_per_token", L) for g in batch) / len(batch),
               "bpb": bits / nbytes, "iterations_per_token_tf": sum(tf_depths) / len(tf_depths)}
        if full is None:
            full = (gen, row)
        ref_gen, ref = full
        agree = [sum(a == b for a, b in zip(x, y)) / len(y) for x, y in zip(gen, ref_gen)]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(gen, ref_gen)]
        row.update(agreement=sum(agree) / len(agree), first_divergence=sum(first) / len(first),
                   bpb_delta_pct=100 * (row["bpb"] / ref["bpb"] - 1),
                   speedup_b1=row["tok_s_b1"] / ref["tok_s_b1"],
                   speedup_batched=row["tok_s_batched"] / ref["tok_s_batched"],
                   speedup_batched_decode=row["tok_s_batched_decode"] / ref["tok_s_batched_decode"])
        rows.append(row)
        name = "full depth" if rule is None else " ".join(f"{k}={v}" for k, v in rule.items())
        print(f"{name:48s} it/tok {row['iterations_per_token']:5.2f} (tf {row['iterations_per_token_tf']:5.2f})  "
              f"b1 {row['tok_s_b1']:7.1f} tok/s ({row['speedup_b1']:.2f}x)  batched {row['tok_s_batched']:8.1f} "
              f"({row['speedup_batched']:.2f}x; decode {row['speedup_batched_decode']:.2f}x)  agree {row['agreement']:.3f}  bpb {row['bpb']:.4f} "
              f"({row['bpb_delta_pct']:+.2f} %)", flush=True)
    within = [r for r in rows[1:] if r["bpb_delta_pct"] <= 1.0]
    best = max(within, key=lambda r: r["speedup_b1"], default=None)
    write("early-exit-" + (f"{args.tag}-" if args.tag else "") + dev.type, {
        "hardware": hardware(dev),
        "workload": {"model": args.model, "config": {k: getattr(cfg, k) for k in (
            "vocab_size", "d_model", "n_heads", "n_kv_heads", "n_prelude", "n_loop_layers", "n_coda", "exit_gate")},
            "dtype": str(model.dtype), "loops": L, "prompts": prompts_n, "prompt_tokens": args.prompt_tokens,
            "tokens": args.tokens, "streams": streams, "bpb_seqs": bpb_seqs, "bpb_prompt": args.bpb_prompt,
            "bpb_tokens": bpb_tokens, "cuda_graphs": model.runner.graphs is not None, "load_s": load_s},
        "rows": rows,
        "best_within_1pct_bpb": best,
    }, args.out_dir)
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
