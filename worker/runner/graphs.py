"""CUDA graphs: decode steps, one per (loops, cache lane); batched decode stages, one per
(lane-count bucket, stage); prefill stages, one per (cache lane, length bucket, stage).
Captured once at start-up, replayed per token, per batched step and per prompt.

Batch-1 decode of a small looped model is bound by weight reads and kernel launches; a graph
removes the launches' host cost. The step reads its token and position from static device
buffers and writes logits and the greedy token to static outputs, so nothing in it touches
the host. Prefill is launch-bound too for prompts up to a few thousand tokens: a prompt is
padded to a bucket and runs the captured stages of `generate.PaddedPrefill` (prelude, each
iteration, coda), so any depth composes from a few graphs. The lane is baked into a graph
(its cache views), so each lane a stream can run on gets its own graphs; they all share one
memory pool, since replays never overlap. A batched decode step (worker/batcher.py, Model.
generate_batch) runs lanes [0, bucket) of `generate.BatchStep` in stages (prelude, each
iteration, coda), with per-lane tokens, positions and depths in static buffers, so any mix of
depths replays from few graphs.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch

from tinyloop.kernels.gemv import ARGMAX_KEY_NONE
from tinyloop.kernels.sampling import greedy_feed
from tinyloop.worker.runner.engine import Engine
from tinyloop.worker.generation.decode import (BatchStep, PaddedPrefill, batch_buckets, batch_buffers, prefill_buckets,
                                      prefill_buffers)
from tinyloop.worker.generation.speculative import VERIFY_BUCKETS, TreeStages, verify_bucket


@dataclass
class DecodeGraph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor     # (1, 1) int64 input
    positions: torch.Tensor  # (1, 1) int64 input: where the token sits
    logits: torch.Tensor     # (1, V) fp32 output
    greedy: torch.Tensor     # (1,) int64 output: argmax of logits
    host: torch.Tensor       # (2,) int64 pinned host ring: host[p % 2] is the greedy token at position p
    loops: int
    x: torch.Tensor          # (1, 1, D) input: the token embedded (the step starts at its first projection)
    table: torch.Tensor      # the embedding table x is a row of
    residual: torch.Tensor   # (1, 1, D) output: the residual after the loop iterations (before the coda)
    next_position: int = -1  # where a replay leaves `positions`: one past the token it ran

    def step(self, token: torch.Tensor | int, position: int) -> torch.Tensor:
        """Run the token (a device tensor of one element, or a host int) at `position`: the
        logits (1, V), the graph's static output.

        A replay ends by feeding itself: its greedy token goes into `tokens` (and its embedding
        into `x`) and `positions` moves one on. So a greedy stream that passes `greedy` back at
        that position (what DecodeState.sample returns after a graph step) sets nothing: the
        step is the replay alone, with no kernel or copy around it."""
        if token is not self.greedy or position != self.next_position:
            self.feed(token, position)
        self.graph.replay()
        self.next_position = position + 1
        return self.logits

    def feed(self, token: torch.Tensor | int, position: int) -> None:
        """Set the next replay's inputs: the token (and its embedding, x) at `position`."""
        if isinstance(token, int):
            self.tokens.fill_(token)
        else:
            self.tokens.copy_(token.view(1, 1))
        torch.index_select(self.table, 0, self.tokens.view(1), out=self.x.view(1, -1))
        self.positions.fill_(position)


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
        self.batch = BatchGraphs(engine, self.pool)
        self.verify = VerifyGraphs(engine, self.pool)

    def capture(self, loops: int, lane: int = 0) -> DecodeGraph:
        """Capture at position 0 of `lane`; the step is position-independent, and the warm-up
        writes only slots 0 and 1 of a lane no request holds yet, which its prefill overwrites."""
        key = (loops, lane)
        if key in self.graphs:
            return self.graphs[key]
        dev = self.engine.cache.k.device
        tokens = torch.zeros(1, 1, dtype=torch.long, device=dev)
        positions = torch.zeros(1, 1, dtype=torch.long, device=dev)
        host = torch.full((2,), -1, dtype=torch.long).pin_memory()
        table = self.engine.model.tok_embeddings.weight.detach()  # (index_select(out=...) takes no grad)
        x = table.new_zeros(1, 1, table.shape[1])
        argmax_key = torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.long, device=dev)
        out = []
        g = _capture(self.engine, self.pool,
                     lambda: out.append(decode_step(self.engine, lane, loops, tokens, positions, host, x, argmax_key)),
                     loops not in self.warm)
        self.warm.add(loops)
        logits, greedy, residual = out[-1]  # the captured run's outputs: the graph's static buffers
        dg = DecodeGraph(g, tokens, positions, logits, greedy, host, loops, x, table, residual)
        self.graphs[key] = dg
        return dg

    def get(self, loops: int, lane: int = 0) -> DecodeGraph | None:
        return self.graphs.get((loops, lane))


def decode_step(engine: Engine, lane: int, loops: int, tokens: torch.Tensor, positions: torch.Tensor,
                host: torch.Tensor, x: torch.Tensor, key: torch.Tensor):
    """The step DecodeGraphs captures: (logits (1, V), greedy (1,), the residual after the loop
    iterations (1, 1, D)) of the token embedded in x (1, 1, D) at `positions` on `lane`. The
    head's epilogue maxes the argmax key `key` (which holds ARGMAX_KEY_NONE between steps), and
    the step's last kernel (kernels.greedy_feed) feeds the greedy token forward: into `tokens`,
    embedded into x, one position on, and into the host ring (see DecodeGraph.step). So a step
    runs no argmax over the logits and no embedding kernel. Eager on any device (the CPU tests
    run it on the interpreted kernels)."""
    e = engine
    p = e.make_pass(slice(lane, lane + 1), positions, e.cache.max_seq_len)
    h = e.run_loops(e.prelude(x, p), p, 0, loops)
    logits = e.logits(e.coda(h, p), p, argmax_key=key)[:, -1]
    return logits, greedy_feed(key, tokens, positions, host, e.model.tok_embeddings.weight, x), h


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
        warm = (bucket, stage) not in self.warm
        self.graphs[(lane, bucket, stage)] = _capture(e, self.pool, lambda: pre.run(stage), warm)
        self.warm.add((bucket, stage))

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


class VerifyGraphs:
    """Captured stages of the speculative tree passes (speculative.TreeStages), keyed by (lane,
    bucket, stage): the prelude, iterations 0 .. max depth - 1 and the coda, for every verify
    bucket, so a chain round's verify and a tree round's drafts and verify, at any (draft_loops,
    verify_loops) pair, replay from them. On a CPU engine (the tests) nothing is captured: the
    same stages run eagerly."""

    def __init__(self, engine: Engine, pool=None):
        self.engine, self.pool = engine, pool
        self.chunks: dict[tuple[int, int], TreeStages] = {}
        self.graphs: dict[tuple[int, int, object], torch.cuda.CUDAGraph | None] = {}  # None: eager
        self.warm: set[tuple[int, object]] = set()  # (bucket, stage) whose kernels have been compiled

    def capture(self, lane: int, loops: int) -> None:
        """Capture every bucket's stages for passes up to `loops` on `lane`. The warm-up runs
        and the captures write K/V at the lane's first positions: capture before any request
        holds the lane."""
        for b in VERIFY_BUCKETS:
            if b > self.engine.cache.max_seq_len:
                continue
            chunk = self.chunks.get((lane, b))
            if chunk is None:
                chunk = self.chunks[(lane, b)] = TreeStages(self.engine, lane, b)
            for stage in TreeStages.stages(0, loops, prelude=True):
                if (lane, b, stage) in self.graphs:
                    continue
                if self.engine.cache.k.device.type != "cuda":
                    self.graphs[(lane, b, stage)] = None
                    continue
                warm = (b, stage) not in self.warm
                self.graphs[(lane, b, stage)] = _capture(self.engine, self.pool, lambda: chunk.run(stage), warm)
                self.warm.add((b, stage))

    def runner(self, lane: int, nodes: int, pos: int, stages: list):
        """(the lane's TreeStages for a tree of `nodes` nodes at pos, run(stage): a stage's
        replay), or None when no captured bucket holds the nodes and `stages`, or its pads would
        pass the cache's end."""
        b = verify_bucket(nodes)
        chunk = self.chunks.get((lane, b))
        if chunk is None or not chunk.fits(pos) or any((lane, b, s) not in self.graphs for s in stages):
            return None

        def run(stage):
            g = self.graphs[(lane, b, stage)]
            chunk.run(stage) if g is None else g.replay()
        return chunk, run

    def run(self, lane: int, residual: torch.Tensor, pos: int, start: int, stop: int) -> torch.Tensor | None:
        """The chain verify of the chunk of residuals (1, n, D) at pos, iterations [start, stop)
        then the coda, by replay: logits (n, V) (a view the next verify overwrites); None when
        no captured bucket and stages cover it."""
        staged = self.runner(lane, residual.shape[1], pos, TreeStages.stages(start, stop))
        if staged is None:
            return None
        chunk, run = staged
        return chunk.verify_chain(residual, pos, start, stop, run)


class BatchGraphs:
    """Captured stages of the batched decode step, keyed by (bucket, stage): lanes [0, bucket)
    for each lane-count bucket of the cache. On a CPU engine (the tests) nothing is captured:
    the same stages run eagerly in the same order."""

    def __init__(self, engine: Engine, pool=None):
        self.engine, self.pool = engine, pool
        self.buckets = batch_buckets(engine.cache.n_slots)
        buffers = batch_buffers(engine, self.buckets[-1]) if self.buckets else None
        self.steps = {b: BatchStep(engine, b, buffers) for b in self.buckets}
        self.graphs: dict[tuple[int, object], torch.cuda.CUDAGraph | None] = {}  # None: eager

    def capture(self, loops: int) -> None:
        """Capture every bucket's stages for depths up to `loops`. The warm-up runs and the
        captures are idle steps (no lane writes its cache), so this may run at any time."""
        for b, step in self.steps.items():
            for stage in BatchStep.stages(loops):
                if (b, stage) in self.graphs:
                    continue
                if self.engine.cache.k.device.type != "cuda":
                    self.graphs[(b, stage)] = None
                    continue
                step.ctl.copy_(self._idle(b))
                self.graphs[(b, stage)] = _capture(self.engine, self.pool, lambda: step.run(stage), True)

    def bucket(self, lanes: int) -> int | None:
        """The smallest bucket that holds lanes [0, lanes)."""
        return next((b for b in self.buckets if b >= lanes), None)

    def run(self, tokens: list[int], positions: list[int], depths: list[int],
            on_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One batched step over lanes [0, len(tokens)) (idle lanes and on_device as in
        `BatchStep`): logits (len(tokens), V), a view the next step overwrites. A stage with no
        graph (not captured, or a CPU engine) runs eagerly on the same buffers."""
        n = len(tokens)
        b = self.bucket(n)
        if b is None:
            raise ValueError(f"a batched step over {n} lanes exceeds the cache's {self.engine.cache.n_slots}")
        pad = b - n
        S = self.engine.cache.max_seq_len
        step = self.steps[b]

        def run(stage):
            g = self.graphs.get((b, stage))
            step.run(stage) if g is None else g.replay()
        return step(tokens + [0] * pad, positions + [S] * pad, depths + [0] * pad, run, on_device)[:n]

    def _idle(self, b: int) -> torch.Tensor:
        S = self.engine.cache.max_seq_len
        return torch.tensor([[0] * b, [S] * b, [0] * b])


def _capture(engine: Engine, pool, fn, warm: bool) -> torch.cuda.CUDAGraph:
    """Capture fn() as a CUDA graph in `pool`; warm: run it twice first on a side stream
    (compile its Triton kernels, settle its allocations outside the graph). What the runs
    count is not inference work: the engine's counters are restored."""
    dev = engine.cache.k.device
    counters = engine.counters.snapshot()
    if warm:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with _gc_paused(), torch.cuda.graph(g, pool=pool):
        fn()
    engine.counters = counters
    return g


@contextlib.contextmanager
def _gc_paused():
    """No automatic garbage collection inside: a collection in a capture window that frees
    another CUDA graph (one held by a reference cycle, say of a closed model) destroys it while
    the stream captures, which CUDA refuses ("operation not permitted when stream is
    capturing") and which invalidates the capture (cudaErrorStreamCaptureInvalidated at its
    end). It happened on the H200 in a test process that had closed models: whether it does
    depends on when the collector's thresholds trip, so it came and went between runs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
