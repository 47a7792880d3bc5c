"""The grpc.aio gateway in front of the worker actors.

Per RPC: auth and caller identity from metadata → cheap wire checks (the worker re-checks
everything with the Model's own messages) → placement (new work: the least-loaded live
worker; handle calls: the worker named inside the handle id) → the worker: Generate and Resume
stream over the worker's token channel (frames on one TCP connection straight into the
worker process, worker/serving/channel.py), or a Ray streaming call where the channel is off; the unary calls
are Ray calls.

Cancellation: when the client cancels or its deadline passes, grpc.aio cancels the handler
task; the handler's `finally` tells the worker to stop the stream (checked before every
decode step) and cancels the Ray streaming task (or the channel call, which cancels the worker's
stream itself), so the lane is free within one step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import grpc
import numpy as np
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tinyloop.client import tinyloop_pb2 as pb
from tinyloop.client import tinyloop_pb2_grpc as pb_grpc
from tinyloop.gateway import handles, metrics
from tinyloop.gateway.status import ServiceError, invalid
from tinyloop.worker.serving import channel as worker_channel
from tinyloop.worker.serving import channel_pb2 as cpb

log = logging.getLogger("tinyloop.gateway")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TinyLoop"].full_name
CALLER_KEY = "x-tinyloop-caller"
ANONYMOUS = "anonymous"
FINISH = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP, "safety": pb.FINISH_REASON_SAFETY}
_ACTOR_ERRORS = tuple(getattr(ray.exceptions, n) for n in
                      ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError")
                      if hasattr(ray.exceptions, n))


@dataclass
class GatewayOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 4 << 20
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    drain_grace_s: float = 10.0
    health_interval_s: float = 1.0  # how often the gateway asks each worker whether it is alive
    auth_tokens: dict[str, str] = field(default_factory=dict)  # bearer token -> caller identity
    tls_cert_file: str | None = None       # PEM certificate chain: serve TLS (with tls_key_file)
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # PEM CA bundle: require client certificates it signed (mutual TLS)
    max_prompt_tokens: int = 1 << 20
    worker_channel: bool = True  # stream over a worker's token channel where it offers one (else Ray)


def server_options(o: GatewayOptions) -> list[tuple[str, int]]:
    """Set explicitly: keepalive (detect dead peers behind load balancers, allow client pings)
    and message size both ways."""
    return [
        ("grpc.max_receive_message_length", o.max_message_bytes),
        ("grpc.max_send_message_length", o.max_message_bytes),
        ("grpc.keepalive_time_ms", o.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", o.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


class _Worker:
    def __init__(self, index: int, actor, info: dict):
        self.index, self.actor, self.info = index, actor, info
        self.inflight = 0  # this gateway's streams on the worker now
        # the worker's count of the other gateways' (and callers') streams at its last poll (its
        # stats, asked for every health interval: every stream it holds, less this gateway's)
        self.others = 0
        self.label = info["worker_id"]
        self.healthy = True
        metrics.UP.labels(self.label).set(1)
        self.lanes = max(1, int(info.get("lanes", 1)))
        for key, seconds in info.get("startup", {}).items():  # worker/api.py Model.startup
            if key.endswith("_s"):
                metrics.STARTUP.labels(self.label, key[:-2]).set(seconds)
        self.channel: dict | None = None  # {"address", "token"} of the worker's token channel, where taken up
        self._link: worker_channel.Link | None = None
        self._opening = asyncio.Lock()

    @property
    def channel_token(self) -> str:
        return self.channel["token"] if self.channel else ""

    async def connect(self, use_channel: bool) -> None:
        """Take up the token channel the worker's info offers (a restarted worker offers a new
        address and token); its connection opens with the first stream. Without one, or with
        use_channel off, streams go through Ray."""
        await self.close()
        self.channel = self.info.get("channel") if use_channel else None

    async def link(self) -> worker_channel.Link:
        """The open connection to the worker's channel: opened on first use, and again after
        one ended (a restart, a network cut)."""
        async with self._opening:
            if self._link is None or self._link.closed:
                if self._link is not None:
                    await self._link.close()
                self._link = await worker_channel.Link.open(self.channel["address"], self.channel["token"])
            return self._link

    async def refresh(self, use_channel: bool, timeout_s: float | None = None) -> None:
        """Its info asked again (a restarted worker: a new epoch, channel address and token), and
        the channel taken up from it."""
        self.info = await asyncio.wait_for(_ref(self.actor.info.remote()), timeout_s)
        await self.connect(use_channel)

    async def close(self) -> None:
        if self._link is not None:
            link, self._link = self._link, None
            await link.close()

    def load_now(self) -> int:
        """Streams on the worker now, as far as this gateway can tell: its own, counted live,
        and the others' at the last poll (their changes show at the next)."""
        return self.others + self.inflight

    def polled(self, stats: dict) -> None:
        """A poll's stats (`WorkerActor.stats` asked with this gateway's origin)."""
        self.others = max(0, int(stats["streams"]) - int(stats.get("own_streams", 0)))


def _deadline(context, p) -> None:
    """The call's remaining time, for the worker: it drops the request if still queued then."""
    remaining = context.time_remaining()
    if remaining is not None:
        p.timeout_s = remaining


def _brief(e: BaseException) -> str:
    """An error for one log line: its type and the first line of its message (a Ray actor
    error's message carries the actor's whole traceback)."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class _ChannelDown(Exception):
    """The worker's token channel broke mid-call (the worker died or restarted)."""


class TinyLoopServicer(pb_grpc.TinyLoopServicer):
    def __init__(self, workers: list[_Worker], options: GatewayOptions):
        self.workers = workers
        self.o = options
        first = workers[0].info
        self.vocab_size, self.max_loops = first["vocab_size"], first["max_loops"]
        self.default_loops = first["default_loops"]
        self.draining = False
        self.inflight = 0
        # this gateway's id: the prefix of its stream keys, which the workers count it by
        self.origin = uuid.uuid4().hex[:12]
        self._rr = itertools.count()
        self.on_health = None  # async callback(serving: bool), set by Gateway: some worker can take work or none
        self.streams: set[asyncio.Task] = set()  # the handler tasks of the streams in flight
        self.cut: set[asyncio.Task] = set()      # those the drain cut at the end of its grace
        # handler task -> ends its stream at its next wait for an item (a worker channel stream's)
        self.interrupts: dict[asyncio.Task, Callable[[], bool]] = {}

    # -- plumbing -----------------------------------------------------------------------
    def _caller(self, context) -> str:
        md = {k: v for k, v in context.invocation_metadata() or ()}
        claimed = md.get(CALLER_KEY)
        if self.o.auth_tokens:
            auth = md.get("authorization", "")
            if not auth.lower().startswith("bearer "):
                raise ServiceError("UNAUTHENTICATED", "UNAUTHENTICATED", "a bearer token is required")
            principal = self.o.auth_tokens.get(auth[7:].strip())
            if principal is None:
                raise ServiceError("UNAUTHENTICATED", "UNAUTHENTICATED", "unknown bearer token")
            if claimed is not None and claimed != principal:
                raise ServiceError("PERMISSION_DENIED", "PERMISSION_DENIED",
                                   f"{CALLER_KEY} {claimed!r} does not match the token's principal")
            return principal
        return claimed or ANONYMOUS

    def _enter(self, method: str, context) -> str:
        metrics.REQUESTS.labels(method).inc()
        if self.draining:
            raise ServiceError("UNAVAILABLE", "DRAINING", "the gateway is shutting down")
        return self._caller(context)

    async def _fail(self, method: str, context, e: ServiceError):
        metrics.ERRORS.labels(method, e.reason).inc()
        await context.abort_with_status(e.to_status())

    def _pick(self) -> _Worker:
        """The healthy worker with the smallest share of its lanes taken, by `_Worker.load_now`;
        ties rotate so equal workers share new work."""
        start = next(self._rr)
        n = len(self.workers)
        live = [self.workers[(start + i) % n] for i in range(n) if self.workers[(start + i) % n].healthy]
        if not live:
            raise ServiceError("UNAVAILABLE", "WORKER_UNAVAILABLE", "no worker is available")
        return min(live, key=lambda w: w.load_now() / w.lanes)

    def _worker_failed(self, w: _Worker, cause: str, detail: str) -> None:
        """Take a failed worker out of placement until it answers again (after a restart, with a
        new epoch). `cause` is the metric's label (a few fixed words), `detail` the log's."""
        if w.healthy:
            w.healthy = False
            log.warning("%s is out of placement (%s): %s", w.label, cause, detail)
            metrics.UP.labels(w.label).set(0)
            metrics.LEFT.labels(w.label, cause).inc()
            loop = asyncio.get_running_loop()
            loop.create_task(self._probe(w))
            self._health_changed()

    def _health_changed(self) -> None:
        if self.on_health is not None:
            asyncio.get_running_loop().create_task(self.on_health(any(w.healthy for w in self.workers)))

    async def _probe(self, w: _Worker) -> None:
        while True:
            try:
                await w.refresh(self.o.worker_channel)
                w.healthy = True
                metrics.UP.labels(w.label).set(1)
                log.info("%s is back (epoch %d)", w.label, w.info["epoch"])
                self._health_changed()
                return
            except _ACTOR_ERRORS:
                await asyncio.sleep(0.5)

    def _route(self, handle_id: str) -> tuple[_Worker, handles.HandleRef]:
        try:
            ref = handles.decode(handle_id)
        except ValueError as e:
            raise invalid(str(e), "MALFORMED_HANDLE") from None
        if ref.worker >= len(self.workers):
            raise ServiceError("NOT_FOUND", "HANDLE_NOT_FOUND", "no such resume handle")
        return self.workers[ref.worker], ref

    async def _call(self, w: _Worker, method: str, *args):
        try:
            out = await getattr(w.actor, method).remote(*args)
        except _ACTOR_ERRORS as e:
            self._worker_failed(w, "call_failed", f"{method}: {_brief(e)}")
            raise ServiceError("UNAVAILABLE", "WORKER_UNAVAILABLE", f"{w.label} is unavailable: "
                               f"{type(e).__name__}") from None
        if out.WhichOneof("result") == "error":
            raise ServiceError.from_worker(worker_channel.error_dict(out.error))
        return out

    # -- wire checks --------------------------------------------------------------------
    def _prompt(self, prompt: pb.Prompt, name: str = "prompt") -> cpb.Prompt:
        which = prompt.WhichOneof("input")
        if which == "text":
            if not prompt.text:
                raise invalid(f"{name} is empty: at least one token is needed")
            return cpb.Prompt(text=prompt.text)
        ids = list(prompt.ids.ids) if which == "ids" else []
        if not ids:
            raise invalid(f"{name} is empty: at least one token is needed")
        if len(ids) > self.o.max_prompt_tokens:
            raise invalid(f"{name} has {len(ids)} tokens, over the gateway limit {self.o.max_prompt_tokens}",
                          "TOO_LONG")
        bad = max(ids)
        if bad >= self.vocab_size:
            raise invalid(f"{name} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        return cpb.Prompt(ids=cpb.TokenIds(ids=ids))

    def _loops(self, value: int, name: str, low: int = 1) -> int:
        if not low <= value <= self.max_loops:
            raise invalid(f"{name}={value} out of range [{low}, max_loops={self.max_loops}]")
        return value

    def _sampling(self, s: pb.SamplingParams, out: cpb.Sampling) -> None:
        if s.HasField("temperature"):
            if not s.temperature >= 0:
                raise invalid(f"temperature must be >= 0, got {s.temperature}")
            out.temperature = s.temperature
        if s.HasField("top_k"):
            out.top_k = s.top_k
        if s.HasField("top_p"):
            if not 0 < s.top_p <= 1:
                raise invalid(f"top_p must be in (0, 1], got {s.top_p}")
            out.top_p = s.top_p
        if s.HasField("repetition_penalty"):
            if not s.repetition_penalty > 0:
                raise invalid(f"repetition_penalty must be > 0, got {s.repetition_penalty}")
            out.repetition_penalty = s.repetition_penalty
        if s.HasField("seed"):
            out.seed = s.seed

    @staticmethod
    def _max_tokens(req, default: int = 128) -> int:
        n = req.max_tokens if req.HasField("max_tokens") else default
        if n < 1:
            raise invalid(f"max_tokens must be >= 1, got {n}")
        return n

    def _stops(self, ids) -> list[int]:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise invalid(f"stop_token_ids holds {bad[0]}, outside the vocabulary")
        return list(ids)

    # -- streams ------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context):
        try:
            caller = self._enter("Generate", context)
            p = cpb.GenerateParams(prompt=self._prompt(request.prompt), cache_window=request.cache_window,
                                   include_text=request.include_text,
                                   stop_token_ids=self._stops(request.stop_token_ids),
                                   max_tokens=self._max_tokens(request), kv_mode=request.kv_mode,
                                   return_handle=request.return_handle)
            if request.HasField("loops"):
                p.loops = self._loops(request.loops, "loops")
            self._sampling(request.sampling, p.sampling)
            if request.HasField("speculative"):
                s = request.speculative
                p.speculative.CopyFrom(cpb.Speculative(
                    draft_loops=self._loops(s.draft_loops, "speculative.draft_loops"),
                    verify_loops=self._loops(s.verify_loops, "speculative.verify_loops"),
                    draft_ahead=s.draft_ahead if s.HasField("draft_ahead") else 4,
                    k_branches=s.k_branches if s.HasField("k_branches") else 1))
            if request.l_warmup_tokens:
                if not request.HasField("l_warmup_loops"):
                    raise invalid("l_warmup_loops is required when l_warmup_tokens > 0")
                p.l_warmup_tokens = request.l_warmup_tokens
                p.l_warmup_loops = self._loops(request.l_warmup_loops, "l_warmup_loops")
            if request.safety_check:
                p.safety_check = True
                if request.HasField("safety_norm_threshold"):
                    if not request.safety_norm_threshold > 0:
                        raise invalid(f"safety_norm_threshold must be > 0, got {request.safety_norm_threshold}")
                    p.safety_norm_threshold = request.safety_norm_threshold
            if request.HasField("early_exit"):
                # checked by the worker's Model against its model (a gate needs a gated model)
                e = request.early_exit
                p.early_exit.CopyFrom(cpb.EarlyExit(criterion=e.criterion, cache=e.cache))
                for f in ("threshold", "min_loops", "patience"):
                    if e.HasField(f):
                        setattr(p.early_exit, f, getattr(e, f))
            if request.return_handle and request.HasField("handle_max_loops"):
                p.handle_max_loops = self._loops(request.handle_max_loops, "handle_max_loops")
            w = self._pick()
        except ServiceError as e:
            await self._fail("Generate", context, e)
            return
        _deadline(context, p)
        depth = (p.speculative.verify_loops if p.HasField("speculative")
                 else p.loops if p.HasField("loops") else self.default_loops)
        metrics.DEPTH.labels("Generate", str(depth)).inc()
        async for msg in self._stream("Generate", context, w, request.request_id, "generate", caller, p):
            yield msg

    async def Resume(self, request: pb.ResumeRequest, context):
        try:
            caller = self._enter("Resume", context)
            w, ref = self._route(request.handle_id)
            p = cpb.ResumeParams(new_loops=self._loops(request.new_loops, "new_loops"),
                                 cache_window=request.cache_window, include_text=request.include_text,
                                 stop_token_ids=self._stops(request.stop_token_ids),
                                 max_tokens=self._max_tokens(request), kv_mode=request.kv_mode)
            self._sampling(request.sampling, p.sampling)
        except ServiceError as e:
            await self._fail("Resume", context, e)
            return
        _deadline(context, p)
        metrics.DEPTH.labels("Resume", str(p.new_loops)).inc()
        async for msg in self._stream("Resume", context, w, request.request_id, "resume", caller,
                                      ref.token, ref.epoch, p):
            yield msg

    async def _stream(self, method: str, context, w: _Worker, request_id: str, actor_method: str, *args):
        key = f"{self.origin}.{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        first = True
        done = False
        items = None
        n_tokens, t_first = 0, t0
        w.inflight += 1
        self.inflight += 1
        metrics.INFLIGHT.labels(w.label).inc()
        task = asyncio.current_task()
        self.streams.add(task)
        try:
            items = (self._channel_items if w.channel is not None else self._ray_items)(w, key, actor_method, args)
            async for item in items:
                if "error" in item:
                    done = True
                    raise ServiceError.from_worker(item["error"])
                if "ids" in item:
                    if first:
                        t_first = time.perf_counter()
                        metrics.TTFT.observe(t_first - t0)
                        first = False
                    n_tokens += len(item["ids"])
                    metrics.TOKENS.labels(w.label).inc(len(item["ids"]))
                    yield pb.GenerateResponse(request_id=request_id,
                                              chunk=pb.Chunk(ids=item["ids"], text=item["text"]))
                else:
                    done = True
                    if n_tokens > 1:
                        metrics.TPOT.observe((time.perf_counter() - t_first) / (n_tokens - 1))
                    yield pb.GenerateResponse(request_id=request_id, complete=self._complete(w, item["complete"]))
            if not done:
                raise ServiceError("INTERNAL", "INTERNAL", f"{w.label} ended the stream without a Complete")
        except ServiceError as e:
            await self._fail(method, context, e)
        except (asyncio.CancelledError, worker_channel.Interrupted):
            if task not in self.cut:
                raise
            # the drain's grace ran out with this stream still going: it ends with the reason
            await self._fail(method, context, ServiceError(
                "UNAVAILABLE", "DRAINING", "the gateway shut down before the stream finished; retry elsewhere"))
        except (_ChannelDown, *_ACTOR_ERRORS) as e:
            done = True
            self._worker_failed(w, "stream_failed", f"{actor_method} mid-stream: {_brief(e)}")
            await self._fail(method, context, ServiceError(
                "UNAVAILABLE", "WORKER_UNAVAILABLE", f"{w.label} failed mid-stream ({type(e).__name__}); "
                "the request was not retried"))
        finally:
            self.streams.discard(task)
            w.inflight -= 1
            self.inflight -= 1
            metrics.INFLIGHT.labels(w.label).dec()
            metrics.LATENCY.labels(method).observe(time.perf_counter() - t0)
            if items is not None:
                # not done (a client cancel, a deadline, a send failure): each path stops the
                # worker's compute now as it closes
                await items.aclose()

    async def _ray_items(self, w: _Worker, key: str, actor_method: str, args: tuple):
        """The stream's items through a Ray streaming call."""
        gen = getattr(w.actor, actor_method).options(num_returns="streaming").remote(key, *args)
        done = False
        try:
            async for ref in gen:
                item = await ref
                done = "ids" not in item  # an error or the Complete: the worker's stream has ended
                yield item
        finally:
            if not done:
                w.actor.cancel.remote(key)
                try:
                    ray.cancel(gen)
                except Exception:  # already finished, or a Ray without generator cancel
                    pass

    async def _channel_items(self, w: _Worker, key: str, actor_method: str, args: tuple):
        """The stream's items over the worker's token channel. Leaving early (the client left)
        sends the worker a cancel, which stops its stream at once."""
        if actor_method == "generate":
            caller, p = args
            call = cpb.StreamCall(key=key, caller=caller, generate=p)
        else:
            caller, token, epoch, p = args
            call = cpb.StreamCall(key=key, caller=caller, resume=p, handle_token=token, handle_epoch=epoch)
        try:
            link = await w.link()
        except (OSError, asyncio.TimeoutError) as e:
            raise _ChannelDown(f"{w.label}'s channel cannot be reached: {type(e).__name__}: {e}") from None
        events = link.stream(key, call)
        task = asyncio.current_task()  # the handler's: it iterates this generator
        self.interrupts[task] = lambda: link.interrupt(key)
        try:
            async for ev in events:
                yield worker_channel.item(ev)
        except worker_channel.ChannelClosed as e:
            raise _ChannelDown(str(e)) from None
        finally:
            self.interrupts.pop(task, None)
            await events.aclose()

    def _complete(self, w: _Worker, c: dict) -> pb.Complete:
        st = c["stats"]
        usage = pb.Usage(prompt_tokens=st.get("prompt_tokens", 0), completion_tokens=st.get("completion_tokens", 0),
                         loop_iterations=st.get("loop_iterations", 0),
                         loop_token_iterations=st.get("loop_token_iterations", 0),
                         accepted_per_verify=st.get("accepted_per_verify", 0.0),
                         acceptance_rate=st.get("acceptance_rate", 0.0),
                         iterations_per_token=st.get("iterations_per_token", 0.0),
                         iterations_histogram=st.get("iterations_histogram", []))
        handle_id = ""
        if "handle" in c:
            h = c["handle"]
            handle_id = handles.encode(w.index, h["epoch"], h["token"])
        return pb.Complete(finish_reason=FINISH.get(c["reason"], pb.FINISH_REASON_UNSPECIFIED), usage=usage,
                           worker_id=c["worker_id"], handle_id=handle_id)

    # -- unary --------------------------------------------------------------------------
    async def BuildResumeHandle(self, request: pb.BuildResumeHandleRequest, context):
        try:
            caller = self._enter("BuildResumeHandle", context)
            # unset fields stay unset: their defaults are the model's, which the worker knows
            p = cpb.BuildParams(prompt=self._prompt(request.prompt), cache_window=request.cache_window,
                                kv_mode=request.kv_mode)
            for name in ("l_used", "max_loops", "seed"):
                if request.HasField(name):
                    setattr(p, name, getattr(request, name))
            w = self._pick()
            w.inflight += 1
            build = asyncio.ensure_future(self._call(w, "build_handle", caller, p))
            try:
                h = await asyncio.shield(build)
            except asyncio.CancelledError:
                # the caller is gone (cancel, deadline): a handle built after it left has no
                # owner who knows its id, so it is freed as soon as it exists
                build.add_done_callback(lambda t, w=w, caller=caller: self._orphaned(w, caller, t))
                raise
            finally:
                w.inflight -= 1
        except ServiceError as e:
            await self._fail("BuildResumeHandle", context, e)
            return
        h = h.handle
        return pb.BuildResumeHandleResponse(
            request_id=request.request_id, handle_id=handles.encode(w.index, h.epoch, h.token),
            seq_len=h.seq_len, loops_used=h.loops_used, max_loops=h.max_loops, nbytes=h.nbytes,
            worker_id=h.worker_id, expires_in_s=h.expires_in_s)

    def _orphaned(self, w: _Worker, caller: str, build: asyncio.Future) -> None:
        if build.cancelled() or build.exception() is not None:
            return
        built = build.result()
        metrics.ERRORS.labels("BuildResumeHandle", "ORPHANED_HANDLE_FREED").inc()
        w.actor.free_handle.remote(caller, built.handle.token, built.handle.epoch)

    async def FreeHandle(self, request: pb.FreeHandleRequest, context):
        try:
            caller = self._enter("FreeHandle", context)
            try:
                w, ref = self._route(request.handle_id)
            except ServiceError as e:
                if e.reason != "HANDLE_NOT_FOUND":
                    raise
                # idempotent, whichever worker a well-formed id names: an unknown handle is
                # already gone (freed=false), as on a worker that never issued it
                return pb.FreeHandleResponse(request_id=request.request_id, freed=False)
            out = await self._call(w, "free_handle", caller, ref.token, ref.epoch)
        except ServiceError as e:
            await self._fail("FreeHandle", context, e)
            return
        return pb.FreeHandleResponse(request_id=request.request_id, freed=out.freed)

    async def Score(self, request: pb.ScoreRequest, context):
        try:
            self._enter("Score", context)
            p = cpb.ScoreParams(prompt=self._prompt(request.prompt))
            kind = request.WhichOneof("kind")
            if kind == "consistency":
                c = request.consistency
                p.consistency.CopyFrom(cpb.Consistency(
                    loops_a=self._loops(c.loops_a, "loops_a"), loops_b=self._loops(c.loops_b, "loops_b"),
                    max_tokens=c.max_tokens if c.HasField("max_tokens") else 32))
                if p.consistency.max_tokens < 1:
                    raise invalid("max_tokens must be >= 1, got 0")
            elif kind == "uncertainty":
                u = request.uncertainty
                p.uncertainty.CopyFrom(cpb.Uncertainty(l_lo=self._loops(u.l_lo, "l_lo"),
                                                       l_hi=self._loops(u.l_hi, "l_hi"),
                                                       return_logits=u.return_logits))
                if u.l_lo > u.l_hi:
                    raise invalid(f"l_lo={u.l_lo} must be <= l_hi={u.l_hi}")
            else:
                raise invalid("set one of consistency or uncertainty")
            out = await self._call(self._pick(), "score", p)
        except ServiceError as e:
            await self._fail("Score", context, e)
            return
        resp = pb.ScoreResponse(request_id=request.request_id, worker_id=out.worker_id)
        if out.WhichOneof("result") == "consistency":
            c = out.consistency
            resp.consistency.CopyFrom(pb.ConsistencyResult(agree=c.agree, answer_a=c.answer_a, answer_b=c.answer_b,
                                                           first_divergence=c.first_divergence))
        else:
            u = out.uncertainty
            resp.uncertainty.CopyFrom(pb.UncertaintyResult(
                kl=u.kl, logits=np.frombuffer(u.logits, dtype=np.float32).tolist()))
        return resp

    async def ScoreTrajectory(self, request: pb.ScoreTrajectoryRequest, context):
        try:
            self._enter("ScoreTrajectory", context)
            p = cpb.TrajectoryParams(prompt=self._prompt(request.prompt),
                                     n_loops=self._loops(request.n_loops, "n_loops"))
            out = await self._call(self._pick(), "trajectory", p)
        except ServiceError as e:
            await self._fail("ScoreTrajectory", context, e)
            return
        t = out.trajectory
        return pb.ScoreTrajectoryResponse(request_id=request.request_id, labels=t.labels,
                                          d_model=t.d_model, worker_id=out.worker_id,
                                          hidden=np.frombuffer(t.hidden, dtype=np.float32).tolist())

    async def ModelInfo(self, request: pb.ModelInfoRequest, context):
        try:
            self._enter("ModelInfo", context)
        except ServiceError as e:
            await self._fail("ModelInfo", context, e)
            return
        import json
        i = self.workers[0].info
        resp = pb.ModelInfoResponse(model_name=i["model_path"].rsplit("/", 1)[-1], vocab_size=i["vocab_size"],
                                    d_model=i["d_model"], default_loops=i["default_loops"],
                                    max_loops=i["max_loops"], max_seq_len=i["max_seq_len"], eos_id=i["eos_id"],
                                    config_json=json.dumps(i["config"], default=str, sort_keys=True),
                                    kv_mode=i["kv_mode"], kv_bytes_per_token_layer=i["kv_bytes_per_token_layer"],
                                    weight_format=i.get("weight_format", ""))
        stats = await asyncio.gather(*(asyncio.wait_for(_ref(w.actor.info.remote()), 5.0) for w in self.workers),
                                     return_exceptions=True)
        for w, s in zip(self.workers, stats):
            alive = isinstance(s, dict)
            s = s if alive else w.info
            resp.workers.append(pb.WorkerInfo(worker_id=w.label, epoch=s["epoch"], device=s["device"],
                                              lanes=s["lanes"], active_lanes=s["active_lanes"] if alive else 0,
                                              handles=s["handles"] if alive else 0,
                                              handle_bytes=s["handle_bytes"] if alive else 0, alive=alive))
        return resp


async def _ref(ref):
    return await ref


class _Malformed:
    """What the request deserializer hands the handler for bytes that are no valid message."""

    def __init__(self, error: Exception):
        self.error = error


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the method's request message (truncated or random bytes,
    invalid UTF-8 in a string field) answer INVALID_ARGUMENT / MALFORMED_REQUEST, where grpc's
    own deserializer failure would answer UNKNOWN with the exception's class name."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as e:  # protobuf's DecodeError, or a parser's own error
                return _Malformed(e)
        kind = "unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream else None
        if kind is None:  # no streaming-request methods in this API
            return handler._replace(request_deserializer=deserialize)
        behavior = getattr(handler, kind)
        error = ServiceError("INVALID_ARGUMENT", "MALFORMED_REQUEST",
                             f"the request is not a valid {details.method.rsplit('/', 1)[-1]} message")

        if kind == "unary_unary":
            async def guarded(request, context):
                if isinstance(request, _Malformed):
                    metrics.ERRORS.labels(details.method.rsplit("/", 1)[-1], error.reason).inc()
                    await context.abort_with_status(error.to_status())
                return await behavior(request, context)
        else:
            async def guarded(request, context):
                if isinstance(request, _Malformed):
                    metrics.ERRORS.labels(details.method.rsplit("/", 1)[-1], error.reason).inc()
                    await context.abort_with_status(error.to_status())
                async for item in behavior(request, context):
                    yield item
        return handler._replace(request_deserializer=deserialize, **{kind: guarded})


def _listen(server, o: GatewayOptions) -> int:
    """Bind the port: TLS when a certificate is configured (mutual TLS with a client CA),
    plaintext otherwise. -> the port bound (0: none)."""
    address = f"{o.host}:{o.port}"
    if o.tls_cert_file is None and o.tls_key_file is None:
        if o.tls_client_ca_file is not None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file (mutual TLS is TLS)")
        return server.add_insecure_port(address)
    if o.tls_cert_file is None or o.tls_key_file is None:
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")

    def read(path):
        with open(path, "rb") as f:
            return f.read()
    ca = read(o.tls_client_ca_file) if o.tls_client_ca_file else None
    creds = grpc.ssl_server_credentials([(read(o.tls_key_file), read(o.tls_cert_file))], root_certificates=ca,
                                        require_client_auth=ca is not None)
    return server.add_secure_port(address, creds)


class Gateway:
    """A running gateway: `await Gateway.start(actors, options)`, then `await gw.stop()`."""

    def __init__(self, server, servicer: TinyLoopServicer, health_servicer, port: int, options: GatewayOptions):
        self.server, self.servicer, self.health, self.port, self.options = server, servicer, health_servicer, port, options
        servicer.on_health = self._set_health
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _set_health(self, serving: bool) -> None:
        """SERVING while some worker can take work, NOT_SERVING while none can (or draining)."""
        if self.servicer.draining:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _watch(self) -> None:
        """Ask every placed worker for its stats every `health_interval_s`: a worker that died
        while idle leaves placement (and health) at once, not at the next request it fails, and
        placement sees the load other gateways put on each worker."""
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            for w in self.servicer.workers:
                if not w.healthy:
                    continue
                try:
                    stats = await asyncio.wait_for(_ref(w.actor.stats.remote(self.servicer.origin)),
                                                   self.options.health_interval_s * 5)
                    if stats.get("epoch") != w.info.get("epoch"):  # Ray restarted it between two polls
                        await w.refresh(self.options.worker_channel, self.options.health_interval_s * 5)
                except asyncio.TimeoutError:
                    self.servicer._worker_failed(w, "poll_timeout", f"no answer within "
                                                 f"{self.options.health_interval_s * 5:g} s (its stats, or "
                                                 "its info after a restart)")
                    continue
                except _ACTOR_ERRORS as e:
                    self.servicer._worker_failed(w, "poll_failed", _brief(e))
                    continue
                w.polled(stats)
                metrics.QUEUED.labels(w.label).set(stats["queued"])
                metrics.RUNNING.labels(w.label).set(stats["active_lanes"])
                metrics.STEPS.update(w.label, stats["steps"])

    @classmethod
    async def start(cls, actors: list, options: GatewayOptions | None = None) -> "Gateway":
        o = options or GatewayOptions()
        infos = await asyncio.gather(*(_ref(a.info.remote()) for a in actors))
        workers = [_Worker(i, a, info) for i, (a, info) in enumerate(zip(actors, infos))]
        for w in workers:
            await w.connect(o.worker_channel)
        servicer = TinyLoopServicer(workers, o)
        server = grpc.aio.server(options=server_options(o), interceptors=[MalformedRequests()])
        pb_grpc.add_TinyLoopServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        port = _listen(server, o)
        if port == 0:
            raise RuntimeError(f"cannot listen on {o.host}:{o.port}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("gateway listening on %s:%d with %d worker(s)", o.host, port, len(workers))
        return cls(server, servicer, health_servicer, port, o)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful: health NOT_SERVING, refuse new RPCs, drain in-flight ones, then stop."""
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        self._watcher.cancel()
        await self.health.enter_graceful_shutdown()
        self.servicer.draining = True
        deadline = time.monotonic() + grace
        while self.servicer.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        floor = 0.0
        if self.servicer.streams:
            # streams still going at the end of the grace end with UNAVAILABLE / DRAINING, not
            # with grpc's reason-less "Cancelling all calls"
            cut = self.servicer.cut = set(self.servicer.streams)
            # a worker channel stream ends where it next waits for an item (Link.interrupt); a
            # cancel could land while the handler hands grpc a message, outside the handler's
            # own code, which then never sends its status. Streams over Ray calls are cancelled.
            for task in cut:
                interrupt = self.servicer.interrupts.get(task)
                if interrupt is None or not interrupt():
                    task.cancel()
            # each cut stream's handler sends its status before the server stops, and the stop
            # leaves the connections open a moment for it to reach the client: a stop right after
            # the cancel can close a connection with the status unsent (the client then reads a
            # bare UNAVAILABLE)
            _, stuck = await asyncio.wait(cut, timeout=1.0)
            for task in stuck:  # a handler that never came back to wait for an item
                task.cancel()
            floor = 0.5
        await self.server.stop(max(floor, deadline - time.monotonic()))
        for w in self.servicer.workers:
            await w.close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


class GatewayThread:
    """A gateway on its own event loop in a background thread (tests, benchmarks)."""

    def __init__(self, actors: list, options: GatewayOptions | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tinyloop-gateway", daemon=True)
        self._thread.start()
        self.gateway: Gateway = self.run(Gateway.start(actors, options))
        self.port = self.gateway.port
        self.address = f"{self.gateway.options.host}:{self.port}"

    def run(self, coro, timeout: float | None = 120):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        self.run(self.gateway.stop(grace_s))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
