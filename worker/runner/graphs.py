"""CUDA graphs of the runner's stages, keyed by (batch bucket, depth) and stage only: the cache
slot, positions, depths and lengths are device-buffer inputs, so no graph depends on which
lane a request holds and the graph count does not grow with the lane count.

- the batch-1 decode step, one graph per depth (`DecodeGraph`): fused projections, the head's
  argmax in its epilogue, and a tail kernel that feeds the greedy token into the next replay
  and into a pinned host ring;
- the stages of a padded prefill (`stages.PaddedPrefill`), per prompt-length bucket, and of
  its multi-row form (2 or 4 prompts of one bucket, each at its own depth: kind "prefill2" /
  "prefill4"), which a step's fresh prompts share (`Runner.prefill_many`);
- the stages of a batched decode step (`stages.BatchStep`), per lane-count bucket;
- the stages of a tree / chain verify (`stages.TreeStages`), per node-count bucket;
- a greedy speculative round, drafts to acceptance (`rounds.ChainRound`), per (draft_loops,
  verify_loops, drafts), captured on first use;
- sampling, every row on its own parameters (`sampler.SamplerGraphs`), per row bucket and the
  parameters' shape flags, captured on first use.

Every graph shares one memory pool: replays never overlap. Only `runner.Runner` uses this
module. Batch-1 decode of a small looped model is bound by weight reads and kernel launches;
a graph removes the launches' host cost.
"""
from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass

import torch

from tinyloop.kernels.gemv import ARGMAX_KEY_NONE
from tinyloop.kernels.sampling import greedy_feed
from tinyloop.worker.runner.engine import Engine

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodeGraph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor     # (1, 1) int64 input
    positions: torch.Tensor  # (1, 1) int64 input: where the token sits
    slot: torch.Tensor       # (1,) int64 input: the cache lane
    logits: torch.Tensor     # (1, V) fp32 output
    greedy: torch.Tensor     # (1,) int64 output: argmax of logits
    host: torch.Tensor       # (2,) int64 pinned host ring: host[p % 2] is the greedy token at position p
    loops: int
    x: torch.Tensor          # (1, 1, D) input: the token embedded (the step starts at its first projection)
    table: torch.Tensor      # the embedding table x is a row of
    residual: torch.Tensor   # (1, 1, D) output: the residual after the loop iterations (before the coda)
    lane: int = -1           # the lane of the last replay, and
    next_position: int = -1  # where it left `positions`: one past the token it ran

    def load(self, lane: int, token: torch.Tensor | int, position: int) -> None:
        """Set the next replay's inputs, unless the last replay left them so: a replay ends by
        feeding itself its greedy token (into `tokens`, embedded into `x`) one position on, so
        a greedy stream that passes `greedy` back on its lane sets nothing and the step is the
        replay alone."""
        if token is self.greedy and position == self.next_position and lane == self.lane:
            return
        if isinstance(token, int):
            self.tokens.fill_(token)
        else:
            self.tokens.copy_(token.view(1, 1))
        torch.index_select(self.table, 0, self.tokens.view(1), out=self.x.view(1, -1))
        self.positions.fill_(position)
        if lane != self.lane:
            self.slot.fill_(lane)

    def replay(self, lane: int, position: int) -> None:
        self.graph.replay()
        self.lane, self.next_position = lane, position + 1


def decode_step(engine: Engine, slot: torch.Tensor, loops: int, tokens: torch.Tensor, positions: torch.Tensor,
                host: torch.Tensor, x: torch.Tensor, key: torch.Tensor):
    """The step a DecodeGraph captures: (logits (1, V), greedy (1,), the residual after the loop
    iterations (1, 1, D)) of the token embedded in x (1, 1, D) at `positions` on cache `slot`.
    The head's epilogue maxes the argmax key `key` (ARGMAX_KEY_NONE between steps), and the
    step's last kernel (kernels.greedy_feed) feeds the greedy token forward: into `tokens`,
    embedded into x, one position on, and into the host ring. Eager on any device (the CPU
    tests run it on the interpreted kernels)."""
    e = engine
    p = e.make_pass(slot, positions, e.cache.max_seq_len)
    h = e.run_loops(e.prelude(x, p), p, 0, loops)
    logits = e.logits(e.coda(h, p), p, argmax_key=key)[:, -1]
    return logits, greedy_feed(key, tokens, positions, host, e.model.tok_embeddings.weight, x, pdl=e.ops.pdl), h


FUSE_AFTER = 8     # a sequence of stages runs as one graph from its 8th launch on (a capture costs ms: rare ones never)
FUSED_KEPT = 256   # sequences kept as graphs (the least recently launched goes first; a few MB of host memory)
SEEN_KEPT = 4096   # sequences counted towards FUSE_AFTER


class Graphs:
    """The captured graphs of one engine. `stages[(kind, bucket, stage)]` holds a stage set's
    graphs (kind "prefill", "batch", "verify"); `decode[loops]` the batch-1 steps; `fused`
    the sequences of stages that `replay_sequence` launches often, each as one graph."""

    def __init__(self, engine: Engine, fuse_after: int = FUSE_AFTER):
        if engine.cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the engine on a CUDA device")
        self.engine = engine
        self.device = engine.cache.device
        self.pool = torch.cuda.graph_pool_handle()
        self.decode: dict[int, DecodeGraph] = {}
        self.stages: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.fused: dict[tuple, torch.cuda.CUDAGraph] = {}  # (kind, bucket, stages) -> one graph, LRU order
        self._seen: dict[tuple, int] = {}  # launches of each sequence not fused yet
        self._unfusable: set[tuple] = set()  # sequences whose capture failed
        self.fuse_after = fuse_after       # the launch of a sequence that fuses it
        self._side: torch.cuda.Stream | None = None  # the stream every capture (and its warm-ups) runs on
        self._primed: set[int] = set()  # threads whose cuBLAS handles exist on the side stream
        self.warm: set = set()  # (kind, bucket, stage) / depths whose kernels have been compiled
        self.key = torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.long, device=self.device)
        self.captures = 0  # graphs captured so far, at start-up and while serving
        self.capture_failures = 0  # fused captures that failed (their sequences run stage by stage)

    def __len__(self) -> int:
        return len(self.decode) + len(self.stages)

    def capture_decode(self, loops: int) -> DecodeGraph:
        """Capture the batch-1 step at depth `loops` on slot 0: the warm-up writes slot 0's first
        two positions, which whatever holds the lane later overwrites before reading (capture
        before serving); the step itself reads its position and slot from its buffers."""
        if loops in self.decode:
            return self.decode[loops]
        dev = self.device
        tokens = torch.zeros(1, 1, dtype=torch.long, device=dev)
        positions = torch.zeros(1, 1, dtype=torch.long, device=dev)
        slot = torch.zeros(1, dtype=torch.long, device=dev)
        host = torch.full((2,), -1, dtype=torch.long).pin_memory()
        table = self.engine.model.tok_embeddings.weight.detach()  # (index_select(out=...) takes no grad)
        x = table.new_zeros(1, 1, table.shape[1])
        out = []

        def step():
            out.append(decode_step(self.engine, slot, loops, tokens, positions, host, x, self.key))
        g = self._capture(step, ("decode", loops) not in self.warm)
        self.warm.add(("decode", loops))
        logits, greedy, residual = out[-1]  # the captured run's outputs: the graph's static buffers
        dg = DecodeGraph(g, tokens, positions, slot, logits, greedy, host, loops, x, table, residual)
        self.decode[loops] = dg
        return dg

    def capture_round(self, key: tuple, rnd) -> torch.cuda.CUDAGraph:
        """The graph of a speculative round (rounds.ChainRound), captured on first use. Its
        warm-up runs the round on the lane in rnd.slot from that lane's state, which the caller
        sets first: each warm-up run starts from that state again (a round moves its lane on,
        and a second round from where the first left could pass the cache's end), the capture
        runs nothing, and the state is restored after it, so the caller's replay is the round it
        asked for (the warm-up wrote positions that round overwrites before anything reads them)."""
        g = self.stages.get(("round", key, "round"))
        if g is None:
            state = rnd.state.clone()

            def warm_run():
                rnd.state.copy_(state)
                rnd.run()
            g = self.stages[("round", key, "round")] = self._capture(rnd.run, True, warm_run)
            rnd.state.copy_(state)
            self.warm.add(("round", key, "round"))
        return g

    def drop(self) -> None:
        """Let go of every graph now (Runner.close): each keeps its capture's closure, which may
        refer back to its owner, a cycle only the collector would break."""
        self.decode.clear()
        self.stages.clear()
        self.fused.clear()

    def capture_call(self, fn) -> torch.cuda.CUDAGraph:
        """fn() as a graph in the shared pool, after two warm runs (runner.sampler's graphs)."""
        return self._capture(fn, True)

    def capture_stage(self, kind: str, bucket: int, stage, run) -> None:
        key = (kind, bucket, stage)
        if key not in self.stages:
            self.stages[key] = self._capture(run, key not in self.warm)
            self.warm.add(key)

    def covers(self, kind: str, bucket: int, stages) -> bool:
        return all((kind, bucket, s) in self.stages for s in stages)

    def replay(self, kind: str, bucket: int, stage) -> None:
        self.stages[(kind, bucket, stage)].replay()

    def replay_sequence(self, kind: str, bucket: int, stages: tuple, run) -> None:
        """The captured stages `stages` of (kind, bucket), in order. A sequence launched often
        (`fuse_after` times) is captured as one graph of run(stage) for each stage, and that graph
        replays from then on: a launch then costs the host one graph launch, not one a stage
        (each costs the host about as much as a short stage's device time), and the device no
        gap between stages. The same kernels on the same static buffers: the same results."""
        key = (kind, bucket, stages)
        g = self.fused.pop(key, None)
        if g is None:
            g = self._fuse(key, run)
        if g is None:  # not launched often enough yet, or its capture failed
            for stage in stages:
                self.replay(kind, bucket, stage)
            return
        self.fused[key] = g  # the most recently launched last
        g.replay()

    def _fuse(self, key: tuple, run) -> torch.cuda.CUDAGraph | None:
        """The sequence `key` as one graph, at its `fuse_after`-th launch (None before, and for
        good once its capture failed)."""
        if key in self._unfusable:
            return None
        n = self._seen.get(key, 0) + 1
        if n < self.fuse_after:
            if len(self._seen) >= SEEN_KEPT:
                self._seen.clear()
            self._seen[key] = n
            return None
        self._seen.pop(key, None)
        if len(self.fused) >= FUSED_KEPT:
            del self.fused[next(iter(self.fused))]
        kind, bucket, stages = key

        def run_all(stages=stages):
            for stage in stages:
                run(stage)
        try:
            return self._record(run_all)  # each stage's kernels are compiled and warm already
        except RuntimeError as e:
            # fusing is only a saving: a capture that fails leaves this sequence to its stages'
            # own graphs from now on (the launch runs them), and says why once
            self.capture_failures += 1
            self._unfusable.add(key)
            log.warning("capturing %s bucket %d's sequence of %d stages failed; it runs stage by stage: %s",
                        kind, bucket, len(stages), e)
            return None

    def _capture(self, fn, warm: bool, warm_fn=None) -> torch.cuda.CUDAGraph:
        """fn() as a CUDA graph in the shared pool; warm: run it (or warm_fn) twice first on the
        capture's stream (compile its Triton kernels, settle its allocations outside the graph)."""
        if warm:
            side = self._side_stream()
            with torch.cuda.stream(side):
                for _ in range(2):
                    (warm_fn or fn)()
        return self._record(fn)

    def _side_stream(self) -> torch.cuda.Stream:
        """The stream captures run on, after the work queued so far on the caller's stream."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        return self._side

    def _prime_blas(self, side: torch.cuda.Stream) -> None:
        """Make this thread's cuBLAS handles and their workspaces for `side`, outside any
        capture. torch keeps one handle per thread and one workspace per (handle, stream), made
        at the first matmul: a worker's step thread is not the thread that loaded the model
        and captured its stages, and its first matmul may be a fused capture's (a batched step
        past Settings.fused_rows projects through cuBLAS), where making a handle invalidates
        the capture."""
        dtype = self.engine.model.tok_embeddings.weight.dtype
        with torch.cuda.stream(side):
            torch.cuda.current_blas_handle()
            for dt in {dtype, torch.float32}:
                a = torch.zeros(8, 8, dtype=dt, device=self.device)
                torch.nn.functional.linear(a, a)
                torch.addmm(a, a, a)
        self._primed.add(threading.get_ident())

    def _record(self, fn) -> torch.cuda.CUDAGraph:
        """Capture fn(), whose kernels are warm, on the side stream (the caller's stream then
        waits for it), with no device sync and no cache emptied: torch.cuda.graph's entry does
        both and frees the cached pinned host memory too, which costs milliseconds at every
        capture and more at the allocations after, at start-up (a thousand captures) as while
        serving. Captures at start-up and while serving take this one path."""
        side = self._side_stream()
        if threading.get_ident() not in self._primed:
            self._prime_blas(side)
        g = torch.cuda.CUDAGraph()
        self.captures += 1
        # no garbage collection inside the capture: a graph keeps its closure, which may hold
        # its owner (a cycle), so a dropped model's graphs, events and pinned buffers go when
        # the collector finds them, and destroying those while a stream captures aborts the
        # process
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(side):
                g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    g.capture_end()
        finally:
            if enabled:
                gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(side)
        # the graph reads the tensors fn closes over (index tables, static inputs) at every
        # replay: keep them alive as long as the graph, or their memory goes to other tensors
        g.captured_fn = fn
        return g
