"""The worker's step loop policy: which queued requests get a cache lane, which prompts prefill
how many tokens in this step, and one batched decode step for every stream that decodes.

Plain Python over the generation layer: no Ray, no asyncio and no thread of its own. The actor
calls `submit` and `cancel` from any thread and `step` on its one step thread; the tests call
them directly.

Each `step`:
1. takes in new jobs and cancellations; a job still queued past its deadline ends with
   `DeadlineExceeded`;
2. admits queued jobs in arrival order while lanes are free;
3. prefills under a token budget (`step_tokens`): admitted prompts in arrival order (or, with
   `SchedulerOptions.prefill_order` "longest", the prompts already midway first and then the
   fresh ones with the most decode work first: `Job.work`), each a
   chunk of at most what is left of the budget (the first always gets one chunk, so a step
   always makes progress; a job that starts whole, such as a speculative stream's prefill,
   waits for a step whose budget it fits or that it opens). A long prompt, or a resume's
   extension over its handle's positions (`resume.Extension`), is cut into chunks over several
   steps, and the streams decoding meanwhile get a token every step instead of waiting for it.
   The fresh prompts that fit the step whole prefill together, in one pass;
4. hands a greedy speculative stream over to the batcher once the worker is busy
   (`SchedulerOptions.speculative_max_running`), then runs one batched decode step
   (`Batcher.step`) for every stream in the batcher (L scheduling, the safety check and sliding
   windows included), one round of every chain speculative stream that shares its rounds
   (`SpecBatch.step`: their draft steps batched, their verifies one pass), and one step of each
   stream that steps alone, and returns what happened as events. Chain speculative streams
   share their rounds once `SchedulerOptions.speculative_share_from` (2) would: each joins the shared rounds between two of its
   own, where nothing of it is in flight (on CUDA that is after its prefill's token: a lone
   stream's device rounds each launch the next ahead, so it stays alone once they began).

A job is a `begin(lane)` callable. What it returns says what the job is: a `Prefill` (a plain
prompt or a resume's extension, chunked here), a `DecodeState` (already prefilled), a token iterator (a
stream that steps alone: a generator, or a `SpeculativeStream`, which a busy worker hands over
to the batched step) or, for a `task` job, the answer itself (handle builds, scores: the
lane is free again at once).
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.decode import DecodeState, Finish, Prefill, prefill_together
from tinyloop.worker.generation.spec_batch import SpecBatch
from tinyloop.worker.generation.speculative import SpeculativeStream
from tinyloop.worker.serving.options import PREFILL_ORDERS, SchedulerOptions  # noqa: F401 (the scheduler's options)


class QueueFull(Exception):
    """No free lane and `max_queue` jobs already wait for one."""


class DeadlineExceeded(Exception):
    """The job's deadline passed while it waited for a lane."""


@dataclass
class Job:
    key: str
    begin: Callable[[int], object]
    tokens: int = 0               # prompt tokens its begin prefills at once (budget accounting)
    deadline: float | None = None  # time.monotonic() past which a still-queued job is dropped
    task: bool = False            # begin's return value is the answer; the lane is free after it
    # begin of the same stream decoded in the batch, where that gives the same tokens (a greedy
    # speculative stream: its tokens are generate's at verify_loops); taken when the worker is
    # busy (SchedulerOptions.speculative_max_running)
    batched: Callable[[int], object] | None = None
    work: int = 0  # the decode iterations its stream may run (depth x max_tokens), for prefill_order "longest"
    submitted: float = field(default_factory=time.monotonic)
    admitted: int = -1  # the scheduler step that gave it a lane (set by the scheduler)


# What `step` reports, per job key:
#   Tokens(ids, finish)  new ids of a stream (finish: its Finish once it ended)
#   Result(value)        a task's answer
#   Failed(exception)    the job ended with this exception (it holds no lane any more)
@dataclass
class Tokens:
    ids: list[int]
    finish: Finish | None = None


@dataclass
class Result:
    value: object


@dataclass
class Failed:
    error: BaseException


Event = tuple[str, Tokens | Result | Failed]


@dataclass
class StepStats:
    """What one step did (the actor's metrics)."""
    prefill_tokens: int = 0
    prefilled_together: int = 0  # prompts of the step's shared prefill pass (0: none ran)
    batched_not_speculative: int = 0  # speculative jobs started in the batch instead (busy worker)
    handed_to_batch: int = 0  # greedy speculative streams moved from their rounds to the batch (busy worker)
    speculative_rows: int = 0  # speculative streams whose round ran in the shared rounds (SpecBatch)
    batch_rows: int = 0
    seconds: float = 0.0      # the step's wall time on the step thread
    cpu_seconds: float = 0.0  # the CPU time the step thread spent in it (the rest it waited: GPU, GIL)


class Scheduler:
    def __init__(self, runner, options: SchedulerOptions = SchedulerOptions(), clock=time.monotonic):
        self.runner = runner
        self.lanes = runner.lanes
        self.o = options
        self.clock = clock
        self.batcher = Batcher(runner)
        self.spec_batch = SpecBatch(runner)
        self._lock = threading.Lock()
        self._inbox: list[Job] = []
        self._cancels: set[str] = set()
        self._waiting: collections.deque[Job] = collections.deque()
        self._prefilling: dict[str, tuple[int, Job, Prefill | None]] = {}  # arrival order (dicts keep it)
        self._batched: dict[int, str] = {}        # lane -> key of a stream in the batcher
        self._alone: dict[str, tuple[int, object]] = {}  # key -> (lane, token iterator)
        self._spec: dict[int, str] = {}           # lane -> key of a speculative stream in spec_batch
        self._step_no = 0                         # steps run (a job's `admitted`)
        self.last = StepStats()

    # -- from any thread ---------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job (it starts in a later `step`); QueueFull when it could only wait and the
        queue is full."""
        with self._lock:
            waiting = len(self._waiting) + len(self._inbox)
            if waiting >= self.lanes.free + self.o.max_queue:
                raise QueueFull(f"{waiting - self.lanes.free} requests already wait for a lane")
            self._inbox.append(job)

    def cancel(self, key: str) -> None:
        """End the job before its next step (queued, prefilling or decoding); it reports nothing
        more and its lane is free after this step."""
        with self._lock:
            self._cancels.add(key)

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._inbox)

    @property
    def running(self) -> int:
        """Jobs holding a lane."""
        return len(self._prefilling) + len(self._batched) + len(self._alone) + len(self._spec)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._cancels or self._waiting or self._prefilling or self._batched
                        or self._alone or self._spec)

    # -- on the step thread ------------------------------------------------------------------
    def step(self, early: Callable[[list[Event]], None] | None = None) -> list[Event]:
        """One step: its events. early(events), when given, gets the events up to the prefill
        (first tokens, refusals) before the decode step runs, so a first token goes out a
        step sooner; the return value then holds the rest."""
        events: list[Event] = []
        stats = self.last = StepStats()
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            cancels, self._cancels = self._cancels, set()
        for key in cancels:
            self._drop(key)
        now = self.clock()
        for job in [j for j in self._waiting if j.deadline is not None and now > j.deadline]:
            self._waiting.remove(job)
            events.append((job.key, Failed(DeadlineExceeded(
                f"the deadline passed after {now - job.submitted:.3f} s waiting for a lane"))))
        self._step_no += 1
        while self._waiting and self.lanes.free:
            job = self._waiting.popleft()
            job.admitted = self._step_no
            self._prefilling[job.key] = (self.lanes.acquire(), job, None)
        self._prefill(events, stats)
        if early is not None and events:
            early(events)
            events = []
        self._decode(events, stats)
        stats.seconds = time.perf_counter() - t0
        stats.cpu_seconds = time.thread_time() - c0
        return events

    def _prefill(self, events: list[Event], stats: StepStats) -> None:
        budget = self.o.step_tokens
        together: list[tuple[str, int, Job, Prefill]] = []
        for key, (lane, job, pre) in self._prefill_order():
            if budget <= 0 or (pre is None and budget < self.o.step_tokens and job.tokens > budget):
                break  # in order: a job that starts whole waits for a step it fits (or opens)
            try:
                if pre is None:
                    got = self._begin(job, lane, stats)
                    if isinstance(got, Prefill):
                        pre = got
                    else:
                        budget -= job.tokens
                        stats.prefill_tokens += job.tokens
                        del self._prefilling[key]
                        self._started(key, lane, job, got, events)
                        continue
                if self._joins(together, pre, budget):
                    together.append((key, lane, job, pre))
                    budget -= pre.remaining
                    stats.prefill_tokens += pre.remaining
                    continue
                n = min(budget, pre.remaining)
                st = pre.run(n)
                budget -= n
                stats.prefill_tokens += n
            except Exception as e:  # this job alone: the others go on
                del self._prefilling[key]
                self.lanes.release(lane)
                events.append((key, Failed(e)))
                continue
            if st is None:
                self._prefilling[key] = (lane, job, pre)
            else:
                del self._prefilling[key]
                self._started(key, lane, job, st, events)
        if together:
            self._prefill_together(together, events)

    def _prefill_order(self) -> list[tuple[str, tuple[int, Job, Prefill | None]]]:
        """The admitted prompts in the order they take the step's budget (prefill_order)."""
        items = list(self._prefilling.items())  # arrival order
        if self.o.prefill_order == "longest":
            # midway prompts first (their chunks hold a lane and a partial cache), then by step
            # of admission and work (a stable sort: ties keep arrival order)
            items.sort(key=lambda it: (0, 0, 0) if it[1][2] is not None else (1, it[1][1].admitted, -it[1][1].work))
        return items

    def _busy(self) -> bool:
        """Whether speculative decoding gives way to the batched step (speculative_max_running):
        as many streams as the limit hold a lane or wait for one, a given one aside (it holds a
        lane: it is in `running`). Streams that arrive together would otherwise each see an
        idle worker and all start speculative."""
        limit = self.o.speculative_max_running
        return bool(limit) and self.running - 1 + len(self._waiting) >= limit

    def _begin(self, job: Job, lane: int, stats: StepStats):
        if job.batched is not None and self._busy():
            stats.batched_not_speculative += 1
            return job.batched(lane)
        return job.begin(lane)

    def _joins(self, together: list, pre: Prefill, budget: int) -> bool:
        if not (self.o.prefill_together and pre.joinable and pre.remaining <= budget):
            return False
        longest = max([pre.remaining, *(p.remaining for _, _, _, p in together)])
        return (len(together) + 1) * longest <= 2 * self.o.step_tokens

    def _prefill_together(self, together: list[tuple[str, int, Job, Prefill]], events: list[Event]) -> None:
        """The step's whole fresh prompts: one pass for two or more (one failure fails them all:
        the pass is shared), the plain chunk for one."""
        try:
            if len(together) == 1:
                states = [together[0][3].run(together[0][3].remaining)]
            else:
                states = prefill_together([pre for _, _, _, pre in together])
                self.last.prefilled_together = len(together)
        except Exception as e:
            for key, lane, _, _ in together:
                del self._prefilling[key]
                self.lanes.release(lane)
                events.append((key, Failed(e)))
            return
        for (key, lane, job, _), st in zip(together, states):
            del self._prefilling[key]
            self._started(key, lane, job, st, events)

    def _started(self, key: str, lane: int, job: Job, got, events: list[Event]) -> None:
        """The job's prefill is done (or it was a task): where it goes from here."""
        if job.task:
            self.lanes.release(lane)
            events.append((key, Result(got)))
            return
        if isinstance(got, DecodeState):
            ids, finish = self.batcher.join(got)
            events.append((key, Tokens(ids, finish)))
            if finish is None:
                self._batched[lane] = key
            else:
                self.lanes.release(lane)
            return
        self._alone[key] = (lane, got)

    def _hand_over(self, events: list[Event], stats: StepStats) -> None:
        """On a busy worker, every greedy speculative stream between two rounds (stepping alone
        or in the shared rounds) goes on in the batched step (`SpeculativeStream.handoff`); it
        runs there from this step's launch on. Its tokens are those its rounds would have decided."""
        if not (self._alone or self._spec) or not self._busy():
            return
        streams = [(key, lane, gen) for key, (lane, gen) in self._alone.items()]
        streams += [(key, lane, self.spec_batch.streams[lane]) for lane, key in self._spec.items()]
        for key, lane, gen in streams:
            if not (isinstance(gen, SpeculativeStream) and gen.can_handoff):
                continue  # not speculative, sampled, or not started (its prefill runs below)
            if lane in self._spec:
                self.spec_batch.take(lane)
                del self._spec[lane]
            else:
                del self._alone[key]
            try:
                self.batcher.add(gen.handoff())
            except Exception as e:  # this stream alone: the others go on
                gen.close()
                self.lanes.release(lane)
                events.append((key, Failed(e)))
                continue
            self._batched[lane] = key
            stats.handed_to_batch += 1

    def _decode(self, events: list[Event], stats: StepStats) -> None:
        self._hand_over(events, stats)
        if self.batcher:
            try:
                updates = self.batcher.step()
            except Exception as e:  # the batched step itself failed: every stream in it ends
                for lane, key in self._batched.items():
                    self.batcher.leave(lane)
                    self.lanes.release(lane)
                    events.append((key, Failed(e)))
                self._batched.clear()
                updates = {}
            stats.batch_rows = self.batcher.rows_stepped if updates else 0
            self._deliver(updates, self._batched, events)
        if self.spec_batch:
            updates = self.spec_batch.step()  # a failure ends its own streams (their updates)
            stats.speculative_rows = len(updates)
            self._deliver(updates, self._spec, events)
        ready = []  # speculative streams between two rounds with nothing in flight
        for key, (lane, gen) in list(self._alone.items()):
            try:
                ids = next(gen)
                events.append((key, Tokens(ids)))
                if isinstance(gen, SpeculativeStream) and self.spec_batch.eligible(gen):
                    ready.append((key, lane, gen))
                continue
            except StopIteration as stop:
                events.append((key, Tokens([], stop.value)))
            except Exception as e:
                events.append((key, Failed(e)))
            del self._alone[key]
            self.lanes.release(lane)
        share = self.o.speculative_share_from
        if ready and share and len(self.spec_batch) + len(ready) >= share:  # their next rounds run together
            for key, lane, gen in ready:
                del self._alone[key]
                self.spec_batch.add(gen)
                self._spec[lane] = key

    def _deliver(self, updates: dict, owners: dict[int, str], events: list[Event]) -> None:
        """A shared step's updates {lane: (ids, Finish or None) or exception} as events of the
        streams `owners` ({lane: key}) holds; a stream that ended leaves it and frees its lane."""
        for lane, update in updates.items():
            key = owners.get(lane)
            if key is None:
                continue
            if isinstance(update, Exception):
                events.append((key, Failed(update)))
                done = True
            else:
                ids, finish = update
                events.append((key, Tokens(ids, finish)))
                done = finish is not None
            if done:
                del owners[lane]
                self.lanes.release(lane)

    def _drop(self, key: str) -> None:
        for job in self._waiting:
            if job.key == key:
                self._waiting.remove(job)
                return
        if key in self._prefilling:
            lane, _, _ = self._prefilling.pop(key)
            self.lanes.release(lane)
            return
        if key in self._alone:
            lane, gen = self._alone.pop(key)
            gen.close()
            self.lanes.release(lane)
            return
        for owners, leave in ((self._spec, self.spec_batch.leave), (self._batched, self.batcher.leave)):
            for lane, k in list(owners.items()):
                if k == key:
                    leave(lane)
                    del owners[lane]
                    self.lanes.release(lane)
                    return
