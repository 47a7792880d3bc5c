"""What a Ray hop costs the service's latency, with no model behind it: the floor under the
gateway's time to first token.

    python -m bench.ray_hop                 # writes bench/results/ray-hop-cpu.json

The gateway places each request on a worker actor as one Ray streaming call
(`actor.generate.options(num_returns="streaming")`) and awaits each yielded item; the worker
yields the first tokens at once. This measures that path alone on a local Ray cluster, from an
asyncio driver as the gateway's: a plain actor call's round trip, a streaming call's first item,
and each further item of the stream (medians over --calls calls). A service's TTFT overhead over
in-process (bench/load.py's `one_stream_vs_in_process`) is at least the streaming call's first
item plus gRPC's own hop.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from bench.common import hardware, write


async def measure(calls: int, items: int) -> dict:
    import ray

    @ray.remote(max_concurrency=100)
    class Echo:
        async def stream(self, n: int):
            for i in range(n):
                yield {"ids": [i]}

        async def call(self) -> int:
            return 1

    actor = Echo.remote()
    await actor.call.remote()  # the actor up and its method warm
    async for ref in actor.stream.options(num_returns="streaming").remote(items):
        await ref
    plain, first, rest = [], [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        await actor.call.remote()
        plain.append(time.perf_counter() - t0)
    for _ in range(calls):
        t0 = time.perf_counter()
        t_first = None
        async for ref in actor.stream.options(num_returns="streaming").remote(items):
            await ref
            if t_first is None:
                t_first = time.perf_counter()
        first.append(t_first - t0)
        rest.append((time.perf_counter() - t_first) / max(1, items - 1))
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return {"plain_call_ms": ms(plain), "stream_first_item_ms": ms(first), "stream_next_item_ms": ms(rest),
            "calls": calls, "items_per_stream": items}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100, help="calls of each kind (medians)")
    ap.add_argument("--items", type=int, default=8, help="items a streaming call yields")
    ap.add_argument("--num-cpus", type=int, default=2, help="the local Ray cluster's CPUs")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.calls < 1 or args.items < 2:
        raise ValueError(f"--calls must be >= 1 and --items >= 2, got {args.calls} and {args.items}")
    import ray
    started = not ray.is_initialized()  # a caller's cluster (a test process's) is reused, and left up
    if started:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        res = asyncio.run(measure(args.calls, args.items))
    finally:
        if started:
            ray.shutdown()
    print(f"Ray actor call {res['plain_call_ms']:.2f} ms; streaming call: first item "
          f"{res['stream_first_item_ms']:.2f} ms, each next {res['stream_next_item_ms']:.2f} ms")
    write("ray-hop-cpu", {"hardware": hardware(torch.device("cpu")), "ray": ray.__version__, "results": res},
          args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
