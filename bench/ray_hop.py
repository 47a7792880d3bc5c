"""What the hop from the gateway to a worker costs the service's latency, with no model behind
it: the floor under the gateway's time to first token, by each path a stream can take.

    python -m bench.ray_hop                 # writes bench/results/ray-hop-cpu.json

A stream reaches the gateway either as a Ray streaming call
(`actor.generate.options(num_returns="streaming")`, each yielded item awaited) or over the
worker's token channel (worker/serving/channel.py: frames on a TCP connection from the worker
process, the real channel server in front of the actor's `generate`). The worker yields the first tokens
at once. This measures both alone on a local Ray cluster, from an asyncio driver as the
gateway's: a plain actor call's round trip, and for each path a stream's first item and each
further item (medians over --calls calls). A service's TTFT overhead over in-process
(bench/load.py's `one_stream_vs_in_process`) is at least its path's first item plus the public
gRPC hop.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from bench.common import hardware, write


class Echo:
    """A worker with no model: its `generate` yields `max_tokens` one-token chunks, then a Complete,
    the shape of `WorkerActor.generate`'s stream."""

    async def generate(self, key: str, caller: str, p):
        for i in range(p.max_tokens):
            yield {"ids": [i], "text": ""}
        yield {"complete": {"reason": "length", "stats": {"completion_tokens": p.max_tokens}, "worker_id": "echo"}}

    async def stream(self, n: int):
        for i in range(n):
            yield {"ids": [i]}

    async def call(self) -> int:
        return 1

    async def channel(self) -> dict:
        from tinyloop.worker.serving import channel
        if not hasattr(self, "_channel"):
            self._channel = await channel.serve(self, channel.ChannelOptions(host="127.0.0.1"))
        return self._channel[1]


async def _channel_hops(actor, calls: int, items: int) -> tuple[list[float], list[float]]:
    from tinyloop.worker.serving import channel, channel_pb2 as cpb
    info = await actor.channel.remote()
    first, rest = [], []
    link = await channel.Link.open(info["address"], info["token"])
    try:
        call = cpb.StreamCall(key="k", caller="bench", generate=cpb.GenerateParams(max_tokens=items))
        async for _ in link.stream("k", call):  # the connection up and the handler warm
            pass
        for _ in range(calls):
            t0 = time.perf_counter()
            t_first = None
            async for ev in link.stream("k", call):
                if t_first is None:
                    t_first = time.perf_counter()
            first.append(t_first - t0)
            rest.append((time.perf_counter() - t_first) / items)  # the items after the first, and the Complete
    finally:
        await link.close()
    return first, rest


async def measure(calls: int, items: int) -> dict:
    import ray

    actor = ray.remote(max_concurrency=100)(Echo).remote()
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
    ch_first, ch_rest = await _channel_hops(actor, calls, items)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return {"plain_call_ms": ms(plain), "stream_first_item_ms": ms(first), "stream_next_item_ms": ms(rest),
            "channel_first_item_ms": ms(ch_first), "channel_next_item_ms": ms(ch_rest),
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
    print(f"Ray actor call {res['plain_call_ms']:.2f} ms; Ray streaming call: first item "
          f"{res['stream_first_item_ms']:.2f} ms, each next {res['stream_next_item_ms']:.2f} ms; worker channel: "
          f"first item {res['channel_first_item_ms']:.2f} ms, each next {res['channel_next_item_ms']:.2f} ms")
    write("ray-hop-cpu", {"hardware": hardware(torch.device("cpu")), "ray": ray.__version__, "results": res},
          args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
