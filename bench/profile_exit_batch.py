"""Where a batch of early-exit streams' time goes on the GPU: per interleaved launch, its rows,
passes and the tokens it ended, the host's time inside Runner.interleave and in the wait for
its ends, and the device's busy share of the run (a torch.profiler timeline), beside the same
batch at full depth (batched whole-token steps). Each run's wall is split at its first batched
step (prefill and first tokens before, decode after), and with --cprofile the host's functions
that take the most time in each run are listed (cProfile's own overhead included).

    python -m bench.profile_exit_batch --out-dir out      # the H200: 64 streams, latent 0.15
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from bench.common import gpu_busy_ms, hardware, warm_until_steady, write


def busy_share(model, prompts, L: int, n: int, tokens: int, kw: dict) -> tuple[float, float]:
    """One run of the batch under torch.profiler -> (its wall, s; the GPU's busy time, ms: the
    union of its kernels' and copies' spans)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        model.generate_batch(prompts, per_lane_loops=[L] * n, max_tokens=tokens, **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return wall, gpu_busy_ms(prof)


def top_functions(prof: cProfile.Profile, n: int) -> list[dict]:
    """The n functions with the most time of their own, with their calls and cumulative time."""
    st = pstats.Stats(prof)
    rows = [{"function": f"{path.rsplit('/tinyloop/', 1)[-1].rsplit('/main/', 1)[-1]}:{line}({name})",
             "calls": nc, "own_ms": tt * 1e3, "cum_ms": ct * 1e3}
            for (path, line, name), (_, nc, tt, ct, _) in st.stats.items()]
    return sorted(rows, key=lambda r: -r["own_ms"])[:n]


# the host's main calls in a batch's decode, timed per call by --sections (class, attribute)
SECTIONS = (
    ("tinyloop.worker.generation.batcher", "Batcher", ("step", "_launch", "_launch_interleaved", "_sample",
                                                       "_copy_to_host", "_host_tokens", "_device_tokens",
                                                       "join_many")),
    ("tinyloop.worker.api", "Model", ("_prefill_wave",)),
    ("tinyloop.worker.generation.decode", "DecodeState", ("advanced", "accept", "finish")),
    ("tinyloop.worker.runner.runner", "Runner", ("interleave", "decode", "release", "_device_rows", "prefill_many",
                                                 "prefill")),
    ("tinyloop.worker.runner.runner", "StepOut", ("resolve", "row", "detach")),
    ("tinyloop.worker.runner.stages", "InterleavedStep", ("load",)),
    ("tinyloop.worker.runner.stages", "BatchStep", ("load",)),
    ("tinyloop.worker.runner.early_exit", "ExitState", ("load_host",)),
    ("tinyloop.worker.runner.graphs", "Graphs", ("replay",)),
)


class Sections:
    """Wall time and calls of each SECTIONS function while `on` (a wrapper around each: its
    own cost, about a microsecond a call, counts in its caller's time)."""

    def __init__(self):
        import importlib
        self.on, self.time, self.calls = False, {}, {}
        for mod, cls, names in SECTIONS:
            owner = getattr(importlib.import_module(mod), cls)
            for name in names:
                fn = vars(owner).get(name)
                if isinstance(fn, staticmethod):
                    setattr(owner, name, staticmethod(self._wrap(f"{cls}.{name}", fn.__func__)))
                elif fn is not None:
                    setattr(owner, name, self._wrap(f"{cls}.{name}", fn))

    def _wrap(self, key, fn):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.time[key] = self.time.get(key, 0.0) + time.perf_counter() - t
                self.calls[key] = self.calls.get(key, 0) + 1
        return timed

    def take(self) -> dict:
        out = {k: {"ms": self.time[k] * 1e3, "calls": self.calls[k]} for k in sorted(self.time, key=lambda k: -self.time[k])}
        self.time, self.calls = {}, {}
        return out


class FirstStep:
    """When a run's first batched step starts (perf_counter): its prefill and first tokens end there."""

    def __init__(self, batcher_cls):
        self.at = None
        inner = batcher_cls.step

        def step(b, *a, **k):
            if self.at is None:
                self.at = time.perf_counter()
            return inner(b, *a, **k)
        batcher_cls.step = step

    def reset(self):
        self.at = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, default=16)
    ap.add_argument("--rule", default="latent=0.15", help="criterion=threshold")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the same steps (no busy share)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="list the N host functions with the most time of their own in each run")
    ap.add_argument("--sections", action="store_true",
                    help="time the host's main calls (SECTIONS) in a run of each kind")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    sections = Sections() if args.sections else None
    from tinyloop.worker.generation.batcher import Batcher
    first = FirstStep(Batcher)
    from bench.early_exit import heldout_sequences
    from tinyloop.worker.api import Model
    from tinyloop.worker.model.default_model import default_model_path
    crit, _, thr = args.rule.partition("=")
    rule = {"criterion": crit, "threshold": float(thr)}
    model = Model(default_model_path(), max_seq_len=args.prompt_tokens + args.tokens + 1, device=args.device,
                  n_slots=args.streams)
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()
    L, n = args.loops, args.streams
    prompts = [t[:args.prompt_tokens] for t in heldout_sequences(model, n, args.prompt_tokens)]
    runner = model.runner
    launches = []
    inner = runner.interleave

    def logged(lanes, tokens, positions, depths, starts, passes, **kw):
        t = time.perf_counter()
        out = inner(lanes, tokens, positions, depths, starts, passes, **kw)
        rec = {"rows": len(lanes), "passes": passes, "fresh": sum(1 for s in starts if s == 0),
               "host_us": (time.perf_counter() - t) * 1e6}
        launches.append(rec)
        if out.pending is not None:
            pend = out.pending

            def timed():
                t0 = time.perf_counter()
                pend()
                rec["wait_us"] = (time.perf_counter() - t0) * 1e6
                rec["ended"] = sum(out.finished)
            out.pending = timed
        elif out.finished is not None:
            rec["ended"] = sum(out.finished)
        return out
    runner.interleave = logged
    kw = {"early_exit": rule}
    # until a run captures nothing: every graph the timed run replays is captured by then
    warm_runs = warm_until_steady(lambda: model.generate_batch(prompts, per_lane_loops=[L] * n,
                                                               max_tokens=args.tokens, **kw), model)
    full = model.generate_batch(prompts, per_lane_loops=[L] * n, max_tokens=2)
    launches.clear()
    sync()
    first.reset()
    t = time.perf_counter()
    g = model.generate_batch(prompts, per_lane_loops=[L] * n, max_tokens=args.tokens, **kw)
    sync()
    end = time.perf_counter()
    wall, decode_wall = end - t, end - first.at
    run = list(launches)
    launches.clear()
    warm_until_steady(lambda: model.generate_batch(prompts, per_lane_loops=[L] * n, max_tokens=args.tokens), model)
    sync()
    first.reset()
    t = time.perf_counter()
    fg = model.generate_batch(prompts, per_lane_loops=[L] * n, max_tokens=args.tokens)
    sync()
    end = time.perf_counter()
    full_wall, full_decode_wall = end - t, end - first.at
    timed = {}
    if sections is not None:
        for name, kwargs in (("exit", kw), ("full_depth", {})):
            sections.on = True
            t = time.perf_counter()
            model.generate_batch(prompts, per_lane_loops=[L] * n, max_tokens=args.tokens, **kwargs)
            sync()
            sections.on = False
            timed[name] = {"wall_ms": (time.perf_counter() - t) * 1e3, "calls": sections.take()}
            print(f"{name}: {timed[name]['wall_ms']:.1f} ms with the sections timed", flush=True)
            for k, v in timed[name]["calls"].items():
                print(f"  {v['ms']:8.2f} ms {v['calls']:6d} calls {v['ms'] * 1e3 / v['calls']:8.1f} us/call  {k}")
    hot = {}
    if args.cprofile:
        for name, kwargs in (("exit", kw), ("full_depth", {})):
            prof = cProfile.Profile()
            prof.enable()
            model.generate_batch(prompts, per_lane_loops=[L] * n, max_tokens=args.tokens, **kwargs)
            sync()
            prof.disable()
            hot[name] = top_functions(prof, args.cprofile)
            print(f"{name}: host functions by own time", flush=True)
            for r in hot[name][:25]:
                print(f"  {r['own_ms']:8.2f} ms own {r['cum_ms']:8.2f} cum {r['calls']:7d} calls  {r['function']}")
    prof_wall, busy = busy_share(model, prompts, L, n, args.tokens, kw) if cuda else (wall, 0.0)
    full_prof_wall, full_busy = busy_share(model, prompts, L, n, args.tokens, {}) if cuda else (full_wall, 0.0)
    tokens = sum(len(x) - len(p) for x, p in zip(g, prompts))
    steady = [r for r in run if r["rows"] == n]
    summary = {k: statistics.median([r[k] for r in steady if k in r]) for k in ("passes", "host_us", "wait_us", "ended",
                                                                                  "fresh")} if steady else {}
    # every stream's first token comes with its prefill, before the first batched step
    decode_tokens = tokens - n
    print(f"decode (from the first batched step): exit {decode_wall * 1e3:.1f} ms "
          f"({decode_tokens / decode_wall:.0f} tok/s), full depth {full_decode_wall * 1e3:.1f} ms "
          f"({decode_tokens / full_decode_wall:.0f} tok/s)", flush=True)
    print(f"{len(run)} launches, {tokens} tokens in {wall * 1e3:.1f} ms ({tokens / wall:.0f} tok/s); "
          f"64-row launches: median {summary}", flush=True)
    full_tokens = sum(len(x) - len(p) for x, p in zip(fg, prompts))
    print(f"profiled run: {prof_wall * 1e3:.1f} ms wall, GPU busy {busy:.1f} ms ({busy / (prof_wall * 1e3):.0%}); "
          f"full depth {full_tokens / full_wall:.0f} tok/s, profiled: {full_prof_wall * 1e3:.1f} ms wall, GPU busy "
          f"{full_busy:.1f} ms ({full_busy / (full_prof_wall * 1e3):.0%})", flush=True)
    write(f"profile-exit-batch-{args.device}", {
        "hardware": hardware(torch.device(args.device)),
        "workload": {"model": "default", "loops": L, "rule": rule, "streams": n, "tokens": args.tokens,
                     "prompt_tokens": args.prompt_tokens},
        "run": {"warm_runs": warm_runs, "wall_ms": wall * 1e3, "tokens": tokens, "tok_s": tokens / wall,
                "launches": len(run),
                "decode_ms": decode_wall * 1e3, "decode_tok_s": decode_tokens / decode_wall,
                "iterations_per_token": sum(x.stats.get("iterations_per_token", L) for x in g) / n},
        "full_rows": len(full),
        "steady_launch_median": summary,
        "profiled": {"wall_ms": prof_wall * 1e3, "gpu_busy_ms": busy},
        "full_depth": {"tok_s": full_tokens / full_wall, "wall_ms": full_wall * 1e3,
                       "decode_ms": full_decode_wall * 1e3, "decode_tok_s": decode_tokens / full_decode_wall,
                       "profiled": {"wall_ms": full_prof_wall * 1e3, "gpu_busy_ms": full_busy}},
        "host_functions": hot,
        "sections": timed,
        "launches": run[:400],
    }, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
