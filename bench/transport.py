"""Round-trip latency between two processes on one host: gRPC (grpc.aio) against asyncio streams.

    python -m bench.transport --out-dir $OUT        # -> transport-<device>.json

What a hop of the service costs before any of its own code runs: a server process echoes, a
client times request -> first reply. gRPC: a new unary-stream call per request (how the
gateway calls a worker per stream), and a ping-pong on one long-lived bidirectional call;
asyncio: a ping-pong of length-prefixed frames on one TCP connection. p50 / p99 over --calls
round trips after --warmup.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import time

from bench.common import hardware, write


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grpc_server(port: int, ready) -> None:
    import grpc

    async def one(req, ctx):
        yield b"x" * 16

    async def bidi(it, ctx):
        async for _ in it:
            yield b"x" * 16

    async def main():
        s = grpc.aio.server()
        s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("e.E", {
            "G": grpc.unary_stream_rpc_method_handler(one), "B": grpc.stream_stream_rpc_method_handler(bidi)}),))
        s.add_insecure_port(f"127.0.0.1:{port}")
        await s.start()
        ready.set()
        await s.wait_for_termination()
    asyncio.run(main())


def _tcp_server(port: int, ready) -> None:
    async def handle(r, w):
        try:
            while True:
                n, = struct.unpack(">I", await r.readexactly(4))
                await r.readexactly(n)
                w.write(struct.pack(">I", 16) + b"x" * 16)
        except asyncio.IncompleteReadError:
            return

    async def main():
        s = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        await s.serve_forever()
    asyncio.run(main())


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_ms": 1e3 * statistics.median(xs), "p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


async def _grpc_client(port: int, calls: int, warmup: int) -> dict:
    import grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        await ch.channel_ready()
        g, b = ch.unary_stream("/e.E/G"), ch.stream_stream("/e.E/B")
        new = []
        for i in range(warmup + calls):
            t0 = time.perf_counter()
            async for _ in g(b"q"):
                pass
            new.append(time.perf_counter() - t0)
        call, pp = b(), []
        for i in range(warmup + calls):
            t0 = time.perf_counter()
            await call.write(b"q")
            await call.read()
            pp.append(time.perf_counter() - t0)
        call.cancel()
    return {"new_call": _stats(new[warmup:]), "ping_pong_one_call": _stats(pp[warmup:])}


async def _tcp_client(port: int, calls: int, warmup: int) -> dict:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    pp = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        w.write(struct.pack(">I", 1) + b"q")
        n, = struct.unpack(">I", await r.readexactly(4))
        await r.readexactly(n)
        pp.append(time.perf_counter() - t0)
    w.close()
    return {"ping_pong_one_connection": _stats(pp[warmup:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    out = {}
    for name, server, client in (("grpc_aio", _grpc_server, _grpc_client), ("asyncio_streams", _tcp_server, _tcp_client)):
        port, ready = _port(), mp.Event()
        p = mp.Process(target=server, args=(port, ready), daemon=True)
        p.start()
        ready.wait(30)
        try:
            out[name] = asyncio.run(client(port, args.calls, args.warmup))
        finally:
            p.kill()
        print(name, out[name], flush=True)
    import grpc
    import torch
    host = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # names the host: the hops run on CPU
    hw = hardware(host)
    hw.update(cores=os.cpu_count(), cpu=platform.processor() or platform.machine())
    write(f"transport-{host.type}", {"hardware": hw, "grpcio": grpc.__version__, "calls": args.calls,
                                     "results": out}, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
