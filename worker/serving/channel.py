"""The worker's token channel: the gateway's Generate and Resume streams straight into the
worker process, as frames on one TCP connection per gateway (proto/tinyloop/worker/v1/channel.proto,
`LinkFrame`: a 4-byte big-endian length, then the serialized frame).

Why not Ray for the tokens. A Ray streaming call puts an object per item and wakes the caller
through the cluster's core worker: a few milliseconds before the first item and about one per
later hop, on the worker's one interpreter (bench/ray_hop.py). Ray keeps what it is good at:
placement, restarts with a new epoch, and the unary calls (handles, scoring, stats).

Why not gRPC either. A gRPC round trip from Python costs about a millisecond of thread
hand-offs inside grpcio on each side (its completion-queue poller wakes the event loop), a
frame on an asyncio stream a tenth of that (bench/transport.py), and every stream's first
token pays it once more behind the public API's own gRPC hop. The frames are protobuf messages,
so the contract stays typed and versioned in the .proto.

The server (`serve`) is a thin codec over the actor's own stream methods
(`WorkerActor.generate` / `.resume`), which the Ray path calls too: the same validation,
queueing, coalescing and errors either way. A `cancel` frame (the gateway sends one when its
client leaves) or the connection's end cancels the stream's task, so the actor's stream leaves
the scheduler before its next step. The gateway's side is `Link`: one connection, streams
multiplexed by key, each read from its own queue.

Access: the connection's first frame is a `LinkHello` with the channel token the worker hands
out through `info()` (so through Ray); with any other first frame, or a wrong token, the
worker answers one error frame and closes the connection.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import struct

from tinyloop.worker.serving import channel_pb2 as cpb
from tinyloop.worker.serving.options import ChannelOptions  # noqa: F401 (where a worker listens)

log = logging.getLogger(__name__)

USAGE = tuple(cpb.Usage.DESCRIPTOR.fields_by_name)  # the usage figures a Complete carries
MAX_FRAME_BYTES = 64 << 20  # a frame's largest body (a long prompt of ids): the gateway's own limit is far below
_LENGTH = struct.Struct(">I")


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


class ChannelClosed(Exception):
    """The connection to the worker's channel ended (the worker died or restarted, or refused
    the token)."""


class Interrupted(Exception):
    """The gateway ended the stream on its side (`Link.interrupt`: its drain ran out)."""


_INTERRUPT = object()  # a stream queue's item: `Link.interrupt`


def frame(f: cpb.LinkFrame) -> bytes:
    data = f.SerializeToString()
    return _LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> cpb.LinkFrame | None:
    """The next frame; None at the connection's end. ValueError: a frame over MAX_FRAME_BYTES or
    one that does not parse (the peer speaks something else)."""
    try:
        n, = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if n > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {n} bytes, over the channel's limit {MAX_FRAME_BYTES}")
        data = await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    f = cpb.LinkFrame()
    try:
        f.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"a frame that is not a LinkFrame ({e})") from None
    return f


def _refusal(message: str) -> bytes:
    return frame(cpb.LinkFrame(event=cpb.StreamEvent(error=cpb.Error(
        code="UNAUTHENTICATED", reason="UNAUTHENTICATED", message=message))))


def _invalid(message: str) -> dict:
    """An INVALID_ARGUMENT error event (the wire's error item) for a malformed call."""
    return {"error": {"code": "INVALID_ARGUMENT", "reason": "INVALID_ARGUMENT", "message": message}}


class _Connection:
    """One gateway's connection on the worker: its streams by key."""

    def __init__(self, actor, token: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.actor, self.token, self.reader, self.writer = actor, token, reader, writer
        self.tasks: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        try:
            hello = await read_frame(self.reader)
            if hello is None or hello.WhichOneof("body") != "hello":
                self.writer.write(_refusal("the channel's first frame must be a LinkHello with its token"))
                return
            if not secrets.compare_digest(hello.hello.token, self.token):
                self.writer.write(_refusal("the worker channel token is wrong"))
                return
            while (f := await read_frame(self.reader)) is not None:
                kind = f.WhichOneof("body")
                if kind == "start":
                    if f.key in self.tasks:
                        self._send(f.key, _invalid(f"stream {f.key!r} is already running"))
                        continue
                    self.tasks[f.key] = asyncio.ensure_future(self._stream(f.key, f.start))
                elif kind == "cancel":
                    task = self.tasks.pop(f.key, None)
                    if task is not None:
                        task.cancel()
        except ValueError as e:
            log.warning("worker channel: closing a connection that sent %s", e)
        finally:
            for task in self.tasks.values():
                task.cancel()
            self.writer.close()

    def _send(self, key: str, it: dict) -> None:
        # one write per frame: frames of concurrent streams never interleave
        self.writer.write(frame(cpb.LinkFrame(key=key, event=event(it))))

    async def _stream(self, key: str, call: cpb.StreamCall) -> None:
        kind = call.WhichOneof("params")
        if kind == "generate":
            stream = self.actor.generate(key, call.caller, call.generate)
        elif kind == "resume":
            stream = self.actor.resume(key, call.caller, call.handle_token, call.handle_epoch, call.resume)
        else:
            self._send(key, _invalid("a StreamCall carries GenerateParams or ResumeParams"))
            self.tasks.pop(key, None)
            return
        try:
            async for it in stream:
                self._send(key, it)
                if self.writer.transport.get_write_buffer_size() > (1 << 20):
                    await self.writer.drain()  # a gateway that stopped reading: wait, do not buffer
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            await stream.aclose()  # cancelled or cut off: the actor's stream leaves the scheduler now
            self.tasks.pop(key, None)


class Link:
    """The gateway's connection to one worker's channel: `await Link.open(address, token)`,
    then `link.stream(key, call)` per stream, concurrently. A link whose connection ended
    (`closed`) fails its streams with ChannelClosed; open a new one."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.queues: dict[str, asyncio.Queue] = {}
        self.closed = False
        self._reading = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, address: str, token: str, timeout_s: float = 10.0) -> "Link":
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
        writer.write(frame(cpb.LinkFrame(hello=cpb.LinkHello(token=token))))
        return cls(reader, writer)

    async def _read(self) -> None:
        try:
            while (f := await read_frame(self.reader)) is not None:
                q = self.queues.get(f.key)
                if q is not None:
                    q.put_nowait(f.event)
                elif not f.key and f.event.WhichOneof("event") == "error":  # the worker refused the connection
                    log.warning("worker channel refused this gateway: %s", f.event.error.message)
        except ValueError as e:
            log.warning("worker channel: %s", e)
        finally:
            self.closed = True
            for q in self.queues.values():
                q.put_nowait(None)
            self.writer.close()

    async def stream(self, key: str, call: cpb.StreamCall):
        """The stream's events (StreamEvent) up to its Complete or Error; ChannelClosed when the
        connection ends first. Closing the iterator early (the caller left) cancels the stream
        on the worker."""
        if self.closed:
            raise ChannelClosed("the connection to the worker's channel has ended")
        q = self.queues[key] = asyncio.Queue()
        self.writer.write(frame(cpb.LinkFrame(key=key, start=call)))
        done = False
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    raise ChannelClosed("the connection to the worker's channel ended mid-stream")
                if ev is _INTERRUPT:
                    raise Interrupted(f"stream {key} interrupted by the gateway")
                done = ev.WhichOneof("event") != "chunk"
                yield ev
                if done:
                    return
        finally:
            del self.queues[key]
            if not done and not self.closed:
                self.writer.write(frame(cpb.LinkFrame(key=key, cancel=True)))

    def interrupt(self, key: str) -> bool:
        """End the stream `key` where its consumer next waits for an event: its iterator raises
        Interrupted there (and cancels the stream on the worker). A consumer busy elsewhere,
        sending the last event on, finishes that first, unlike a task cancel, which can land in
        the middle of it. False: no such stream (it has ended)."""
        q = self.queues.get(key)
        if q is None:
            return False
        q.put_nowait(_INTERRUPT)
        return True

    async def close(self) -> None:
        self.closed = True
        self.writer.close()
        self._reading.cancel()
        try:
            await self.writer.wait_closed()
        except Exception:  # already reset by the peer
            pass


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

    async def accept(reader, writer):
        await _Connection(actor, token, reader, writer).run()

    server = await asyncio.start_server(accept, options.host, options.port)
    port = server.sockets[0].getsockname()[1]
    host = _advertised(options.host)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    log.info("worker channel listening on %s", address)
    return server, {"address": address, "token": token}
