"""The runner: the one owner of the GPU work of a model.

Generation, resume, speculative decoding, batching and scoring are written once against its
stages:

    prefill(lane, tokens, loops)            a fresh prompt -> its last logits
    build(lane, tokens, loops)              a prompt's prelude and first iterations -> the residual
    extend(lane, residual, start, stop)     iterations [start, stop) and the coda over a chunk's residual
    decode(lanes, tokens, positions, depths) one decode step of B lanes, each at its own depth
    verify(lane, residual, pos, start, stop) a draft chain's iterations [start, stop) -> every logit
    verify_many(lanes, residuals, positions, start, stop)  the same for several lanes' chains, one pass
    chain_round(lane, Ld, Lv, k, state)     a speculative chain round (greedy or sampled), drafts to acceptance, on the device
    tree(lane, nodes, pos)                  a draft tree's stages (drafting depth by depth, verify)
    trace(lane, tokens, loops)              every stage's last-position residual (scoring)

Behind each stage the runner decides alone whether a captured CUDA graph replays or the same
stages run eagerly (a CPU engine, a shape no bucket covers, a sliding window, a tracked
norm), and it counts the loop-block work each call needs, once, whichever ran. It also owns
the cache lanes (`lanes`).

Static outputs. A graph writes its outputs into buffers that its next replay overwrites, and
a stream may hold a step's output across a yield (its step launched ahead). So a `StepOut`
that views a graph's buffers is the buffers' owner until its stream's next call (`prev`);
a call for anyone else on the same buffers first gives the owner copies of its own
(`StepOut.detach`), queued before the replay on the same stream.
"""
from __future__ import annotations

import functools
import heapq
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tinyloop.worker.model.cache import CacheParts
from tinyloop.worker.model.errors import LanesBusy
from tinyloop.worker.model.modules import LoopedTransformer
from tinyloop.worker.model.ops import Ops
from tinyloop.worker.runner.early_exit import IDLE_PARAMS, INTERLEAVED_CRITERIA, ExitRule, ExitState, fill_skipped
from tinyloop.worker.runner.engine import Counters, Engine
from tinyloop.worker.runner.rounds import ChainRound
from tinyloop.worker.runner.solo_exit import SoloExit
from tinyloop.worker.runner.sampler import RowSampling, SamplerGraphs, SamplingParams, sample_rows
from tinyloop.worker.runner.stages import (EXIT_STAGES, INTERLEAVED_STAGES, BatchStep, InterleavedStep, PaddedPrefill,
                                           TreeStages, batch_buckets, batch_buffers, device_tensor, interleaved_buffers,
                                           prefill_buckets, prefill_buffers, rows_prefill_buffers,
                                           rows_prefill_views, Staging)


@dataclass(frozen=True)
class RunnerSettings:
    """cuda_graphs: capture at start-up (CUDA only). prefill_graph_len: the longest prompt the
    prefill graphs cover (0: prefill stays eager). verify_buckets: the node counts the verify
    graphs are built for (a chain of the default draft_ahead 4; a two-branch tree of depth 4 or
    a chain of up to 8 drafts; the longest tree): a verify runs in the smallest that holds it,
    its pads computed like nodes, so a bucket close to the node count keeps them few.
    prefill_rows: the prompt counts of the multi-row prefill graphs (`prefill_many`; those up
    to the lane count), each for the length buckets up to prefill_rows_bucket whose rows ×
    bucket is at most prefill_rows_len tokens: a burst of 64 short prompts is one replay per
    stage, not 16 (their stage sets share one set of buffers, so the row counts cost graphs and
    start-up time, not memory beyond the largest; a longer prompt fills a pass well alone).
    device_rounds:
    speculative chains (greedy or sampled) run whole rounds on the device (`chain_round`), one graph per
    round where graphs are captured (eager elsewhere: the CPU tests). sampler_graphs: with
    graphs, `sample` replays a captured sampler per row bucket. interleave: batched steps of
    streams at different depths run their rows each at its own iteration (`interleave`), where
    the engine can (`Engine.interleaves`). fused_sampler: sampling's distributions and draws in
    a launch each (sampler.probs / draw) where the vocabulary fits one program."""
    cuda_graphs: bool = False
    prefill_graph_len: int = 2048
    verify_buckets: tuple[int, ...] = (5, 9, 17)
    prefill_rows: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    prefill_rows_len: int = 2048
    prefill_rows_bucket: int = 256
    device_rounds: bool = False
    sampler_graphs: bool = True
    interleave: bool = True
    fused_sampler: bool = False


class LanePool:
    """The cache lanes (slots) of a runner: the lowest free lane first, which keeps the rows of
    a batched step on few lanes. Thread-safe."""

    def __init__(self, n: int):
        self.n = n
        self._free = list(range(n))
        self._lock = threading.Lock()

    def acquire(self) -> int | None:
        with self._lock:
            return heapq.heappop(self._free) if self._free else None

    def release(self, lane: int) -> None:
        if not 0 <= lane < self.n:
            raise ValueError(f"lane {lane} outside [0, {self.n})")
        with self._lock:
            if lane in self._free:
                raise ValueError(f"lane {lane} is free already")
            heapq.heappush(self._free, lane)

    @property
    def free(self) -> int:
        return len(self._free)

    def hold(self) -> "_Held":
        return _Held(self)


class _Held:
    def __init__(self, pool: LanePool):
        self.pool = pool
        self.lane: int | None = None

    def __enter__(self) -> int:
        self.lane = self.pool.acquire()
        if self.lane is None:
            raise LanesBusy(f"all {self.pool.n} cache lanes are in use")
        return self.lane

    def __exit__(self, *exc) -> None:
        self.pool.release(self.lane)


def _settles(method):
    """A Runner call that first ends the pending one-row exit step (`Runner._decode_solo`), so
    that its outputs, its stream's token and its lane's cache are final before anything reads
    or overwrites them."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._solo_last is not None:
            self._settle_solo()
        return method(self, *args, **kwargs)
    return call


@dataclass(eq=False)
class StepOut:
    """A decode step's outputs for its B lanes. `greedy` is the argmax of `logits`; `host`, when
    set, is (pinned host tensor, index) where the replay itself wrote greedy[0] for the host
    (no copy to launch). `residual` (B, 1, D): after the loop iterations. `norm` (B,): the
    largest residual norm of the step, when tracked. `work`: what the step counted."""
    logits: torch.Tensor
    greedy: torch.Tensor
    residual: torch.Tensor | None
    norm: torch.Tensor | None
    work: Counters
    host: tuple[torch.Tensor, int] | None = None
    depths: list[int] = field(default_factory=list)
    finished: list[bool] | None = None  # an interleaved launch: whose token ended
    # an interleaved launch with exit rules, or a one-row exit step (Runner._decode_solo):
    # `resolve` ends it and sets finished / depths / work; until then its outputs are not final,
    # so a copy of greedy taken before is stale (hand the runner the tensor itself)
    pending: Callable[[], None] | None = None
    # an interleaved launch with exit rules on graphs: CUDA events around its passes (their
    # elapsed time is readable once it is resolved), for the batcher's cost of a launch
    timing: tuple | None = None
    # an interleaved launch with exit rules, once resolved: `greedy` on the host, read with its
    # ends (a row's entry is its next token where its token ended)
    greedy_host: list[int] | None = None

    def resolve(self) -> None:
        """A pending step: wait for it and read whose token ended and the iterations each ran
        (`finished`, `depths`, `work`); nothing otherwise."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending()

    def detach(self) -> None:
        """Own copies of the outputs (the buffers they view are about to be overwritten)."""
        self.logits, self.greedy = self.logits.clone(), self.greedy.clone()
        if self.residual is not None:
            self.residual = self.residual.clone()
        self.host = None

    def row(self, i: int) -> "RowOut":
        """Lane i's outputs alone: views of this step's, made when read (a batched step hands
        every row out, and most are only ever asked for their work)."""
        return RowOut(self, i)


@dataclass(frozen=True)
class DeviceTokens:
    """Tokens of a decode step's rows that are on the device, sampled and not read on the host:
    row rows[i] runs values[index[i]]. One tensor for many rows, so a batched step hands its
    sampled tokens to the next with no per-row tensor op."""
    rows: list[int]
    values: torch.Tensor  # (n,) int64 on the device
    index: list[int]

    @classmethod
    def of(cls, tokens: dict[int, torch.Tensor]) -> "DeviceTokens | None":
        """From {row: one-element tensor}; None when empty."""
        if not tokens:
            return None
        rows = list(tokens)
        if len(rows) == 1:  # the tensor itself, no copy: a pending step's token is final only
            return cls(rows, tokens[rows[0]].view(1), [0])  # once that step has ended
        return cls(rows, torch.stack([tokens[r].view(()) for r in rows]), list(range(len(rows))))

    def as_dict(self) -> dict[int, torch.Tensor]:
        return {r: self.values[i:i + 1] for r, i in zip(self.rows, self.index)}


class RowOut:
    """Row i of a StepOut, with its fields (views) made on first read. A batched step hands
    every row out, once per token of each stream: its work is `iterations` alone (its token's,
    which DecodeState counts)."""
    __slots__ = ("_step", "_i", "iterations", "host")
    pending = None  # a row is handed out once its step has ended

    def __init__(self, step: StepOut, i: int):
        self._step, self._i = step, i
        self.iterations = step.depths[i] if step.depths else step.work.loop_iterations
        self.host = step.host if i == 0 else None

    def _view(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[self._i:self._i + 1]

    @property
    def logits(self) -> torch.Tensor:
        return self._view(self._step.logits)

    @property
    def greedy(self) -> torch.Tensor:
        return self._view(self._step.greedy)

    @property
    def residual(self) -> torch.Tensor | None:
        return self._view(self._step.residual)

    @property
    def norm(self) -> torch.Tensor | None:
        return self._view(self._step.norm)

    def detach(self) -> None:
        self._step.detach()


@dataclass(eq=False)
class ChunkOut:
    """A chunk stage's outputs: last logits (1, V) (None where the stage runs no coda), the
    residual entering the next iteration (1, T, D) (build only), the largest residual norm
    (1,) when tracked, and what it counted."""
    logits: torch.Tensor | None
    work: Counters
    residual: torch.Tensor | None = None
    norm: torch.Tensor | None = None


@dataclass(eq=False)
class ChunksOut:
    """A chunk stage's outputs for several rows (`verify_many`): every position's logits
    (B, n, V), and what each row counted (`works[b]`: as its own call would count it)."""
    logits: torch.Tensor
    works: list[Counters]

    @property
    def work(self) -> Counters:
        total = Counters()
        for w in self.works:
            total = total.plus(w)
        return total


class RoundOut:
    """A launched chain round's result (of k drafts): its copy to the host is queued behind it;
    `result()` waits for that copy alone -> (drafts accepted n, the round's n + 1 tokens)."""

    def __init__(self, out: torch.Tensor, work: Counters, k: int):
        self.work, self.k = work, k
        if out.is_cuda:
            self._host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self._host.copy_(out, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = out.clone(), None

    def result(self) -> tuple[int, list[int]]:
        if self._done is not None:
            self._done.synchronize()
        vals = self._host.tolist()
        n = vals[0]
        return n, vals[1:n + 2]


class TreeRun:
    """A draft tree's (or chain's) stages on one lane (stages.TreeStages), replayed where a
    verify bucket's graphs cover them, else run eagerly. `tokens` (1, nodes) and `logits`
    (nodes, V) are the stage set's buffers (valid until the next tree or verify call)."""

    def __init__(self, runner: "Runner", stages: TreeStages, graphed: bool, lane: int, nodes: int):
        self.runner, self.ts, self.graphed, self.lane, self.nodes = runner, stages, graphed, lane, nodes
        self.work = Counters()

    @property
    def tokens(self) -> torch.Tensor:
        return self.ts.tokens

    @property
    def logits(self) -> torch.Tensor:
        return self.ts.logits

    def load_tree(self, t: int, pos: int, K: int, k: int) -> None:
        self.ts.load_tree(self.lane, t, pos, K, k)

    def load_chain(self, residual: torch.Tensor, pos: int) -> None:
        self.ts.load_chain(self.lane, residual, pos)

    def run(self, stage, nodes: int | None = None) -> None:
        """One stage; an iteration counts `nodes` tokens (default: the whole tree): the nodes
        the caller needs it for, not the bucket's pads."""
        if self.graphed:
            self.runner.graphs.replay("verify", self.ts.bucket, stage)
        else:
            self.ts.run(stage)
        if isinstance(stage, int):
            w = self.runner.counters.add(1, self.nodes if nodes is None else nodes)
            self.work = self.work.plus(w)


class Runner:
    def __init__(self, model: LoopedTransformer, cache: CacheParts, ops: Ops, settings: RunnerSettings):
        self.engine = Engine(model, cache, ops)
        self.model, self.cache, self.ops, self.settings = model, cache, ops, settings
        self.config = model.config
        self.device = cache.device
        self.counters = Counters()
        self.lanes = LanePool(cache.n_slots)
        self.graphs = None
        S = cache.max_seq_len
        self._prefill_buckets = prefill_buckets(S, settings.prefill_graph_len) if settings.cuda_graphs else []
        self._batch_buckets = batch_buckets(cache.n_slots) if settings.cuda_graphs else []
        self._verify_buckets = [b for b in settings.verify_buckets if b <= S] if settings.cuda_graphs else []
        self._prefill: dict[int, PaddedPrefill] = {}
        # (rows, bucket) of the multi-row prefill graphs
        self._rows_buckets = [(r, b) for r in settings.prefill_rows if 1 < r <= cache.n_slots
                              for b in self._prefill_buckets
                              if b <= settings.prefill_rows_bucket and r * b <= settings.prefill_rows_len]
        self._prefill_rows: dict[tuple[int, int], PaddedPrefill] = {}
        self._batch: dict[int, BatchStep] = {}
        self._interleaved: dict[int, InterleavedStep] = {}
        self._interleaved_shared = None
        # each lane's residual between interleaved calls (row n_slots: the idle rows')
        self._lane_x = None
        self._exit: dict[int, BatchStep] = {}  # eager early-exit stage sets by row count
        self._exit_shared = None
        self._exit_checks: ExitState | None = None  # the exit checks' static buffers
        self._lane_exits: ExitState | None = None   # interleaved launches': one row per lane, and the idle rows'
        self._exits_checked: list | None = None     # the exit rules the last interleaved launch checked
        self._interleaved_last: tuple | None = None  # the last interleaved rows loaded (`_interleave_again`)
        self._solo: SoloExit | None = None  # a one-row exit step's graphs, made on first use
        # the one-row exit step launched last and not ended yet, with its StepOut: the next
        # step of its stream is launched before it ends (`_decode_solo`); anything else ends it
        # first (`_settles`)
        self._solo_last: tuple | None = None
        self._solo_at: dict[int, tuple[int, int]] = {}  # half -> (lane, position) of its last step
        # two pairs of events around interleaved exit launches' passes, in turn (StepOut.timing)
        self._timing = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(2)] if self.device.type == "cuda" else []
        self._timing_i = 0
        self._rows_staging = self._rows_dev = None  # _device_rows' row indices, host side and device side
        self._trees: dict[int, TreeStages] = {}
        self._owners: dict[object, StepOut] = {}  # buffers (a DecodeGraph, "batch") -> the StepOut viewing them
        self._prefill_shared = None
        self._rows_shared = None  # the multi-row prefills' buffers, flat (`_rows_stages`)
        self._batch_shared = None
        self._rounds: dict[tuple, ChainRound] = {}
        # each lane's speculative round state, (token, position), read and left by its rounds
        self._round_state = torch.zeros(cache.n_slots, 2, dtype=torch.long, device=self.device)
        # each lane's sampling parameters for sampled rounds: [temperature, top_p], [top_k, seed]
        self._round_params = (torch.ones(cache.n_slots, 2, dtype=torch.float32, device=self.device),
                              torch.zeros(cache.n_slots, 2, dtype=torch.long, device=self.device))
        self._sampler: SamplerGraphs | None = None  # the sampling graphs, made on first use
        self.startup = {"graphs": 0, "graph_bytes": 0}
        if settings.cuda_graphs:
            from tinyloop.worker.runner.graphs import Graphs
            self.graphs = Graphs(self.engine)

    # -- start-up --------------------------------------------------------------------------
    @_settles
    def capture(self, loops: list[int], progress=None) -> dict:
        """Capture every graph for depths up to max(loops): the batch-1 decode step of each
        depth in `loops`, and for depths up to the deepest, the prefill stages of every length
        bucket, the verify stages of every node bucket and the batched decode stages of every
        lane-count bucket. Writes the first positions of lane 0: capture before serving.
        -> seconds by part, graph count and the graph pool's bytes (also in `startup`)."""
        if self.graphs is None or not loops:
            return self.startup
        g, top = self.graphs, max(loops)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # so the reserved bytes after the captures count what they took
        mem0 = torch.cuda.memory_reserved(self.device)
        parts = [("decode_graphs_s", lambda L=L: g.capture_decode(L)) for L in loops]

        def stage(kind, b, s, stages, load):
            # load before each capture: the stage sets of a kind share their buffers
            return lambda: (load(), g.capture_stage(kind, b, s, lambda: stages.run(s)))
        for b in self._prefill_buckets:
            pre = self._prefill_stages(b)
            parts += [("prefill_graphs_s", stage("prefill", b, s, pre, lambda pre=pre, b=b: pre.load_tokens(0, [0] * b)))
                      for s in PaddedPrefill.stages(top)]
        for r, b in self._rows_buckets:
            pre = self._rows_stages(r, b)
            parts += [("prefill_graphs_s", stage(f"prefill{r}", b, s, pre,
                                                 lambda pre=pre, r=r, b=b: pre.load_prompts([0] * r, [[0] * b] * r, [top] * r)))
                      for s in PaddedPrefill.stages(top)]
        for b in self._verify_buckets:
            ts = self._tree_stages(b)
            parts += [("verify_graphs_s", stage("verify", b, s, ts, lambda ts=ts: ts.load_chain(0, ts.x[:, :1], 0)))
                      for s in TreeStages.span(0, top, prelude=True)]
        for b in self._batch_buckets:
            step = self._batch_stage(b)  # idle rows: the warm-up and capture write no lane
            parts += [("batch_graphs_s", stage("batch", b, s, step, lambda step=step: step.load([], [], [], [])))
                      for s in BatchStep.stages(top)]
            if self.interleaves:
                il = self._interleaved_step(b)
                parts += [("interleaved_graphs_s", stage("interleaved", b, s, il,
                                                         lambda il=il: il.load([], [], [], [], [])))
                          for s in INTERLEAVED_STAGES]
        # captures queue their warm-ups without a device sync (Graphs._record): each part ends
        # with one, so that its time holds its own device work
        for k, (part, capture) in enumerate(progress(parts) if progress else parts):
            t = time.perf_counter()
            capture()
            if k + 1 == len(parts) or parts[k + 1][0] != part:
                torch.cuda.synchronize(self.device)
            self.startup[part] = self.startup.get(part, 0.0) + time.perf_counter() - t
        # the warm-ups' blocks go back, so the reserved bytes count the graphs' pool (captures
        # empty no cache on the way: graphs.Graphs._record)
        torch.cuda.empty_cache()
        self.startup["graphs"] = len(g)
        self.startup["graph_bytes"] += max(0, torch.cuda.memory_reserved(self.device) - mem0)
        return self.startup

    # -- chunk stages ----------------------------------------------------------------------
    @torch.no_grad()
    @_settles
    def prefill(self, lane: int, tokens: list[int], loops: int, window: int = 0,
                track_norm: bool = False) -> ChunkOut:
        """A fresh prompt at depth `loops` into `lane`: its last logits (1, V)."""
        T = len(tokens)
        work = self.counters.add(loops, loops * T)
        pre = self._padded(T, ["prelude", *range(loops), "coda"], window, track_norm)
        if pre is not None:
            pre.load_tokens(lane, tokens)
            self._run_padded(pre, ["prelude", *range(loops), "coda"])
            return ChunkOut(pre.logits.clone(), work)  # the buffer is the next prefill's
        e = self.engine
        p = e.make_pass(self._slots([lane]), self._arange(0, T), T, window, track_norm)
        logits = e.forward(self._slots([tokens]), p, loops)[:, -1]
        return ChunkOut(logits, work, norm=p.norm_max)

    @torch.no_grad()
    @_settles
    def prefill_many(self, lanes: list[int], prompts: list[list[int]], depths: list[int]) -> list[ChunkOut]:
        """Fresh prompts into their lanes in one pass, each at its own depth: their last logits
        (1, V) each, as `prefill` gives them one by one. The prompts are right-padded to the
        longest: a pad token sits after every real one, so causal attention keeps it out of
        the real tokens' values; its K/V land in the lane's cache past the prompt, where the
        lane's decode steps write before they read. Rows run deepest first, so an iteration
        advances a prefix of the batch (run_loops' lane_loops). Full cache, no norm tracking:
        the callers' other prompts take `prefill`."""
        if not (len(lanes) == len(prompts) == len(depths)) or not lanes:
            raise ValueError(f"prefill_many needs as many lanes, prompts and depths, at least one: "
                             f"{len(lanes)}, {len(prompts)}, {len(depths)}")
        if any(not t for t in prompts):
            raise ValueError("prefill_many: every prompt needs at least one token")
        if self._prefill_buckets:
            return self._prefill_many_graphed(lanes, prompts, depths)
        order = sorted(range(len(lanes)), key=lambda i: -depths[i])
        T = max(len(t) for t in prompts)
        tokens = [prompts[i] + [0] * (T - len(prompts[i])) for i in order]
        e = self.engine
        p = e.make_pass(self._slots([lanes[i] for i in order]), self._arange(0, T).repeat(len(order), 1), T)
        loops = [depths[i] for i in order]
        x = e.run_loops(e.embed_prelude(self._slots(tokens), p), p, 0, loops[0], lane_loops=loops)
        x = e.coda(x, p)
        last = self._slots([len(prompts[i]) - 1 for i in order])
        logits = e.logits(x[torch.arange(len(order), device=x.device), last][:, None], p)[:, -1]
        out: list[ChunkOut | None] = [None] * len(lanes)
        for row, i in enumerate(order):
            out[i] = ChunkOut(logits[row:row + 1], self.counters.add(depths[i], depths[i] * len(prompts[i])))
        return out

    def _prefill_many_graphed(self, lanes: list[int], prompts: list[list[int]], depths: list[int]) -> list[ChunkOut]:
        """prefill_many on captured graphs: the prompts grouped by depth and then length into
        the largest captured row counts (a group's rows share one replay of each stage), the
        rest one by one through their own prefill graphs."""
        out: list[ChunkOut | None] = [None] * len(lanes)
        todo = sorted(range(len(lanes)), key=lambda i: (-depths[i], -len(prompts[i])))
        for rows in sorted({r for r, _ in self._rows_buckets}, reverse=True):
            rest = []
            while len(todo) >= rows:
                group, todo = todo[:rows], todo[rows:]
                L = max(depths[i] for i in group)
                pre = self._rows_graph(rows, max(len(prompts[i]) for i in group), L)
                if pre is None:
                    rest += group[:1]
                    todo = group[1:] + todo
                    continue
                pre.load_prompts([lanes[i] for i in group], [list(prompts[i]) for i in group],
                                 [depths[i] for i in group])
                for stage in PaddedPrefill.stages(L):
                    self.graphs.replay(f"prefill{rows}", pre.bucket, stage)
                logits = pre.logits.clone()  # the buffer is the next group's
                for row, i in enumerate(group):
                    out[i] = ChunkOut(logits[row:row + 1], self.counters.add(depths[i], depths[i] * len(prompts[i])))
            todo = rest + todo
        for i in todo:
            out[i] = self.prefill(lanes[i], list(prompts[i]), depths[i])
        return out

    @torch.no_grad()
    @_settles
    def chunk(self, lane: int, tokens: list[int], first_pos: int, loops: int, window: int = 0,
              track_norm: bool = False) -> ChunkOut:
        """A prompt's tokens at positions [first_pos, first_pos + T) of `lane` at depth `loops`,
        the lane's cache holding the positions before them (chunked prefill): the last logits
        (1, V). At first_pos 0 this is `prefill`."""
        if first_pos == 0:
            return self.prefill(lane, tokens, loops, window, track_norm)
        T = len(tokens)
        work = self.counters.add(loops, loops * T)
        e = self.engine
        end = first_pos + T
        p = e.make_pass(self._slots([lane]), self._arange(first_pos, end), end, window, track_norm)
        logits = e.forward(self._slots([tokens]), p, loops)[:, -1]
        return ChunkOut(logits, work, norm=p.norm_max)

    @torch.no_grad()
    @_settles
    def build(self, lane: int, tokens: list[int], loops: int, window: int = 0) -> ChunkOut:
        """The prelude and iterations [0, loops) of a fresh prompt into `lane`: the residual
        entering iteration `loops` (1, T, D), no coda."""
        T = len(tokens)
        work = self.counters.add(loops, loops * T)
        pre = self._padded(T, ["prelude", *range(loops)], window, False)
        if pre is not None:
            pre.load_tokens(lane, tokens)
            self._run_padded(pre, ["prelude", *range(loops)])
            return ChunkOut(None, work, residual=pre.x[:, :T].clone())
        e = self.engine
        p = e.make_pass(self._slots([lane]), self._arange(0, T), T, window)
        x = e.run_loops(e.embed_prelude(self._slots([tokens]), p), p, 0, loops)
        return ChunkOut(None, work, residual=x)

    @torch.no_grad()
    @_settles
    def extend(self, lane: int, residual: torch.Tensor, start: int, stop: int, first_pos: int = 0,
               window: int = 0, track_norm: bool = False) -> ChunkOut:
        """Iterations [start, stop) and the coda over a chunk's residual (1, T, D) entering
        iteration `start`, at positions [first_pos, first_pos + T) of `lane` (whose cache
        layers below `start` hold the chunk's K/V): the last logits (1, V). `residual` is read,
        not written."""
        T = residual.shape[1]
        work = self.counters.add(stop - start, (stop - start) * T)
        stages = [*range(start, stop), "coda"]
        pre = self._padded(T, stages, window, track_norm) if first_pos == 0 else None
        if pre is not None:
            pre.load_residual(lane, residual)
            self._run_padded(pre, stages)
            return ChunkOut(pre.logits.clone(), work)
        e = self.engine
        end = first_pos + T
        p = e.make_pass(self._slots([lane]), self._arange(first_pos, end), end, window, track_norm)
        x = e.run_loops(residual.clone(), p, start, stop)
        return ChunkOut(e.logits(e.coda(x, p)[:, -1:])[:, -1], work, norm=p.norm_max)

    @torch.no_grad()
    @_settles
    def trace(self, lane: int, tokens: list[int], loops: int) -> tuple[list[str], torch.Tensor]:
        """Every stage's residual at the last position of a fresh prompt: (labels, (n, D) fp32)."""
        T = len(tokens)
        self.counters.add(loops, loops * T)
        trace: list = []
        e = self.engine
        p = e.make_pass(self._slots([lane]), self._arange(0, T), T, trace=trace)
        e.forward(self._slots([tokens]), p, loops)
        return [label for label, _ in trace], torch.cat([h for _, h in trace], 0)

    # -- decode ----------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, lanes: list[int], tokens: list, positions: list[int], depths: list[int], window: int = 0,
               track_norm: bool = False, on_device: "dict[int, torch.Tensor] | DeviceTokens | None" = None,
               prev: StepOut | None = None, exits: "list[ExitRule | None] | None" = None) -> StepOut:
        """One decode step: row i runs tokens[i] at positions[i] on lanes[i] at depth depths[i].
        A token is a host int or a one-element device tensor (sampled, not read yet); on_device
        ({row: tensor}, or a DeviceTokens: many rows' tokens in one device tensor) replaces rows'
        tokens the same way. prev: the caller's last StepOut, which it lets go (its buffers may
        be reused without a copy). exits: row i's early-exit rule (None: it runs depths[i]); the
        StepOut's `depths` are then the iterations each row ran (early_exit.py)."""
        B = len(lanes)
        exiting = exits is not None and any(r is not None for r in exits)
        if self._solo_last is not None and not (exiting and B == 1 and self.graphs is not None):
            self._settle_solo()
        if exiting:
            if window or track_norm:
                raise ValueError("early exit runs on the full cache (cache_window=0) with no safety check")
            return self._decode_exit(lanes, tokens, positions, depths, exits, on_device, prev)
        if B == 1 and on_device is None and not window and not track_norm and self.graphs is not None:
            g = self.graphs.decode.get(depths[0])
            if g is not None:  # a stream alone on its depth's graph: the common step, made with no lists
                return self._decode_graph(lanes[0], tokens[0], positions[0], depths[0],
                                          self.counters.add(depths[0], depths[0]), prev)
        work = self.counters.add(max(depths), sum(depths))
        if isinstance(on_device, DeviceTokens):
            if window == 0 and not track_norm and B > 1:
                return self._decode_batched(lanes, tokens, positions, depths, on_device, work, prev)
            on_device = on_device.as_dict()
        on_device = dict(on_device or {})
        for i, t in enumerate(tokens):
            if isinstance(t, torch.Tensor):
                on_device[i] = t
        if window == 0 and not track_norm:
            if B == 1 and self.graphs is not None and depths[0] in self.graphs.decode:
                return self._decode_graph(lanes[0], on_device.get(0, tokens[0]), positions[0], depths[0],
                                          work, prev)
            if B > 1:
                return self._decode_batched(lanes, tokens, positions, depths, DeviceTokens.of(on_device),
                                            work, prev)
        e = self.engine
        tok = self._device_tokens([0 if isinstance(t, torch.Tensor) else t for t in tokens], on_device)
        pos = self._slots(positions)
        kv_len = max(positions) + 1
        p = e.make_pass(self._slots(lanes), pos[:, None], kv_len, window, track_norm)
        depth = None if len(set(depths)) == 1 else self._slots(depths)
        x = e.run_loops(e.embed_prelude(tok[:, None], p), p, 0, max(depths), depth=depth)
        logits = e.logits(e.coda(x, p))[:, -1]
        return StepOut(logits, logits.argmax(-1), x, p.norm_max, work, depths=list(depths))

    def _decode_graph(self, lane, token, position, loops, work, prev) -> StepOut:
        g = self.graphs.decode[loops]
        self._claim(g, prev)
        g.load(lane, token, position)
        g.replay(lane, position)
        out = StepOut(g.logits, g.greedy, g.residual, None, work, (g.host, (position + 1) % 2), [loops])
        self._owners[g] = out
        return out

    def _decode_batched(self, lanes, tokens, positions, depths, on_device, work, prev) -> StepOut:
        B = len(lanes)
        b = next((b for b in self._batch_buckets if b >= B), None)
        graphed = b is not None and self.graphs.covers("batch", b, BatchStep.stages(max(depths)))
        step = self._batch_stage(b if graphed else B)
        self._claim("batch", prev)
        self._load_step(step, lanes, tokens, positions, depths, on_device)
        # rows in non-increasing depth (the batcher's order): iteration i needs only the rows
        # deeper than i, a prefix, so it replays the smallest bucket holding them (the buckets
        # share their buffers; a row of the bucket past that prefix is frozen by its depth)
        shrink = graphed and depths[0] != depths[-1] and all(a >= c for a, c in zip(depths, depths[1:]))
        stages = BatchStep.stages(max(depths))
        if not graphed:
            for stage in stages:
                step.run(stage)
        elif not shrink:  # every stage on bucket b: once launched often, one graph
            self.graphs.replay_sequence("batch", b, tuple(stages), step.run)
        else:
            active = B  # rows deeper than the iteration: a prefix, shrinking as the iterations go
            for stage in stages:
                bucket = b
                if isinstance(stage, int):
                    while depths[active - 1] <= stage:
                        active -= 1
                    bucket = next(x for x in self._batch_buckets if x >= active)
                self.graphs.replay("batch", bucket, stage)
        out = StepOut(step.logits[:B], step.greedy[:B], step.x[:B], None, work, depths=list(depths))
        self._owners["batch"] = out
        return out

    # -- interleaved decode ------------------------------------------------------------------
    @property
    def interleaves(self) -> bool:
        """Whether `interleave` runs here (the setting, and an engine whose rows at different
        iterations can share a pass)."""
        return self.settings.interleave and self.engine.interleaves

    @property
    def exit_interleaves(self) -> bool:
        """Whether a batch's exit rules are best checked inside interleaved launches here: where
        the stage sets replay as graphs, a pass costs the same whatever rows are live, so a row
        that stops early is a token gained; eagerly, the whole-token exit step's stage sets hold
        only the rows still iterating, and an interleaved pass, which runs every row, loses to it
        (bench/results/early-exit-interleaved-cpu.json)."""
        return self.interleaves and self.graphs is not None

    @property
    def pass_overhead(self) -> float:
        """What an interleaved call costs beside its passes, in passes: the prelude, the coda
        and the head, by their weights against the shared block's (a decode step of a few
        rows reads its weights once per layer, whatever the rows)."""
        cfg = self.config
        layer = cfg.layer_matmul_params()
        return ((cfg.n_prelude + cfg.n_coda) * layer + cfg.vocab_size * cfg.d_model) / (cfg.n_loop_layers * layer)

    @torch.no_grad()
    @_settles
    def interleave(self, lanes: list[int], tokens: list, positions: list[int], depths: list[int],
                   starts: list[int], passes: int, on_device: DeviceTokens | None = None,
                   prev: StepOut | None = None, exits: list | None = None) -> StepOut:
        """`passes` passes over B decode rows, each at its own iteration: row i runs iterations
        [starts[i], min(starts[i] + passes, depths[i])) of the token at positions[i] on
        lanes[i]. A row at starts[i] == 0 embeds its token first (tokens[i], or on_device's);
        a row that reaches its depth gets its logits (its row of the StepOut; the other rows'
        are not logits). Between calls a row's residual waits in the runner's row for its lane,
        so a row continues where its last call left it (the same lane, position and depth).
        Every row of every pass runs the same weights, so a shallow row decodes its next tokens
        while a deep one is still iterating.

        exits: each row's ExitRule or None (rules that `interleave`: gate or latent, the copy
        fill). A row's rule is checked on the device after each of its iterations, its criteria
        kept per lane between calls like its residual; a row it stops ends its token there (the
        skipped iterations' cache entries filled at the call's end) and gets its logits. The
        host then reads, once, which rows' tokens ended and the iterations each ran: the
        StepOut's `finished` and `depths`, once `StepOut.resolve` is called (which waits for the
        launch: the host prepares its next launch meanwhile). A row's rule stays the same until
        its token ends."""
        B = len(lanes)
        if passes < 1:
            raise ValueError(f"interleave runs at least one pass, got {passes}")
        again = self._interleave_again(lanes, positions, depths, starts, on_device, exits, prev)
        if again is not None:
            step, b, graphed, own = again
            self._claim("interleaved", prev)
        else:
            step, b, graphed = self._interleave_load(lanes, tokens, positions, depths, starts, on_device, prev, exits)
            own = False
        stages = ["next"] if own else []  # the rows move on inside the launch
        stages += (["exit_start"] if exits is not None else []) + (["resume"] if any(starts) else [])
        stages += ["prelude"] if not all(starts) else []
        stages += ["iter" if exits is None else "iter_exit"] * passes
        stages += ["save"] if any(s + passes < d for s, d in zip(starts, depths)) else []
        ends = any(s + passes >= d for s, d in zip(starts, depths))
        stages += ["coda"] if ends or exits is not None else []
        stages += ["exit_end"] if exits is not None else []
        timing = None
        if graphed and exits is not None and self._timing:
            self._timing_i ^= 1
            timing = self._timing[self._timing_i]
            timing[0].record()
        if graphed:
            self.graphs.replay_sequence("interleaved", b, tuple(stages), step.run)
        else:
            for stage in stages:
                step.run(stage)
        if timing is not None:
            timing[1].record()
        logits, greedy = step.logits[:B], step.greedy[:B]  # (a launch without the coda ends no row)
        if exits is None:
            work = self.counters.add(passes, sum(min(s + passes, d) - s for s, d in zip(starts, depths)))
            out = StepOut(logits, greedy, None, None, work, depths=list(depths),
                          finished=[s + passes >= d for s, d in zip(starts, depths)])
        else:
            if step.published_event is not None:
                step.published_event.record()
            out = StepOut(logits, greedy, None, None, Counters(0, 0), timing=timing)

            def read(out=out, step=step):
                if step.published_event is not None:
                    step.published_event.synchronize()
                ran, done, out.greedy_host = step.published[:, :B].tolist()
                out.depths, out.finished = ran, [bool(f) for f in done]
                out.work = self.counters.add(passes, sum(r - s if f else passes
                                                         for r, s, f in zip(ran, starts, out.finished)))
            out.pending = read
        self._owners["interleaved"] = out
        return out

    def _interleave_again(self, lanes, positions, depths, starts, on_device, exits, prev):
        """The rows of the last interleaved launch again, each whose token ended one position on
        and starting its next token, its token on the device, and each other going on from where
        it stopped (a batch's steady state): the rows move on on the device, with nothing made,
        checked or copied on the host again -> (step, bucket, graphed, own), or None where the
        launch is another (`_interleave_load` then loads it). own: the tokens are that launch's
        greedy ones (prev is its StepOut, resolved, and they are its `greedy`), so the launch's
        own "next" stage moves the rows on, whichever ended (prev.finished: the rows that start
        a token now); otherwise, where every row's token ended, `InterleavedStep.reload_next`
        does, before the launch."""
        last = self._interleaved_last
        if last is None or on_device is None:
            return None
        step, b, graphed, l_lanes, l_positions, l_depths, l_exits = last
        B = len(lanes)
        fresh = [s == 0 for s in starts]
        if not (graphed and len(on_device.rows) == B and on_device.rows == on_device.index and lanes == l_lanes
                and depths == l_depths and (exits is None) == (l_exits is None) and (exits is None or exits == l_exits)
                and all(p == q + f for p, q, f in zip(positions, l_positions, fresh))):
            return None
        values = on_device.values[:B]
        own = (prev is not None and prev is self._owners.get("interleaved") and prev.greedy.shape[0] == B
               and values.data_ptr() == prev.greedy.data_ptr() and prev.finished == fresh)
        if not own:
            if not all(fresh):
                return None
            step.reload_next(values)
        self._interleaved_last = (step, b, graphed, l_lanes, list(positions), l_depths, l_exits)
        return step, b, graphed, own

    def _interleave_load(self, lanes, tokens, positions, depths, starts, on_device, prev, exits):
        """`interleave`'s checks, and its rows loaded from the host -> (step, bucket, graphed)."""
        B = len(lanes)
        if not self.interleaves:
            raise ValueError("interleaved decode needs the K/V cache, one weight set for every iteration and "
                             "RunnerSettings.interleave")
        if not (len(tokens) == len(positions) == len(depths) == len(starts) == B) or B == 0:
            raise ValueError("interleave takes as many tokens, positions, depths and starts as lanes, at least one")
        if len(set(lanes)) != B:
            raise ValueError("interleave takes each lane once")
        if not all(0 <= s < d <= self.cache.max_loops for s, d in zip(starts, depths)):
            raise ValueError(f"each row starts inside its depth, at most {self.cache.max_loops}: "
                             f"starts {starts}, depths {depths}")
        if exits is not None:
            if len(exits) != B:
                raise ValueError("interleave takes one exit rule (or None) per row")
            bad = [] if exits == self._exits_checked else [r for r in exits if r is not None and not r.interleaves]
            self._exits_checked = None if bad else list(exits)  # a batch's next launches bring the same rules
            if bad:
                raise ValueError(f"an interleaved launch checks the {' and '.join(INTERLEAVED_CRITERIA)} criteria "
                                 f"with the copy fill, not {bad[0].criterion} / {bad[0].cache}")
        b = next((b for b in self._batch_buckets if b >= B), None)
        graphed = b is not None and self.graphs.covers("interleaved", b, INTERLEAVED_STAGES)
        step = self._interleaved_step(b if graphed else B)
        self._claim("interleaved", prev)
        rules = None
        if exits is not None:
            state = self._lane_exit_state()
            step.with_exits(state, IDLE_PARAMS, INTERLEAVED_CRITERIA)
            if graphed and not self.graphs.covers("interleaved", b, EXIT_STAGES):
                self._capture_exit_stages(state)
            rules = state.load_host(list(exits), list(depths))
        host = [0 if isinstance(t, torch.Tensor) else t for t in tokens]
        step.load(list(lanes), host, list(positions), list(depths), list(starts), self._device_rows(on_device),
                  rules=rules)
        # the next launch may bring the same rows on (`_interleave_again`)
        self._interleaved_last = (step, b, graphed, list(lanes), list(positions), list(depths),
                                  None if exits is None else list(exits))
        return step, b, graphed

    def _capture_exit_stages(self, state: ExitState) -> None:
        """The exit stages of every interleaved bucket as graphs, captured the first time an
        interleaved launch has exit rules (a batch that shrinks as its streams end then finds
        its smaller buckets' ready), each over idle rows: capturing writes no lane."""
        for bucket in self._batch_buckets:
            if not self.graphs.covers("interleaved", bucket, INTERLEAVED_STAGES):
                continue
            step = self._interleaved_step(bucket)
            step.with_exits(state, IDLE_PARAMS, INTERLEAVED_CRITERIA)
            step.load([], [], [], [], [], rules=[])
            for s in EXIT_STAGES:
                if not self.graphs.covers("interleaved", bucket, [s]):
                    self.graphs.capture_stage("interleaved", bucket, s, lambda step=step, s=s: step.run(s))

    def _lane_exit_state(self) -> ExitState:
        """The exit criteria of interleaved launches: one row per lane, row n_slots the idle rows'."""
        if self._lane_exits is None:
            self._lane_exits = ExitState(self.model, self.cache.n_slots + 1, self.device, self.ops.exit_check)
        return self._lane_exits

    def _interleaved_step(self, b: int) -> InterleavedStep:
        if b not in self._interleaved:
            if self._lane_x is None:
                cfg = self.config
                self._lane_x = torch.zeros(self.cache.n_slots + 1, 1, cfg.residual_width, device=self.device,
                                           dtype=self.model.tok_embeddings.weight.dtype)
            shared = None
            if self._batch_buckets and b <= self._batch_buckets[-1]:
                if self._interleaved_shared is None:
                    self._interleaved_shared = interleaved_buffers(self.engine, self._batch_buckets[-1])
                shared = self._interleaved_shared
            self._interleaved[b] = InterleavedStep(self.engine, b, self._lane_x, shared)
        return self._interleaved[b]

    def _load_step(self, step: BatchStep, lanes, tokens, positions, depths, on_device: DeviceTokens | None) -> None:
        host = [0 if isinstance(t, torch.Tensor) else t for t in tokens]
        step.load(list(lanes), host, list(positions), list(depths), self._device_rows(on_device))

    def _device_rows(self, on_device: DeviceTokens | None) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(row indices or None: rows 0, 1, ..., their tokens) on the device, as the stage sets'
        `load` takes them; None when no row's token is on the device."""
        if on_device is None or not on_device.rows:
            return None
        n = len(on_device.rows)
        if on_device.rows == on_device.index == list(range(n)):  # the common case: every row goes on
            return None, on_device.values[:n]
        if self._rows_staging is None:
            self._rows_staging = Staging((2, self.cache.n_slots), torch.long, self.device)
            self._rows_dev = torch.zeros(2, self.cache.n_slots, dtype=torch.long, device=self.device)
        v = self._rows_staging.next()
        v[0, :n], v[1, :n] = on_device.rows, on_device.index
        self._rows_staging.copy_to(self._rows_dev)  # queued before the step that reads it
        rows, index = self._rows_dev[0, :n], self._rows_dev[1, :n]
        return rows, on_device.values.index_select(0, index)

    def _decode_exit(self, lanes, tokens, positions, depths, rules, on_device, prev) -> StepOut:
        """A decode step whose rows stop iterating where their exit rule says (early_exit.py).

        The rows run as a batched step (stages.BatchStep) over buffers whose first `active`
        rows are the rows still iterating. After each iteration the check (a captured graph
        per batch bucket, or the same ops eagerly) sets the depth of the rows that stop to the
        iterations they ran, on the device, so every later iteration carries them through
        unchanged; once the host has read the decisions, the stopped rows move behind the
        others and the next iteration runs over the smallest stage set holding the rows still
        going: a captured batch bucket's graph where every stage is captured, else eager
        stages of exactly that many rows. On the graphs the host reads iteration i's decisions
        after launching iteration i + 1 (the read overlaps the device's work). Then the rows go
        back to their order, the coda runs over all of them, and the skipped iterations' cache
        layers are filled (the rows' policy)."""
        B = len(lanes)
        if B == 1 and self.graphs is not None:
            return self._decode_solo(lanes[0], tokens[0], positions[0], depths[0], rules[0], on_device, prev)
        if isinstance(on_device, DeviceTokens):
            dev_tokens = on_device
        else:
            dev = dict(on_device or {})
            dev.update({i: t for i, t in enumerate(tokens) if isinstance(t, torch.Tensor)})
            dev_tokens = DeviceTokens.of(dev)
        top = max(depths)
        b = next((b for b in self._batch_buckets if b >= B), None)
        graphed = b is not None and self.graphs.covers("batch", b, BatchStep.stages(top))
        key = "batch" if graphed else "exit"
        self._claim(key, prev)

        def stage_set(n: int) -> tuple[BatchStep, int | None]:
            if graphed:
                bucket = next(x for x in self._batch_buckets if x >= n)
                return self._batch_stage(bucket), bucket
            return self._exit_stage(n), None

        def run(step_bucket, stage) -> None:
            step, bucket = step_bucket
            if bucket is None:
                step.run(stage)
            else:
                self.graphs.replay("batch", bucket, stage)

        state = self._exit_state()
        if graphed:
            self._capture_checks(state, b)
        full = stage_set(B)
        step = full[0]
        self._load_step(step, lanes, tokens, positions, depths, dev_tokens)
        state.reset(list(rules), list(depths))
        run(full, "prelude")
        # graphed: the host reads iteration i's decisions after launching iteration i + 1, so
        # the read overlaps the device's work (a row stopped meanwhile is frozen on the device
        # and costs one iteration at most); eager, at once (nothing to overlap on the CPU)
        lag = graphed
        order = list(range(B))  # buffer row k holds the step's row order[k]
        active = B
        stopped: set[int] = set()  # rows read as stopped that still sit among the first `active`
        pending = None  # (host slot, the rows it covers, in buffer order) published, not read
        for i in range(top):
            d = i + 1
            cur = stage_set(active)
            run(cur, i)
            rows = [r for r in order[:active] if r not in stopped]
            need = state.needs_logits(d, rows)
            if need:
                run(cur, "coda")
            slot = d % 2
            if graphed:
                self.graphs.replay("exit", cur[1], f"check+logits{slot}" if need else f"check{slot}")
            else:
                state.check(active, self.model.state(step.x[:active, 0]), step.logits[:active] if need else None,
                            step.ctl[2, :active], slot)
            published = None
            if state.can_stop(d, rows):
                state.mark(slot)
                published = (slot, order[:active])  # the ring holds the first `active` buffer rows
            if lag:
                to_read, pending = pending, published
            else:
                to_read = published
            if to_read is None:
                continue
            slot, covered = to_read
            stopped |= {r for r, f in zip(covered, state.read(slot, len(covered))) if f}
            going = [r for r in order[:active] if r not in stopped]
            if not going:
                break
            # the rows going move to the front only where that lets the next iteration run a
            # smaller stage set: the graphs' buckets are powers of two, and a stopped row left
            # among them is frozen (its depth), so until then a permutation would buy nothing
            if len(going) < active and (not graphed or stage_set(len(going))[1] < cur[1]):
                at = {r: k for k, r in enumerate(order)}
                order = going + [r for r in order[:active] if r in stopped] + order[active:]
                self._permute(step, B, [at[r] for r in order])
                state.set_order(order)
                active = len(going)
                stopped.clear()
        if order != list(range(B)):
            at = {r: k for k, r in enumerate(order)}
            self._permute(step, B, [at[r] for r in range(B)])
        ran = [int(v) for v in step.ctl[2, :B].tolist()]  # each row's depth: where it stopped
        run(full, "coda")
        fill_skipped(self.engine, [(r, lanes[r], positions[r], ran[r], depths[r], rules[r].cache)
                                   for r in range(B) if rules[r] is not None and ran[r] < depths[r]], step.x)
        work = self.counters.add(max(ran), sum(ran))
        logits = step.logits[:B]
        out = StepOut(logits, logits.argmax(-1), step.x[:B], None, work, depths=ran)
        self._owners[key] = out
        return out

    def _decode_solo(self, lane, token, position, depth, rule, on_device, prev) -> StepOut:
        """_decode_exit of one row on graphs of its own (solo_exit.py): a span graph per token,
        launched and not waited for. The StepOut is pending: `resolve` ends the step (its
        `depths` and `work` are set then); so does the runner's next call of any kind.

        The next step of the same stream (its token the device tensor this step's greedy
        token lands in) is launched before this one ends: the device runs the two spans back
        to back while the host ends the first. Where the first went on past its span (the
        host runs its later iterations), the second ran on its stale token and runs again."""
        if isinstance(on_device, DeviceTokens):
            on_device = on_device.as_dict()
        token = (on_device or {}).get(0, token)
        if self._solo is None:
            self._solo = SoloExit(self.engine, self.graphs, self.ops.exit_check)
        solo, last = self._solo, self._solo_last
        ahead = (last is not None and isinstance(token, torch.Tensor)
                 and token.data_ptr() == solo.greedy[last[0].parity].data_ptr()
                 and last[0].precedes(lane, position, depth, rule) and not solo.needs_capture(depth, rule))
        if last is not None and not ahead:
            self._settle_solo()
        parity = position % 2
        owner = self._owners.pop(("solo", parity), None)
        # the half's last step is this stream's step before `prev` (pipelined decode): let go
        behind = prev is not None and last is not None and last[1] is prev and \
            self._solo_at.get(parity) == (lane, position - 2)
        if owner is not None and owner is not prev and not behind:
            owner.detach()
        self._solo_at[parity] = (lane, position)
        s = solo.launch(lane, token, position, depth, rule)
        h = solo.halves[parity]
        out = StepOut(h.step.logits, solo.greedy[parity], h.step.x, None, Counters(0, 0), (solo.host[parity], 1))
        out.pending = lambda: self._end_solo(s, out)
        if self._solo_last is not None:  # launched ahead of its stream's last step: end that one now
            solo.counts["ahead"] += 1
            if self._settle_solo():
                solo.relaunch(s)
        self._solo_last = (s, out)
        self._owners[("solo", parity)] = out
        return out

    def _end_solo(self, s, out: StepOut) -> None:
        if self._solo_last is not None and self._solo_last[0] is s:
            self._solo_last = None
        ran = self._solo.finish(s)
        out.depths, out.work = [ran], self.counters.add(ran, ran)

    def _settle_solo(self) -> bool:
        """End the one-row exit step still pending, if any -> whether it went on past its span."""
        last, self._solo_last = self._solo_last, None
        if last is None:
            return False
        last[1].resolve()
        return last[0].went_on

    @_settles
    def sample(self, logits: torch.Tensor, seen: torch.Tensor | None, params: list[SamplingParams],
               seeds: list[int], positions: list[int]) -> torch.Tensor:
        """The tokens of rows of logits (B, V), row b on its own parameters params[b], key
        seeds[b] and absolute position positions[b] (sampler.sample_rows; seen (B, V) bool: the
        tokens each row has seen, read where a row has a repetition penalty) -> (B,) int64 on
        the device, no host sync. With graphs, one replay of a captured sampler per row bucket;
        else the ops eagerly."""
        if self.graphs is not None and self.settings.sampler_graphs:
            if self._sampler is None:
                self._sampler = SamplerGraphs(self.config.vocab_size, [1, *self._batch_buckets], self.device,
                                              self.graphs.capture_call, self.settings.fused_sampler)
            if self._sampler.covers(logits.shape[0]):
                return self._sampler.sample(logits, seen, params, seeds, positions)
        rs = RowSampling.of(params, logits.shape[-1], self.device)
        return sample_rows(logits, seen, rs, device_tensor(seeds, self.device), device_tensor(positions, self.device),
                           self.settings.fused_sampler)

    def _exit_state(self) -> ExitState:
        if self._exit_checks is None:
            self._exit_checks = ExitState(self.model, self.cache.n_slots, self.device, self.ops.exit_check)
        return self._exit_checks

    def _capture_checks(self, state: ExitState, top: int) -> None:
        """The exit check of every batch bucket up to `top` as graphs (kind "exit"), captured
        the first time an exit step needs them: the check reads the bucket's residual and
        logits buffers and the state's static buffers, every criterion the model offers
        computed (each row keeps its own), so one graph per bucket, logits and host slot
        serves every rule mix.
        Capturing runs the check on whatever the buffers hold: before a step loads its rows."""
        for bucket in self._batch_buckets:
            if bucket > top:
                break
            step = self._batch_stage(bucket)
            for slot in (0, 1):
                for stage, logits in ((f"check{slot}", None), (f"check+logits{slot}", step.logits[:bucket])):
                    if not self.graphs.covers("exit", bucket, [stage]):
                        self.graphs.capture_stage(
                            "exit", bucket, stage, lambda step=step, bucket=bucket, logits=logits, slot=slot:
                            state.check(bucket, self.model.state(step.x[:bucket, 0]), logits, step.ctl[2, :bucket],
                                        slot, state.all_kinds))

    def _permute(self, step: BatchStep, B: int, perm: list[int]) -> None:
        """Buffer rows [0, B) of a batched step reordered: row k takes row perm[k]."""
        idx = self._slots(perm)
        ctl = step.ctl[:, :B]
        ctl.copy_(ctl.index_select(1, idx))
        x = step.x[:B]
        x.copy_(x.index_select(0, idx))

    def _exit_stage(self, n: int) -> BatchStep:
        """An eager stage set of exactly n rows over buffers every size shares (its first n)."""
        if n not in self._exit:
            if self._exit_shared is None:
                self._exit_shared = batch_buffers(self.engine, self.cache.n_slots)
            self._exit[n] = BatchStep(self.engine, n, self._exit_shared)
        return self._exit[n]

    @_settles
    def close(self) -> None:
        """Let go of every captured graph at once (Model.close): a graph keeps the closure it
        captured, which refers back to what owns the graph, so left alone the graphs would go
        whenever the collector finds those cycles, perhaps in another model's capture. The
        device finishes first: a step may still be in flight (launched, not waited for), and the
        graphs' pool and this model's tensors go back to the allocator here, for the next
        model's streams to take."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for owner in (self.graphs, self._solo, self._sampler):
            if owner is not None:
                owner.drop()
        self._owners.clear()
        self.graphs = self._solo = self._sampler = None

    def release(self, out: StepOut | None) -> None:
        """The caller is done with `out`: its buffers may be reused without a copy (a pending
        step ends first: its stream's cache is then as its depths say)."""
        if self._solo_last is not None and self._solo_last[1] is out:
            self._settle_solo()
        for key, owner in list(self._owners.items()):
            if owner is out:
                del self._owners[key]

    def _claim(self, buffers, prev: StepOut | None) -> None:
        owner = self._owners.pop(buffers, None)
        if owner is not None and owner is not prev:
            owner.detach()

    # -- speculative rounds on the device ------------------------------------------------------
    def round_fits(self, pos: int, k: int, rounds: int = 1) -> bool:
        """Whether `rounds` chain rounds of k drafts, the first starting at pos, stay inside the
        cache (each writes k + 1 positions and moves at most k + 1 on)."""
        return pos + rounds * (k + 1) <= self.cache.max_seq_len

    @torch.no_grad()
    @_settles
    def chain_round(self, lane: int, draft_loops: int, verify_loops: int, k: int,
                    state: tuple[int, int] | None = None, sampling: SamplingParams | None = None,
                    seed: int = 0) -> "RoundOut":
        """One chain round on `lane` (rounds.ChainRound): state (t, pos), the decided token and
        its position, or None: where the lane's last round left it. sampling: None or greedy
        params (the verifier's argmax decides), else the sampled round's parameters with the
        request's `seed`, stored for the lane with `state` (a sampled stream's first round
        gives both; a repetition penalty is refused: it needs the tokens so far). Launched, not
        waited for: `RoundOut.result()` reads it. The graph of the (Ld, Lv, k, sampling flags)
        round is captured on its first use where graphs are; a round that would pass the
        cache's end is the caller's to avoid (`round_fits`)."""
        flags = None
        if sampling is not None and not sampling.greedy:
            if sampling.repetition_penalty != 1.0:
                raise ValueError("a round on the device takes no repetition penalty (it depends on the tokens so far)")
            flags = RowSampling.flags([sampling], self.config.vocab_size)[:2]
        key = (draft_loops, verify_loops, k, flags)
        rnd = self._rounds.get(key)
        if rnd is None:
            rnd = self._rounds[key] = ChainRound(self.engine, self._round_state, draft_loops, verify_loops, k,
                                                 flags, self._round_params, self.settings.fused_sampler)
        if state is not None:
            t, pos = state
            if not self.round_fits(pos, k):
                raise ValueError(f"a round of {k} drafts at {pos} passes the cache's {self.cache.max_seq_len} positions")
            self._round_state[lane].copy_(device_tensor([t, pos], self.device))
            if flags is not None:
                self._round_params[0][lane].copy_(device_tensor([sampling.temperature, sampling.top_p], self.device,
                                                                torch.float32))
                self._round_params[1][lane].copy_(device_tensor([sampling.top_k, seed], self.device))
        rnd.slot.fill_(lane)
        if self.graphs is not None:
            self.graphs.capture_round(key, rnd).replay()
        else:
            rnd.run()
        iterations, token_iterations = rnd.work
        work = self.counters.add(iterations, token_iterations)
        return RoundOut(rnd.out, work, k)

    # -- speculative verify ------------------------------------------------------------------
    @torch.no_grad()
    @_settles
    def verify(self, lane: int, residual: torch.Tensor, pos: int, start: int, stop: int) -> ChunkOut:
        """A draft chain's verify: the chunk of residuals (1, n, D) entering iteration `start`,
        first token at pos, through iterations [start, stop) and the coda: every position's
        logits (n, V) (a view the next verify or tree call overwrites)."""
        n = residual.shape[1]
        tr = self.tree(lane, n, pos, TreeStages.span(start, stop))
        tr.load_chain(residual, pos)
        for stage in TreeStages.span(start, stop):
            tr.run(stage)
        return ChunkOut(tr.logits[:n], tr.work)

    @torch.no_grad()
    @_settles
    def verify_many(self, lanes: list[int], residuals, positions: list[int], start: int, stop: int) -> ChunksOut:
        """`verify` of several lanes' draft chains in one eager pass: row b's chunk of residuals
        entering iteration `start`, its first token at positions[b] of lanes[b], through
        iterations [start, stop) and the coda -> every position's logits (B, n, V), a tensor of
        its own. residuals: (B, n, D), or B tensors (1, n, D); every row the same n.

        The rows attend by position (a chunk token reads its lane's cache up to its own
        position, its chunk's earlier tokens included: `Engine._attend`'s chunk read, masked by
        position, or the batch-invariant chunk kernel by rows), so chunks at different
        positions share the pass. Each row counts what its `verify` alone counts,
        (stop - start, (stop - start)·n), as `prefill_many` counts its rows: a stream's work is
        the same batched or alone. ValueError, before anything runs or counts, for rows that
        do not match, a lane twice or outside the cache's, iterations outside [0, max_loops],
        or a chunk past the cache's end."""
        B = len(lanes)
        if isinstance(residuals, (list, tuple)):
            if len(residuals) != B or not B:
                raise ValueError(f"verify_many needs as many lanes, positions and residual rows, at least one: "
                                 f"{B}, {len(positions)}, {len(residuals)}")
            if any(r.dim() != 3 or r.shape[0] != 1 for r in residuals):
                raise ValueError(f"verify_many takes each row's residuals as (1, n, D), got "
                                 f"{[tuple(r.shape) for r in residuals]}")
            ns = [r.shape[1] for r in residuals]
            if len(set(ns)) != 1:
                raise ValueError(f"verify_many takes chunks of one length n, got {ns}")
            residuals = torch.cat(list(residuals))
        rows = residuals.shape[0] if residuals.dim() == 3 else None
        if not (B == len(positions) == rows) or not B:
            raise ValueError(f"verify_many needs as many lanes, positions and residual rows, at least one: "
                             f"{B}, {len(positions)}, {rows if rows is not None else tuple(residuals.shape)}")
        n, width = residuals.shape[1], self.config.residual_width
        if n < 1 or residuals.shape[2] != width:
            raise ValueError(f"verify_many's residuals are (B, n, D) with n >= 1 and D = {width}, "
                             f"got {tuple(residuals.shape)}")
        if len(set(lanes)) != B:
            raise ValueError(f"verify_many takes each lane once, got {list(lanes)}")
        bad = [lane for lane in lanes if not 0 <= lane < self.cache.n_slots]
        if bad:
            raise ValueError(f"lane {bad[0]} outside [0, {self.cache.n_slots})")
        if not 0 <= start < stop <= self.cache.max_loops:
            raise ValueError(f"verify_many runs iterations [start, stop) inside [0, {self.cache.max_loops}], "
                             f"got [{start}, {stop})")
        S = self.cache.max_seq_len
        for lane, pos in zip(lanes, positions):
            if pos < 0 or pos + n > S:
                raise ValueError(f"a chunk of {n} tokens at {pos} (lane {lane}) passes the cache's {S} positions"
                                 if pos >= 0 else f"a chunk at position {pos} (lane {lane}): positions are >= 0")
        works = [self.counters.add(stop - start, (stop - start) * n) for _ in range(B)]
        e = self.engine
        pos = self._slots(list(positions))[:, None] + self._arange(0, n)  # (B, n)
        p = e.make_pass(self._slots(list(lanes)), pos, max(positions) + n)
        x = e.run_loops(residuals.clone(), p, start, stop)  # run_loops works in place: the caller's stays
        return ChunksOut(e.logits(e.coda(x, p), p), works)

    @_settles
    def tree(self, lane: int, nodes: int, pos: int, stages: list | None = None) -> TreeRun:
        """The tree stages for `nodes` nodes rooted at pos on `lane`: a verify bucket's graphs
        when they cover `stages` and its pads stay inside the cache, else eager stages of
        exactly `nodes` nodes."""
        for b in self._verify_buckets:
            if b >= nodes:
                ts = self._tree_stages(b)
                if ts.fits(pos) and (stages is None or self.graphs.covers("verify", b, stages)):
                    return TreeRun(self, ts, True, lane, nodes)
                break
        if pos + nodes > self.cache.max_seq_len:
            raise ValueError(f"a tree of {nodes} nodes at {pos} passes the cache's {self.cache.max_seq_len} positions")
        return TreeRun(self, self._tree_stages(nodes, graphed=False), False, lane, nodes)

    # -- stage sets and helpers ----------------------------------------------------------------
    def _padded(self, T: int, stages: list, window: int, track_norm: bool) -> PaddedPrefill | None:
        if window or track_norm:
            return None
        b = next((b for b in self._prefill_buckets if b >= T), None)
        if b is None or not self.graphs.covers("prefill", b, stages):
            return None
        return self._prefill_stages(b)

    def _run_padded(self, pre: PaddedPrefill, stages: list) -> None:
        for stage in stages:
            self.graphs.replay("prefill", pre.bucket, stage)

    def _rows_stages(self, rows: int, b: int) -> PaddedPrefill:
        if (rows, b) not in self._prefill_rows:
            if self._rows_shared is None:
                top_rows = max(r for r, _ in self._rows_buckets)
                top_tokens = max(r * b for r, b in self._rows_buckets)
                self._rows_shared = rows_prefill_buffers(self.engine, top_tokens, top_rows)
            views = rows_prefill_views(self._rows_shared, rows, b)
            self._prefill_rows[(rows, b)] = PaddedPrefill(self.engine, b, views, rows=rows)
        return self._prefill_rows[(rows, b)]

    def _rows_graph(self, rows: int, T: int, loops: int) -> PaddedPrefill | None:
        """The captured `rows`-row prefill for prompts of up to T tokens at depths up to loops."""
        b = next((b for r, b in self._rows_buckets if r == rows and b >= T), None)
        if b is None or not self.graphs.covers(f"prefill{rows}", b, PaddedPrefill.stages(loops)):
            return None
        return self._rows_stages(rows, b)

    def _prefill_stages(self, b: int) -> PaddedPrefill:
        if b not in self._prefill:
            if self._prefill_shared is None:
                self._prefill_shared = prefill_buffers(self.engine, self._prefill_buckets[-1])
            self._prefill[b] = PaddedPrefill(self.engine, b, self._prefill_shared)
        return self._prefill[b]

    def _batch_stage(self, b: int) -> BatchStep:
        if b not in self._batch:
            if self._batch_buckets and b <= self._batch_buckets[-1]:
                if self._batch_shared is None:
                    self._batch_shared = batch_buffers(self.engine, self._batch_buckets[-1])
                self._batch[b] = BatchStep(self.engine, b, self._batch_shared)
            else:
                self._batch[b] = BatchStep(self.engine, b)
        return self._batch[b]

    def _tree_stages(self, b: int, graphed: bool = True) -> TreeStages:
        key = b if graphed else -b
        if key not in self._trees:
            self._trees[key] = TreeStages(self.engine, b)
        return self._trees[key]

    def _slots(self, values) -> torch.Tensor:
        return device_tensor(values, self.device)

    def _arange(self, start: int, stop: int) -> torch.Tensor:
        return torch.arange(start, stop, device=self.device)[None]

    def _device_tokens(self, host: list[int], on_device: dict[int, torch.Tensor]) -> torch.Tensor:
        tok = self._slots(host)
        if on_device:
            rows = list(on_device)
            tok = tok.index_copy(0, self._slots(rows), torch.stack([on_device[r].view(()) for r in rows]))
        return tok
