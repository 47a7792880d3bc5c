"""Where a batched decode step's time goes on the GPU: B streams stepped together by the
worker's Batcher (as bench/batch.py steps them), profiled.

    source bench/gpu_env.sh && python -m bench.profile_batch --out-dir $OUT   # -> profile-batch-cuda.json

For each --batch size B, and for one stream alone (its pipelined batch-1 decode, the path a
lone stream takes): the wall ms per step over --steps steps, once the steps capture no more
graphs (a sequence of stages launched often is captured as one graph: `warm_until_steady`);
then --profiled steps under torch.profiler: per step, the GPU's busy time (the union of its
kernels' and copies' intervals) and so its idle time (wall minus busy: the device waiting on
the host, or on the gaps between a graph's kernels, about a microsecond each where a kernel
does not launch early by PDL), and the kernels and copies by name (GPU ms and launches per
step). Then (--cprofile N) the same steps under cProfile: the host functions with the most time
of their own per step (cProfile's overhead included), which tell the two causes of idle apart.

The model is built as a worker builds it (`Model(cuda_graphs=True)`: every graph captured at
load), with max(--batch) lanes."""
from __future__ import annotations

import argparse
import cProfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.batch import prompts
from bench.common import gpu_busy_ms, hardware, warm_until_steady, write
from bench.decode import random_checkpoint
from bench.profile_decode import kernel_rows
from bench.profile_exit_batch import top_functions
from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.decode import decode_steps
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.runner.graphs import FUSE_AFTER


def measured(step, steps: int, profiled: int, hot: int) -> dict:
    """step() run `steps` times timed on the wall clock, then `profiled` times under the
    profiler -> the per-step figures (module docstring); with hot > 0, then `steps` more under
    cProfile: the host functions with the most time of their own, ms per step."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            step()
        torch.cuda.synchronize()
    busy = gpu_busy_ms(prof) / profiled
    rows = [{"kernel": r["kernel"], "ms_per_step": r["ms"], "launches_per_step": r["launches"]}
            for r in kernel_rows(prof, profiled)]
    out = {"wall_ms": wall, "gpu_busy_ms": busy, "gpu_idle_ms": max(wall - busy, 0.0),
           "launches_per_step": sum(r["launches_per_step"] for r in rows), "kernels": rows}
    if hot:
        host = cProfile.Profile()
        host.enable()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        host.disable()
        out["host_functions"] = [{**r, "own_ms": r["own_ms"] / steps, "cum_ms": r["cum_ms"] / steps,
                                  "calls": r["calls"] / steps} for r in top_functions(host, hot)]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-285m", help="random-init model preset")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per stream")
    ap.add_argument("--steps", type=int, default=48, help="steps timed on the wall clock")
    ap.add_argument("--profiled", type=int, default=8, help="steps profiled")
    ap.add_argument("--cprofile", type=int, default=25, metavar="N",
                    help="list the N host functions with the most time of their own per step (0: none)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    cfg = PRESETS[args.preset]
    lanes = max(args.batch)
    warm = 40  # at most: warm_until_steady's runs, until a step captures no graph (a fused sequence)
    tokens = warm + 2 * args.steps + args.profiled + 2
    m = Model(random_checkpoint(args.preset, cfg), max_seq_len=args.context + tokens + 64, device=dev,
              dtype=torch.bfloat16, n_slots=lanes, prefill_graph_len=args.context, cuda_graphs=True)
    ps = prompts(lanes, args.context, cfg.vocab_size)
    result: dict = {"hardware": hardware(dev), "model": f"{args.preset} (random init, bfloat16)",
                    "loops": args.loops, "context": args.context, "steps": args.steps, "profiled": args.profiled,
                    "lanes": lanes}

    def request(p):
        return m.make_request(p, loops=args.loops, max_tokens=tokens, stop_token_ids=[])

    tokens_alone = decode_steps(m.start(request(ps[0]), 0))
    warm_until_steady(lambda: next(tokens_alone), m, min_runs=FUSE_AFTER + 2, max_runs=warm)
    result["alone"] = measured(lambda: next(tokens_alone), args.steps, args.profiled, args.cprofile)
    for _ in tokens_alone:  # to its end: the lane's last step released
        pass
    rows = []
    for B in args.batch:
        b = Batcher(m.runner)
        for lane, p in enumerate(ps[:B]):
            b.join(m.start(request(p), lane))
        warm_until_steady(b.step, m, min_runs=FUSE_AFTER + 2, max_runs=warm)
        row = {"streams": B, **measured(b.step, args.steps, args.profiled, args.cprofile)}
        rows.append(row)
        for lane in list(b.states):
            b.leave(lane)
        b.step()  # lets go of the last step's buffers
    result["rows"] = rows
    for name, r in [("alone", result["alone"])] + [(f"B = {r['streams']}", r) for r in rows]:
        print(f"{name}: {r['wall_ms']:.3f} ms a step, GPU busy {r['gpu_busy_ms']:.3f} ms, idle {r['gpu_idle_ms']:.3f} ms, "
              f"{r['launches_per_step']:.0f} launches")
        for k in r["kernels"][:12]:
            print(f"  {k['ms_per_step'] * 1e3:8.1f} us  x{k['launches_per_step']:5.1f}  {k['kernel'][:100]}")
        for f in r.get("host_functions", [])[:15]:
            print(f"  host {f['own_ms'] * 1e3:7.1f} us own {f['cum_ms'] * 1e3:8.1f} us cum x{f['calls']:5.1f}  {f['function'][:90]}")
    write("profile-batch-cuda", result, args.out_dir)
    m.close()


if __name__ == "__main__":
    main()
