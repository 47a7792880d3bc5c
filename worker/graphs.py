"""CUDA graphs: decode steps, one per (loops, cache lane), and prefill stages, one per
(cache lane, length bucket, stage); captured once, replayed per token and per prompt.

Batch-1 decode of a small looped model is bound by weight reads and kernel launches; a graph
removes the launches' host cost. The step reads its token and position from static device
buffers and writes logits and the greedy token to static outputs, so nothing in it touches
the host. Prefill is launch-bound too for prompts up to a few thousand tokens: a prompt is
padded to a bucket and runs the captured stages of `generate.PaddedPrefill` (prelude, each
iteration, coda), so any depth composes from a few graphs. The lane is baked into a graph
(its cache views), so each lane a stream can run on gets its own graphs; they all share one
memory pool, since replays never overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.worker.engine import Engine
from tinyloop.worker.generate import PaddedPrefill, prefill_buckets, prefill_buffers


@dataclass
class DecodeGraph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor     # (1, 1) int64 input
    positions: torch.Tensor  # (1, 1) int64 input: where the token sits
    logits: torch.Tensor     # (1, V) fp32 output
    greedy: torch.Tensor     # (1,) int64 output: argmax of logits
    loops: int

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    """Captured batch-1 decode steps of one engine, keyed by (loops, lane); `prefill` holds
    its prefill stages (up to prompts of `prefill_len` tokens; 0: none)."""

    def __init__(self, engine: Engine, prefill_len: int = 0):
        if engine.cache.k.device.type != "cuda":
            raise ValueError("CUDA graphs need the engine on a CUDA device")
        self.engine = engine
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.warm: set[int] = set()  # depths whose kernels have been compiled
        self.pool = torch.cuda.graph_pool_handle()
        self.prefill = PrefillGraphs(engine, self.pool, prefill_len)

    def _eager(self, tokens: torch.Tensor, positions: torch.Tensor, loops: int, lane: int):
        e = self.engine
        p = e.make_pass(slice(lane, lane + 1), positions, e.cache.max_seq_len)
        logits = e.forward(tokens, p, loops)[:, -1]
        return logits, logits.argmax(-1)

    def capture(self, loops: int, lane: int = 0) -> DecodeGraph:
        """Capture at position 0 of `lane`; the step is position-independent, and the warm-up
        writes only slot 0 of a lane no request holds yet, which its prefill overwrites."""
        key = (loops, lane)
        if key in self.graphs:
            return self.graphs[key]
        dev = self.engine.cache.k.device
        tokens = torch.zeros(1, 1, dtype=torch.long, device=dev)
        positions = torch.zeros(1, 1, dtype=torch.long, device=dev)
        counters = self.engine.counters.snapshot()
        if loops not in self.warm:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile Triton kernels and settle allocations outside the graph
                    self._eager(tokens, positions, loops, lane)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.warm.add(loops)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            logits, greedy = self._eager(tokens, positions, loops, lane)
        self.engine.counters = counters  # capture work is not inference work
        dg = DecodeGraph(g, tokens, positions, logits, greedy, loops)
        self.graphs[key] = dg
        return dg

    def get(self, loops: int, lane: int = 0) -> DecodeGraph | None:
        return self.graphs.get((loops, lane))


class PrefillGraphs:
    """Captured stages of the padded prefill, keyed by (lane, bucket, stage). Every lane and
    bucket shares one set of static buffers, sized for the largest bucket. On a CPU engine
    (the tests) nothing is captured: the same stages run eagerly in the same order."""

    def __init__(self, engine: Engine, pool, max_len: int):
        self.engine, self.pool = engine, pool
        self.buckets = prefill_buckets(engine.cache.max_seq_len, max_len)
        self.buffers = prefill_buffers(engine, self.buckets[-1]) if self.buckets else None
        self.prefills: dict[tuple[int, int], PaddedPrefill] = {}
        self.graphs: dict[tuple[int, int, object], torch.cuda.CUDAGraph | None] = {}  # None: eager
        self.warm: set[tuple[int, object]] = set()  # (bucket, stage) whose kernels have been compiled

    def bucket(self, T: int) -> int | None:
        return next((b for b in self.buckets if b >= T), None)

    def capture(self, lane: int, loops: int) -> None:
        """Capture every bucket's stages for prompts at depths up to `loops` on `lane`. The
        warm-up runs and the captures write K/V into the lane's positions below the bucket:
        capture before any request holds the lane (its prefill overwrites them)."""
        for b in self.buckets:
            for stage in PaddedPrefill.stages(loops):
                self._capture(lane, b, stage)

    def _capture(self, lane: int, bucket: int, stage) -> None:
        if (lane, bucket, stage) in self.graphs:
            return
        e = self.engine
        dev = e.cache.k.device
        pre = self.prefills.get((lane, bucket))
        if pre is None:
            pre = self.prefills[(lane, bucket)] = PaddedPrefill(e, lane, bucket, self.buffers)
        if dev.type != "cuda":
            self.graphs[(lane, bucket, stage)] = None
            return
        counters = e.counters.snapshot()
        if (bucket, stage) not in self.warm:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile Triton kernels and settle allocations outside the graph
                    pre.run(stage)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.warm.add((bucket, stage))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            pre.run(stage)
        e.counters = counters  # capture work is not inference work
        self.graphs[(lane, bucket, stage)] = g

    def run(self, lane: int, tokens: list[int], loops: int) -> torch.Tensor | None:
        """The last logits (1, V) of the prompt prefilled at `loops` into `lane` by replaying its
        bucket's stages; None when no captured bucket and depth cover it (prefill eagerly)."""
        found = self._find(lane, len(tokens), PaddedPrefill.stages(loops))
        return None if found is None else found[0](tokens, loops, found[1])

    def build(self, lane: int, tokens: list[int], loops: int) -> torch.Tensor | None:
        """A resume handle's prefill by replay (PaddedPrefill.build); None: not covered."""
        found = self._find(lane, len(tokens), PaddedPrefill.stages(loops)[:-1])
        return None if found is None else found[0].build(tokens, loops, found[1])

    def resume(self, lane: int, residual: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
        """A resume's iterations [start, stop) and coda by replay (PaddedPrefill.resume); None:
        not covered."""
        found = self._find(lane, residual.shape[1], [*range(start, stop), "coda"])
        return None if found is None else found[0].resume(residual, start, stop, found[1])

    def _find(self, lane: int, T: int, stages: list):
        """(the lane's PaddedPrefill for T tokens, a runner of its captured stages), or None."""
        b = self.bucket(T)
        if b is None or any((lane, b, s) not in self.graphs for s in stages):
            return None
        pre = self.prefills[(lane, b)]

        def run(stage):
            g = self.graphs[(lane, b, stage)]
            pre.run(stage) if g is None else g.replay()
        return pre, run
