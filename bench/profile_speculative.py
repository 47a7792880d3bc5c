"""Where a speculative round's time goes on the GPU: its parts timed alone, and one whole
greedy speculative generate against the GPU's busy time.

    source bench/gpu_env.sh && python -m bench.profile_speculative --out-dir $OUT

Parts (each the median of many calls, synchronised around each, so host time counts): the
batch-1 decode step at draft_loops and at verify_loops (graph replays), the verify of a chain
of draft_ahead + 1 tokens from the draft's residuals, a whole chain round driven by the host
(speculative._chain_round) and, with device rounds, one round on the device (one graph), greedy
and sampled (--temperature); the kernels of the verify, of one plain step at verify_loops and of
a device round (greedy and sampled), by name (run with TINYLOOP_PDL=0 for each kernel's own
time: with PDL a kernel's span covers its wait). Then one
speculative generate and one plain generate under torch.profiler: wall time, the union of the
GPU's kernel intervals (busy), kernels launched and the host's top operators, so the gap between
wall and busy is the device waiting on the host. The model is built as bench/speculative.py
builds it (graphs captured at load, one lane)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import gpu_busy_ms, hardware, write
from bench.speculative import PROMPTS
from tinyloop.worker import Model
from tinyloop.worker.model.settings import Settings
from tinyloop.worker.generation import speculative as spec_mod
from tinyloop.worker.generation.speculative import SpecParams, _Chooser
from tinyloop.worker.runner.sampler import SamplingParams


def _ms(fn, dev, n=50, warmup=5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _busy(prof) -> tuple[float, int, list]:
    """(ms the GPU ran kernels or copies, union of intervals; kernels; top host ops by self time)."""
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    top = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:15]
    host = [{"op": a.key, "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3} for a in top]
    return gpu_busy_ms(prof), kernels, host


def kernels_of(fn, reps: int = 10) -> list[dict]:
    """The kernels that `fn` launches (run once before, then `reps` times under the profiler),
    by name: launches and GPU microseconds a call, most expensive first. With PDL a kernel's
    span includes its wait on the one before it (TINYLOOP_PDL=0 gives each kernel's own)."""
    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
    by: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:80]
            n, t = by.get(name, (0, 0.0))
            by[name] = (n + 1, t + (e.time_range.end - e.time_range.start))
    rows = [{"kernel": name, "per_call": n / reps, "us_per_call": t / reps} for name, (n, t) in by.items()]
    return sorted(rows, key=lambda x: -x["us_per_call"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--verify-loops", type=int, default=8)
    ap.add_argument("--draft-ahead", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="the sampled round's (top-k 50, as bench/speculative.py samples)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="batch-invariant kernels and device rounds (Settings.batch_invariant)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    Ld, Lv, k = args.draft_loops, args.verify_loops, args.draft_ahead
    settings = Settings.from_env().replace(batch_invariant=args.batch_invariant)
    with Model(args.model, max_seq_len=512, device="cuda", n_slots=1, settings=settings) as m:
        dev, r = m.device, m.runner
        prompt = m.tokenizer.encode(PROMPTS[0])
        m.generate(prompt, loops=Lv, max_tokens=4)
        pos = len(prompt)
        r.prefill(0, prompt, Lv)
        parts = {}
        out = [None]

        def step(L):
            out[0] = r.decode([0], [65], [pos], [L], prev=out[0])
        parts["decode_ms_at_draft_loops"] = _ms(lambda: step(Ld), dev)
        parts["decode_ms_at_verify_loops"] = _ms(lambda: step(Lv), dev)
        res = out[0].residual.new_zeros(1, k + 1, out[0].residual.shape[-1])
        parts["verify_ms"] = _ms(lambda: r.verify(0, res, pos, Ld, Lv), dev)
        chooser = _Chooser(m.make_request(prompt).sampling, 0, dev, r.settings.fused_sampler)
        sp = SpecParams(Ld, Lv, k)
        last = [None]

        def round_():
            _, _, _, last[0] = spec_mod._chain_round(r, 0, sp, chooser, 65, pos, k, last[0])
        parts["chain_round_host_ms"] = _ms(round_, dev)
        sampled = SamplingParams(temperature=args.temperature, top_k=50)
        rounds = {}  # one device round each, greedy and sampled
        if r.settings.device_rounds:
            rounds = {"round": lambda: r.chain_round(0, Ld, Lv, k, state=(65, pos)).result(),
                      "round_sampled": lambda: r.chain_round(0, Ld, Lv, k, state=(65, pos), sampling=sampled,
                                                             seed=1).result()}
            parts["chain_round_device_ms"] = _ms(rounds["round"], dev)
            parts["chain_round_sampled_device_ms"] = _ms(rounds["round_sampled"], dev)
        # the kernels of the verify alone, of one plain step at verify_loops and of the rounds
        by_kernel = {"verify": kernels_of(lambda: r.verify(0, res, pos, Ld, Lv)),
                     "decode_at_verify_loops": kernels_of(lambda: step(Lv)),
                     **{name: kernels_of(fn) for name, fn in rounds.items()}}
        r.release(last[0])
        r.release(out[0])
        print(parts)

        runs = {}
        for name, fn in [("plain", lambda: m.generate(prompt, loops=Lv, max_tokens=args.max_tokens)),
                         ("chain", lambda: m.generate_speculative(prompt, max_tokens=args.max_tokens, draft_loops=Ld,
                                                                  verify_loops=Lv, draft_ahead=k))]:
            fn()
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            g = fn()
            torch.cuda.synchronize(dev)
            wall = (time.perf_counter() - t) * 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize(dev)
            busy, kernels, host = _busy(prof)
            runs[name] = {"wall_ms": wall, "tokens": g.stats["completion_tokens"], "gpu_busy_ms_profiled": busy,
                          "gpu_records": kernels, "host_top": host,
                          **{k2: g.stats[k2] for k2 in ("verify_steps", "accepted_per_verify") if k2 in g.stats}}
            print(name, {k2: v for k2, v in runs[name].items() if k2 != "host_top"})
        write("profile-speculative-cuda", {"hardware": hardware(dev), "model": m.path,
                                           "batch_invariant": args.batch_invariant,
                                           "device_rounds": r.settings.device_rounds, "draft_loops": Ld,
                                           "verify_loops": Lv, "draft_ahead": k, "parts": parts, "runs": runs,
                                           "pdl": settings.pdl, "kernels": by_kernel},
              args.out_dir)


if __name__ == "__main__":
    main()
