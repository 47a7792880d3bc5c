"""Service overhead: gateway + Ray vs in-process, measured in the same run.

    python -m bench.service                       # CPU: writes bench/results/service-cpu.json
    python -m bench.service --preset small --device cuda --out bench/results/service-gpu.json

Measures, on one worker with the same model file and thread count as the in-process baseline:
- per-token time (decode) and time to first token, in-process `Model.stream` vs a gRPC client
  through the gateway and the Ray actor; the difference is the service's overhead;
- aggregate throughput (tokens/s) at 1, 8 and 32 concurrent streams through the service, with
  the in-process single-stream rate beside it.
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


def make_model(preset: str, path: str) -> None:
    import torch

    from tinyloop.worker import checkpoint
    from tinyloop.worker.config import PRESETS
    checkpoint.save(checkpoint.init_model(PRESETS[preset], 0, std=0.3), path, dtype=torch.float32)


def in_process(path: str, prompt: list[int], loops: int, max_tokens: int, reps: int, device: str) -> dict:
    from tinyloop.worker.api import Model
    model = Model(path, max_seq_len=len(prompt) + max_tokens + 8, device=device)
    ttft, per_token, tps = [], [], []
    for _ in range(reps + 1):  # the first run warms up
        req = model.make_request(prompt, loops=loops, max_tokens=max_tokens)
        t0 = time.perf_counter()
        gen = model.stream(req)
        first, n = None, 0
        try:
            while True:
                n += len(next(gen))
                first = first or time.perf_counter()
        except StopIteration:
            pass
        t1 = time.perf_counter()
        ttft.append(first - t0)
        per_token.append((t1 - first) / max(1, n - 1))
        tps.append(n / (t1 - t0))
    model.close()
    return {"ttft_ms": 1e3 * statistics.median(ttft[1:]), "per_token_ms": 1e3 * statistics.median(per_token[1:]),
            "tokens_per_s": statistics.median(tps[1:])}


def one_stream(client, prompt, loops, max_tokens):
    t0 = time.perf_counter()
    first, n = None, 0
    stream = client.generate(prompt, loops=loops, max_tokens=max_tokens)
    for chunk in stream:
        n += len(chunk.ids)
        first = first or time.perf_counter()
    return t0, first, time.perf_counter(), n


def service(path: str, prompt: list[int], loops: int, max_tokens: int, reps: int, device: str,
            concurrency: list[int], torch_threads: int) -> dict:
    import ray

    from tinyloop.client import TinyLoopClient
    from tinyloop.gateway import workers
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    actors = workers.spawn(1, workers.WorkerOptions(model_path=path, lanes=max(concurrency),
                                                    max_seq_len=len(prompt) + max_tokens + 8, device=device,
                                                    torch_threads=torch_threads))
    gw = GatewayThread(actors, GatewayOptions(port=0))
    try:
        with TinyLoopClient(gw.address) as c:
            ttft, per_token = [], []
            for _ in range(reps + 1):
                t0, first, t1, n = one_stream(c, prompt, loops, max_tokens)
                ttft.append(first - t0)
                per_token.append((t1 - first) / max(1, n - 1))
            out = {"ttft_ms": 1e3 * statistics.median(ttft[1:]),
                   "per_token_ms": 1e3 * statistics.median(per_token[1:]), "throughput": {}}
        for k in concurrency:
            clients = [TinyLoopClient(gw.address) for _ in range(k)]
            with concurrent.futures.ThreadPoolExecutor(k) as pool:
                t0 = time.perf_counter()
                results = list(pool.map(lambda cl: one_stream(cl, prompt, loops, max_tokens), clients))
                wall = time.perf_counter() - t0
            for cl in clients:
                cl.close()
            tokens = sum(r[3] for r in results)
            out["throughput"][str(k)] = {"streams": k, "tokens": tokens, "wall_s": wall,
                                         "tokens_per_s": tokens / wall,
                                         "median_ttft_ms": 1e3 * statistics.median(r[1] - r[0] for r in results)}
        return out
    finally:
        gw.stop(1.0)
        ray.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--loops", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "service-cpu.json"))
    args = p.parse_args()

    import torch
    torch.set_num_threads(args.torch_threads)
    prompt = [(7 * i + 3) % 256 for i in range(args.prompt_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{args.preset}.tinyloop")
        make_model(args.preset, path)
        base = in_process(path, prompt, args.loops, args.max_tokens, args.reps, args.device)
        svc = service(path, prompt, args.loops, args.max_tokens, args.reps, args.device, args.concurrency,
                      args.torch_threads)
    from bench.common import provenance
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
        **provenance(),
        "hardware": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                     "cpu_count": os.cpu_count(), "device": args.device, "python": platform.python_version(),
                     "torch": torch.__version__, "torch_threads": args.torch_threads},
        "workload": {"preset": args.preset, "loops": args.loops, "prompt_tokens": args.prompt_tokens,
                     "max_tokens": args.max_tokens, "reps": args.reps, "greedy": True},
        "in_process": base,
        "service": svc,
        "overhead": {"per_token_ms": svc["per_token_ms"] - base["per_token_ms"],
                     "ttft_ms": svc["ttft_ms"] - base["ttft_ms"],
                     "per_token_ratio": svc["per_token_ms"] / base["per_token_ms"]},
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
