"""What the hop from the gateway to a worker costs the service's latency, with no model behind
it: the floor under the gateway's time to first token, by each path a stream can take.

    python -m bench.ray_hop                 # writes bench/results/ray-hop-cpu.json

A stream reaches the gateway either as a Ray streaming call
(`actor.generate.options(num_returns="streaming")`, each yielded item awaited) or over the
worker's token channel (worker/serving/channel.py: frames on a TCP connection from the worker
process, the real channel server in front of the actor's `generate`). The worker yields the first tokens
at once. This measures both alone on a local Ray cluster, from an asyncio driver as the
gateway's: a plain actor call's round trip, and for each path a stream's first item and each
further item (medians over --calls calls).

The public side too, from an asyncio client (`AsyncTinyLoopClient`) as a caller's: the bare gRPC
hop (a grpc.aio server on its own event loop thread, with the gateway's server options and
interceptor, whose `Generate` yields the items at once), and the whole path through the real
gateway (`GatewayThread`) in front of the same worker over its channel. A service's TTFT overhead
over in-process (bench/load.py's `ttft_overhead_ms`) is at least the gateway path's first item;
that less the bare gRPC hop and the channel's first item is what the gateway's own code adds.
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

    async def info(self) -> dict:
        """What the gateway reads of a worker's info (`WorkerActor.info`): its channel offered."""
        return {"worker_id": "echo", "epoch": 0, "lanes": 1, "vocab_size": 256, "max_loops": 8, "default_loops": 8,
                "channel": await self.channel()}

    async def stats(self, origin: str = "") -> dict:
        """What the gateway's health poll reads (`WorkerActor.stats`)."""
        return {"epoch": 0, "streams": 0, "own_streams": 0, "queued": 0, "active_lanes": 0, "steps": {}}

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


class _BareServer:
    """A grpc.aio server on its own event loop thread, set up as the gateway's (its server options
    and interceptor), whose `Generate` yields `max_tokens` one-token chunks and a Complete at once."""

    def __init__(self):
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bare-grpc", daemon=True)
        self.thread.start()
        self.server, self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)

    async def _start(self):
        import grpc

        from tinyloop.client import tinyloop_pb2 as pb
        from tinyloop.client import tinyloop_pb2_grpc as pb_grpc
        from tinyloop.gateway.server import GatewayOptions, MalformedRequests, server_options

        class Servicer(pb_grpc.TinyLoopServicer):
            async def Generate(self, request, context):
                for i in range(request.max_tokens):
                    yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.Chunk(ids=[i]))
                yield pb.GenerateResponse(request_id=request.request_id, complete=pb.Complete(
                    finish_reason=pb.FINISH_REASON_LENGTH, worker_id="echo"))

        server = grpc.aio.server(options=server_options(GatewayOptions()), interceptors=[MalformedRequests()])
        pb_grpc.add_TinyLoopServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _public_hops(address: str, calls: int, items: int) -> tuple[list[float], list[float]]:
    """A stream's first item and each next one (the Complete included) from an asyncio client."""
    from tinyloop.client import AsyncTinyLoopClient

    first, rest = [], []
    async with AsyncTinyLoopClient(address) as c:
        await c.generate([1] * 8, loops=8, max_tokens=items).collect()  # the connection up, the handler warm
        for _ in range(calls):
            t0 = time.perf_counter()
            t_first = None
            async for _ in c.generate([1] * 8, loops=8, max_tokens=items):
                if t_first is None:
                    t_first = time.perf_counter()
            first.append(t_first - t0)
            rest.append((time.perf_counter() - t_first) / items)
    return first, rest


def public(actor, calls: int, items: int) -> dict:
    """The bare gRPC hop and the whole path through the gateway in front of `actor`, each from an
    asyncio client on this thread, the servers on threads of their own."""
    from tinyloop.gateway.server import GatewayOptions, GatewayThread

    bare = _BareServer()
    try:
        b_first, b_rest = asyncio.run(_public_hops(f"127.0.0.1:{bare.port}", calls, items))
    finally:
        bare.stop()
    gw = GatewayThread([actor], GatewayOptions(port=0))
    try:
        g_first, g_rest = asyncio.run(_public_hops(gw.address, calls, items))
    finally:
        gw.stop()
    return {"grpc_first_item_ms": _ms(b_first), "grpc_next_item_ms": _ms(b_rest),
            "gateway_first_item_ms": _ms(g_first), "gateway_next_item_ms": _ms(g_rest)}


def _ms(xs: list[float]) -> float:
    return round(1e3 * statistics.median(xs), 3)


async def measure(calls: int, items: int) -> tuple[dict, object]:
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
    return {"plain_call_ms": _ms(plain), "stream_first_item_ms": _ms(first), "stream_next_item_ms": _ms(rest),
            "channel_first_item_ms": _ms(ch_first), "channel_next_item_ms": _ms(ch_rest),
            "calls": calls, "items_per_stream": items}, actor


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
        res, actor = asyncio.run(measure(args.calls, args.items))
        res.update(public(actor, args.calls, args.items))
        ray.kill(actor)
    finally:
        if started:
            ray.shutdown()
    # what the gateway's own code adds to a first item: its path less the two hops it is made of
    res["gateway_own_first_item_ms"] = round(
        res["gateway_first_item_ms"] - res["grpc_first_item_ms"] - res["channel_first_item_ms"], 3)
    print(f"Ray actor call {res['plain_call_ms']:.2f} ms; Ray streaming call: first item "
          f"{res['stream_first_item_ms']:.2f} ms, each next {res['stream_next_item_ms']:.2f} ms; worker channel: "
          f"first item {res['channel_first_item_ms']:.2f} ms, each next {res['channel_next_item_ms']:.2f} ms; "
          f"bare gRPC: first item {res['grpc_first_item_ms']:.2f} ms; through the gateway: first item "
          f"{res['gateway_first_item_ms']:.2f} ms (its own code {res['gateway_own_first_item_ms']:.2f} ms)")
    write("ray-hop-cpu", {"hardware": hardware(torch.device("cpu")), "ray": ray.__version__, "results": res},
          args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
