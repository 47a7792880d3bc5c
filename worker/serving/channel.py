"""The worker's token channel (proto/tinyloop/worker/v1/channel.proto): the gateway's Generate and
Resume streams over gRPC, straight into the worker process.

Why not Ray for the tokens. A Ray streaming call puts an object per item and wakes the caller
through the cluster's core worker: a few milliseconds before the first item and about one per
later hop, on the worker's one interpreter (bench/ray_hop.py). Every stream's first token pays
that in TTFT, and with many streams the hops, not the GPU, bound the worker. A message on an
open HTTP/2 connection costs a fraction of it. Ray keeps what it is good at: placement, restarts
with a new epoch, and the unary calls (handles, scoring, stats).

The servicer is a thin codec over the actor's own stream methods (`WorkerActor.generate` /
`.resume`), which the Ray path calls too: the same validation, queueing, coalescing and errors
either way. Cancelling the RPC (the gateway does when its client leaves) cancels the handler, so
the actor's stream leaves the scheduler before its next step.

Access: every call carries the channel token the worker hands out through `info()` (so through
Ray) in the `x-tinyloop-worker-token` metadata; a call without it is UNAUTHENTICATED.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import grpc

from tinyloop.worker.serving import channel_pb2 as cpb
from tinyloop.worker.serving import channel_pb2_grpc as cpb_grpc

log = logging.getLogger(__name__)

TOKEN_KEY = "x-tinyloop-worker-token"
USAGE = tuple(cpb.Usage.DESCRIPTOR.fields_by_name)  # the usage figures a Complete carries
MAX_MESSAGE_BYTES = 64 << 20  # a prompt of ids as JSON: the gateway's own limit is far below


@dataclass
class ChannelOptions:
    """Where a worker listens for its gateways' streams. `host` "0.0.0.0" listens on every
    interface and advertises the node's IP (as Ray sees it), for gateways on other nodes or pods;
    port 0 picks a free port. `enabled=False`: no channel, the streams go through Ray."""
    enabled: bool = True
    host: str = "0.0.0.0"
    port: int = 0


def error_message(item: dict) -> cpb.Error:
    """An {"error": {"code", "reason", "message"}} item as the typed messages carry it."""
    return cpb.Error(**item["error"])


def error_dict(e: cpb.Error) -> dict:
    """`error_message`'s inverse: the status fields the gateway maps (ServiceError.from_worker)."""
    return {"code": e.code, "reason": e.reason, "message": e.message}


def event(item: dict) -> cpb.StreamEvent:
    """One item of the actor's stream ({"ids", "text"} | {"complete"} | {"error"}) as a message."""
    if "error" in item:
        return cpb.StreamEvent(error=error_message(item))
    if "complete" in item:
        c = item["complete"]
        st = c["stats"]
        done = cpb.Complete(reason=c["reason"], worker_id=c["worker_id"],
                            usage=cpb.Usage(**{f: st[f] for f in USAGE if st.get(f) is not None}))
        if "handle" in c:
            done.handle.CopyFrom(cpb.Handle(**c["handle"]))
        return cpb.StreamEvent(complete=done)
    return cpb.StreamEvent(chunk=cpb.Chunk(ids=item["ids"], text=item["text"]))


def item(ev: cpb.StreamEvent) -> dict:
    """`event`'s inverse: the dict the gateway reads from either path."""
    kind = ev.WhichOneof("event")
    if kind == "chunk":
        return {"ids": list(ev.chunk.ids), "text": ev.chunk.text}
    if kind == "complete":
        c = ev.complete
        u = c.usage
        stats = {f: getattr(u, f) for f in USAGE}
        stats["iterations_histogram"] = list(u.iterations_histogram)
        done = {"reason": c.reason, "worker_id": c.worker_id, "stats": stats}
        if c.HasField("handle"):
            done["handle"] = {f.name: getattr(c.handle, f.name) for f in cpb.Handle.DESCRIPTOR.fields}
        return {"complete": done}
    if kind == "error":
        return {"error": error_dict(ev.error)}
    return {"error": {"code": "INTERNAL", "reason": "INTERNAL", "message": "an empty event on the worker channel"}}


class ChannelServicer(cpb_grpc.WorkerChannelServicer):
    def __init__(self, actor, token: str):
        self.actor, self.token = actor, token

    async def _check(self, context) -> None:
        md = dict(context.invocation_metadata() or ())
        if not secrets.compare_digest(md.get(TOKEN_KEY, ""), self.token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the worker channel token is missing or wrong")

    @staticmethod
    async def _relay(stream):
        try:
            async for it in stream:
                yield event(it)
        finally:
            await stream.aclose()  # a cancelled RPC: the actor's stream leaves the scheduler now

    async def Generate(self, request: cpb.StreamCall, context):
        await self._check(context)
        if request.WhichOneof("params") != "generate":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Generate call carries GenerateParams")
        async for ev in self._relay(self.actor.generate(request.key, request.caller, request.generate)):
            yield ev

    async def Resume(self, request: cpb.StreamCall, context):
        await self._check(context)
        if request.WhichOneof("params") != "resume":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Resume call carries ResumeParams")
        async for ev in self._relay(self.actor.resume(request.key, request.caller, request.handle_token,
                                                      request.handle_epoch, request.resume)):
            yield ev


def _advertised(host: str) -> str:
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray: this host's own name for itself
        import socket
        return socket.gethostbyname(socket.gethostname())


async def serve(actor, options: ChannelOptions):
    """Start the channel on the running event loop: (server, {"address", "token"})."""
    token = secrets.token_urlsafe(24)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    cpb_grpc.add_WorkerChannelServicer_to_server(ChannelServicer(actor, token), server)
    port = server.add_insecure_port(f"{options.host}:{options.port}")
    if port == 0:
        raise RuntimeError(f"the worker channel cannot listen on {options.host}:{options.port}")
    await server.start()
    host = _advertised(options.host)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    log.info("worker channel listening on %s", address)
    return server, {"address": address, "token": token}
