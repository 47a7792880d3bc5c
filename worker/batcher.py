"""Continuous batching: the decode steps of many streams in one forward.

Each stream prefills alone on its own cache lane (`join`), then its `DecodeState` waits
here. A `step` runs every waiting stream's decided token through the model in one batched
step over lanes [0, bucket) (`generate.BatchStep`: per-lane tokens, positions (B, 1) and
depths), then samples every stream's next token -- one sampling call per distinct set of
sampling parameters, each row with its own random key (seed, absolute position) -- and
reads them all in one host sync. Streams join and leave between steps.

On CUDA the step replays the stages captured at start-up (worker/graphs.py `BatchGraphs`,
one graph per (lane-count bucket, stage)); elsewhere the same stages run eagerly. Lanes of
the bucket that no waiting stream holds (free, prefilling, stepping alone, or lane 0 that
the actor keeps for internal calls) are idle: depth 0 and position `max_seq_len`, outside
the cache, so `rope_decode_attention` neither writes nor reads their cache: they touch no
lane's data and cost no cache reads; their logits are discarded.

On CPU a lane of the batch is bitwise the step it would take alone: every op of a decode
step is row-independent, and the projections run row by row (`model.linear`), so each
stream's tokens are exactly those of `Model.stream` (tests/worker/test_batcher.py). On CUDA
the batched projections are one GEMM over the lanes, so a lane equals its step alone up to
the GEMM's rounding (tests/worker/test_gpu_engine.py).

All calls run on the worker's one step thread (never two at once).
"""
from __future__ import annotations

import torch

from tinyloop.worker.engine import Engine
from tinyloop.worker.generate import DecodeState, Finish
from tinyloop.worker.graphs import BatchGraphs
from tinyloop.worker.sampling import sample

Update = tuple[list[int], Finish | None]  # new token ids, and the Finish once the stream ends


class Batcher:
    def __init__(self, engine: Engine):
        self.engine = engine
        # the captured stages of a graph-backed engine, else the same stages run eagerly
        self.stepper = engine.graphs.batch if engine.graphs is not None else BatchGraphs(engine)
        self.states: dict[int, DecodeState] = {}  # lane -> a stream whose decided token waits to run
        self.steps = 0       # batched forwards run
        self.lane_steps = 0  # stream steps they carried (lane_steps / steps: the mean batch)

    def eligible(self, st: DecodeState) -> bool:
        """Plain decode (see `DecodeState.batchable`)."""
        return st.batchable

    def join(self, st: DecodeState) -> Update:
        """Decide the first token of a prefilled stream at once (time to first token); the
        stream then waits for the next `step`, unless that token already ended it."""
        t = st.decide()
        if st.accept(t):
            self.states[st.lane] = st
            return [t], None
        return [t], st.finish()

    def leave(self, lane: int) -> None:
        """Take a stream out (cancelled): its lane is in no later step."""
        self.states.pop(lane, None)

    def __bool__(self) -> bool:
        return bool(self.states)

    def step(self) -> dict[int, Update]:
        """Run every waiting stream's decided token in one forward; sample each stream's next
        token. -> {lane: (ids, Finish or None)}; a finished stream has left."""
        if not self.states:
            return {}
        lanes = sorted(self.states)
        logits = self._forward(lanes)
        self.steps += 1
        self.lane_steps += len(lanes)
        for row, lane in enumerate(lanes):
            self.states[lane].advanced(logits[row][None])
        toks = self._sample(lanes, logits).tolist()  # one host sync
        out: dict[int, Update] = {}
        for lane, t in zip(lanes, toks):
            st = self.states[lane]
            if st.accept(t):
                out[lane] = [t], None
            else:
                out[lane] = [t], st.finish()
                del self.states[lane]
        return out

    def _forward(self, lanes: list[int]) -> torch.Tensor:
        """One batched step over lanes [0, lanes[-1]]: the logits rows of `lanes` (len, V)."""
        e = self.engine
        if len(lanes) == 1 and e.graphs is not None:
            # one stream: its lane's captured batch-1 step (fused projections, no idle lanes)
            st = self.states[lanes[0]]
            g = e.graphs.get(st.req.loops, st.lane)
            if g is not None:
                logits = g.step(st.tok_id, st.pos)
                e.counters.loop_iterations += g.loops
                e.counters.loop_token_iterations += g.loops
                return logits
        n = lanes[-1] + 1
        S = e.cache.max_seq_len
        tokens, positions, depths = [0] * n, [S] * n, [0] * n  # idle lanes: see the module docstring
        for lane in lanes:
            st = self.states[lane]
            tokens[lane], positions[lane], depths[lane] = st.tok_id, st.pos, st.req.loops
        logits = self.stepper.run(tokens, positions, depths)  # the static output: the next step's
        return logits[torch.tensor(lanes, device=logits.device)]

    def _sample(self, lanes: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Every stream's next token (len(lanes),) on the device: one `sample` per distinct set
        of sampling parameters over the rows that share it, each row with its own key."""
        groups: dict = {}
        for row, lane in enumerate(lanes):
            groups.setdefault(self.states[lane].req.sampling, []).append(row)
        toks = torch.empty(len(lanes), dtype=torch.long, device=logits.device)
        for params, rows in groups.items():
            sts = [self.states[lanes[r]] for r in rows]
            idx = torch.tensor(rows, device=logits.device)
            seen = torch.cat([st.seen for st in sts])
            seed = torch.cat([st.seed for st in sts])
            pos = torch.tensor([st.pos for st in sts], device=logits.device)
            toks[idx] = sample(logits.index_select(0, idx), seen, params, seed, pos)
        return toks
