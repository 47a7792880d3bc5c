"""Where a batch-1 decode step's time goes: GPU time per kernel of one step (torch.profiler,
the step run op by op so each kernel is its own record), against the captured step's time.

    source bench/gpu_env.sh && python -m bench.profile_decode --out-dir $OUT

The sum of kernel times is what the step costs with no launch gaps at all; the captured
(graph) step minus that sum is the gap between kernels inside the graph.

Then one fresh generate (prefix --context, 16 tokens, the served path: prefill graphs,
pipelined decode on graph steps), wall clock against the GPU's busy time (kernels, those the
graphs launch included, and copies): what is left is the device waiting on the host. Its wall
time by max_tokens (the slope: a token's cost on the served path), and the host time of each
call of the pipelined loop per token. And the kernels of that prompt's prefill on its own (the
stage graphs), against its wall time.

The model is built as a worker builds it (`Model(cuda_graphs=True)`: every graph captured at
load), with one cache lane; the op-by-op step runs the runner's engine (`runner.engine`, the
eager stage math) on the same weights and kernels."""
from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import hardware, run_timed, timed, write
from bench.decode import bytes_per_token, ceilings, decode_rate, random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.generation.decode import DecodeState, start
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.runner.stages import PaddedPrefill, prefill_buckets


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-285m", help="random-init model preset")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    c = ceilings(dev)
    cfg = PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, max_loops=max(cfg.max_loops, args.loops))
    m = Model(random_checkpoint(args.preset, cfg), max_seq_len=4096, device="cuda", dtype="bfloat16",
              n_slots=1, cuda_graphs=True)
    L, T = args.loops, args.context
    graph_ms = decode_rate(m.runner, L, T, 64)
    e = m.runner.engine
    prompt = torch.randint(0, cfg.vocab_size, (T,)).tolist()
    m.runner.prefill(0, prompt, L)
    tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
    slot = torch.zeros(1, dtype=torch.long, device=dev)  # lane 0

    def step():
        p = e.make_pass(slot, torch.full((1, 1), T, device=dev), T + 1)
        return e.forward(tok, p, L)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [{"kernel": r["kernel"], "ms_per_step": r["ms"], "launches_per_step": r["launches"]}
            for r in kernel_rows(prof, steps)]
    kernel_ms = sum(r["ms_per_step"] for r in rows)
    floor_ms = bytes_per_token(cfg, L, T)["total"] / (c["copy_GBps"] * 1e6)
    print(f"L={L}: floor {floor_ms:.3f} ms, graph step {graph_ms:.3f} ms, kernels alone {kernel_ms:.3f} ms "
          f"({sum(r['launches_per_step'] for r in rows):.0f} launches)")
    for r in rows[:25]:
        print(f"  {r['ms_per_step'] * 1e3:8.1f} us  x{r['launches_per_step']:5.1f}  {r['kernel'][:110]}")
    timeline = replay_timeline(m, prompt, L)
    print(f"replayed step: {timeline['step_us']:.1f} us from its first kernel's start to its last's end, "
          f"{timeline['gap_between_steps_us']:.1f} us between steps; critical path by kernel:")
    for k, us in timeline["critical_path_us"].items():
        print(f"  {us:8.1f} us  {k[:110]}")
    print(f"per layer ({timeline['per_layer']['layers']} layers), by offset from the attention kernel:")
    for k, us in timeline["per_layer"]["adds_us"].items():
        print(f"  {us:8.2f} us  {k[:110]}")
    pre = prefill_profile(m, prompt, L)
    print(f"prefill({T} tokens, L={L}, the served path: stage graphs): {pre['wall_ms']:.3f} ms wall, "
          f"kernels {pre['kernel_sum_ms']:.3f} ms")
    for r in pre["kernels"][:15]:
        print(f"  {r['ms'] * 1e3:8.1f} us  x{r['launches']:5.1f}  {r['kernel'][:110]}")
    pre["one_graph"] = prefill_one_graph(m, prompt, L)
    print(f"prefill as {len(PaddedPrefill.stages(L))} stage replays {pre['one_graph']['stages_ms']:.3f} ms, "
          f"as one graph {pre['one_graph']['one_graph_ms']:.3f} ms (wall, median)")
    gen = generate_profile(m, prompt, L)
    gen["first_token"] = first_token(m, prompt, L)
    print("first token, us from the call: host " + ", ".join(
        f"{k} {v:.0f}" for k, v in gen["first_token"]["host_us"].items()) + "; GPU done " + ", ".join(
        f"{k} {v:.0f}" for k, v in gen["first_token"]["gpu_us"].items()))
    gen["wall_by_tokens"] = wall_by_tokens(m, prompt, L)
    gen["host_us_per_token"] = host_phases(m, prompt, L)
    print("host us per token of the pipelined loop: "
          + ", ".join(f"{k} {v:.0f}" for k, v in gen["host_us_per_token"].items()))
    per_token = (gen["wall_by_tokens"][-1]["ms"] - gen["wall_by_tokens"][1]["ms"]) / (16 - 2)
    print("generate wall by max_tokens: " + ", ".join(f"{r['tokens']}: {r['ms']:.2f} ms" for r in gen["wall_by_tokens"])
          + f"; {per_token:.3f} ms per token past the second, against the {graph_ms:.3f} ms graph step")
    print(f"generate(prefix {T}, decode 16, L={L}): {gen['wall_ms']:.2f} ms wall, GPU busy {gen['gpu_busy_ms']:.2f} ms "
          f"({gen['gpu_ops']} kernels and copies)")
    write("profile-decode-cuda" if args.preset == "bench-285m" else f"profile-decode-{args.preset}-cuda", {"preset": args.preset,"hardware": hardware(dev), "ceilings": c, "loops": L, "context": T,
                                  "floor_ms": floor_ms, "graph_ms": graph_ms, "kernel_sum_ms": kernel_ms,
                                  "kernels": rows, "replay_timeline": timeline, "prefill": pre, "generate": gen},
          args.out_dir)
    m.close()


def replay_timeline(m: Model, prompt: list[int], L: int, reps: int = 12, skip: int = 2) -> dict:
    """The captured step as the GPU runs it (CUPTI records each kernel a graph launches): each
    kernel's start and end in its step, and what it adds to the step's critical path, its end
    minus the latest end before it. With PDL a kernel starts before the one ahead of it ends, so
    its own duration overstates its cost; the additions sum to the step. Medians over the
    replays past the first `skip`; one step's kernels listed in order."""
    runner, T = m.runner, len(prompt)
    first = runner.prefill(0, prompt, L).logits.argmax(-1)
    g = runner.graphs.decode[L]
    g.load(0, first, T)
    for i in range(3):
        g.replay(0, T + i)
    g.load(0, first, T)  # the replays decode at contexts T .. T + reps - 1, feeding themselves
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            g.replay(0, T + i)
        torch.cuda.synchronize()
    kernels = [(ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
               if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith("Mem")]
    out = critical_path(kernels, reps, skip)
    out["per_layer"] = per_layer(out["one_step"], ATTENTION_KERNEL)
    return out


ATTENTION_KERNEL = "_rope_decode_attention_split_kernel"  # one launch per layer of a decode step


def per_layer(one_step: list[dict], anchor: str) -> dict:
    """What each kernel of a layer adds to the step, averaged over the layers: a layer runs from
    the kernel before its `anchor` (the attention, once per layer; before it, the q|k|v
    projection) to the kernel before the next layer's anchor, and the kernels are labelled by
    their offset from the anchor ("-1 _gemv_kernel", "+0 <anchor>", ...). The last layer is
    taken as long as the one before it (what follows is the head)."""
    at = [i for i, k in enumerate(one_step) if k["kernel"] == anchor]
    if len(at) < 2:
        raise ValueError(f"{len(at)} launches of {anchor} in the step: per-layer figures need two or more")
    span = at[1] - at[0]
    sums: dict[str, float] = {}
    for a in at:
        for i in range(a - 1, min(a - 1 + span, len(one_step))):
            label = f"{i - a:+d} {one_step[i]['kernel']}"
            sums[label] = sums.get(label, 0.0) + one_step[i]["adds_us"]
    return {"layers": len(at), "adds_us": {k: v / len(at) for k, v in sums.items()}}


def critical_path(kernels: list[tuple[float, float, str]], reps: int, skip: int = 2) -> dict:
    """replay_timeline's arithmetic: kernels (start us, end us, name) of `reps` replays of one
    graph, in any order -> the step's span, the gap between steps, what each kernel adds to the
    step's end (median over the replays past the first `skip`), summed by name, and the last
    replay's kernels in order."""
    kernels = sorted(kernels)
    n = len(kernels) // reps  # the step's kernels
    if n < 1 or len(kernels) % reps or reps <= skip + 1:
        raise ValueError(f"{len(kernels)} kernels over {reps} replays (skipping {skip}): not whole steps")
    steps = [kernels[i * n:(i + 1) * n] for i in range(reps)]
    adds = defaultdict(list)  # (index in the step, name) -> us added per replay
    for st in steps[skip:]:
        prev_end = st[0][0]
        for i, (_, end, name) in enumerate(st):
            adds[(i, name)].append(max(end - prev_end, 0.0))
            prev_end = max(prev_end, end)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    per_kernel = defaultdict(float)
    for (_, name), v in adds.items():
        per_kernel[name] += med(v)
    t0 = steps[-1][0][0]
    return {
        "kernels_per_step": n,
        "step_us": med([st[-1][1] - st[0][0] for st in steps[skip:]]),
        "gap_between_steps_us": med([steps[i + 1][0][0] - steps[i][-1][1] for i in range(skip, reps - 1)]),
        "critical_path_us": {k: v for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])},
        "one_step": [{"kernel": name, "start_us": s - t0, "end_us": end - t0, "adds_us": med(adds[(i, name)])}
                     for i, (s, end, name) in enumerate(steps[-1])],
    }


def kernel_rows(prof, runs: int) -> list[dict]:
    """GPU ms and launches per run of each kernel name, slowest first."""
    per = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time / runs / 1e3
            per[ev.name][1] += 1
    return sorted(({"kernel": k, "ms": v[0], "launches": v[1] / runs} for k, v in per.items()),
                  key=lambda r: -r["ms"])


def prefill_profile(m: Model, prompt: list[int], L: int, runs: int = 3) -> dict:
    """One fresh prompt's prefill on the served path (the stage graphs): wall ms, and the GPU
    time of each kernel the graphs launch."""
    import time
    runner = m.runner
    for _ in range(2):
        runner.prefill(0, prompt, L)
    torch.cuda.synchronize()
    t = time.perf_counter()
    runner.prefill(0, prompt, L)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            runner.prefill(0, prompt, L)
        torch.cuda.synchronize()
    rows = kernel_rows(prof, runs)
    return {"tokens": len(prompt), "wall_ms": wall, "kernel_sum_ms": sum(r["ms"] for r in rows), "kernels": rows}


def prefill_one_graph(m: Model, prompt: list[int], L: int, repeat: int = 20) -> dict:
    """Wall ms (median) of the prompt's prefill on lane 0 as the served path runs it (one
    replay per stage) against all its stages captured as one graph (an experiment: the runner
    captures stages, so that any depth composes from few graphs). The one graph runs a padded
    prefill of the same bucket on buffers of its own, in the runner's graph pool (replays never
    overlap)."""
    runner = m.runner
    bucket = next(b for b in prefill_buckets(runner.cache.max_seq_len, m.prefill_graph_len) if b >= len(prompt))
    pre = PaddedPrefill(runner.engine, bucket)
    pre.load_tokens(0, prompt)
    stages = PaddedPrefill.stages(L)

    def run():
        for s in stages:
            pre.run(s)

    side = torch.cuda.Stream(m.device)  # warm up outside the capture (as the runner's captures do)
    side.wait_stream(torch.cuda.current_stream(m.device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(m.device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=runner.graphs.pool):
        run()

    def one():
        pre.load_tokens(0, prompt)
        g.replay()
        return pre.logits.clone()

    staged_s, a = run_timed(lambda: runner.prefill(0, prompt, L).logits, m.device, repeat, warmup=2)
    one_s, b = run_timed(one, m.device, repeat, warmup=2)
    return {"stages": len(stages), "stages_ms": staged_s * 1e3, "one_graph_ms": one_s * 1e3,
            "same_logits": bool(torch.equal(a, b))}


def first_token(m: Model, prompt: list[int], L: int, repeat: int = 7) -> dict:
    """Where a generate's first token goes, µs from the call (median of `repeat`): on the host,
    when each call of the served path returns (the request built, the prefill launched, the
    decode state built, the first token sampled, its copy started, the second step launched
    ahead, the token on the host); on the device, when the prefill and that step finish."""
    import statistics
    import time
    runner = m.runner
    host, gpu = defaultdict(list), defaultdict(list)
    for _ in range(repeat + 2):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        t0 = time.perf_counter()
        ev[0].record()
        req = m.make_request(prompt, loops=L, max_tokens=16, stop_token_ids=[])
        t1 = time.perf_counter()
        out = runner.prefill(0, req.prompt, L)
        ev[1].record()
        t2 = time.perf_counter()
        st = DecodeState(runner, 0, req, out.logits, out.norm, out.work)  # generation.decode.start, in two
        t3 = time.perf_counter()
        tok = st.sample()
        t4 = time.perf_counter()
        st.copy_to_host(tok)
        t5 = time.perf_counter()
        st.speculate()
        ev[2].record()
        t6 = time.perf_counter()
        st.host_token()
        t7 = time.perf_counter()
        torch.cuda.synchronize()
        for k, t in (("request", t1), ("prefill_launched", t2), ("state", t3), ("sample", t4), ("copy", t5),
                     ("step_launched", t6), ("token_on_host", t7)):
            host[k].append((t - t0) * 1e6)
        gpu["prefill"].append(ev[0].elapsed_time(ev[1]) * 1e3)
        gpu["step"].append(ev[0].elapsed_time(ev[2]) * 1e3)
    return {"host_us": {k: statistics.median(v[2:]) for k, v in host.items()},
            "gpu_us": {k: statistics.median(v[2:]) for k, v in gpu.items()}}


def wall_by_tokens(m: Model, prompt: list[int], L: int, counts=(1, 2, 4, 8, 16), repeat: int = 10) -> list[dict]:
    """Median wall ms of one generate per max_tokens, no profiler: the slope is what a token
    costs on the served path (the graph step plus the host's work per token, where the two do
    not overlap), the intercept what a request costs besides."""
    return [{"tokens": n, "ms": timed(lambda: m.generate(prompt, loops=L, max_tokens=n), m.device, repeat=repeat)}
            for n in counts]


def host_phases(m: Model, prompt: list[int], L: int, tokens: int = 48) -> dict:
    """Median host microseconds of each call of the pipelined decode loop (generate.
    decode_steps) per token: sample, the token's copy to the host, the step launched ahead,
    the wait for the token, accept. Only the wait should take long (the device's step): a
    call that syncs shows as one that takes a step's time."""
    import statistics
    import time
    clock = time.perf_counter
    st = start(m.runner, 0, m.make_request(prompt, loops=L, max_tokens=tokens + 1, stop_token_ids=[]))
    phases = defaultdict(list)
    for _ in range(tokens):
        t0 = clock()
        tok = st.sample()
        t1 = clock()
        st.copy_to_host(tok)
        t2 = clock()
        st.speculate()
        t3 = clock()
        t = st.host_token()
        t4 = clock()
        st.accept(t)
        t5 = clock()
        for name, a, b in (("sample", t0, t1), ("copy_to_host", t1, t2), ("launch_ahead", t2, t3),
                           ("wait_token", t3, t4), ("accept", t4, t5), ("total", t0, t5)):
            phases[name].append((b - a) * 1e6)
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in phases.items()}


def generate_profile(m: Model, prompt: list[int], L: int, tokens: int = 16) -> dict:
    """Wall ms of one generate against the union of the GPU's busy intervals in it."""
    import time
    for _ in range(2):
        m.generate(prompt, loops=L, max_tokens=tokens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        m.generate(prompt, loops=L, max_tokens=tokens)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    busy, end, gaps = 0.0, float("-inf"), []
    for a, b in spans:  # union of intervals, in microseconds
        if b > end:
            if end > float("-inf") and a > end:
                gaps.append((a - end, end - spans[0][0]))
            busy += b - max(a, end)
            end = b
    gaps.sort(reverse=True)
    return {"tokens": tokens, "wall_ms": wall, "gpu_busy_ms": busy / 1e3, "gpu_ops": len(spans),
            "gpu_span_ms": (end - spans[0][0]) / 1e3,
            # the device idle between its first and last op: the longest gaps, and where they start
            "idle_gaps_us": [{"us": g, "at_us": at} for g, at in gaps[:20]],
            "idle_over_10us_ms": sum(g for g, _ in gaps if g > 10) / 1e3}


if __name__ == "__main__":
    main()
