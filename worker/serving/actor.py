"""The Ray worker actor: one `Model`, its cache lanes and its table of resume handles.

This module imports nothing heavy at import time (torch loads inside `WorkerActor.__init__`),
so the gateway can name the class to create actors without importing torch.

Execution model. The actor is a Ray *async* actor: every call is a coroutine on one event
loop, and all torch work runs on a single-thread executor, one step at a time, so the event
loop stays free to answer `cancel`, `stats` and handle calls. Each stream prefills alone on
its lane. Plain decode streams then join the `Batcher`: one loop on the event loop submits
a batched decode step (CUDA graphs on a GPU) while any has joined, and hands each stream its
new tokens through its queue. The other streams (speculative, L scheduling, safety check,
windowed cache) step their own generator one decode step at a time; the
executor interleaves those steps with the batched ones. A cancelled stream stops before its
next step.

Lanes. The Model's runner owns the cache lanes (`runner.lanes`); a stream, a handle build and
a scoring call each hold one while they run, and wait in one queue when none is free.

Errors never cross Ray as exceptions: a call returns (or a stream yields) a dict
`{"error": {"code", "reason", "message"}}` whose `code` names a gRPC status code; the gateway
turns it into a `google.rpc.Status`. Ray-level failures (actor death) stay Ray exceptions.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import secrets
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_HANDLE_BUDGET_BYTES = 1 << 30
DEFAULT_HANDLE_TTL_S = 600.0
DEFAULT_MAX_HANDLES = 4096
DEFAULT_MAX_QUEUE = 256
DEFAULT_COALESCE_S = 0.05  # per Ray hop after the first token: one object per token costs ~3 ms of step time on CPU
TOMBSTONES = 65536  # remembered dead handles, so a late call learns *why* its handle is gone

FINISH_REASONS = ("length", "stop", "safety")


def error(code: str, reason: str, message: str) -> dict:
    return {"error": {"code": code, "reason": reason, "message": message}}


def _value_error(e: Exception) -> dict:
    """The Model's argument errors: ValueError (bad argument) and the RuntimeErrors it raises
    for arguments that cannot be honoured (too long for max_seq_len, new_L out of range)."""
    msg = str(e)
    if "out of memory" in msg:
        return error("RESOURCE_EXHAUSTED", "OUT_OF_MEMORY", msg)
    if "max_seq_len" in msg:
        return error("INVALID_ARGUMENT", "TOO_LONG", msg)
    return error("INVALID_ARGUMENT", "INVALID_ARGUMENT", msg)


def _step_error(worker_id: str, e: Exception) -> dict:
    """A failed decode step as a status: out of memory is RESOURCE_EXHAUSTED, anything else
    INTERNAL, with the exception's type and first line only (no traceback, paths or ids)."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    if "out of memory" in first.lower():
        return error("RESOURCE_EXHAUSTED", "OUT_OF_MEMORY", f"{worker_id}: out of memory in a decode step")
    return error("INTERNAL", "STEP_FAILED", f"{worker_id}: a decode step failed ({type(e).__name__}: {first})")


class _Cancelled(Exception):
    pass


class _NoLane(Exception):
    """No lane and no room in the queue: args[0] is the error dict to answer."""


@dataclass
class _Entry:
    handle: object
    owner: str
    nbytes: int
    last_used: float
    active: int = 0  # resumes streaming from it now


@dataclass
class _StreamState:
    cancelled: bool = False
    lane: int | None = None
    waiter: asyncio.Future | None = field(default=None, repr=False)
    queue: asyncio.Queue | None = field(default=None, repr=False)  # batched: (ids, finish) per step


class WorkerActor:
    """Create with `ray.remote(WorkerActor).options(...)` (see tinyloop.gateway.workers)."""

    def __init__(self, index: int, model_path: str | None = None, lanes: int | None = None,
                 max_seq_len: int = 2048, device: str | None = None, dtype: str | None = None,
                 handle_budget_bytes: int = DEFAULT_HANDLE_BUDGET_BYTES,
                 handle_ttl_s: float = DEFAULT_HANDLE_TTL_S, max_handles: int = DEFAULT_MAX_HANDLES,
                 max_queue: int = DEFAULT_MAX_QUEUE, coalesce_s: float = DEFAULT_COALESCE_S,
                 torch_threads: int | None = None, max_loops: int | None = None, init_scale: float = 1.0):
        import torch

        from tinyloop.worker.api import Model
        from tinyloop.worker.generation.batcher import Batcher
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.index = index
        self.worker_id = f"worker-{index}"
        self.epoch = _next_epoch(index)
        self.model = Model(model_path, max_seq_len=max_seq_len, device=device, dtype=dtype, n_slots=lanes,
                           max_loops=max_loops, init_scale=init_scale)
        self.lanes = self.model.n_slots
        self._pool_lanes = self.model.runner.lanes
        self.batcher = Batcher(self.model.runner)
        self._joined: dict[int, asyncio.Queue] = {}  # lane -> queue of a stream in the batcher
        self._batch_task: asyncio.Task | None = None
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tinyloop-step")
        self._streams: dict[str, _StreamState] = {}
        self._handles: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # LRU order
        self._tombstones: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._handle_bytes = 0
        self.handle_budget_bytes = handle_budget_bytes
        self.handle_ttl_s = handle_ttl_s
        self.max_handles = max_handles
        self.max_queue = max_queue
        self.coalesce_s = coalesce_s
        self._sweeper: asyncio.Task | None = None
        self._device = str(self.model.device)
        s = self.model.startup
        log.info("%s: model loaded in %.1f s; %d CUDA graphs captured in %.1f s", self.worker_id, s["load_s"],
                 s["graphs"], sum(v for k, v in s.items() if k.endswith("_graphs_s")))

    # -- introspection ------------------------------------------------------------------
    async def info(self) -> dict:
        cfg = self.model.config
        return {"worker_id": self.worker_id, "index": self.index, "epoch": self.epoch,
                "device": self._device, "lanes": self.lanes, "model_path": self.model.path,
                "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "default_loops": cfg.default_loops,
                "max_loops": cfg.max_loops, "max_seq_len": self.model.max_seq_len, "eos_id": cfg.eos_id,
                "config": _config_dict(cfg), "startup": self.model.startup, **(await self.stats())}

    async def stats(self) -> dict:
        """Worker-side counts the tests use to prove nothing leaks."""
        self._sweep()
        return {"epoch": self.epoch, "active_lanes": self.lanes - self._pool_lanes.free,
                "queued": len(self._waiters), "streams": len(self._streams),
                "handles": len(self._handles), "handle_bytes": self._handle_bytes,
                "batched_steps": self.batcher.steps, "batched_lane_steps": self.batcher.lane_steps}

    async def configure(self, handle_ttl_s: float | None = None, handle_budget_bytes: int | None = None,
                        coalesce_s: float | None = None) -> dict:
        """Change the table limits at run time (operators; the tests shorten the TTL)."""
        if handle_ttl_s is not None:
            self.handle_ttl_s = handle_ttl_s
        if handle_budget_bytes is not None:
            self.handle_budget_bytes = handle_budget_bytes
        if coalesce_s is not None:
            self.coalesce_s = coalesce_s
        self._sweep()
        return await self.stats()

    # -- streams ------------------------------------------------------------------------
    async def generate(self, key: str, caller: str, p: dict):
        """Async generator of {"ids", "text"} chunks, then one {"complete": {...}} (or one error)."""
        try:
            ids = self._prompt_ids(p["prompt"])
            kwargs = dict(loops=p.get("loops"), max_tokens=p.get("max_tokens", 128),
                          stop_token_ids=p.get("stop_token_ids") or None,
                          cache_window=p.get("cache_window", 0), **_sampling(p))
            if p.get("speculative"):
                kwargs["speculative"] = p["speculative"]
            req = self.model.make_request(ids, **kwargs)
        except (ValueError, RuntimeError) as e:
            yield _value_error(e)
            return
        after = None
        if p.get("return_handle"):
            max_loops = p.get("handle_max_loops") or self.model.config.max_loops
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
            after = lambda: self._build(caller, ids, req.loops, max_loops, req.window)  # noqa: E731
        start = self.model.stream if req.speculative else self.model.start
        async for item in self._stream(key, lambda lane: start(req, lane),
                                       p.get("include_text", False), after):
            yield item

    async def resume(self, key: str, caller: str, token: bytes, epoch: int, p: dict):
        entry = self._lookup(caller, token, epoch)
        if isinstance(entry, dict):
            yield entry
            return
        try:
            rr = self.model.make_resume_request(entry.handle, p["new_loops"], max_tokens=p.get("max_tokens", 128),
                                                cache_window=p.get("cache_window", 0),
                                                stop_token_ids=p.get("stop_token_ids") or None, **_sampling(p))
        except (ValueError, RuntimeError) as e:
            yield _value_error(e)
            return
        entry.active += 1
        try:
            async for item in self._stream(key, lambda lane: self.model.start_resume(rr, lane),
                                           p.get("include_text", False)):
                yield item
        finally:
            entry.active -= 1
            entry.last_used = time.monotonic()

    async def cancel(self, key: str) -> bool:
        """Stop a stream before its next decode step (or take it out of the lane queue)."""
        state = self._streams.get(key)
        if state is None:
            return False
        state.cancelled = True
        if state.waiter is not None and not state.waiter.done():
            state.waiter.set_exception(_Cancelled())
        if state.queue is not None:
            state.queue.put_nowait(None)
        return True

    async def _stream(self, key: str, start, include_text: bool, after=None):
        """start(lane) -> a DecodeState (prefilled) or a token generator (speculative)."""
        state = self._streams[key] = _StreamState()
        loop = asyncio.get_running_loop()
        begun, gen = False, None
        try:
            try:
                state.lane = await self._acquire_lane(state)
            except _Cancelled:
                return
            if state.lane is None:
                yield error("RESOURCE_EXHAUSTED", "QUEUE_FULL",
                            f"{self.worker_id}: {len(self._waiters)} requests already wait for a lane")
                return
            begun = True
            try:
                first, gen = await loop.run_in_executor(self._pool, self._begin, start, state.lane)
            except (ValueError, RuntimeError) as e:
                yield _value_error(e)
                return
            if gen is None and first[1] is None:
                state.queue = self._joined[state.lane] = asyncio.Queue()
                if self._batch_task is None:
                    self._batch_task = loop.create_task(self._batch_loop())
            text = _TextStream(self.model.tokenizer) if include_text else None
            ids: list[int] = []
            flushed_once, last_flush = False, time.monotonic()
            while not state.cancelled:
                try:
                    if first is not None:
                        (new, finish), first = first, None
                    elif gen is not None:
                        new, finish = await loop.run_in_executor(self._pool, _step, gen)
                    else:
                        update = await state.queue.get()
                        if update is None:  # cancelled
                            break
                        if isinstance(update, BaseException):
                            raise update
                        new, finish = update
                except Exception as e:  # a step failed: this stream ends with a status, the worker serves on
                    yield _step_error(self.worker_id, e)
                    return
                if new:
                    ids.extend(new)
                now = time.monotonic()
                if ids and (finish is not None or not flushed_once or now - last_flush >= self.coalesce_s):
                    # The first token goes out at once (TTFT); later ones are coalesced per hop.
                    yield {"ids": ids, "text": text.feed(ids, finish is not None) if text else ""}
                    ids, flushed_once, last_flush = [], True, now
                if finish is not None:
                    tail = text.feed([], True) if text else ""
                    if tail:  # a character held back at the last token
                        yield {"ids": [], "text": tail}
                    complete = {"reason": finish.reason, "stats": dict(finish.stats),
                                "worker_id": self.worker_id}
                    if after is not None:
                        built = await after()
                        if "error" in built:
                            yield built
                            return
                        complete["handle"] = built
                    yield {"complete": complete}
                    return
        finally:
            self._streams.pop(key, None)
            lane = state.lane
            if begun:
                # The stream leaves the batcher (or its generator is closed) on the step thread,
                # after any step in flight; the lane is free only then.
                self._joined.pop(lane, None)
                fut = self._pool.submit(self._end, lane, gen)
                fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._release_lane, lane))
            elif lane is not None:
                self._release_lane(lane)

    def _begin(self, start, lane: int):
        """On the step thread: prefill. -> (first update, None) for a stream that joined the
        batcher (or ended at its first token), or (None, generator) to step alone."""
        from tinyloop.worker.generation.decode import DecodeState, decode_steps  # torch: not at import time
        st = start(lane)
        if not isinstance(st, DecodeState):
            return None, st
        if self.batcher.eligible(st):
            return self.batcher.join(st), None
        return None, decode_steps(st)

    def _end(self, lane: int, gen) -> None:
        """On the step thread: the stream on `lane` is over (finished, cancelled or failed)."""
        self.batcher.leave(lane)
        if gen is not None:
            gen.close()

    async def _batch_loop(self) -> None:
        """Batched decode steps while any stream is in the batcher; each stream's update goes
        to its queue (a stream cancelled meanwhile has left `_joined` and gets nothing)."""
        loop = asyncio.get_running_loop()
        try:
            while self._joined:
                try:
                    updates = await loop.run_in_executor(self._pool, self.batcher.step)
                except Exception as e:  # every batched stream fails with it; the step thread lives on
                    for queue in self._joined.values():
                        queue.put_nowait(e)
                    self._joined.clear()
                    return
                for lane, update in updates.items():
                    queue = self._joined.get(lane)
                    if queue is not None:
                        queue.put_nowait(update)
                        if isinstance(update, BaseException) or update[1] is not None:
                            del self._joined[lane]
        finally:
            self._batch_task = None

    async def _acquire_lane(self, state: _StreamState) -> int | None:
        if not self._waiters:
            lane = self._pool_lanes.acquire()
            if lane is not None:
                return lane
        if len(self._waiters) >= self.max_queue:
            return None
        state.waiter = waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except BaseException:
            # A lane handed over (_release_lane) just as this wait ended otherwise (its task
            # cancelled before it could resume) would be lost with it: pass it on.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release_lane(waiter.result())
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            state.waiter = None

    async def _on_lane(self, fn):
        """fn(lane) on the step thread, holding a lane (queued like a stream); _NoLane with the
        error dict when the queue is full."""
        lane = await self._acquire_lane(_StreamState())
        if lane is None:
            raise _NoLane(error("RESOURCE_EXHAUSTED", "QUEUE_FULL",
                                f"{self.worker_id}: {len(self._waiters)} requests already wait for a lane"))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, lane)
        finally:
            self._release_lane(lane)

    def _release_lane(self, lane: int) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(lane)
                return
        self._pool_lanes.release(lane)

    # -- handles ------------------------------------------------------------------------
    async def build_handle(self, caller: str, p: dict) -> dict:
        try:
            ids = self._prompt_ids(p["prompt"])
        except ValueError as e:
            return _value_error(e)
        max_loops = min(p.get("max_loops", 32), self.model.config.max_loops)
        return await self._build(caller, ids, p.get("l_used", 8), max_loops, p.get("cache_window", 0))

    def _over_budget(self, seq_len: int, max_loops: int, window: int) -> dict | None:
        """The error for a handle larger than the whole byte budget (no eviction could fit it),
        told before any work; None when it can fit."""
        from tinyloop.worker.generation.resume import handle_nbytes  # torch: not at import time
        nbytes = handle_nbytes(self.model.config, seq_len, max_loops, window, self.model.dtype)
        if nbytes <= self.handle_budget_bytes:
            return None
        return error("RESOURCE_EXHAUSTED", "HANDLE_BUDGET_EXHAUSTED",
                     f"a handle of {nbytes} bytes ({seq_len} tokens, max_loops {max_loops}) exceeds "
                     f"{self.worker_id}'s handle budget of {self.handle_budget_bytes} bytes")

    async def _build(self, caller: str, ids: list[int], l_used: int, max_loops: int, window: int) -> dict:
        self._sweep()
        if isinstance(l_used, int) and isinstance(max_loops, int) and 0 <= l_used <= max_loops:
            too_big = self._over_budget(len(ids), max_loops, window)
            if too_big is not None:
                return too_big
        if len(self._handles) >= self.max_handles and not self._evict(0, count=True):
            return error("RESOURCE_EXHAUSTED", "HANDLE_BUDGET_EXHAUSTED",
                         f"{self.worker_id} holds {len(self._handles)} handles (max {self.max_handles})")
        try:
            handle = await self._on_lane(lambda lane: self.model.build_resume_handle(
                ids, L_used=l_used, max_loops=max_loops, cache_window=window, lane=lane))
        except (ValueError, RuntimeError) as e:
            return _value_error(e)
        except _NoLane as e:
            return e.args[0]
        loop = asyncio.get_running_loop()
        nbytes = int(handle.nbytes())
        if not self._evict(nbytes):
            await loop.run_in_executor(self._pool, self.model.free_resume_handle, handle)
            return error("RESOURCE_EXHAUSTED", "HANDLE_BUDGET_EXHAUSTED",
                         f"a handle of {nbytes} bytes does not fit {self.worker_id}'s handle budget of "
                         f"{self.handle_budget_bytes} bytes beside the {len(self._handles)} resident handles "
                         f"that resumes are streaming from")
        token = secrets.token_bytes(16)
        self._handles[token] = _Entry(handle, caller, nbytes, time.monotonic())
        self._handle_bytes += nbytes
        return {"token": token, "epoch": self.epoch, "seq_len": handle.seq_len(),
                "loops_used": handle.loops_used(), "max_loops": handle.max_loops(), "nbytes": nbytes,
                "worker_id": self.worker_id, "expires_in_s": self.handle_ttl_s}

    async def free_handle(self, caller: str, token: bytes, epoch: int) -> dict:
        entry = self._lookup(caller, token, epoch, touch=False)
        if isinstance(entry, dict):
            if entry["error"]["reason"] in ("NOT_OWNER",):
                return entry
            return {"freed": False}  # idempotent: already gone, for whatever reason
        if entry.active:
            return error("FAILED_PRECONDITION", "HANDLE_BUSY",
                         f"{entry.active} resume(s) are streaming from this handle; free it after they finish")
        await self._drop(token, "HANDLE_NOT_FOUND")
        return {"freed": True}

    def _lookup(self, caller: str, token: bytes, epoch: int, touch: bool = True):
        if epoch != self.epoch:
            if epoch < self.epoch:
                return error("NOT_FOUND", "HANDLE_LOST",
                             f"the handle was built before {self.worker_id} restarted (epoch {epoch}, "
                             f"now {self.epoch}); build it again")
            return error("NOT_FOUND", "HANDLE_NOT_FOUND", "no such resume handle")
        self._sweep()
        entry = self._handles.get(token)
        if entry is None:
            reason = self._tombstones.get(token, "HANDLE_NOT_FOUND")
            text = {"HANDLE_EXPIRED": f"the handle expired after {self.handle_ttl_s:g} s unused",
                    "HANDLE_EVICTED": "the handle was evicted to make room under the handle byte budget",
                    }.get(reason, "no such resume handle (never built, or freed)")
            return error("NOT_FOUND", reason, text)
        if entry.owner != caller:
            return error("PERMISSION_DENIED", "NOT_OWNER", "the handle belongs to another caller")
        if touch:
            entry.last_used = time.monotonic()
            self._handles.move_to_end(token)
        return entry

    async def _drop(self, token: bytes, reason: str) -> None:
        entry = self._handles.pop(token)
        self._handle_bytes -= entry.nbytes
        self._remember(token, reason)
        self.model.free_resume_handle(entry.handle)

    def _remember(self, token: bytes, reason: str) -> None:
        self._tombstones[token] = reason
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _evict(self, nbytes: int, count: bool = False) -> bool:
        """Evict least-recently-used idle handles until `nbytes` more fit the budget (or, with
        count, until one more handle fits max_handles). False when it cannot be made to fit."""
        def fits():
            return (len(self._handles) < self.max_handles if count
                    else self._handle_bytes + nbytes <= self.handle_budget_bytes)
        for token in [t for t, e in self._handles.items() if not e.active]:
            if fits():
                break
            entry = self._handles.pop(token)
            self._handle_bytes -= entry.nbytes
            self._remember(token, "HANDLE_EVICTED")
            self.model.free_resume_handle(entry.handle)
        return fits()

    def _sweep(self) -> None:
        """Expire idle handles past their TTL (on every table access and every TTL/4)."""
        if self._sweeper is None:
            try:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
            except RuntimeError:
                pass
        deadline = time.monotonic() - self.handle_ttl_s
        for token in [t for t, e in self._handles.items() if not e.active and e.last_used < deadline]:
            entry = self._handles.pop(token)
            self._handle_bytes -= entry.nbytes
            self._remember(token, "HANDLE_EXPIRED")
            self.model.free_resume_handle(entry.handle)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(self.handle_ttl_s / 4, 30.0)))
            self._sweep()

    # -- scoring ------------------------------------------------------------------------
    async def score(self, p: dict) -> dict:
        try:
            ids = self._prompt_ids(p["prompt"])
            if "consistency" in p:
                c = p["consistency"]
                r = await self._on_lane(lambda lane: self.model.score_with_consistency(
                    ids, c["loops_a"], c["loops_b"], max_tokens=c.get("max_tokens", 32), lane=lane))
                return {"worker_id": self.worker_id, "consistency": {
                    "agree": bool(r["agree"]), "answer_a": [int(t) for t in r["answer_a"]],
                    "answer_b": [int(t) for t in r["answer_b"]], "first_divergence": int(r["first_divergence"])}}
            u = p["uncertainty"]
            logits, kl = await self._on_lane(
                lambda lane: self.model.score_with_uncertainty(ids, u["l_lo"], u["l_hi"], lane=lane))
            return {"worker_id": self.worker_id, "uncertainty": {
                "kl": float(kl), "logits": logits.tobytes() if u.get("return_logits") else b""}}
        except (ValueError, RuntimeError) as e:
            return _value_error(e)
        except _NoLane as e:
            return e.args[0]

    async def trajectory(self, p: dict) -> dict:
        try:
            ids = self._prompt_ids(p["prompt"])
            r = await self._on_lane(lambda lane: self.model.score_trajectory(ids, p["n_loops"], lane=lane))
        except (ValueError, RuntimeError) as e:
            return _value_error(e)
        except _NoLane as e:
            return e.args[0]
        hidden = r["hidden"]
        return {"worker_id": self.worker_id, "labels": list(r["labels"]), "d_model": int(hidden.shape[1]),
                "hidden": hidden.tobytes()}

    # -- helpers ------------------------------------------------------------------------
    def _prompt_ids(self, prompt: dict) -> list[int]:
        if "text" in prompt:
            ids = self.model.tokenizer.encode(prompt["text"])
            if not ids:
                raise ValueError("prompt text encodes to no tokens")
            return ids
        return list(prompt["ids"])


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


def _sampling(p: dict) -> dict:
    keys = ("temperature", "top_k", "top_p", "repetition_penalty", "seed")
    return {k: p[k] for k in keys if p.get(k) is not None}


def _config_dict(cfg) -> dict:
    import dataclasses
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))


def _next_epoch(index: int) -> int:
    """A restart epoch that grows every time Ray (re)creates this actor: a counter in the
    cluster's GCS key-value store, keyed by the actor id (stable across restarts)."""
    try:
        import ray
        from ray.experimental import internal_kv
        key = f"tinyloop/epoch/{ray.get_runtime_context().get_actor_id()}".encode()
        old = internal_kv._internal_kv_get(key)
        epoch = int(old) + 1 if old else 1
        internal_kv._internal_kv_put(key, str(epoch).encode(), overwrite=True)
        return epoch
    except Exception:  # outside Ray (unit use): a random epoch still tells restarts apart
        return secrets.randbelow(1 << 31) + 1
