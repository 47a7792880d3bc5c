"""Where an early-exit decode step's time goes, on the GPU.

    python -m bench.profile_exit --out-dir out     # the H200: bench/results/profile-exit-cuda.json

One stream on the embedded default model (or --model), greedy, at depth --loops, with and
without an exit rule (--rule, a criterion=threshold pair). Records:

    generate        tokens/s of a --tokens generate, full depth and with the rule, and the
                    rule's iterations per token; solo_steps: the one-row exit steps run
                    (warm-up included) and how many went on past their span graph
    graphs_us       GPU microseconds of one replay of each captured graph an exit step replays
                    (the 2-row batch bucket's prelude, one iteration and coda, its exit checks
                    where an exit step captured them, the one-row exit step's span graphs by
                    length, one iteration and end) and of the batch-1 decode step at full depth (CUDA events
                    around --replays back-to-back replays)
    launch_us       host microseconds of the replay call of those graphs (the launch alone), the
                    device idle before each: median of 50
    host_us         wall microseconds of one exit step through Runner.decode, called with no
                    `prev` (so each call first copies the last step's outputs), median and p90
    profile_16_steps  torch.profiler's table (CPU and CUDA totals by op) over 16 such steps
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import hardware, write


def gpu_us(fn, reps: int) -> float:
    """Mean GPU microseconds of fn() over reps back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return 1000 * a.elapsed_time(b) / reps


def launch_us(fn, reps: int) -> float:
    """Median host microseconds of the call fn() itself (a graph's launch), the device idle
    before each."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def timed_generate(model, prompt, L: int, tokens: int, rule) -> tuple[float, dict]:
    kw = {} if rule is None else {"early_exit": rule}
    model.generate(prompt, loops=L, max_tokens=4, **kw)  # warm: kernels, the checks' graphs
    torch.cuda.synchronize()
    t = time.perf_counter()
    g = model.generate(prompt, loops=L, max_tokens=tokens, **kw)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    return (len(g) - len(prompt)) / s, g.stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--loops", type=int, default=16)
    ap.add_argument("--rule", default="latent=0.05", help="criterion=threshold")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    from tinyloop.worker.api import Model
    from tinyloop.worker.model.default_model import default_model_path
    crit, _, thr = args.rule.partition("=")
    rule = {"criterion": crit, "threshold": float(thr)}
    model = Model(default_model_path() if args.model == "default" else args.model, max_seq_len=512, device="cuda",
                  n_slots=4)
    runner, L = model.runner, args.loops
    model.capture_graphs([L])
    prompt = model.tokenizer.encode("def fibonacci(n):\n    ")
    full_tok_s, _ = timed_generate(model, prompt, L, args.tokens, None)
    exit_tok_s, stats = timed_generate(model, prompt, L, args.tokens, rule)
    solo_counts = dict(runner._solo.counts) if runner._solo is not None else None
    g = runner.graphs
    graphs_us = {f"decode L={L}": gpu_us(g.decode[L].graph.replay, args.replays)}
    for kind, stage in (("batch", "prelude"), ("batch", 0), ("batch", "coda"), ("exit", "check0"),
                        ("exit", "check+logits0")):
        key = (kind, 2, stage)
        if key in g.stages:
            graphs_us[f"{kind} {stage}"] = gpu_us(g.stages[key].replay, args.replays)
    solo = runner._solo  # (its timed replays run over whatever its step last held)
    if solo is not None:
        for (flags, parity, _), span in sorted(solo.spans.items()):
            if parity == 0:
                graphs_us[f"solo span {len(flags)}"] = gpu_us(span.replay, args.replays)
        it_key = min(solo.iterations)  # (half, iteration, host slot, with logits)
        i = it_key[1]
        graphs_us[f"solo iteration {i}"] = gpu_us(solo.iterations[it_key].replay, args.replays)
        graphs_us["solo end"] = gpu_us(solo.ends[(0, None)].replay, args.replays)
    print("graphs (GPU us per replay):", {k: round(v, 1) for k, v in graphs_us.items()}, flush=True)
    launches = {f"decode L={L}": g.decode[L].graph.replay}
    if solo is not None:
        launches.update({f"solo span {len(flags)}": span.replay for (flags, parity, _), span in sorted(solo.spans.items())
                         if parity == 0})
        launches[f"solo iteration {i}"] = solo.iterations[it_key].replay
    launch = {name: launch_us(fn, 50) for name, fn in launches.items()}
    print("launch (host us per replay call):", {k: round(v, 1) for k, v in launch.items()}, flush=True)
    # one exit step at a time, as the stream runs them
    req = model.make_request(prompt, loops=L, max_tokens=1, early_exit=rule)
    with runner.lanes.hold() as lane:
        out = runner.prefill(lane, prompt, L)
        tok, pos = int(out.logits.argmax(-1)), len(prompt)
        steps = []
        for _ in range(args.tokens):
            torch.cuda.synchronize()
            t = time.perf_counter()
            o = runner.decode([lane], [tok], [pos], [L], exits=[req.early_exit])
            o.resolve()  # a one-row exit step is launched, not waited for
            tok = int(o.greedy[0])
            steps.append((time.perf_counter() - t) * 1e6)
            pos += 1
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(16):
                o = runner.decode([lane], [tok], [pos], [L], exits=[req.early_exit])
                o.resolve()
                tok = int(o.greedy[0])
                pos += 1
    steps.sort()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60)
    print(table, flush=True)
    write("profile-exit-cuda", {
        "hardware": hardware(torch.device("cuda")),
        "workload": {"model": args.model, "loops": L, "rule": rule, "tokens": args.tokens, "prompt_tokens": len(prompt)},
        "generate": {"full_tok_s": full_tok_s, "exit_tok_s": exit_tok_s, "speedup": exit_tok_s / full_tok_s,
                     "iterations_per_token": stats.get("iterations_per_token"),
                     "solo_steps": solo_counts},
        "graphs_us": graphs_us,
        "launch_us": launch,
        "host_us": {"exit_step_median": steps[len(steps) // 2], "exit_step_p90": steps[int(0.9 * len(steps))]},
        "profile_16_steps": table.splitlines(),
    }, args.out_dir)
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
