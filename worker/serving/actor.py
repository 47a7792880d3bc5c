"""The Ray worker actor: one `Model`, its cache lanes and its table of resume handles.

This module imports nothing heavy at import time (torch loads inside `WorkerActor.__init__`),
so the gateway can name the class to create actors without importing torch.

Execution model. The actor is a Ray *async* actor: every call is a coroutine on one event
loop, which only validates, queues and forwards. All torch work runs on one step thread
(`_StepThread`): it steps the `Scheduler` (serving/scheduler.py: admission, chunked prefill,
one batched decode step for every batched stream and a step of each stream that steps alone)
while it has work, and runs the other calls that touch the model between steps. A step's
events go back to the event loop, into the queue of the stream (or the future of the call)
they belong to. A cancelled request leaves the scheduler before its next step.

Lanes. The Model's runner owns the cache lanes (`runner.lanes`); the scheduler hands them to
streams, handle builds and scoring calls in arrival order, and queues the rest (`max_queue`).

Streams reach the gateway over the worker's token channel (serving/channel.py: frames on a TCP
server on this event loop, started at the first `info()`), or as Ray streaming calls where it is off; both
run the same `generate` / `resume` coroutines below.

Requests arrive typed (`channel_pb2.GenerateParams`, `ResumeParams`, `BuildParams`,
`ScoreParams`, `TrajectoryParams`: proto/tinyloop/worker/v1/channel.proto), as the gateway
checked them against the wire's rules; this actor checks them against the model (the Model's
own errors) and fills the model's defaults. The unary calls answer typed too (`BuildResult`,
`FreeResult`, `ScoreResult`, `TrajectoryResult`).

Errors never cross Ray as exceptions: a call answers with its result's `error` set (a stream
yields `{"error": {"code", "reason", "message"}}`), whose `code` names a gRPC status code; the
gateway turns it into a `google.rpc.Status`. The status is chosen by the exception's type
(`_status`), never by its message. Ray-level failures (actor death) stay Ray exceptions.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import secrets
import threading
import time

from tinyloop.worker.model.errors import HandleFreed, OutOfMemory, OutOfRange, TooLong
from tinyloop.worker.serving import channel_pb2 as cpb  # the typed requests: imports no torch
from tinyloop.worker.serving.channel import error_message
from tinyloop.worker.serving.handles import BudgetExhausted, HandleGone, HandleTable, NotOwner
from tinyloop.worker.serving.options import WorkerOptions

log = logging.getLogger(__name__)

# the step thread waits for a step's first tokens to be passed on (WorkerOptions.first_token_wait_s)
# only where the new streams are at least this share of those running: the wait holds the
# step's other streams back
FIRST_TOKEN_WAIT_SHARE = 0.25


def error(code: str, reason: str, message: str) -> dict:
    return {"error": {"code": code, "reason": reason, "message": message}}


def _status(worker_id: str, e: BaseException) -> dict:
    """An exception as the status the caller gets, by its type: an argument the model cannot
    honour is INVALID_ARGUMENT (TOO_LONG for the cache's length), memory RESOURCE_EXHAUSTED, a
    deadline passed in the queue DEADLINE_EXCEEDED; anything else is a failed step, INTERNAL,
    with the exception's type and first line only (no traceback, paths or ids: those go to the
    worker's log)."""
    import torch

    from tinyloop.worker.serving.scheduler import DeadlineExceeded
    msg = str(e)
    if isinstance(e, TooLong):
        return error("INVALID_ARGUMENT", "TOO_LONG", msg)
    if isinstance(e, (ValueError, OutOfRange, HandleFreed)):
        return error("INVALID_ARGUMENT", "INVALID_ARGUMENT", msg)
    if isinstance(e, (OutOfMemory, torch.OutOfMemoryError)):
        return error("RESOURCE_EXHAUSTED", "OUT_OF_MEMORY", f"{worker_id}: out of memory")
    if isinstance(e, DeadlineExceeded):
        return error("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", f"{worker_id}: {msg}")
    first = (msg.strip().splitlines() or [""])[0][:200]
    # the caller gets one line; the worker's log gets the traceback, once per failure (a failed
    # step's exception reaches every stream of the step)
    if not getattr(e, "_tinyloop_logged", False):
        log.error("%s: a decode step failed", worker_id, exc_info=e)
        try:
            e._tinyloop_logged = True
        except AttributeError:  # an exception type that takes no attributes: logged each time
            pass
    return error("INTERNAL", "STEP_FAILED", f"{worker_id}: a decode step failed ({type(e).__name__}: {first})")


def waits_for_first_tokens(starting: int, running: int, wait_s: float) -> bool:
    """Whether the step thread waits for a step's first tokens to leave before its decode step
    (`WorkerActor._post`): `starting` streams get their first tokens, `running` hold a lane."""
    return bool(starting and wait_s > 0 and starting >= FIRST_TOKEN_WAIT_SHARE * running)


class _Refused(Exception):
    """args[0]: the error dict to answer (a full queue)."""


_CANCELLED = object()  # a pipe's end: the job was cancelled


class _Pipe:
    """A job's events on the event loop, gathered between its consumer's reads. The consumer is
    woken for its first tokens, for its end, and otherwise at most once per `interval()`
    seconds (the worker's coalescing interval, which grows with its streams): with many streams
    a step's events would otherwise wake every stream's coroutine every step, and each wake's
    Ray hop, not the GPU, would bound the worker."""
    __slots__ = ("ids", "end", "waiter", "flushed", "last", "interval")

    def __init__(self, interval):
        self.ids: list[int] = []
        self.end = None  # the final event: Tokens with a finish, Failed, Result, or _CANCELLED
        self.waiter: asyncio.Future | None = None
        self.flushed, self.last, self.interval = False, 0.0, interval

    def _due(self, now: float) -> bool:
        return self.end is not None or bool(self.ids) and (not self.flushed or now - self.last >= self.interval())

    def push(self, ids: list[int], end, now: float) -> None:
        """New ids, and the final event if this one is (None otherwise)."""
        self.ids.extend(ids)
        if end is not None and self.end is None:
            self.end = end
        if self.waiter is not None and not self.waiter.done() and self._due(now):
            self.waiter.set_result(None)

    async def take(self) -> tuple[list[int], object]:
        """(new ids, the end or None), once there is something to send."""
        while not self._due(time.monotonic()):
            self.waiter = asyncio.get_running_loop().create_future()
            wait = max(0.0, self.last + self.interval() - time.monotonic()) if self.ids else None
            try:
                # a coalesced wait also ends by the clock: no later step may come to wake it
                await asyncio.wait_for(self.waiter, wait)
            except asyncio.TimeoutError:
                pass
            finally:
                self.waiter = None
        ids, self.ids = self.ids, []
        self.flushed, self.last = True, time.monotonic()
        return ids, self.end


class _StepThread:
    """The worker's one torch thread: scheduler steps while there is work, and `call`s between
    them. `on_events(events[, step stats])` runs on this thread: for a step's first tokens before
    its decode step, and for the rest with the step's stats after it."""

    def __init__(self, scheduler, on_events):
        self.scheduler, self.on_events = scheduler, on_events
        self._calls: list = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tinyloop-step", daemon=True)
        self._thread.start()

    def call(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._calls or self.scheduler.has_work()):
                    self._cond.wait()
                if self._stop:
                    return
                calls, self._calls = self._calls, []
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # the caller gets it; the thread serves on
                        fut.set_exception(e)
            if self.scheduler.has_work():
                try:
                    events = self.scheduler.step(early=self.on_events)
                except BaseException:  # the scheduler contains a job's failure; this is a bug
                    log.exception("scheduler step failed")
                    events = []
                self.on_events(events, self.scheduler.last)


class WorkerActor:
    """Create with `ray.remote(WorkerActor).options(...)` (see tinyloop.gateway.workers)."""

    def __init__(self, index: int, opts: WorkerOptions | None = None):
        import sys

        import torch
        o = opts if opts is not None else WorkerOptions()
        sys.setswitchinterval(o.gil_switch_s)  # WorkerOptions.gil_switch_s says why
        self.first_token_wait_s = o.first_token_wait_s

        from tinyloop.worker.api import Model
        from tinyloop.worker.serving.scheduler import Scheduler
        if o.torch_threads:
            torch.set_num_threads(o.torch_threads)
        self.index = index
        self.worker_id = f"worker-{index}"
        self.epoch = _next_epoch(index)
        self.model = Model(o.model_path, max_seq_len=o.max_seq_len, device=o.device, dtype=o.dtype, n_slots=o.lanes,
                           max_loops=o.max_loops, init_scale=o.init_scale, kv_mode=o.kv_mode,
                           batch_invariant=o.batch_invariant)
        self.lanes = self.model.n_slots
        self.scheduler = Scheduler(self.model.runner, o.scheduler)
        self.handles = HandleTable(self.model.free_resume_handle, o.handle_budget_bytes, o.handle_ttl_s,
                                   o.max_handles)
        self.coalesce_s = o.coalesce_s
        self.max_hops_per_s = o.max_hops_per_s
        self._keys = itertools.count()
        self._sinks: dict[str, _Pipe] = {}  # job key -> where its events go (on the event loop)
        self._loop: asyncio.AbstractEventLoop | None = None
        # the step thread's events not handed to the event loop yet (_post)
        self._pending: dict[str, list] = {}
        self._started: set[str] = set()  # jobs whose first tokens went out, until their end
        self._flushed = 0.0
        self._flush_s = min(0.01, o.coalesce_s / 2)
        self._steps = _StepThread(self.scheduler, self._post)
        self._sweeper: asyncio.Task | None = None
        self._device = str(self.model.device)
        self._metrics = _StepMetrics(self.model.config.max_loops)
        self._channel_options = o.channel
        self._channel: asyncio.Future | None = None  # -> (asyncio server, {"address", "token"})
        s = self.model.startup
        log.info("%s: model loaded in %.1f s; %d CUDA graphs captured in %.1f s", self.worker_id, s["load_s"],
                 s["graphs"], sum(v for k, v in s.items() if k.endswith("_graphs_s")))
        # Everything made so far (the model, its graphs and their closures, the buffers) lives as
        # long as the worker: out of the collector's sight, a full collection while serving walks
        # only what requests made, not the start-up's objects (tenths of a second, every stream waiting)
        gc.collect()
        gc.freeze()

    # -- introspection ------------------------------------------------------------------
    async def channel(self) -> dict | None:
        """The token channel's {"address", "token"} (serving/channel.py), started on the actor's
        event loop at the first ask; None when it is off. Calls that ask at once (a gateway's
        probe and its poll) share the one start."""
        if not self._channel_options.enabled:
            return None
        if self._channel is None:
            from tinyloop.worker.serving import channel
            self._channel = asyncio.ensure_future(channel.serve(self, self._channel_options))
        return (await asyncio.shield(self._channel))[1]

    async def info(self) -> dict:
        cfg = self.model.config
        return {"worker_id": self.worker_id, "index": self.index, "epoch": self.epoch,
                "device": self._device, "lanes": self.lanes, "model_path": self.model.path,
                "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "default_loops": cfg.default_loops,
                "max_loops": cfg.max_loops, "max_seq_len": self.model.max_seq_len, "eos_id": cfg.eos_id,
                "config": _config_dict(cfg), "weight_format": self.model.weight_format, "startup": self.model.startup, "kv_mode": self.model.kv_mode,
                "kv_bytes_per_token_layer": self.model.kv_bytes_per_token_layer, "channel": await self.channel(),
                **(await self.stats())}

    async def stats(self, origin: str | None = None) -> dict:
        """Worker-side counts: what the tests use to prove nothing leaks, and the gateway's
        metrics (cumulative step histograms in `steps`). With origin (a gateway's id, the prefix
        `<origin>.` of its stream keys), `own_streams` counts that gateway's streams among
        `streams` (both at one instant of the event loop), so its placement can take the other
        gateways' load from here and its own from its live count."""
        self._sweep()
        b = self.scheduler.batcher
        out = {"epoch": self.epoch, "active_lanes": self.lanes - self.model.runner.lanes.free,
               "queued": self.scheduler.queued, "running": self.scheduler.running,
               "streams": len(self._sinks), "handles": len(self.handles), "handle_bytes": self.handles.nbytes,
               "batched_steps": b.steps, "batched_lane_steps": b.lane_steps, "steps": self._metrics.snapshot()}
        if origin:
            prefix = origin + "."
            out["own_streams"] = sum(1 for key in self._sinks if key.startswith(prefix))
        return out

    async def configure(self, handle_ttl_s: float | None = None, handle_budget_bytes: int | None = None,
                        coalesce_s: float | None = None) -> dict:
        """Change the table limits at run time (operators; the tests shorten the TTL)."""
        if handle_ttl_s is not None:
            self.handles.ttl_s = handle_ttl_s
        if handle_budget_bytes is not None:
            self.handles.budget_bytes = handle_budget_bytes
        if coalesce_s is not None:
            self.coalesce_s = coalesce_s
            self._flush_s = min(0.01, coalesce_s / 2)
        self._sweep()
        return await self.stats()

    # -- the step thread's events ---------------------------------------------------------
    def _post(self, events, step_stats=None) -> None:
        """On the step thread: gather events per job and hand them to the event loop (and, at
        a step's end, its stats to the metrics). What is urgent goes at once: a step's early
        events (first tokens, refusals), a job's first tokens or its end, and everything once
        the scheduler runs dry. Other tokens go at most every `_flush_s`, merged per job: the
        streams' consumers send them per hop (`_Pipe`) no sooner anyway, and each hand-over
        costs the event loop a wake-up and a push per job, Python that shares the interpreter
        lock with this thread.

        A job's first tokens: this thread then waits (at most first_token_wait_s; 0: not) until the
        event loop has passed them on, so they leave before this thread takes the interpreter
        back to launch the next decode step, which would otherwise hold them up behind its
        Python. The wait delays that step for every stream in it, so it is made only when the
        streams starting now are at least FIRST_TOKEN_WAIT_SHARE of the running ones (a lone
        stream, a burst of arrivals), not for one arrival among many running streams."""
        from tinyloop.worker.serving.scheduler import Tokens
        if step_stats is not None:
            self._metrics.observe(step_stats)
        urgent = step_stats is None
        first = 0
        pending, started = self._pending, self._started
        for key, ev in events:
            slot = pending.get(key)
            if slot is None:
                slot = pending[key] = [[], None]
            if isinstance(ev, Tokens):
                slot[0].extend(ev.ids)
                end = ev if ev.finish is not None else None
                if end is not None and ev.finish.stats.get("iterations_histogram"):
                    self._metrics.observe_iterations(ev.finish.stats["iterations_histogram"])
            else:
                end = ev
            if end is not None:
                if key not in started and slot[0]:
                    first += 1  # a job whose first tokens end it
                slot[1] = end
                started.discard(key)
                urgent = True
            elif key not in started:
                started.add(key)
                urgent = True
                first += 1
        now = time.monotonic()
        if pending and (urgent or now - self._flushed >= self._flush_s or not self.scheduler.has_work()):
            self._pending, self._flushed = {}, now
            wait = waits_for_first_tokens(first, self.scheduler.running, self.first_token_wait_s)
            passed = threading.Event() if wait else None
            self._loop.call_soon_threadsafe(self._deliver, pending, passed)
            if passed is not None:
                passed.wait(self.first_token_wait_s)

    def _deliver(self, pending: dict, passed: threading.Event | None = None) -> None:
        """On the event loop: each job's gathered (ids, end) into its pipe. `passed` is set once
        the streams woken here have run (their tokens sent): callbacks run in order, and each
        woken stream's step was scheduled by its push."""
        now = time.monotonic()
        for key, (ids, end) in pending.items():
            pipe = self._sinks.get(key)
            if pipe is not None:  # a job whose caller left gets nothing
                pipe.push(ids, end, now)
        if passed is not None:
            self._loop.call_soon(passed.set)

    def _submit(self, begin, tokens: int = 0, task: bool = False, timeout_s: float | None = None,
                key: str | None = None, batched=None, work: int = 0):
        """Queue a job on the scheduler under `key` (the gateway's stream key, or a new one):
        (key, its event queue); _Refused when the queue is full."""
        from tinyloop.worker.serving.scheduler import Job, QueueFull
        self._loop = self._loop or asyncio.get_running_loop()
        key = key or f"call-{next(self._keys)}"
        sink = self._sinks[key] = _Pipe(self._hop_interval)
        deadline = time.monotonic() + timeout_s if timeout_s else None
        try:
            self.scheduler.submit(Job(key, begin, tokens=tokens, deadline=deadline, task=task, batched=batched,
                                      work=work))
        except QueueFull as e:
            del self._sinks[key]
            raise _Refused(error("RESOURCE_EXHAUSTED", "QUEUE_FULL", f"{self.worker_id}: {e}")) from None
        self._steps.wake()
        return key, sink

    def _leave(self, key: str, done: bool) -> None:
        self._sinks.pop(key, None)
        self._started.discard(key)  # a cancelled job posts no end (one set operation: atomic)
        if not done:
            self.scheduler.cancel(key)
            self._steps.wake()

    async def _on_lane(self, fn, tokens: int = 0):
        """fn(lane) on the step thread, holding a lane (queued like a stream): its value, or its
        exception raised here; _Refused when the queue is full."""
        from tinyloop.worker.serving.scheduler import Failed
        key, sink = self._submit(fn, tokens, task=True)
        done = False
        try:
            _, ev = await sink.take()
            done = True
        finally:
            self._leave(key, done)
        if isinstance(ev, Failed):
            raise ev.error
        return ev.value

    def _hop_interval(self) -> float:
        """Seconds between a stream's chunks after its first: coalesce_s, or longer when the
        worker's streams together would exceed max_hops_per_s."""
        return max(self.coalesce_s, len(self._sinks) / self.max_hops_per_s)

    async def _on_step_thread(self, fn):
        return await asyncio.wrap_future(self._steps.call(fn))

    # -- streams ------------------------------------------------------------------------
    async def generate(self, key: str, caller: str, p: "cpb.GenerateParams"):
        """Async generator of {"ids", "text"} chunks, then one {"complete": {...}} (or one error)."""
        try:
            ids = self._prompt_ids(p.prompt)
            kwargs = dict(loops=p.loops if p.HasField("loops") else None, max_tokens=p.max_tokens,
                          stop_token_ids=list(p.stop_token_ids) or None, cache_window=p.cache_window,
                          kv_mode=p.kv_mode or None, **_sampling(p.sampling), **_depth_and_safety(p))
            if p.HasField("speculative"):
                s = p.speculative
                kwargs["speculative"] = {"draft_loops": s.draft_loops, "verify_loops": s.verify_loops,
                                         "draft_ahead": s.draft_ahead, "k_branches": s.k_branches}
            if p.HasField("early_exit"):
                e = p.early_exit
                kwargs["early_exit"] = {"criterion": e.criterion or None, "cache": e.cache or None,
                                        **{f: getattr(e, f) for f in ("threshold", "min_loops", "patience")
                                           if e.HasField(f)}}
            req = self.model.make_request(ids, **kwargs)
        except (ValueError, RuntimeError) as e:
            yield _status(self.worker_id, e)
            return
        after = None
        if p.return_handle:
            max_loops = p.handle_max_loops if p.HasField("handle_max_loops") else self.model.config.max_loops
            # everything the handle needs is checked before any work: it keeps the first
            # req.loops iterations, allocated for max_loops
            if req.loops > max_loops:
                yield error("INVALID_ARGUMENT", "INVALID_ARGUMENT",
                            f"handle_max_loops={max_loops} is below the request's loops={req.loops}")
                return
            too_big = self._over_budget(len(ids), max_loops, req.window)
            if too_big is not None:
                yield too_big
                return
            # the handle's latent state is the request's own (input injection)
            after = lambda: self._build(caller, ids, req.loops, max_loops, req.window, req.seed)  # noqa: E731
        batched = None
        if req.speculative:
            begin = lambda lane: self.model.stream(req, lane)  # noqa: E731
            if req.sampling.greedy:  # the same tokens as plain decoding at verify_loops
                plain = dataclasses.replace(req, speculative=None)
                batched = lambda lane: self.model.start_chunked(plain, lane)  # noqa: E731
        else:
            begin = lambda lane: self.model.start_chunked(req, lane)  # noqa: E731
        async for item in self._stream(key, begin, len(ids), p, after, batched=batched,
                                       work=req.loops * req.max_tokens):
            yield item

    async def resume(self, key: str, caller: str, token: bytes, epoch: int, p: "cpb.ResumeParams"):
        entry = self._lookup(caller, token, epoch)
        if isinstance(entry, dict):
            yield entry
            return
        try:
            rr = self.model.make_resume_request(entry.handle, p.new_loops, max_tokens=p.max_tokens,
                                                cache_window=p.cache_window, kv_mode=p.kv_mode or None,
                                                stop_token_ids=list(p.stop_token_ids) or None,
                                                **_sampling(p.sampling))
        except (ValueError, RuntimeError) as e:
            yield _status(self.worker_id, e)
            return
        entry.active += 1
        try:
            async for item in self._stream(key, lambda lane: self.model.start_resume_chunked(rr, lane),
                                           entry.handle.seq_len(), p, work=rr[2].loops * rr[2].max_tokens):
                yield item
        finally:
            entry.active -= 1
            entry.last_used = time.monotonic()

    async def cancel(self, key: str) -> bool:
        """Stop a stream before its next step (or take it out of the queue)."""
        sink = self._sinks.get(key)
        if sink is None:
            return False
        self._leave(key, False)
        sink.push([], _CANCELLED, time.monotonic())
        return True

    async def _stream(self, key: str, begin, tokens: int, p, after=None, batched=None, work: int = 0):
        """Run a stream job: begin(lane) -> a Prefill, a DecodeState or a token generator
        (batched: Job.batched; work: Job.work)."""
        from tinyloop.worker.serving.scheduler import Failed
        t0 = time.monotonic()
        try:
            key, sink = self._submit(begin, tokens, timeout_s=p.timeout_s if p.HasField("timeout_s") else None,
                                     key=key, batched=batched, work=work)
        except _Refused as e:
            yield e.args[0]
            return
        text = _TextStream(self.model.tokenizer) if p.include_text else None
        done = False
        t_first = None
        try:
            while True:
                ids, end = await sink.take()
                if t_first is None and ids:
                    t_first = time.monotonic()
                    self._metrics.observe_ttft(t_first - t0)
                if end is _CANCELLED:
                    return
                if isinstance(end, Failed):
                    done = True
                    yield _status(self.worker_id, end.error)
                    return
                done = end is not None
                if ids:
                    # the first tokens go out at once (TTFT); later ones coalesced per hop (_Pipe)
                    yield {"ids": ids, "text": text.feed(ids, done) if text else ""}
                if done:
                    finish = end.finish
                    tail = text.feed([], True) if text else ""
                    if tail:  # a character held back at the last token
                        yield {"ids": [], "text": tail}
                    complete = {"reason": finish.reason, "stats": dict(finish.stats), "worker_id": self.worker_id}
                    if after is not None:
                        built = await after()
                        if "error" in built:
                            yield built
                            return
                        complete["handle"] = built
                    yield {"complete": complete}
                    return
        finally:
            self._leave(key, done)

    # -- handles ------------------------------------------------------------------------
    async def build_handle(self, caller: str, p: "cpb.BuildParams") -> "cpb.BuildResult":
        try:
            ids = self._prompt_ids(p.prompt)
            self.model.check_kv_mode(p.kv_mode or None)
        except ValueError as e:
            return cpb.BuildResult(error=error_message(_status(self.worker_id, e)))
        # the defaults are the model's: l_used its default depth, max_loops its deepest; a
        # value past them is the Model's error, never clamped
        cfg = self.model.config
        max_loops = p.max_loops if p.HasField("max_loops") else cfg.max_loops
        l_used = p.l_used if p.HasField("l_used") else min(cfg.default_loops, max_loops)
        built = await self._build(caller, ids, l_used, max_loops, p.cache_window,
                                  p.seed if p.HasField("seed") else None)
        if "error" in built:
            return cpb.BuildResult(error=error_message(built))
        return cpb.BuildResult(handle=cpb.Handle(**built))

    def _over_budget(self, seq_len: int, max_loops: int, window: int) -> dict | None:
        """The error for a handle larger than the whole byte budget (no eviction could fit it),
        told before any work; None when it can fit."""
        nbytes = self.model.handle_nbytes(seq_len, max_loops, window)
        if self.handles.fits_budget(nbytes):
            return None
        return error("RESOURCE_EXHAUSTED", "HANDLE_BUDGET_EXHAUSTED",
                     f"a handle of {nbytes} bytes ({seq_len} tokens, max_loops {max_loops}) exceeds "
                     f"{self.worker_id}'s handle budget of {self.handles.budget_bytes} bytes")

    async def _build(self, caller: str, ids: list[int], l_used: int, max_loops: int, window: int,
                     seed: int | None = None) -> dict:
        if isinstance(l_used, int) and isinstance(max_loops, int) and 0 <= l_used <= max_loops:
            too_big = self._over_budget(len(ids), max_loops, window)
            if too_big is not None:
                return too_big
        try:
            self.handles.make_room_for_one()
            handle = await self._on_lane(lambda lane: self.model.build_resume_handle(
                ids, L_used=l_used, max_loops=max_loops, cache_window=window, lane=lane, seed=seed), len(ids))
        except BudgetExhausted as e:
            return error("RESOURCE_EXHAUSTED", "HANDLE_BUDGET_EXHAUSTED", f"{self.worker_id} {e}")
        except _Refused as e:
            return e.args[0]
        except Exception as e:
            return _status(self.worker_id, e)
        nbytes = int(handle.nbytes())
        try:
            token = self.handles.put(handle, caller, nbytes)
        except BudgetExhausted as e:
            await self._on_step_thread(lambda: self.model.free_resume_handle(handle))
            return error("RESOURCE_EXHAUSTED", "HANDLE_BUDGET_EXHAUSTED", f"{self.worker_id}: {e}")
        return {"token": token, "epoch": self.epoch, "seq_len": handle.seq_len(),
                "loops_used": handle.loops_used(), "max_loops": handle.max_loops(), "nbytes": nbytes,
                "worker_id": self.worker_id, "expires_in_s": self.handles.ttl_s}

    async def free_handle(self, caller: str, token: bytes, epoch: int) -> "cpb.FreeResult":
        entry = self._lookup(caller, token, epoch, touch=False)
        if isinstance(entry, dict):
            if entry["error"]["reason"] in ("NOT_OWNER",):
                return cpb.FreeResult(error=error_message(entry))
            return cpb.FreeResult(freed=False)  # idempotent: already gone, for whatever reason
        if entry.active:
            return cpb.FreeResult(error=error_message(error(
                "FAILED_PRECONDITION", "HANDLE_BUSY",
                f"{entry.active} resume(s) are streaming from this handle; free it after they finish")))
        self.handles.drop(token)
        return cpb.FreeResult(freed=True)

    def _lookup(self, caller: str, token: bytes, epoch: int, touch: bool = True):
        if epoch != self.epoch:
            if epoch < self.epoch:
                return error("NOT_FOUND", "HANDLE_LOST",
                             f"the handle was built before {self.worker_id} restarted (epoch {epoch}, "
                             f"now {self.epoch}); build it again")
            return error("NOT_FOUND", "HANDLE_NOT_FOUND", "no such resume handle")
        self._sweep()
        try:
            return self.handles.lookup(caller, token, touch)
        except HandleGone as e:
            return error("NOT_FOUND", e.reason, str(e))
        except NotOwner as e:
            return error("PERMISSION_DENIED", "NOT_OWNER", str(e))

    def _sweep(self) -> None:
        """Expire idle handles past their TTL (on every table access and every TTL/4)."""
        if self._sweeper is None:
            try:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
            except RuntimeError:
                pass
        self.handles.sweep()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(self.handles.ttl_s / 4, 30.0)))
            self._sweep()

    # -- scoring ------------------------------------------------------------------------
    async def score(self, p: "cpb.ScoreParams") -> "cpb.ScoreResult":
        try:
            ids = self._prompt_ids(p.prompt)
            if p.WhichOneof("score") == "consistency":
                c = p.consistency
                max_tokens = c.max_tokens if c.HasField("max_tokens") else 32
                r = await self._on_lane(lambda lane: self.model.score_with_consistency(
                    ids, c.loops_a, c.loops_b, max_tokens=max_tokens, lane=lane), len(ids))
                return cpb.ScoreResult(worker_id=self.worker_id, consistency=cpb.ConsistencyAnswer(
                    agree=bool(r["agree"]), answer_a=[int(t) for t in r["answer_a"]],
                    answer_b=[int(t) for t in r["answer_b"]], first_divergence=int(r["first_divergence"])))
            if p.WhichOneof("score") != "uncertainty":
                raise ValueError("a score request names consistency or uncertainty")
            u = p.uncertainty
            logits, kl = await self._on_lane(
                lambda lane: self.model.score_with_uncertainty(ids, u.l_lo, u.l_hi, lane=lane), len(ids))
            return cpb.ScoreResult(worker_id=self.worker_id, uncertainty=cpb.UncertaintyAnswer(
                kl=float(kl), logits=logits.tobytes() if u.return_logits else b""))
        except _Refused as e:
            return cpb.ScoreResult(worker_id=self.worker_id, error=error_message(e.args[0]))
        except Exception as e:  # the status by its type; the worker serves on
            return cpb.ScoreResult(worker_id=self.worker_id, error=error_message(_status(self.worker_id, e)))

    async def trajectory(self, p: "cpb.TrajectoryParams") -> "cpb.TrajectoryResult":
        try:
            ids = self._prompt_ids(p.prompt)
            r = await self._on_lane(lambda lane: self.model.score_trajectory(ids, p.n_loops, lane=lane), len(ids))
        except _Refused as e:
            return cpb.TrajectoryResult(worker_id=self.worker_id, error=error_message(e.args[0]))
        except Exception as e:  # the status by its type; the worker serves on
            return cpb.TrajectoryResult(worker_id=self.worker_id, error=error_message(_status(self.worker_id, e)))
        hidden = r["hidden"]
        return cpb.TrajectoryResult(worker_id=self.worker_id, trajectory=cpb.Trajectory(
            labels=list(r["labels"]), d_model=int(hidden.shape[1]), hidden=hidden.tobytes()))

    # -- helpers ------------------------------------------------------------------------
    def _prompt_ids(self, prompt: "cpb.Prompt") -> list[int]:
        which = prompt.WhichOneof("input")
        if which == "text":
            ids = self.model.tokenizer.encode(prompt.text)
            if not ids:
                raise ValueError("prompt text encodes to no tokens")
            return ids
        if which != "ids" or not prompt.ids.ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        return list(prompt.ids.ids)


class _TextStream:
    """Incremental text as suffixes of the decoded stream so far, holding back a trailing
    incomplete character (U+FFFD) until the next chunk or the end; so the chunks' texts join
    to exactly `tokenizer.decode(all ids)`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def feed(self, ids: list[int], last: bool) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if not last and text.endswith("\ufffd"):
            return ""
        out, self.emitted = text[self.emitted:], len(text)
        return out


def _step(gen):
    """One decode step on the step thread: (new ids, None) or (None, Finish)."""
    try:
        return next(gen), None
    except StopIteration as stop:
        return None, stop.value


def _depth_and_safety(p: "cpb.GenerateParams") -> dict:
    """L scheduling and the safety check, as `Model.make_request` takes them."""
    out = {}
    if p.l_warmup_tokens:
        out["l_warmup_tokens"] = p.l_warmup_tokens
        out["l_warmup_L"] = p.l_warmup_loops if p.HasField("l_warmup_loops") else None
    if p.safety_check:
        out["safety_check"] = True
        if p.HasField("safety_norm_threshold"):
            out["safety_norm_threshold"] = p.safety_norm_threshold
    return out


class _StepMetrics:
    """Cumulative histograms of what the steps did, which the gateway exports: rows of the
    batched step, prompt tokens prefilled per step, the step's wall time, the iterations
    each early-exit decode token ran (bounds 1 .. max_loops), and each stream's worker-side time
    to its first tokens. Bucket bounds are upper bounds
    (Prometheus' `le`); the last is +inf."""
    BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    TTFT = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
    PREFILL = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096)
    SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)

    def __init__(self, max_loops: int = 1):
        self.ITERATIONS = tuple(range(1, max_loops + 1))
        self.iterations = [0] * (max_loops + 1)
        self.iterations_sum = 0
        self._lock = threading.Lock()
        self.batch = [0] * (len(self.BATCH) + 1)
        self.prefill = [0] * (len(self.PREFILL) + 1)
        self.seconds = [0] * (len(self.SECONDS) + 1)
        self.batch_sum = self.prefill_sum = self.steps = 0
        self.seconds_sum = self.cpu_seconds_sum = 0.0
        self.prefilled_together = self.batched_not_speculative = self.handed_to_batch = 0
        self.speculative_rows = 0
        self.ttft = [0] * (len(self.TTFT) + 1)
        self.ttft_sum = 0.0

    @staticmethod
    def _bucket(bounds, x) -> int:
        return next((i for i, b in enumerate(bounds) if x <= b), len(bounds))

    def observe(self, st) -> None:
        with self._lock:
            self.steps += 1
            if st.batch_rows:
                self.batch[self._bucket(self.BATCH, st.batch_rows)] += 1
                self.batch_sum += st.batch_rows
            self.prefill[self._bucket(self.PREFILL, st.prefill_tokens)] += 1
            self.prefill_sum += st.prefill_tokens
            self.seconds[self._bucket(self.SECONDS, st.seconds)] += 1
            self.seconds_sum += st.seconds
            self.cpu_seconds_sum += st.cpu_seconds
            self.prefilled_together += st.prefilled_together
            self.batched_not_speculative += st.batched_not_speculative
            self.handed_to_batch += st.handed_to_batch
            self.speculative_rows += st.speculative_rows

    def observe_ttft(self, seconds: float) -> None:
        """A stream's first tokens handed to its caller, `seconds` after it reached the worker
        (queue, prefill, the step thread's hand-over to the event loop)."""
        with self._lock:
            self.ttft[self._bucket(self.TTFT, seconds)] += 1
            self.ttft_sum += seconds

    def observe_iterations(self, histogram: list[int]) -> None:
        """A finished early-exit stream's usage histogram (entry d - 1: its tokens that ran d)."""
        with self._lock:
            for d, n in enumerate(histogram, 1):
                self.iterations[min(d, len(self.ITERATIONS)) - 1] += n
                self.iterations_sum += d * n

    def snapshot(self) -> dict:
        with self._lock:
            return {"steps": self.steps, "batch_bounds": list(self.BATCH), "batch_counts": list(self.batch),
                    "batch_sum": self.batch_sum, "prefill_bounds": list(self.PREFILL),
                    "prefill_counts": list(self.prefill), "prefill_sum": self.prefill_sum,
                    "seconds_bounds": list(self.SECONDS), "seconds_counts": list(self.seconds),
                    "seconds_sum": self.seconds_sum, "cpu_seconds_sum": self.cpu_seconds_sum,
                    "prefilled_together": self.prefilled_together,
                    "batched_not_speculative": self.batched_not_speculative,
                    "handed_to_batch": self.handed_to_batch,
                    "speculative_rows": self.speculative_rows,
                    "iterations_bounds": list(self.ITERATIONS), "iterations_counts": list(self.iterations),
                    "iterations_sum": self.iterations_sum,
                    "ttft_bounds": list(self.TTFT), "ttft_counts": list(self.ttft), "ttft_sum": self.ttft_sum,
                    # every thread of the worker process (the step thread, the event loop, Ray's)
                    "process_cpu_seconds": time.process_time(), "clock_s": time.monotonic()}


def _sampling(s: "cpb.Sampling") -> dict:
    """The sampling fields set, as `Model.make_request` takes them (unset: the model's default)."""
    keys = ("temperature", "top_k", "top_p", "repetition_penalty", "seed")
    return {k: getattr(s, k) for k in keys if s.HasField(k)}


def _config_dict(cfg) -> dict:
    import dataclasses
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))


def _next_epoch(index: int) -> int:
    """A restart epoch that grows every time Ray (re)creates this actor: a counter in the
    cluster's GCS key-value store, keyed by the actor id (stable across restarts)."""
    try:
        import ray
        from ray.experimental import internal_kv
        if not ray.is_initialized():  # asking for the runtime context would start a Ray of its own
            raise RuntimeError("not in Ray")
        key = f"tinyloop/epoch/{ray.get_runtime_context().get_actor_id()}".encode()
        old = internal_kv._internal_kv_get(key)
        epoch = int(old) + 1 if old else 1
        internal_kv._internal_kv_put(key, str(epoch).encode(), overwrite=True)
        return epoch
    except Exception:  # outside Ray (unit use): a random epoch still tells restarts apart
        return secrets.randbelow(1 << 31) + 1
