"""Continuous batching: the decode steps of many streams in one forward.

Each stream prefills alone on its own cache lane (`join`), then its `DecodeState` waits
here. A `step` runs every waiting stream's decided token through the model in one batched
step over lanes [0, bucket) (`generate.BatchStep`: per-lane tokens, positions (B, 1) and
depths), then samples every stream's next token -- one sampling call per distinct set of
sampling parameters, each row with its own random key (seed, absolute position) -- and
reads them all in one host sync. The step is pipelined like a stream alone: the forward for
the tokens just sampled is launched before the host reads them (`Batcher.step`). Streams join
and leave between steps. A stream alone in the batcher steps on its lane's captured decode
graph exactly as it would outside it (DecodeState's pipelined calls): a greedy token is the
graph's own argmax, fed into its next replay and read from its pinned host ring, and nothing
is copied or launched around the replay.

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

from tinyloop.worker.runner.engine import Engine
from tinyloop.worker.generation.decode import DecodeState, Finish, device_tensor
from tinyloop.worker.runner.graphs import BatchGraphs
from tinyloop.worker.generation.sampling import sample

Update = tuple[list[int], Finish | None]  # new token ids, and the Finish once the stream ends


class Batcher:
    def __init__(self, engine: Engine):
        self.engine = engine
        # the captured stages of a graph-backed engine, else the same stages run eagerly
        self.stepper = engine.graphs.batch if engine.graphs is not None else BatchGraphs(engine)
        self.states: dict[int, DecodeState] = {}  # lane -> a stream whose decided token waits to run
        self.steps = 0       # batched forwards whose logits streams used
        self.lane_steps = 0  # stream steps they carried (lane_steps / steps: the mean batch)
        # ([(lane, state)], logits, the lane's DecodeGraph when a lone stream ran on it) of a step launched ahead
        self._ahead: tuple[list, torch.Tensor, object] | None = None
        self._host: torch.Tensor | None = None       # pinned buffer the sampled tokens are copied into
        self._copied: torch.cuda.Event | None = None

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
        """Take a stream out (cancelled): its lane is in no later step. A step launched ahead
        may still write the lane's K/V at its next position: harmless, whatever takes the lane
        next writes a position before it reads it (as with `DecodeState.discard`)."""
        self.states.pop(lane, None)

    def __bool__(self) -> bool:
        return bool(self.states)

    def step(self) -> dict[int, Update]:
        """Hand every waiting stream the logits of its decided token, sample its next token,
        and return the new tokens: {lane: (ids, Finish or None)}; a finished stream has left.

        Pipelined: the forward for the tokens sampled here is launched before the host reads
        them (they feed it on the device), so on CUDA the device runs step t while the host
        handles the tokens of step t - 1. The next call uses that forward's logits; a stream
        that joined meanwhile runs its first token in the forward after. A stream whose token
        reaches max_tokens is left out of the launch; one that samples a stop token has its
        row dropped. The tokens, logits and stats are those of the plain loop."""
        if not self.states:
            self._ahead = None
            return {}
        try:
            if self._ahead is None:
                self._launch({})
            ran, logits, graph = self._ahead
            self._ahead = None
            # a stream that left meanwhile is dropped (its lane may hold a new stream already)
            rows = [(row, lane) for row, (lane, st) in enumerate(ran) if self.states.get(lane) is st]
            if not rows:
                return {}
            lanes = [lane for _, lane in rows]
            self.steps += 1
            self.lane_steps += len(lanes)
            if graph is not None:
                # a lone stream's own decode graph ran the step: it steps as it would alone
                # (DecodeState's pipelined calls): a greedy token is the graph's argmax, already
                # fed into its next replay and written to its host ring; the logits are read in
                # stream order before the next launch overwrites them, so they are not copied
                st = self.states[lanes[0]]
                st.advanced(logits, graph)
                tok = st.sample()
                st.copy_to_host(tok)
                go_on = {lanes[0]: tok} if st.generated + 1 < st.req.max_tokens else {}
            else:
                logits = logits.clone()  # the static output the next launch overwrites
                for row, lane in rows:
                    self.states[lane].advanced(logits[row][None])
                toks = self._sample(lanes)
                self._copy_to_host(toks)
                go_on = {lane: toks[i] for i, lane in enumerate(lanes)
                         if self.states[lane].generated + 1 < self.states[lane].req.max_tokens}
            if go_on or len(self.states) > len(lanes):  # or streams joined since: their first token
                self._launch(go_on, skip=set(lanes) - set(go_on))
            toks_h = [st.host_token()] if graph is not None else self._host_tokens(len(lanes))
        except Exception:
            self._ahead = None
            raise
        out: dict[int, Update] = {}
        for lane, t in zip(lanes, toks_h):
            st = self.states[lane]
            if st.accept(t):
                out[lane] = [t], None
            else:
                out[lane] = [t], st.finish()
                del self.states[lane]
        return out

    def _launch(self, on_device: dict[int, torch.Tensor], skip: frozenset | set = frozenset()) -> None:
        """Launch the forward of every waiting stream but `skip` (the step launched ahead)."""
        lanes = sorted(lane for lane in self.states if lane not in skip)
        self._ahead = [(lane, self.states[lane]) for lane in lanes], *self._forward(lanes, on_device)

    def _forward(self, lanes: list[int], on_device: dict[int, torch.Tensor]):
        """Launch one batched step over lanes [0, lanes[-1]]: (the logits rows of `lanes`
        (len, V), None), or (logits (1, V), the graph) when one stream ran on its lane's
        decode graph. A lane's token is its decided token on the host, or on_device[lane], a
        one-element device tensor sampled and not read yet; a lane in on_device runs at the
        position after the one its host state last ran."""
        e = self.engine
        if len(lanes) == 1 and e.graphs is not None:
            # one stream: its lane's captured batch-1 step (fused projections, no idle lanes)
            st = self.states[lanes[0]]
            g = e.graphs.get(st.req.loops, st.lane)
            if g is not None:
                logits = g.step(on_device.get(st.lane, st.tok_id), st.pos)
                e.counters.loop_iterations += g.loops
                e.counters.loop_token_iterations += g.loops
                return logits, g
        n = lanes[-1] + 1
        S = e.cache.max_seq_len
        tokens, positions, depths = [0] * n, [S] * n, [0] * n  # idle lanes: see the module docstring
        for lane in lanes:
            st = self.states[lane]
            tokens[lane], positions[lane], depths[lane] = st.tok_id, st.pos, st.req.loops
        dev = None
        if on_device:
            dev = (self._to_device(list(on_device)), torch.stack([t.view(()) for t in on_device.values()]))
        logits = self.stepper.run(tokens, positions, depths, dev)  # the static output: the next step's
        if lanes[-1] - lanes[0] + 1 == len(lanes):
            return logits[lanes[0]:], None
        return logits.index_select(0, self._to_device(lanes)), None

    def _sample(self, lanes: list[int]) -> torch.Tensor:
        """Every stream's next token (len(lanes),) on the device from its logits: one `sample`
        per distinct set of sampling parameters over the rows that share it, each row with its
        own key."""
        groups: dict = {}
        for row, lane in enumerate(lanes):
            groups.setdefault(self.states[lane].req.sampling, []).append(row)
        toks = None
        for params, rows in groups.items():
            sts = [self.states[lanes[r]] for r in rows]
            seen = None if params.repetition_penalty == 1.0 else torch.cat([st.seen for st in sts])
            seed = torch.cat([st.seed for st in sts])
            pos = None if params.greedy else self._to_device([st.pos for st in sts])
            got = sample(torch.cat([st.logits for st in sts]), seen, params, seed, pos)
            if len(rows) == len(lanes):
                return got
            if toks is None:
                toks = torch.empty(len(lanes), dtype=torch.long, device=got.device)
            toks.index_copy_(0, self._to_device(rows), got)
        return toks

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """A small int64 host list on the device without a host sync: a pageable copy would
        wait for the step launched ahead, and the pipelining would be lost."""
        return device_tensor(values, self.engine.cache.k.device)

    def _copy_to_host(self, toks: torch.Tensor) -> None:
        """Start copying the tokens to the host (pinned buffer + event on CUDA), before the
        next step is launched behind them on the same stream."""
        if toks.device.type != "cuda":
            self._host = toks
            return
        n = toks.shape[0]
        if self._host is None or self._host.shape[0] < n:
            self._host = torch.empty(max(n, 16), dtype=torch.long, pin_memory=True)
            self._copied = torch.cuda.Event()
        self._host[:n].copy_(toks, non_blocking=True)
        self._copied.record()

    def _host_tokens(self, n: int) -> list[int]:
        if self._copied is not None:  # set with the pinned buffer, on CUDA only
            self._copied.synchronize()
        return self._host[:n].tolist()
