"""Load through the real gateway and one Ray worker: many concurrent streams, each its own prompt.

    source bench/gpu_env.sh && python -m bench.load --out-dir $OUT          # H200: load-cuda.json
    python -m bench.load --device cpu --model default --prompt-tokens 32 --max-tokens 32 --lanes 8 \\
        --max-seq-len 2048 --concurrency 1 8 32 --mixed 8 --mixed-depths 2 4 8 --torch-threads 1  # CPU: load-cpu.json

Per concurrency k (all streams start at once over --channels client channels already connected,
which share one TCP connection to the gateway as one client process's channels do, gRPC's
subchannel pool; greedy, L = --loops; --repeat runs, the median run's row kept with every
run's tokens/s): tokens/s over
the wall time, time to first token p50 / p99, time per output token (after the first) p50 / p99,
errors, and the means of the gateway's and the worker's own time to first token. Beside
each, measured in the same run on the same GPU with the service stopped, the ceiling: the
runner's batched decode step alone at B = min(k, lanes) streams (`Batcher.step`, sampling and
host sync included), and for k = 1 the in-process `Model.stream` (tokens/s, TTFT).

The probes (--probes N): N streams one at a time over one connected channel, each read to its
end, for the time to first token with no other stream beside; against the same streams
in-process (`Model.stream`) and through the worker's scheduler alone; the p50 difference from
the scheduler alone is the service's TTFT overhead (what the event loop, the worker channel, the
gateway and the public gRPC hop add to the worker's own path).

The mixed run: --mixed streams with depths drawn (seeded) from --mixed-depths, a tenth of them
self-speculative (draft at half the depth); its depth-weighted tokens/s (tokens x depth / --loops)
is what compares with the plain run at the same concurrency. All its streams start at once and
decode --max-tokens each, so it lasts as long as its deepest streams do.

The closed loop (--sustained-s): --mixed callers, each sending its next request as soon as its
last one ends (plain at --loops, then mixed as above, each request's depth drawn), counted over
a window after a warm-up: the steady load of a population of callers, where a shallow request
that ends early is followed by the next. `closed_loop.vs_plain`: mixed over plain, depth-weighted.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch
from tqdm import tqdm

from bench.batch import batched
from bench.common import hardware, write
from bench.decode import random_checkpoint, sync
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.serving.options import PREFILL_ORDERS, WorkerOptions

# the served worker's options default to tinyloop serve's own (one place for them)
SERVE = WorkerOptions()


# what the workers log when a step fails (its traceback follows) or a capture while serving fails
WORKER_FAILURES = ("a decode step failed", "failed; it runs stage by stage")


def worker_failures(path: str, ray_logs: str = "/tmp/ray/session_latest/logs") -> int:
    """The failed steps' tracebacks and failed captures from the Ray workers' logs of the
    server's session (the caller gets one line of a failed step, the worker logs it whole) into
    `path`, where there are any. -> how many."""
    out, n = [], 0
    for f in sorted(glob.glob(os.path.join(ray_logs, "worker-*.err"))):
        with open(f, errors="replace") as fh:
            lines = fh.read().splitlines()
        for i, line in enumerate(lines):
            if any(w in line for w in WORKER_FAILURES):
                n += 1
                out += [f"== {os.path.basename(f)}:{i + 1}"] + lines[i:i + 80]
    if out:
        with open(path, "w") as fh:
            fh.write("\n".join(out) + "\n")
        print(f"{n} failures in the workers' logs: {path}", flush=True)
    return n


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


async def one(client, prompt, kw) -> dict:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    try:
        async for chunk in client.generate(prompt, timeout=600, **kw):
            now = time.perf_counter()
            if first is None and chunk.ids:
                first = now
            n += len(chunk.ids)
            last = now
    except Exception as e:  # recorded: the goal is none
        return {"error": f"{type(e).__name__}: {e}"[:200], "tokens": n}
    return {"ttft": first - t0, "tpot": (last - first) / (n - 1) if n > 1 else None, "tokens": n,
            "end": last}


async def load(address: str, jobs: list[tuple[list[int], dict, int]], channels: int) -> dict:
    """All jobs at once over `channels` gRPC channels: the row of figures."""
    from tinyloop.client import AsyncTinyLoopClient
    clients = [AsyncTinyLoopClient(address) for _ in range(channels)]
    try:
        # each channel connected first, as a client's long-lived channel is: the streams' TTFT is
        # the service's, not a TCP and HTTP/2 handshake's
        await asyncio.gather(*(c.model_info() for c in clients))
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one(clients[i % channels], p, kw) for i, (p, kw, _) in enumerate(jobs)))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.close()
    ok = [r for r in rs if "error" not in r]
    tokens = sum(r["tokens"] for r in rs)
    weighted = sum(r["tokens"] * depth for r, (_, _, depth) in zip(rs, jobs) if "error" not in r)
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    return {"streams": len(jobs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "depth_token_per_s": weighted / wall, "errors": len(rs) - len(ok),
            "error_examples": sorted({r["error"] for r in rs if "error" in r})[:3],
            "ttft_ms_p50": ttft and 1e3 * pct(ttft, 50), "ttft_ms_p99": ttft and 1e3 * pct(ttft, 99),
            "tpot_ms_p50": tpot and 1e3 * pct(tpot, 50), "tpot_ms_p99": tpot and 1e3 * pct(tpot, 99),
            "tpot_p99_over_p50": tpot and pct(tpot, 99) / pct(tpot, 50)}


async def sustained_load(address: str, users: int, job, warm_s: float, window_s: float, channels: int) -> dict:
    """A closed loop: `users` callers, each sending its next request as soon as its last one
    ends (job(user, i) -> (prompt, kwargs, depth)), for warm_s + window_s seconds. Counted: the
    tokens that arrive inside the window (after the warm-up, which all users start at once),
    each also weighted by its stream's depth; the streams still running at the window's end are
    cancelled. The load a service sees from a steady population of callers, where a short
    request is followed by the next one."""
    from tinyloop.client import AsyncTinyLoopClient
    clients = [AsyncTinyLoopClient(address) for _ in range(channels)]
    tokens, weighted, errors, ttfts, done = 0, 0.0, [], [], 0
    try:
        await asyncio.gather(*(c.model_info() for c in clients))
        t0 = time.perf_counter()
        start, end = t0 + warm_s, t0 + warm_s + window_s

        async def user(u: int) -> None:
            nonlocal tokens, weighted, done
            i = 0
            while time.perf_counter() < end:
                p, kw, depth = job(u, i)
                i += 1
                stream = clients[u % channels].generate(p, timeout=600, **kw)
                t = time.perf_counter()
                first = True
                try:
                    async for chunk in stream:
                        now = time.perf_counter()
                        if first and chunk.ids:
                            if start <= t and now <= end:
                                ttfts.append(now - t)
                            first = False
                        if start <= now <= end:
                            tokens += len(chunk.ids)
                            weighted += len(chunk.ids) * depth
                        if now > end:
                            stream.cancel()
                            break
                    else:
                        done += 1
                except Exception as e:  # recorded: the goal is none
                    if time.perf_counter() <= end:
                        errors.append(f"{type(e).__name__}: {e}"[:200])
        await asyncio.gather(*(user(u) for u in range(users)))
    finally:
        for c in clients:
            await c.close()
    return {"users": users, "warm_s": warm_s, "window_s": window_s, "tokens": tokens,
            "tokens_per_s": tokens / window_s, "depth_token_per_s": weighted / window_s,
            "requests_completed": done, "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "ttft_ms_p50": ttfts and 1e3 * pct(ttfts, 50), "ttft_ms_p99": ttfts and 1e3 * pct(ttfts, 99)}


async def probes(address: str, prompts: list[list[int]], loops: int, max_tokens: int) -> list[float]:
    """Time to first token of one stream at a time over one connected channel (each a whole
    stream of max_tokens, read to its end): the service's own latency, no other stream beside."""
    from tinyloop.client import AsyncTinyLoopClient
    async with AsyncTinyLoopClient(address) as c:
        await c.model_info()
        out = []
        for p in prompts:
            r = await one(c, p, dict(loops=loops, max_tokens=max_tokens, stop_token_ids=[]))
            if "error" in r:
                raise RuntimeError(f"a probe failed: {r['error']}")
            out.append(r["ttft"])
        return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_args(path: str, args, port, mport) -> list[str]:
    return ["serve", "--model", path, "--lanes", str(args.lanes), "--max-seq-len", str(args.max_seq_len),
            "--device", args.device, "--port", str(port), "--metrics-port", str(mport),
            "--step-tokens", str(args.step_tokens), "--coalesce-ms", str(args.coalesce_ms),
            "--gil-switch-ms", str(args.gil_switch_ms), "--first-token-wait-ms", str(args.first_token_wait_ms), "--max-hops-per-s", str(args.max_hops_per_s),
            "--speculative-max-running", str(args.speculative_max_running),
            "--prefill-together" if args.prefill_together else "--no-prefill-together",
            "--prefill-order", args.prefill_order,
            "--worker-channel" if args.worker_channel else "--no-worker-channel"]


def serve(path: str, args, port: int, mport: int, log_path: str) -> subprocess.Popen:
    """`tinyloop serve` in its own process, once its health says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop.cli", *serve_args(path, args, port, mport)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tinyloop serve exited with {proc.returncode}: see {log_path}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return proc
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"tinyloop serve did not start in 600 s: see {log_path}")
            time.sleep(1)


def worker_steps(mport: int) -> dict:
    """The worker's step histograms' sums and counts, scraped from the gateway's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
    out = {}
    for name in ("tinyloop_worker_step_seconds", "tinyloop_worker_batch_rows",
                 "tinyloop_worker_time_to_first_token_seconds"):
        for part in ("sum", "count"):
            m = re.search(rf'^{name}_{part}{{worker="worker-0"}} ([0-9.e+-]+)$', text, re.M)
            out[f"{name}_{part}"] = float(m.group(1)) if m else 0.0
    for part in ("sum", "count"):  # the gateway's own, unlabelled
        m = re.search(rf'^tinyloop_time_to_first_token_seconds_{part} ([0-9.e+-]+)$', text, re.M)
        out[f"tinyloop_time_to_first_token_seconds_{part}"] = float(m.group(1)) if m else 0.0
    for name in ("tinyloop_worker_step_cpu_seconds_total", "tinyloop_worker_process_cpu_seconds_total",
                 "tinyloop_worker_stats_clock_seconds", "tinyloop_worker_prompts_prefilled_together_total",
                 "tinyloop_worker_speculative_batched_total", "tinyloop_worker_speculative_handed_to_batch_total"):
        m = re.search(rf'^{name}{{worker="worker-0"}} ([0-9.e+-]+)$', text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def step_delta(before: dict, after: dict) -> dict:
    """What the worker's step loop did during a run: steps, their mean wall and step-thread CPU
    time, the mean rows of its batched steps, and the worker process's CPU seconds per second
    between the two reports (all its threads)."""
    d = {k: after[k] - before[k] for k in after}
    steps = d["tinyloop_worker_step_seconds_count"]
    batched = d["tinyloop_worker_batch_rows_count"]
    mean_ms = lambda name: d[f"{name}_count"] and 1e3 * d[f"{name}_sum"] / d[f"{name}_count"]  # noqa: E731
    return {"steps": steps, "step_ms_mean": steps and 1e3 * d["tinyloop_worker_step_seconds_sum"] / steps,
            "step_cpu_ms_mean": steps and 1e3 * d["tinyloop_worker_step_cpu_seconds_total"] / steps,
            "batch_rows_mean": batched and d["tinyloop_worker_batch_rows_sum"] / batched,
            "prompts_prefilled_together": d["tinyloop_worker_prompts_prefilled_together_total"],
            "speculative_batched": d["tinyloop_worker_speculative_batched_total"],
            "speculative_handed_to_batch": d["tinyloop_worker_speculative_handed_to_batch_total"],
            # where a stream's time to first token goes: the gateway's (its call to the first
            # chunk) and the worker's (arrival to the first tokens handed over), means
            "gateway_ttft_ms_mean": mean_ms("tinyloop_time_to_first_token_seconds"),
            "worker_ttft_ms_mean": mean_ms("tinyloop_worker_time_to_first_token_seconds"),
            # the worker process's CPU seconds per second of the run, all threads: near 1 with
            # the step thread waiting, the threads share one interpreter lock
            "process_cpu_per_wall_s": d["tinyloop_worker_stats_clock_seconds"] and (
                d["tinyloop_worker_process_cpu_seconds_total"] / d["tinyloop_worker_stats_clock_seconds"])}


def _scheduler(m, args):
    """The worker's scheduler over the model's runner, with the worker's options from args,
    and a function that makes one prompt's job as the worker makes it."""
    from tinyloop.worker.serving.scheduler import Job, Scheduler, SchedulerOptions
    s = Scheduler(m.runner, SchedulerOptions(step_tokens=args.step_tokens, prefill_together=args.prefill_together,
                                             prefill_order=args.prefill_order))

    def job(key: str, p: list[int]) -> Job:
        req = m.make_request(p, loops=args.loops, max_tokens=args.max_tokens, stop_token_ids=[])
        return Job(key, lambda lane: m.start_chunked(req, lane), tokens=len(p))
    return s, job


def scheduler_alone(m, ps: list[list[int]], args) -> dict:
    """The worker's scheduler in this process (no Ray, no gRPC, no event loop): every prompt
    submitted at once, stepped until all are done, as the worker steps them."""
    s, job = _scheduler(m, args)
    for i, p in enumerate(ps):
        s.submit(job(f"s{i}", p))
    sync(m.device)
    t0 = time.perf_counter()
    steps = tokens = 0
    while s.has_work():
        tokens += sum(len(ev.ids) for _, ev in s.step() if hasattr(ev, "ids"))
        steps += 1
    sync(m.device)
    wall = time.perf_counter() - t0
    return {"streams": len(ps), "tokens": tokens, "steps": steps, "wall_s": wall, "tokens_per_s": tokens / wall}


def scheduler_ttft(m, ps: list[list[int]], args) -> list[float]:
    """Each prompt alone through the worker's scheduler in this process, stepped to its end: the
    seconds from submit to the step's first-token events (the worker's own path to a first
    token, with no event loop or thread hand-off)."""
    s, job = _scheduler(m, args)
    out = []
    for i, p in enumerate(ps):
        j = job(f"t{i}", p)
        t0 = time.perf_counter()
        s.submit(j)
        first = []

        def early(events):  # the step's first tokens, handed over before its decode step runs
            if events and not first:
                first.append(time.perf_counter())
        while s.has_work():
            s.step(early=early)
        out.append(first[0] - t0)
    return out


def ceiling(path: str, args, batches: list[int]) -> tuple[dict, dict]:
    """In-process, same GPU, no service: the batched step per B (and, beside it, the worker's
    scheduler alone with B streams arriving at once), and one stream alone."""
    from bench.service import local_stream, timing
    from tinyloop.worker.api import Model
    out = {}
    with Model(path, device=args.device, max_seq_len=args.max_seq_len, n_slots=args.lanes) as m:
        ps = make_prompts(max(batches), args.prompt_tokens, m.config.vocab_size, 1)
        for B in tqdm(batches, desc="ceiling (batched step alone)"):
            batched(m, ps[:B], args.loops, 8)  # warm-up
            ms, _ = batched(m, ps[:B], args.loops, args.max_tokens)
            out[str(B)] = {"B": B, "ms_per_step": ms, "tokens_per_s": B * 1e3 / ms}
            if B > 1:
                scheduler_alone(m, ps[:B], args)  # warm-up
                out[str(B)]["scheduler_alone"] = scheduler_alone(m, ps[:B], args)
        runs = [local_stream(m, ps[0], args.loops, args.max_tokens) for _ in range(4)]
        alone = timing(runs)
        if args.probes:
            qs = make_prompts(args.probes + 1, args.prompt_tokens, m.config.vocab_size, 77)
            firsts = [local_stream(m, q, args.loops, args.max_tokens) for q in qs]
            alone["probe_ttft_ms_p50"] = 1e3 * statistics.median(r[1] - r[0] for r in firsts[1:])
            alone["scheduler_probe_ttft_ms_p50"] = 1e3 * statistics.median(scheduler_ttft(m, qs, args)[1:])
    return out, alone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-285m", help="a random model of this preset")
    ap.add_argument("--model", default=None, help="'default': the embedded model instead of --preset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--lanes", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--mixed", type=int, default=64, help="streams of the mixed run (0: none)")
    ap.add_argument("--mixed-depths", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--sustained-s", type=float, default=3.0,
                    help="the closed-loop runs' counted window, seconds (0: none): --mixed callers, each "
                         "sending its next request when its last ends, plain and mixed")
    ap.add_argument("--sustained-warm-s", type=float, default=1.0, help="the closed-loop runs' uncounted start")
    ap.add_argument("--step-tokens", type=int, default=SERVE.scheduler.step_tokens)
    ap.add_argument("--prefill-together", action=argparse.BooleanOptionalAction, default=SERVE.scheduler.prefill_together,
                    help="tinyloop serve's --prefill-together")
    ap.add_argument("--prefill-order", default=SERVE.scheduler.prefill_order, choices=PREFILL_ORDERS,
                    help="tinyloop serve's --prefill-order")
    ap.add_argument("--speculative-max-running", type=int, default=SERVE.scheduler.speculative_max_running,
                    help="tinyloop serve's --speculative-max-running")
    ap.add_argument("--worker-channel", action=argparse.BooleanOptionalAction, default=SERVE.channel.enabled,
                    help="tinyloop serve's --worker-channel: tokens over the worker's gRPC channel, else Ray")
    ap.add_argument("--coalesce-ms", type=float, default=SERVE.coalesce_s * 1e3, help="tinyloop serve's --coalesce-ms")
    ap.add_argument("--gil-switch-ms", type=float, default=SERVE.gil_switch_s * 1e3, help="tinyloop serve's --gil-switch-ms")
    ap.add_argument("--first-token-wait-ms", type=float, default=SERVE.first_token_wait_s * 1e3, help="tinyloop serve's --first-token-wait-ms")
    ap.add_argument("--max-hops-per-s", type=float, default=SERVE.max_hops_per_s, help="tinyloop serve's --max-hops-per-s")
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each load (a 64-stream run lasts well under a second): the median's row")
    ap.add_argument("--torch-threads", type=int, default=None, help="the in-process ceiling's")
    ap.add_argument("--probes", type=int, default=32,
                    help="streams one at a time, for the time to first token (0: none)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.model == "default":
        from tinyloop.worker.model import checkpoint
        from tinyloop.worker.model.default_model import default_model_path
        path = default_model_path()
        cfg = checkpoint.read_config(path)[0]
    else:
        cfg = PRESETS[args.preset]
        path = random_checkpoint(f"load-{args.preset}", cfg)
    batches = sorted({min(k, args.lanes) for k in args.concurrency})
    ceil, alone = ceiling(path, args, batches)
    if args.device == "cuda":
        torch.cuda.empty_cache()

    port, mport = free_port(), free_port()
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)  # the serve log lands there before the JSON does
    log_path = os.path.join(args.out_dir or tempfile.gettempdir(), f"load-serve-{args.preset}.log")
    server = serve(path, args, port, mport, log_path)
    address = f"127.0.0.1:{port}"
    rows, mixed, extra = {}, None, {}
    try:
        plain = dict(loops=args.loops, max_tokens=args.max_tokens, stop_token_ids=[])
        warm = make_prompts(4, args.prompt_tokens, cfg.vocab_size, 99)
        asyncio.run(load(address, [(p, plain, args.loops) for p in warm], 1))  # warm-up
        time.sleep(1.5)  # the gateway's next probe brings the warm-up's steps: not the first run's

        if args.probes:
            qs = make_prompts(args.probes, args.prompt_tokens, cfg.vocab_size, 78)
            before = worker_steps(mport)
            got = asyncio.run(probes(address, qs, args.loops, args.max_tokens))
            time.sleep(1.5)  # the gateway's next probe brings the worker's TTFT histogram
            w = step_delta(before, worker_steps(mport))
            extra["ttft_probes"] = {
                "requests": len(got), "ttft_ms_p50": 1e3 * statistics.median(got),
                "ttft_ms_p99": 1e3 * pct(got, 99), "gateway_ttft_ms_mean": w["gateway_ttft_ms_mean"],
                "worker_ttft_ms_mean": w["worker_ttft_ms_mean"]}

        def measured(jobs, channels):
            """The run repeated --repeat times: the run of median tokens/s, with every run's."""
            runs = []
            for _ in range(args.repeat):
                before = worker_steps(mport)
                row = asyncio.run(load(address, jobs, channels))
                time.sleep(1.5)  # the gateway's next probe brings the worker's step histograms
                row["worker"] = step_delta(before, worker_steps(mport))
                if row["errors"]:
                    tqdm.write(f"{row['errors']} of {row['streams']} streams failed: {row['error_examples']}")
                runs.append(row)
            row = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
            row["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
            row["runs_ttft_ms_p99"] = [r["ttft_ms_p99"] for r in runs]
            return row

        for k in tqdm(args.concurrency, desc="concurrency"):
            ps = make_prompts(k, args.prompt_tokens, cfg.vocab_size, 1000 + k)
            row = measured([(p, plain, args.loops) for p in ps], min(args.channels, k))
            del row["depth_token_per_s"]
            c = ceil[str(min(k, args.lanes))]
            row["ceiling_tokens_per_s"] = c["tokens_per_s"]
            row["of_ceiling"] = row["tokens_per_s"] / c["tokens_per_s"]
            rows[str(k)] = row
        if args.mixed:
            rng = random.Random(7)
            jobs = []
            for i, p in enumerate(make_prompts(args.mixed, args.prompt_tokens, cfg.vocab_size, 5)):
                d = rng.choice(args.mixed_depths)
                kw = dict(max_tokens=args.max_tokens, stop_token_ids=[])
                if i % 10 == 0 and d >= 2:
                    kw["speculative"] = {"draft_loops": d // 2, "verify_loops": d}
                else:
                    kw["loops"] = d
                jobs.append((p, kw, d))
            plain_row = rows.get(str(args.mixed))
            # the same depths with no speculative stream beside: what the speculative ones cost
            no_spec = [(p, {**{k: v for k, v in kw.items() if k != "speculative"}, "loops": d}, d)
                       for p, kw, d in jobs]
            for name, js in (("mixed", jobs), ("mixed_depths_only", no_spec)):
                r = measured(js, min(args.channels, len(js)))
                r["depth_weighted_tokens_per_s"] = r.pop("depth_token_per_s") / args.loops
                r["depths"] = {str(d): sum(1 for *_, x in js if x == d) for d in args.mixed_depths}
                r["speculative_streams"] = sum(1 for _, kw, _ in js if "speculative" in kw)
                if plain_row:
                    r["vs_plain"] = r["depth_weighted_tokens_per_s"] / plain_row["tokens_per_s"]
                extra[name] = r
            mixed = extra.pop("mixed")
        if args.mixed and args.sustained_s > 0:
            # the closed loop: the same number of callers, plain at --loops and mixed (each
            # request's depth drawn, a tenth speculative), one after the other on the same server
            pool = make_prompts(256, args.prompt_tokens, cfg.vocab_size, 11)

            def mixed_job(u: int, i: int):
                rng = random.Random(u * 100_003 + i)
                d = rng.choice(args.mixed_depths)
                kw = dict(max_tokens=args.max_tokens, stop_token_ids=[])
                if rng.random() < 0.1 and d >= 2:
                    kw["speculative"] = {"draft_loops": d // 2, "verify_loops": d}
                else:
                    kw["loops"] = d
                return pool[rng.randrange(len(pool))], kw, d

            def plain_job(u: int, i: int):
                return pool[random.Random(u * 100_003 + i).randrange(len(pool))], plain, args.loops
            closed = {}
            for name, job in (("plain", plain_job), ("mixed", mixed_job)):
                runs = []
                for _ in range(args.repeat):
                    before = worker_steps(mport)
                    r = asyncio.run(sustained_load(address, args.mixed, job, args.sustained_warm_s,
                                                   args.sustained_s, min(args.channels, args.mixed)))
                    time.sleep(1.5)  # the gateway's next probe brings the worker's step histograms
                    r["worker"] = step_delta(before, worker_steps(mport))
                    r["depth_weighted_tokens_per_s"] = r.pop("depth_token_per_s") / args.loops
                    runs.append(r)
                r = sorted(runs, key=lambda r: r["depth_weighted_tokens_per_s"])[len(runs) // 2]
                r["runs_depth_weighted_tokens_per_s"] = [x["depth_weighted_tokens_per_s"] for x in runs]
                closed[name] = r
            closed["vs_plain"] = (closed["mixed"]["depth_weighted_tokens_per_s"]
                                  / closed["plain"]["depth_weighted_tokens_per_s"])
            extra["closed_loop"] = closed
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    failures = worker_failures(os.path.join(args.out_dir or tempfile.gettempdir(), "load-worker-failures.log"))
    one_row = rows.get("1")
    dev = torch.device(args.device)
    write(f"load-{dev.type}", {
        "hardware": hardware(dev),
        "workload": {"preset": "the embedded default model" if args.model == "default" else args.preset,
                     "weights": "trained" if args.model == "default" else "random bf16",
                     "loops": args.loops, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                     "lanes": args.lanes, "max_seq_len": args.max_seq_len, "step_tokens": args.step_tokens,
                     "prefill_together": args.prefill_together, "prefill_order": args.prefill_order,
                     "speculative_max_running": args.speculative_max_running,
                     "coalesce_ms": args.coalesce_ms, "gil_switch_ms": args.gil_switch_ms,
                     "first_token_wait_ms": args.first_token_wait_ms,
                     "max_hops_per_s": args.max_hops_per_s, "worker_channel": args.worker_channel,
                     "repeat": args.repeat,
                     "greedy": True},
        "worker_log_failures": failures,
        "in_process_one_stream": alone,
        "ceiling": ceil,
        "service": rows,
        "mixed": mixed,
        **extra,
        "one_stream_vs_in_process": one_row and one_row["ttft_ms_p50"] is not None and {
            "tokens_per_s_ratio": one_row["tokens_per_s"] / alone["tokens_per_s"],
            "ttft_overhead_ms": one_row["ttft_ms_p50"] - alone["ttft_ms"]},
        # what the service adds to the worker's own path to a first token (its scheduler alone,
        # in-process); Model.stream on a CPU also runs the next decode step before its first yield
        "ttft_overhead_ms": "ttft_probes" in extra and (
            extra["ttft_probes"]["ttft_ms_p50"] - alone["scheduler_probe_ttft_ms_p50"]),
        "server": {"command": "python -m tinyloop.cli " + " ".join(serve_args(path, args, "PORT", "MPORT")),
                   "process": "the gateway in its own process (tinyloop serve), the worker a Ray actor, "
                              "the clients in the benchmark's process"},
    }, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
