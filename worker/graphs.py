"""CUDA-graph decode steps: one graph per (loops, cache lane) captured once, replayed per token.

Batch-1 decode of a small looped model is bound by weight reads and kernel launches; a graph
removes the launches' host cost. The step reads its token and position from static device
buffers and writes logits and the greedy token to static outputs, so nothing in it touches
the host. The lane is baked into a graph (its cache views), so each lane a stream can run
on gets its own graphs; they share one memory pool, since replays never overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.worker.engine import Engine


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
    """Captured batch-1 decode steps of one engine, keyed by (loops, lane)."""

    def __init__(self, engine: Engine):
        if engine.cache.k.device.type != "cuda":
            raise ValueError("CUDA graphs need the engine on a CUDA device")
        self.engine = engine
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.warm: set[int] = set()  # depths whose kernels have been compiled
        self.pool = torch.cuda.graph_pool_handle()

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
