"""Early exit of one stream's decode step on captured graphs (Runner.decode with one lane).

The batched exit step (Runner._decode_exit) replays a batch bucket's stage graphs and a check
graph per iteration: on a small model that is several times the batch-1 step's launches, and a
stream alone pays all of them. Here one row has a stage set of its own (stages.BatchStep of
one row, whose iterations take the batch-1 step's fused projections) and each iteration is one
graph: the iteration, the coda where the rule reads logits, and the check (kernels/exit_check:
one launch), which publishes the decision into a pinned host slot. So a token costs, besides
its iterations, one graph to start (the check's state cleared, the prelude), one per iteration
and one to end (the coda and the greedy token), and where the token exited early one that fills
the skipped iterations' cache entries (the `copy` policy; `recompute` runs early_exit's eager
fill).

The host reads iteration d's decision after launching iteration d + 1, so the wait overlaps
the device's work; a row stopped at d is frozen on the device (its depth becomes d) and runs
iteration d + 1 unchanged.

Graphs are captured the first time a step needs them, before it loads its row: the stage set
then holds an idle row (a position past the cache, depth 0), so a capture's warm-up writes no
lane's cache. The fill graphs are captured per (exit depth, depth) when first used: a fill
copies within the row's own lane and position, so its warm-up writes what the fill writes.
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
        self.start, self.end = None, []
        self.iterations: dict[tuple[int, int, bool], object] = {}  # (i, host slot, with logits)
        self.fills: dict[tuple[int, int], object] = {}           # (exit depth, depth)
        self._loaded: tuple | None = None  # (rule, depth) whose params rule_params holds

    def _capture(self, top: int, logits: bool) -> None:
        st, step, cap = self.state, self.step, self.graphs.capture_call
        missing = [(i, s) for i in range(top) for s in (0, 1) if (i, s, logits) not in self.iterations]
        if self.start is not None and not missing:
            return
        step.load([], [], [], [])  # an idle row: no capture's warm-up writes a lane
        if self.start is None:
            def start():
                st.params.copy_(self.rule_params)
                st.clear()
                st.order.zero_()
                step.run("prelude")

            def end(parity):
                step.run("coda")
                torch.argmax(step.logits, -1, out=self.greedy[parity])
            self.start, self.end = cap(start), [cap(lambda p=p: end(p)) for p in (0, 1)]
        model = self.engine.model
        for i, slot in missing:
            def iteration(i=i, slot=slot):
                step.run(i)
                if logits:
                    step.run("coda")
                st.check(1, model.state(step.x[:, 0]), step.logits if logits else None, step.ctl[2], slot,
                         st.all_kinds)
            self.iterations[(i, slot, logits)] = cap(iteration)
        self._loaded = None  # the captures' warm-ups ran the start over rule_params

    def run(self, lane: int, token, position: int, depth: int, rule: ExitRule) -> int:
        """One decode step of `token` (a host int or a one-element device tensor) at `position`
        on `lane`, at most `depth` iterations, stopping where `rule` says -> the iterations it
        ran. Its outputs: step.logits (1, V), self.greedy[position % 2] (1,), step.x (1, 1, W)."""
        st, step = self.state, self.step
        need_any = rule.needs_logits
        self._capture(depth, False)
        if need_any:
            self._capture(depth, True)
        dev = token if isinstance(token, torch.Tensor) else None
        step.load([lane], [0 if dev is not None else token], [position], [depth],
                  None if dev is None else (None, dev.view(1)))
        params = st.load_host([rule], [depth])
        if self._loaded != (rule, depth):
            self.rule_params.copy_(device_tensor(params, self.rule_params.device, torch.float32), non_blocking=True)
            self._loaded = (rule, depth)
        self.start.replay()
        ran, pending = depth, None
        for i in range(depth):
            d = i + 1
            slot = d % 2
            self.iterations[(i, slot, need_any and st.needs_logits(d, [0]))].replay()
            published = None
            if d < depth and st.can_stop(d, [0]):
                st.mark(slot)
                published = (slot, d)
            to_read, pending = pending, published
            if to_read is not None and st.read(to_read[0], 1)[0]:
                ran = to_read[1]
                break
        self.end[position % 2].replay()
        if ran < depth:
            if rule.cache == "copy":
                key = (ran, depth)
                g = self.fills.get(key)
                if g is None:
                    g = self.fills[key] = self.graphs.capture_call(self._fill(ran, depth))
                else:
                    g.replay()
            else:
                fill_skipped(self.engine, [(0, lane, position, ran, depth, rule.cache)], step.x)
        return ran

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
