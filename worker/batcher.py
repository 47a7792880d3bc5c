"""Continuous batching: the decode steps of many streams in one forward.

Each stream prefills alone on its own cache lane (`join`), then its `DecodeState` waits
here. A `step` runs every waiting stream's decided token through the model in one forward
over the contiguous lane range they span, with per-lane positions (B, 1) and per-lane depths
(`Engine.run_loops(depth=...)`), then lets each stream sample its next token with its own
parameters and random key (seed, absolute position). Streams join and leave between steps.

A lane of the batch is bitwise the step it would take alone: every op of a decode step is
row-independent, and the projections run row by row (`model.linear`). So each stream's
tokens are exactly those of `Model.stream` (tests/worker/test_batcher.py).

Lanes in the range that no waiting stream holds (free, prefilling, or stepping alone) are
idle no-ops: depth 0 and position `max_seq_len`. Their K/V writes fall outside the cache, and
the write ops drop those (`rope_cache_write` skips indices outside [0, S)), so they touch no
lane's data; they read the whole lane, finite values, and their logits are discarded.

All calls run on the worker's one step thread (never two at once). CUDA graphs capture
batch-1 steps per lane, so a graph-backed engine is not batched: see `eligible`.
"""
from __future__ import annotations

import torch

from tinyloop.worker.engine import Engine
from tinyloop.worker.generate import DecodeState, Finish

Update = tuple[list[int], Finish | None]  # new token ids, and the Finish once the stream ends


class Batcher:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.states: dict[int, DecodeState] = {}  # lane -> a stream whose decided token waits to run
        self.steps = 0       # batched forwards run
        self.lane_steps = 0  # stream steps they carried (lane_steps / steps: the mean batch)

    def eligible(self, st: DecodeState) -> bool:
        """Eager engines only (a captured graph is a batch-1 step on one lane), and plain decode."""
        return self.engine.graphs is None and st.batchable

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
        for lane in lanes:
            self.states[lane].advanced(logits[lane - lanes[0]][None])
        toks = torch.cat([self.states[lane].sample() for lane in lanes]).tolist()  # one host sync
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
        """One decode step over lanes [lanes[0], lanes[-1]]: logits (B, V)."""
        e = self.engine
        lo, B = lanes[0], lanes[-1] - lanes[0] + 1
        S = e.cache.max_seq_len
        tokens, positions, depth = [0] * B, [S] * B, [0] * B  # idle lanes: see the module docstring
        for lane in lanes:
            st = self.states[lane]
            tokens[lane - lo], positions[lane - lo], depth[lane - lo] = st.tok_id, st.pos, st.req.loops
        device = e.cache.k.device
        pos = torch.tensor(positions, device=device)[:, None]  # (B, 1)
        p = e.make_pass(slice(lo, lo + B), pos, S + 1)
        return e.forward(torch.tensor(tokens, device=device)[:, None], p, max(depth),
                         depth=torch.tensor(depth, device=device))[:, -1]
