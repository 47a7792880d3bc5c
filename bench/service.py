"""Service overhead: gateway + Ray vs in-process, measured in the same run.

    python -m bench.service                       # CPU: writes bench/results/service-cpu.json
    python -m bench.service --preset small --device cuda --out bench/results/service-gpu.json
    python -m bench.service --model default --max-seq-len 2048 --concurrency 32 --no-speculative \
        --out /tmp/service-serve-defaults.json   # the embedded model as `tinyloop serve` runs it

Measures, on one worker with the same model file and thread count as the in-process baseline:
- per-token time (decode) and time to first token, in-process `Model.stream` vs a gRPC client
  through the gateway and the Ray actor; the difference is the service's overhead;
- aggregate throughput (tokens/s) at 1, 8 and 32 concurrent streams through the service, with
  the in-process single-stream rate beside it;
- self-speculative decoding (chain: draft at --draft-loops, default loops // 2, verify at --loops,
  draft_ahead 4), in-process and through the service, each against a plain greedy generate at
  --loops on the same path in the same run: time to first token, per-token time, tokens/s, the
  usage's accepted_per_verify and acceptance_rate, and greedy parity (diverged_at: the first
  generated token that differs). Parity is recorded, not asserted: exact in fp32, but in bf16 the
  verify may round a near tie the other way. Skipped when --loops < 2.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DRAFT_AHEAD = 4


def make_model(preset: str, path: str) -> None:
    import torch

    from tinyloop.worker.model import checkpoint
    from tinyloop.worker.model.config import PRESETS
    checkpoint.save(checkpoint.init_model(PRESETS[preset], 0, std=0.3), path, dtype=torch.float32)


def timing(runs) -> dict:
    """Medians over timed streams (start, first token, end, ids, usage), the first (a warm-up) left out."""
    runs = runs[1:]
    return {"ttft_ms": 1e3 * statistics.median(r[1] - r[0] for r in runs),
            "per_token_ms": 1e3 * statistics.median((r[2] - r[1]) / max(1, len(r[3]) - 1) for r in runs),
            "tokens_per_s": statistics.median(len(r[3]) / (r[2] - r[0]) for r in runs)}


def spec_row(plain, spec) -> dict:
    """Speculative streams against the plain greedy ones at verify_loops, on the same path."""
    from tinyloop.worker.generation.scoring import first_divergence
    gen, row, usage = timing(plain), timing(spec), spec[-1][4]
    d = first_divergence(spec[-1][3], plain[-1][3])
    return {**row, "speedup_vs_generate": row["tokens_per_s"] / gen["tokens_per_s"],
            "accepted_per_verify": usage["accepted_per_verify"], "acceptance_rate": usage["acceptance_rate"],
            "greedy_parity": d == -1, "diverged_at": None if d == -1 else d, "generate": gen}


def local_stream(model, prompt, loops, max_tokens, speculative=None):
    req = model.make_request(prompt, loops=loops, max_tokens=max_tokens, speculative=speculative)
    t0 = time.perf_counter()
    gen = model.stream(req)
    first, ids = None, []
    try:
        while True:
            ids += next(gen)
            first = first or time.perf_counter()
    except StopIteration as stop:
        stats = stop.value.stats
    return t0, first, time.perf_counter(), ids, stats


def in_process(path: str, prompt: list[int], loops: int, max_tokens: int, reps: int, device: str,
               spec: dict | None, max_seq_len: int, batch_invariant: bool | None = None) -> tuple[dict, dict | None]:
    from tinyloop.worker.api import Model
    with Model(path, max_seq_len=max_seq_len, device=device, batch_invariant=batch_invariant) as model:
        plain = [local_stream(model, prompt, loops, max_tokens) for _ in range(reps + 1)]  # the first warms up
        fast = spec and [local_stream(model, prompt, loops, max_tokens, spec) for _ in range(reps + 1)]
    return timing(plain), spec and spec_row(plain, fast)


def one_stream(client, prompt, loops, max_tokens, speculative=None):
    t0 = time.perf_counter()
    first, ids = None, []
    stream = client.generate(prompt, loops=loops, max_tokens=max_tokens, speculative=speculative)
    for chunk in stream:
        ids += chunk.ids
        first = first or time.perf_counter()
    return t0, first, time.perf_counter(), ids, stream.complete.usage


def service(path: str, prompt: list[int], loops: int, max_tokens: int, reps: int, device: str,
            concurrency: list[int], torch_threads: int, spec: dict | None,
            max_seq_len: int, batch_invariant: bool | None = None) -> tuple[dict, dict | None]:
    import ray

    from tinyloop.client import TinyLoopClient
    from tinyloop.gateway import workers
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    actors = workers.spawn(1, workers.WorkerOptions(model_path=path, lanes=max(concurrency),
                                                    max_seq_len=max_seq_len, device=device,
                                                    torch_threads=torch_threads,
                                                    batch_invariant=batch_invariant))
    gw = GatewayThread(actors, GatewayOptions(port=0))
    try:
        with TinyLoopClient(gw.address) as c:
            plain = [one_stream(c, prompt, loops, max_tokens) for _ in range(reps + 1)]
            fast = spec and [one_stream(c, prompt, loops, max_tokens, spec) for _ in range(reps + 1)]
        t = timing(plain)
        out = {"ttft_ms": t["ttft_ms"], "per_token_ms": t["per_token_ms"], "throughput": {}}
        for k in concurrency:
            clients = [TinyLoopClient(gw.address) for _ in range(k)]
            with concurrent.futures.ThreadPoolExecutor(k) as pool:
                t0 = time.perf_counter()
                results = list(pool.map(lambda cl: one_stream(cl, prompt, loops, max_tokens), clients))
                wall = time.perf_counter() - t0
            for cl in clients:
                cl.close()
            tokens = sum(len(r[3]) for r in results)
            out["throughput"][str(k)] = {"streams": k, "tokens": tokens, "wall_s": wall,
                                         "tokens_per_s": tokens / wall,
                                         "median_ttft_ms": 1e3 * statistics.median(r[1] - r[0] for r in results)}
        return out, spec and spec_row(plain, fast)
    finally:
        gw.stop(1.0)
        ray.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="a seeded random model of this preset")
    p.add_argument("--model", default=None,
                   help="a model file instead of --preset ('default': the embedded model)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="cache positions per lane (default: the workload's prompt + max_tokens + 8)")
    p.add_argument("--no-speculative", action="store_true", help="skip the speculative rows")
    p.add_argument("--loops", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--draft-loops", type=int, default=None,
                   help="speculative draft depth, below --loops (default: loops // 2)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels, in-process and in the worker (default: the environment's)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "service-cpu.json"))
    args = p.parse_args()
    if args.draft_loops is None and args.loops >= 2 and not args.no_speculative:
        args.draft_loops = args.loops // 2
    if args.draft_loops is not None and not 1 <= args.draft_loops < args.loops:
        p.error(f"--draft-loops must be in [1, --loops={args.loops})")
    spec = args.draft_loops and {"draft_loops": args.draft_loops, "verify_loops": args.loops,
                                 "draft_ahead": DRAFT_AHEAD}

    import torch
    torch.set_num_threads(args.torch_threads)
    prompt = [(7 * i + 3) % 256 for i in range(args.prompt_tokens)]
    max_seq_len = args.max_seq_len or len(prompt) + args.max_tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "default":
            from tinyloop.worker.model.default_model import default_model_path
            path = default_model_path()
        elif args.model:
            path = args.model
        else:
            path = os.path.join(tmp, f"{args.preset}.tinyloop")
            make_model(args.preset, path)
        base, base_spec = in_process(path, prompt, args.loops, args.max_tokens, args.reps, args.device, spec,
                                     max_seq_len, args.batch_invariant)
        svc, svc_spec = service(path, prompt, args.loops, args.max_tokens, args.reps, args.device,
                                args.concurrency, args.torch_threads, spec, max_seq_len, args.batch_invariant)
    from bench.common import provenance
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
        **provenance(),
        "hardware": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                     "cpu_count": os.cpu_count(), "device": args.device, "python": platform.python_version(),
                     "torch": torch.__version__, "torch_threads": args.torch_threads,
                     **({"gpu": torch.cuda.get_device_name()} if args.device.startswith("cuda") else {})},
        "workload": {"model": args.model or f"preset {args.preset}", "max_seq_len": max_seq_len,
                     "loops": args.loops, "prompt_tokens": args.prompt_tokens,
                     "max_tokens": args.max_tokens, "reps": args.reps, "greedy": True,
                     "batch_invariant": args.batch_invariant},
        "in_process": base,
        "service": svc,
        "overhead": {"per_token_ms": svc["per_token_ms"] - base["per_token_ms"],
                     "ttft_ms": svc["ttft_ms"] - base["ttft_ms"],
                     "per_token_ratio": svc["per_token_ms"] / base["per_token_ms"]},
        "speculative": {"mode": "chain", **spec, "in_process": base_spec, "service": svc_spec} if spec
        else {"skipped": "--no-speculative" if args.no_speculative
              else f"loops={args.loops}: no shallower depth to draft at"},
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
