"""Early exit of one stream's decode step on captured graphs (Runner.decode with one lane).

The batched exit step (Runner._decode_exit) replays a batch bucket's stage graphs and a check
graph per iteration: on a small model that is several times the batch-1 step's launches, and a
stream alone pays all of them. Here one row has a stage set of its own (stages.BatchStep of
one row, whose iterations take the batch-1 step's fused projections).

A token's step is one graph, a *span*: the check's state cleared, the prelude, the first `c`
iterations each followed by the check (kernels/exit_check: one launch; the coda before it
where the rule reads logits), then the coda, the greedy token and, under the `copy` policy, the
skipped iterations' cache entries, with the exit depth read on the device. A row its rule
stops at d <= c is frozen on the device (its depth becomes d), so the iterations after d carry
it through unchanged and the coda reads its exit state: the span's result is the token's
whatever c is. The span's last kernel writes the depth the row ran and its token into pinned
host memory (kernels/exit_fill.exit_publish), so the host reads both once the span is done,
with no copy launched; the stream takes the token from there (StepOut.host). The span's
checks publish nothing: each copy to host memory in a graph is a node that costs the device
microseconds. Where the rule had not
stopped the row by c (and c < its depth), the step goes on from there: one graph per
iteration (the iteration, its coda where the rule reads logits, the check publishing its
decision into a pinned host slot), the host reading iteration d's decision after launching
iteration d + 1, then an end graph (coda, greedy token, the copy fill keyed by the exit depth,
the publication) that overwrites what the span's end wrote. `recompute` runs early_exit's
eager fill after it.

`launch` replays the span and returns; `finish` waits for it, reads the depth and goes on where
needed. A stream's next step (its token the device tensor this one's greedy token lands in)
is launched before this one is finished (Runner._decode_solo), so the device runs the spans
back to back while the host finishes the first and does the stream's work: the steps of even
and odd positions have buffers of their own (`_Half`: the stage set, the check state), and a
step that goes on past its span still finds its state there. The next step then ran on a
stale token (and a cache without this token's later iterations) and runs again (`relaunch`):
its cache writes are at its own position, which the second run writes over. choose_span
counts that second run in a miss's cost.

c is a guess of where the stream's tokens stop, from the depths its last tokens ran
(`choose_span`): iterations past a token's exit are paid on the device, a token that goes on
past c pays a host round trip and a launch per further iteration. A fixed `span` (an int, or
"min" / "max") replaces the guess.

The span graphs (every length the guess may pick, both position parities) and the iteration
graphs are captured the first time a step of a rule's depth and kind needs them, before it loads
its row: the stage sets then hold an idle row (a position past the cache, depth 0), so a
capture's warm-up writes no lane's cache. The end graphs (per position parity, exit depth and
depth) are captured after the row is loaded into its half and before it runs (`_capture_ends`).
No step is in flight during a capture (`needs_capture`: the runner finishes the last first).
"""
from __future__ import annotations

from collections import deque

import torch

from tinyloop.worker.runner.early_exit import ExitRule, ExitState, fill_skipped
from tinyloop.worker.runner.stages import BatchStep, Staging, device_tensor

# choose_span's costs, in the device time of one iteration: a token that goes on past the span
# waits for the host to read it, and each of its further iterations is a launch of its own
MISS_COST = 3.0
LATE_ITERATION_COST = 1.5
HISTORY = 64  # the tokens whose depths choose_span weighs
RULES_KEPT = 256  # the (rule, depth) pairs whose histories are kept (a request's threshold is any float)


def choose_span(first: int, depth: int, ran: list[int]) -> int:
    """The span in [first, depth] that costs least over the depths `ran` of recent tokens: the
    iterations the span runs past `first`, plus, for each token that ran deeper, MISS_COST, the
    span's own iterations again (the step launched after it ran on its stale token and runs
    once more) and LATE_ITERATION_COST per iteration past the span. No history: `first`. One
    pass over the depths, then one over the spans (suffix sums of the tokens past each)."""
    if not ran:
        return first
    count = [0] * (depth + 1)
    for r in ran:
        count[min(r, depth)] += 1
    best, cost = first, None
    past = past_sum = 0  # the tokens that ran deeper than c, and their depths' sum
    for c in range(depth, first - 1, -1):  # longest first: `<=` keeps the shortest of the cheapest
        late = past * (MISS_COST + c) + LATE_ITERATION_COST * (past_sum - c * past)
        cst = c - first + late / len(ran)
        if cost is None or cst <= cost:
            best, cost = c, cst
        past += count[c]
        past_sum += c * count[c]
    return best


class _Half:
    """The buffers of the steps at one position parity: the row's stage set, its check state
    and the event behind its last span. A stream's consecutive steps alternate halves, so a
    step runs while its predecessor's buffers still hold what that one needs to go on."""

    def __init__(self, engine, op):
        dev = engine.cache.device
        self.step = BatchStep(engine, 1)
        self.state = ExitState(engine.model, 1, dev, op)
        self.event = torch.cuda.Event() if dev.type == "cuda" else None
        # the row's (token, position, depth, lane) on the host, copied into the stage set's
        # control buffer (one slot: the runner ends a step before launching the one two
        # positions on, so the slot's last copy has run by the time it is written again)
        self.staging = Staging((4, 1), torch.long, dev, slots=1)

    def load(self, lane: int, token, position: int, depth: int) -> None:
        """The stage set's one row: `token` a host int or a one-element device tensor."""
        dev = isinstance(token, torch.Tensor)
        self.staging.next()[:, 0] = (0 if dev else token, position, depth, lane)
        self.staging.copy_to(self.step.ctl)
        if dev:
            self.step.ctl[0].copy_(token.view(1))


class SoloStep:
    """A launched step: what `SoloExit.finish` needs to end it."""
    __slots__ = ("lane", "token", "position", "depth", "rule", "parity", "c", "copy", "key", "history",
                 "went_on")

    def __init__(self, lane, token, position, depth, rule, c, copy, key, history):
        self.lane, self.token, self.position, self.depth, self.rule = lane, token, position, depth, rule
        self.parity, self.c, self.copy, self.key, self.history = position % 2, c, copy, key, history
        self.went_on = False

    def precedes(self, lane: int, position: int, depth: int, rule: ExitRule) -> bool:
        """Whether a step of (lane, position, depth, rule) is this step's stream's next, with
        the copy fill (inside the span: recompute fills eagerly once the step has ended)."""
        return (self.lane == lane and self.position + 1 == position and self.depth == depth
                and self.rule == rule and rule.cache == "copy")


class SoloExit:
    def __init__(self, engine, graphs, op, span: int | str | None = None):
        if span is not None and span not in ("min", "max") and not (isinstance(span, int) and span >= 1):
            raise ValueError(f"span must be None, 'min', 'max' or an int >= 1, got {span!r}")
        self.engine, self.graphs, self.span = engine, graphs, span
        dev = engine.cache.device
        cuda = dev.type == "cuda"
        self.halves = [_Half(engine, op), _Half(engine, op)]
        self.rule_params = torch.zeros(1, 6, dtype=torch.float32, device=dev)  # the span graph's input
        # the greedy token of even and odd positions: a stream reads a step's token after
        # launching the next step (pipelined decode), so consecutive steps write different ones
        self.greedy = torch.zeros(2, 1, dtype=torch.long, device=dev)
        # per position parity, the depth the row ran and its token as the span's (or the end
        # graph's) last kernel publishes them (pinned on CUDA: kernels/exit_fill.exit_publish)
        self.host = torch.zeros(2, 2, dtype=torch.long, pin_memory=cuda)
        # span: keyed by (whether each of its iterations reads logits, position parity, copy fill)
        self.spans: dict[tuple[tuple[bool, ...], int, bool], object] = {}
        self.iterations: dict[tuple[int, int, int, bool], object] = {}  # (parity, i, host slot, with logits)
        # end: the coda, the greedy token and its publication, and the copy fill of an early
        # exit, keyed by (position parity, (exit depth, depth) or None)
        self.ends: dict[tuple[int, tuple[int, int] | None], object] = {}
        self._fills: dict[tuple[int, int], object] = {}  # (parity, depth) -> the span's copy fill
        self._loaded: tuple | None = None  # (rule, depth) whose params rule_params holds
        self._ready: set[tuple] = set()  # the (depth, first, logits, copy) whose iterations and spans are captured
        self._ends_ready: set[tuple] = set()  # the (parity, depth, copy) whose end graphs are captured
        # (rule, depth) -> [first iteration it may stop after, the depths its last tokens ran,
        # {span: the span's logits flags}]
        self._plans: dict[tuple, list] = {}
        # steps ended, those that went on past their span, those launched before the step
        # before them had ended (Runner._decode_solo), and those of these launched again
        # because the step before them went on
        self.counts = {"steps": 0, "went_on": 0, "ahead": 0, "relaunched": 0}

    def drop(self) -> None:
        """Let go of the graphs now (Runner.close): their closures refer back to this object."""
        for graphs in (self.spans, self.iterations, self.ends):
            graphs.clear()

    def _iteration(self, h: _Half, i: int, slot: int | None, logits: bool) -> None:
        """Iteration i, the coda where the check reads logits, and the check into host slot
        `slot` (None: nothing published)."""
        st, step = h.state, h.step
        step.run(i)
        if logits:
            step.run("coda")
        st.check(1, self.engine.model.state(step.x[:, 0]), step.logits if logits else None, step.ctl[2], slot,
                 st.all_kinds)

    def _capture(self, first: int, top: int, logits: bool) -> None:
        """The iteration graphs from `first` up to `top` (with logits too where the rule reads
        them), both halves, where missing: captured before the step loads its row."""
        missing = [(par, i, s, lg) for par in (0, 1) for i in range(first, top) for s in (0, 1)
                   for lg in {False, logits} if (par, i, s, lg) not in self.iterations]
        for par in {m[0] for m in missing}:
            self.halves[par].step.load([], [], [], [])  # an idle row: no capture's warm-up writes a lane
        for key in missing:
            par, i, s, lg = key
            self.iterations[key] = self.graphs.capture_call(
                lambda h=self.halves[par], i=i, s=s, lg=lg: self._iteration(h, i, s, lg))

    def _capture_span(self, key: tuple, depth: int) -> None:
        """The span graph `key` (flags, parity, copy) of a step of `depth` iterations, captured
        before the step loads its row, the greedy tokens kept through its warm-ups."""
        flags, parity, copy = key
        h = self.halves[parity]
        st, step = h.state, h.step
        fill = self._span_fill(parity, depth) if copy else None

        def span():
            st.params.copy_(self.rule_params)
            st.clear()
            st.order.zero_()
            step.run("prelude")
            for i, lg in enumerate(flags):
                self._iteration(h, i, None, lg)
            step.run("coda")
            torch.argmax(step.logits, -1, out=self.greedy[parity])
            if fill is not None:
                fill()
            self.engine.ops.exit_publish(step.ctl[2], self.greedy[parity], self.host[parity])
        step.load([], [], [], [])
        kept = self.greedy.clone()
        self.spans[key] = self.graphs.capture_call(span)
        self.greedy.copy_(kept)

    def needs_capture(self, depth: int, rule: ExitRule) -> bool:
        """Whether a step of `depth` iterations under `rule` captures graphs before it runs (the
        captures load idle rows into both halves: nothing may be in flight)."""
        plan, copy = self._plans.get((rule, depth)), rule.cache == "copy"
        return (plan is None or (depth, plan[0], rule.needs_logits, copy) not in self._ready
                or any((par, depth, copy) not in self._ends_ready for par in (0, 1)))

    def launch(self, lane: int, token, position: int, depth: int, rule: ExitRule) -> SoloStep:
        """Launch one decode step of `token` (a host int or a one-element device tensor) at
        `position` on `lane`, at most `depth` iterations, stopping where `rule` says: its span
        graph, not waited for (`finish` ends it). Its outputs, once ended: the half's step.logits
        (1, V) and step.x (1, 1, W), self.greedy[position % 2] (1,), self.host[position % 2]
        (the iterations it ran, its greedy token). Captures run first where `needs_capture`."""
        parity = position % 2
        if self._loaded != (rule, depth):  # the host's copy of the rule, and the span's input
            for h in self.halves:
                params = h.state.load_host([rule], [depth])
            self.rule_params.copy_(device_tensor(params, self.rule_params.device, torch.float32), non_blocking=True)
            self._loaded = (rule, depth)
        plan = self._plan(rule, depth)
        first, history, flags_of = plan
        c = self._span(first, depth, history)
        st = self.halves[parity].state
        if c not in flags_of:
            flags_of[c] = tuple(st.needs_logits(d, [0]) for d in range(1, c + 1))
        copy = rule.cache == "copy"
        key = (flags_of[c], parity, copy)
        if (depth, first, rule.needs_logits, copy) not in self._ready:
            self._capture(first, depth, rule.needs_logits)
            # every span the guess may pick, at once: a capture (two warm-up runs and the
            # capture) costs many steps, and the guess moves with the stream's depths
            for n in range(first, depth + 1):
                if n not in flags_of:
                    flags_of[n] = tuple(st.needs_logits(d, [0]) for d in range(1, n + 1))
                for par in (0, 1):
                    if (flags_of[n], par, copy) not in self.spans:
                        self._capture_span((flags_of[n], par, copy), depth)
            self._ready.add((depth, first, rule.needs_logits, copy))
        if key not in self.spans:
            self._capture_span(key, depth)
        s = SoloStep(lane, token, position, depth, rule, c, copy, key, history)
        self._load(s)
        if (parity, depth, copy) not in self._ends_ready:
            self._capture_ends(parity, depth, copy)
            self._ends_ready.add((parity, depth, copy))
        self._replay(s)
        return s

    def _load(self, s: SoloStep) -> None:
        self.halves[s.parity].load(s.lane, s.token, s.position, s.depth)

    def _replay(self, s: SoloStep) -> None:
        h = self.halves[s.parity]
        self.spans[s.key].replay()
        if h.event is not None:
            h.event.record()

    def relaunch(self, s: SoloStep) -> None:
        """Run launched step `s` again, from its row's load: the step before it went on past its
        span after `s` was launched, so `s` ran on that step's stale token and cache."""
        self.counts["relaunched"] += 1
        self._load(s)
        self._replay(s)

    def finish(self, s: SoloStep) -> int:
        """End launched step `s` -> the iterations it ran: wait for its span, and where its rule
        had not stopped it by the span's end, go on one iteration at a time (the host reads
        each decision) and run its end graph, which publishes its token."""
        h = self.halves[s.parity]
        if h.event is not None:
            h.event.synchronize()
        ran = int(self.host[s.parity, 0])
        self.counts["steps"] += 1
        if ran > s.c:  # the rule had not stopped it by the span's end: on, one iteration at a time
            self.counts["went_on"] += 1
            s.went_on = True
            ran = self._go_on(h, s)
        s.history.append(ran)
        if ran < s.depth and not s.copy:
            fill_skipped(self.engine, [(0, s.lane, s.position, ran, s.depth, s.rule.cache)], h.step.x)
        return ran

    def _plan(self, rule: ExitRule, depth: int) -> list:
        """The (rule, depth) pair's plan, the most recently used last; the oldest beyond
        RULES_KEPT let go."""
        plan = self._plans.pop((rule, depth), None)
        if plan is None:
            plan = [max(1, min(rule.earliest(), depth)), deque(maxlen=HISTORY), {}]
        self._plans[(rule, depth)] = plan
        if len(self._plans) > RULES_KEPT:
            del self._plans[next(iter(self._plans))]
        return plan

    def _span(self, first: int, depth: int, history) -> int:
        if self.span == "min":
            return first
        if self.span == "max":
            return depth
        if self.span is not None:
            return min(max(self.span, first), depth)
        return choose_span(first, depth, list(history))

    def _go_on(self, h: _Half, s: SoloStep) -> int:
        """Iterations c .. depth - 1 of a row the span left going, then the end graph (its token
        published; waited for) -> the iterations it ran."""
        st, depth = h.state, s.depth
        ran, pending = depth, None
        for i in range(s.c, depth):
            d = i + 1
            slot = d % 2
            self.iterations[(s.parity, i, slot, st.needs_logits(d, [0]))].replay()
            published = None
            if d < depth and st.can_stop(d, [0]):
                st.mark(slot)
                published = (slot, d)
            to_read, pending = pending, published
            if to_read is not None and st.read(to_read[0], 1)[0]:
                ran = to_read[1]
                break
        self.ends[(s.parity, (ran, depth) if s.copy and ran < depth else None)].replay()
        if h.event is not None:
            h.event.record()
            h.event.synchronize()
        return ran

    def _capture_ends(self, parity: int, depth: int, copy: bool) -> None:
        """The end graphs of a step of `depth` iterations at `parity` where missing, under the
        copy policy for every exit depth: captured after the step loaded its row into that
        half and before it runs, so their warm-ups write only the row's own position, in cache
        layers that the step itself writes afterwards (its iterations below where it stops, its
        fill from there to its depth, its coda)."""
        h, cap = self.halves[parity], self.graphs.capture_call
        step = h.step
        missing = [fill for fill in [None] + ([(e, depth) for e in range(1, depth)] if copy else [])
                   if (parity, fill) not in self.ends]
        if not missing:
            return
        # the last step's token, which its stream may not have read yet, survives the warm-ups
        kept = self.greedy.clone()
        for fill in missing:
            fn = None if fill is None else self._fill(step, *fill)

            def end(fn=fn):
                step.run("coda")
                torch.argmax(step.logits, -1, out=self.greedy[parity])
                if fn is not None:
                    fn()
                self.engine.ops.exit_publish(step.ctl[2], self.greedy[parity], self.host[parity])
            self.ends[(parity, fill)] = cap(end)
        self.greedy.copy_(kept)

    def _fill(self, step: BatchStep, e: int, top: int):
        """The copy policy's fill of a token that ran e of `top` iterations, on the row's lane
        and position as `step`'s buffers hold them: iterations [e, top) of every block layer
        get iteration e - 1's K/V (early_exit.fill_skipped, with device indices)."""
        cfg, cache, dev = self.engine.config, self.engine.cache, self.engine.cache.device
        pairs = [(cfg.loop_layer_index(i, j), cfg.loop_layer_index(e - 1, j))
                 for i in range(e, top) for j in range(cfg.n_loop_layers)]
        dst, src = (torch.tensor(v, dtype=torch.long, device=dev) for v in zip(*pairs))
        slot, pos = step.ctl[3], step.ctl[1]

        def fill():
            for t in (cache.k, cache.v):
                t[dst, slot, :, pos] = t[src, slot, :, pos]
        return fill

    def _span_fill(self, parity: int, top: int):
        """The copy fill of a span of a step of `top` iterations at `parity`, its exit depth e
        read on the device (the row's depth entry, which the check set where the rule stopped
        it): every iteration i in [e, top) of every block layer gets iteration e - 1's K/V (the
        ops' exit_fill, kernels/exit_fill.py, over every candidate cell i in [1, top)). An idle
        row (depth 0) moves nothing."""
        if (parity, top) in self._fills:
            return self._fills[(parity, top)]
        cfg, cache, dev = self.engine.config, self.engine.cache, self.engine.cache.device
        nl = cfg.n_loop_layers
        if top < 2:
            self._fills[(parity, top)] = None
            return None
        cells = [(i, j) for i in range(1, top) for j in range(nl)]
        its = torch.tensor([i for i, _ in cells], dtype=torch.long, device=dev)
        dst = torch.tensor([cfg.loop_layer_index(i, j) for i, j in cells], dtype=torch.long, device=dev)
        # row e - 1 of `src`: each cell's source when the token exited after e iterations
        src = torch.tensor([[cfg.loop_layer_index(e - 1, j) for _, j in cells] for e in range(1, top + 1)],
                           dtype=torch.long, device=dev)
        ctl, op = self.halves[parity].step.ctl, self.engine.ops.exit_fill

        def fill():
            op(cache.k, cache.v, ctl[2], ctl[3], ctl[1], its, dst, src)
        self._fills[(parity, top)] = fill
        return fill
