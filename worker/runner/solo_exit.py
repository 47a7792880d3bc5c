"""Early exit of one stream's decode step on captured graphs (Runner.decode with one lane).

The batched exit step (Runner._decode_exit) replays a batch bucket's stage graphs and a check
graph per iteration: on a small model that is several times the batch-1 step's launches, and a
stream alone pays all of them. Here one row has a stage set of its own (stages.BatchStep of
one row, whose iterations take the batch-1 step's fused projections) and each iteration is one
graph: the iteration, the coda where the rule reads logits, and the check (kernels/exit_check:
one launch), which publishes the decision into a pinned host slot. So a token costs one graph
to start (the check's state cleared, the prelude, and the iterations after which its rule may
not stop yet, min_loops or the criterion's first decision), one per later iteration, and one to
end (the coda, the greedy token and, where the token exited early under the `copy` policy, the
skipped iterations' cache entries; `recompute` runs early_exit's eager fill after it).

The host reads iteration d's decision after launching iteration d + 1, so the wait overlaps
the device's work; a row stopped at d is frozen on the device (its depth becomes d) and runs
iteration d + 1 unchanged.

The start and iteration graphs are captured the first time a step needs them, before it loads
its row: the stage set then holds an idle row (a position past the cache, depth 0), so a
capture's warm-up writes no lane's cache. The end graphs (per position parity, exit depth and
depth) are captured after the row is loaded and before it runs (`_capture_ends`).
"""
from __future__ import annotations

import torch

from tinyloop.worker.runner.early_exit import ExitRule, ExitState, fill_skipped
from tinyloop.worker.runner.stages import BatchStep, device_tensor


class SoloExit:
    def __init__(self, engine, graphs, op):
        self.engine, self.graphs = engine, graphs
        dev = engine.cache.device
        self.step = BatchStep(engine, 1)
        self.state = ExitState(engine.model, 1, dev, op)
        self.rule_params = torch.zeros(1, 6, dtype=torch.float32, device=dev)  # the start graph's input
        # the greedy token of even and odd positions: a stream may read a step's token after
        # launching the next step (pipelined decode), so consecutive steps write different ones
        self.greedy = torch.zeros(2, 1, dtype=torch.long, device=dev)
        # start: the check's state cleared, the prelude and the iterations after which no rule
        # may stop yet, keyed by whether each of those reads logits
        self.starts: dict[tuple[bool, ...], object] = {}
        self.iterations: dict[tuple[int, int, bool], object] = {}  # (i, host slot, with logits)
        # end: the coda and the greedy token, and the copy fill of an early exit, keyed by
        # (position parity, (exit depth, depth) or None)
        self.ends: dict[tuple[int, tuple[int, int] | None], object] = {}
        self._loaded: tuple | None = None  # (rule, depth) whose params rule_params holds
        self._ready: set[tuple] = set()  # the (depth, head, logits, copy) whose graphs are all captured

    def _iteration(self, i: int, slot: int, logits: bool) -> None:
        """Iteration i, the coda where the check reads logits, and the check into host slot `slot`."""
        st, step = self.state, self.step
        step.run(i)
        if logits:
            step.run("coda")
        st.check(1, self.engine.model.state(step.x[:, 0]), step.logits if logits else None, step.ctl[2], slot,
                 st.all_kinds)

    def _capture(self, top: int, head: tuple[bool, ...], logits: bool) -> None:
        """The iteration graphs up to `top` (with logits too where the rule reads them) and the
        start graph `head`, where missing: captured before the step loads its row."""
        st, step, cap = self.state, self.step, self.graphs.capture_call
        missing = [(i, s, lg) for i in range(top) for s in (0, 1) for lg in {False, logits}
                   if (i, s, lg) not in self.iterations]
        if head in self.starts and not missing:
            return
        step.load([], [], [], [])  # an idle row: no capture's warm-up writes a lane
        for key in missing:
            self.iterations[key] = cap(lambda key=key: self._iteration(*key))
        if head not in self.starts:
            def start():
                st.params.copy_(self.rule_params)
                st.clear()
                st.order.zero_()
                step.run("prelude")
                for i, lg in enumerate(head):
                    self._iteration(i, (i + 1) % 2, lg)
            self.starts[head] = cap(start)

    def run(self, lane: int, token, position: int, depth: int, rule: ExitRule) -> int:
        """One decode step of `token` (a host int or a one-element device tensor) at `position`
        on `lane`, at most `depth` iterations, stopping where `rule` says -> the iterations it
        ran. Its outputs: step.logits (1, V), self.greedy[position % 2] (1,), step.x (1, 1, W)."""
        st, step = self.state, self.step
        params = st.load_host([rule], [depth])
        k = max(0, min(st.earliest[0], depth) - 1)  # iterations after which no rule may stop: the start's
        head = tuple(st.needs_logits(d, [0]) for d in range(1, k + 1))
        copy = rule.cache == "copy"
        ready = (depth, head, rule.needs_logits, copy) in self._ready
        if not ready:
            self._capture(depth, head, rule.needs_logits)
        dev = token if isinstance(token, torch.Tensor) else None
        step.load([lane], [0 if dev is not None else token], [position], [depth],
                  None if dev is None else (None, dev.view(1)))
        if not ready:
            self._capture_ends(depth, copy)
            self._ready.add((depth, head, rule.needs_logits, copy))
        if self._loaded != (rule, depth):
            self.rule_params.copy_(device_tensor(params, self.rule_params.device, torch.float32), non_blocking=True)
            self._loaded = (rule, depth)
        self.starts[head].replay()
        ran, pending = depth, None
        for i in range(k, depth):
            d = i + 1
            slot = d % 2
            self.iterations[(i, slot, st.needs_logits(d, [0]))].replay()
            published = None
            if d < depth and st.can_stop(d, [0]):
                st.mark(slot)
                published = (slot, d)
            to_read, pending = pending, published
            if to_read is not None and st.read(to_read[0], 1)[0]:
                ran = to_read[1]
                break
        self.ends[(position % 2, (ran, depth) if copy and ran < depth else None)].replay()
        if ran < depth and not copy:
            fill_skipped(self.engine, [(0, lane, position, ran, depth, rule.cache)], step.x)
        return ran

    def _capture_ends(self, depth: int, copy: bool) -> None:
        """The end graphs of a step of `depth` iterations where missing, for both parities and,
        under the copy policy, every exit depth: captured after the step loaded its row and
        before it runs, so their warm-ups write only the row's own position, in cache layers
        that the step itself writes afterwards (its iterations below where it stops, its fill
        from there to its depth, its coda)."""
        step, cap = self.step, self.graphs.capture_call
        missing = [(parity, fill) for parity in (0, 1)
                   for fill in [None] + ([(e, depth) for e in range(1, depth)] if copy else [])
                   if (parity, fill) not in self.ends]
        if not missing:
            return
        # the last step's token, which its stream may not have read yet, survives the warm-ups
        kept = self.greedy.clone()
        for parity, fill in missing:
            fn = None if fill is None else self._fill(*fill)

            def end(parity=parity, fn=fn):
                step.run("coda")
                torch.argmax(step.logits, -1, out=self.greedy[parity])
                if fn is not None:
                    fn()
            self.ends[(parity, fill)] = cap(end)
        self.greedy.copy_(kept)

    def _fill(self, e: int, top: int):
        """The copy policy's fill of a token that ran e of `top` iterations, on the row's lane
        and position as the step's buffers hold them: iterations [e, top) of every block layer
        get iteration e - 1's K/V (early_exit.fill_skipped, with device indices)."""
        cfg, cache, dev = self.engine.config, self.engine.cache, self.engine.cache.device
        pairs = [(cfg.loop_layer_index(i, j), cfg.loop_layer_index(e - 1, j))
                 for i in range(e, top) for j in range(cfg.n_loop_layers)]
        dst, src = (torch.tensor(v, dtype=torch.long, device=dev) for v in zip(*pairs))
        slot, pos = self.step.ctl[3], self.step.ctl[1]

        def fill():
            for t in (cache.k, cache.v):
                t[dst, slot, :, pos] = t[src, slot, :, pos]
        return fill
