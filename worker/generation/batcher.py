"""Continuous batching: the decode steps of many streams in one runner step.

Each stream prefills alone on its own cache lane (`join`), then its `DecodeState` waits
here; a stream that decoded elsewhere up to a decided token can come in too (`add`: a greedy
speculative stream handed over between rounds). A `step` runs every waiting stream's decided
token through one `Runner.decode` (per-lane tokens, positions, depths and cache lanes: any
lanes, in any order), then samples every stream's next token -- one sampling call per
distinct set of sampling parameters, each row with its own random key (seed, absolute
position) -- and reads them all in one host sync.
The step is pipelined like a stream alone: the step for the tokens just sampled is launched
before the host reads them (`Batcher.step`). Streams join and leave between steps. A stream
alone in the batcher steps exactly as it would outside it (DecodeState's pipelined calls).

On CPU a lane of the batch is bitwise the step it would take alone: every op of a decode
step is row-independent, and the projections run row by row (`modules.linear`), so each
stream's tokens are exactly those of `Model.stream` (tests/worker/test_batcher.py). On CUDA
the batched projections are one launch over the lanes, so a lane equals its step alone up to
its rounding (tests/worker/test_gpu_engine.py).

Streams at different depths interleave (`Runner.interleave`, where the runner can): a launch
is then a number of passes over every stream's row, each row at its own iteration of its own
token, and only the rows whose token reaches its depth come back with logits; the others go on
in the next launch from where they stopped. So a stream at depth 4 decodes several tokens
(up to eight) while one at depth 32 decodes one, instead of every row's step lasting the
deepest row's 32 iterations. How many passes a launch runs is `chunk_passes`' choice. Rows of
one depth at a token boundary run the plain batched step.

Where the runner says so (`Runner.exit_interleaves`: on CUDA), streams with an early-exit rule
interleave too where the rule can be checked inside the passes (`ExitRule.interleaves`: the gate
or latent criterion, the copy fill) and at least two streams share the launch: a row that its
rule stops ends its token there, and its next token starts in the next launch, so the rows'
exits turn into tokens for their streams instead of idle rows waiting for the deepest. The host
reads each launch's ends before the next (one read a launch); where the same plain greedy
streams wait, the next launch is those rows again, made at once on the device (`_step_steady`):
each row whose token ended one token on, each other from where it stopped; the streams whose
token ended take it while that launch runs. Other rules (kl, argmax,
recompute), a stream alone, and every exit stream elsewhere run the whole-token exit step, once
the rows midway through a token have finished theirs.

Streams with the per-iteration safety check or a sliding window (`DecodeState.checked`) batch
too, in a step of their own beside the plain one (`_step_checked`): the safety check decides on
the host whether a token is kept, from its step's residual norm, so such a step cannot be
launched ahead of its token; and a pass runs one window. Each `step` therefore also runs one
eager decode per window among them, its rows at their own depths, tokens and positions, the
norm tracked per row where any of them checks it, and reads their tokens and norms in one host
read: a row over its threshold ends its stream there (its token dropped), the others go on.

All calls run on the worker's one step thread (never two at once).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import numpy as np
import torch

from tinyloop.worker.generation.decode import FINISH_SAFETY, DecodeState, Finish
from tinyloop.worker.runner.runner import DeviceTokens, Runner, StepOut
from tinyloop.worker.runner.stages import device_tensor

# new token ids and the Finish once the stream ends; or the exception that ended this stream alone
Update = tuple[list[int], Finish | None] | Exception


def chunk_passes(remaining: list[int], overhead: float) -> int:
    """How many passes an interleaved launch runs, given each row's iterations left on its
    token and the launch's own cost in passes (`Runner.pass_overhead`: prelude, coda, head):
    the count among the rows' remainders with the most row-iterations per unit of cost (a row
    whose token ends sooner waits for the launch's end, at no cost in a memory-bound pass);
    the fewer passes on a tie."""
    if not remaining or min(remaining) < 1:
        raise ValueError(f"every row has at least one iteration left, got {remaining}")
    counts = sorted(Counter(remaining).items())  # a few distinct depths, however many rows
    best, rate = 0, -1.0
    for g, _ in counts:
        r = sum(n * min(x, g) for x, n in counts) / (overhead + g)
        if r > rate * (1 + 1e-12):
            best, rate = g, r
    return best


EXIT_HISTORY = 4  # a stream's latest token depths that its next token's expected depth reads


class HostCost:
    """The host's share of an interleaved launch with exit rules, in passes of device time.

    The host reads such a launch's ends before it prepares the next, so the device waits for
    the host between the two: a launch costs the host's preparation beside its passes and its
    own overhead (prelude, coda, head). On a small model that wait is several passes, and a
    launch that ends fewer tokens pays it more often. `update` takes each launch's host time
    (from its predecessor's ends read to its own launch) and its passes' device time (the
    runner's `StepOut.timing`, read once it has ended); `passes` is their running mean, 0 until
    a launch is measured (a runner that times no launch leaves the choice to the device's cost)."""
    WEIGHT = 0.25  # of the newest launch in the running mean
    CAP = 64.0     # passes at most: one odd launch (a capture, a paused host) skews no choice for long

    def __init__(self):
        self.passes = 0.0

    def update(self, host_s: float, device_s: float, units: float) -> None:
        """A launch whose host preparation took host_s and whose `units` passes (its own
        overhead included) took device_s on the device."""
        if host_s < 0 or device_s <= 0 or units <= 0:
            return
        sample = min(self.CAP, host_s / (device_s / units))
        self.passes += self.WEIGHT * (sample - self.passes)


def expected_remaining(depths: list[int], depth: int, start: int) -> int:
    """The iterations a token with an exit rule is expected to run from `start` on, for the
    choice of passes: up to the deepest of its stream's latest EXIT_HISTORY tokens (its depth
    for a first token, or once it has run past them: no guess below where it stands)."""
    guess = max(depths[-EXIT_HISTORY:]) if depths else depth
    return (guess if guess > start else depth) - start


class _Steady:
    """An exit launch that the next one may repeat on the device (`Batcher._step_steady`): its
    rows (lanes, streams, depths, rules, the positions and starts of the tokens they run), its
    passes and the batch's membership when it launched; once repeated, each stream's latest
    token depths (`hist`)."""

    def __init__(self, out, lanes, sts, depths, rules, positions, starts, passes, members):
        self.out, self.lanes, self.sts, self.depths, self.rules = out, lanes, sts, depths, rules
        self.positions, self.starts, self.passes, self.members = positions, starts, passes, members
        self.hist: np.ndarray | None = None  # (rows, EXIT_HISTORY) ring of depths, -1: none yet
        self.turn: np.ndarray | None = None  # each row's column for its next token's depth
        B = len(lanes)
        self.rows, self.tokens = list(range(B)), [0] * B


class Batcher:
    def __init__(self, runner: Runner, interleave: bool = True, interleave_exits: bool | None = None):
        self.runner = runner
        # interleaved launches for streams at different depths (Runner.interleave), where it runs
        self.interleave = interleave and runner.interleaves
        # and for streams with exit rules (None: where the runner says so; the module docstring)
        self.interleave_exits = self.interleave and (runner.exit_interleaves if interleave_exits is None
                                                     else interleave_exits)
        self._iters: dict[int, int] = {}  # lane -> iterations its stream's token in flight has run
        self.states: dict[int, DecodeState] = {}  # lane -> a stream whose decided token waits to run
        # lane -> a stream with the safety check or a window, stepped by `_step_checked`
        self.checked: dict[int, DecodeState] = {}
        self.steps = 0       # batched forwards whose logits streams used
        self.lane_steps = 0  # stream steps they carried (lane_steps / steps: the mean batch)
        # ([(row, lane, state)] of the rows with logits, their StepOut, whether it is a lone
        # stream's own step, the rows it ran) of a step launched ahead
        self._ahead: tuple[list, StepOut, bool, int] | None = None
        self.rows_stepped = 0  # the rows of the launch the last `step` handed out (the batch size)
        self._last: StepOut | None = None            # the runner step the states' outputs view
        self.host_cost = HostCost()  # exit launches' host preparation, for the choice of passes
        self._ends_read: float | None = None  # when the last exit launch's ends were read (perf_counter)
        self._steady: _Steady | None = None  # the exit launch in flight that the next may repeat
        self._members = 0  # counts every change of the waiting streams (joins, leaves, ends)
        self._warm: set[int] = set()  # lanes whose stream joined in L scheduling's warm-up (`_still_warming`)
        self._host: torch.Tensor | None = None       # pinned buffer the sampled tokens are copied into
        self._copied: torch.cuda.Event | None = None

    @property
    def lanes(self) -> list[int]:
        """The lanes of every stream in the batch."""
        return [*self.states, *self.checked]

    def join(self, st: DecodeState) -> Update:
        """Decide the first token of a prefilled stream at once (time to first token); the
        stream then waits for the next `step`, unless that token already ended it (or, with
        the safety check, its prefill's norm did: no token then)."""
        if st.lane in self.states or st.lane in self.checked:
            raise ValueError(f"lane {st.lane} already has a stream in the batch")
        if st.checked:
            t = st.decide()
            if t is None:
                return [], st.finish()
            if st.accept(t):
                self.checked[st.lane] = st
                return [t], None
            return [t], st.finish()
        t = st.decide()
        if st.accept(t):
            self.states[st.lane] = st
            if st.warm_L is not None:
                self._warm.add(st.lane)
            self._members += 1
            self._iters.pop(st.lane, None)
            return [t], None
        return [t], st.finish()

    def join_many(self, states: list[DecodeState]) -> list[Update]:
        """`join` for several prefilled streams (prompts prefilled together): their first tokens
        in one sampling call and one host read, each row on its own parameters and key, so each
        is the token its own `join` decides. A stream with the safety check or a window joins
        alone (`join`: its residual norm is read with its token)."""
        together = [st for st in states if not st.checked and st.lane not in self.states]
        first: dict[int, int] = {}
        if len(together) > 1:
            toks = self._sample_states(together)
            for i, (st, t) in enumerate(zip(together, toks.tolist())):
                st.tok = toks[i:i + 1]
                first[id(st)] = t
        out = []
        for st in states:
            if id(st) not in first:
                out.append(self.join(st))
                continue
            t = first[id(st)]
            if st.accept(t):
                self.states[st.lane] = st
                if st.warm_L is not None:
                    self._warm.add(st.lane)
                self._members += 1
                self._iters.pop(st.lane, None)
                out.append(([t], None))
            else:
                out.append(([t], st.finish()))
        return out

    def add(self, st: DecodeState) -> None:
        """Take in a stream whose decided token is accepted already and waits to run
        (`DecodeState.decided`: a speculative stream handed over between rounds). Like a stream
        that joined, it runs in the next launch, from its host token at its position, and
        `step` then hands it its row; it needs no logits of its own before that."""
        if st.checked:
            raise ValueError("a decided stream joins as plain decode on the full cache only")
        if st.lane in self.states or st.lane in self.checked:
            raise ValueError(f"lane {st.lane} already has a stream in the batch")
        self.states[st.lane] = st
        if st.warm_L is not None:
            self._warm.add(st.lane)
        self._members += 1
        self._iters.pop(st.lane, None)

    def leave(self, lane: int) -> None:
        """Take a stream out (cancelled): its lane is in no later step. A step launched ahead
        may still write the lane's K/V at its next position: harmless, whatever takes the lane
        next writes a position before it reads it (as with `DecodeState.discard`)."""
        self.states.pop(lane, None)
        self.checked.pop(lane, None)
        self._members += 1
        self._iters.pop(lane, None)

    def __bool__(self) -> bool:
        return bool(self.states) or bool(self.checked)

    def step(self) -> dict[int, Update]:
        """Hand every waiting stream the logits of its decided token, sample its next token,
        and return the new tokens: {lane: (ids, Finish or None)} (or the exception that ended
        that stream alone); a finished stream has left. The plain streams' step
        (`_step_plain`), then the checked streams' (`_step_checked`)."""
        updates = self._step_plain()
        if self.checked:
            checked = self._step_checked()
            self.rows_stepped += len(checked)
            updates.update(checked)
        return updates

    def _step_plain(self) -> dict[int, Update]:
        """`step` for the plain streams (`states`).

        Pipelined: the forward for the tokens sampled here is launched before the host reads
        them (they feed it on the device), so on CUDA the device runs step t while the host
        handles the tokens of step t - 1. The next call uses that forward's logits; a stream
        that joined meanwhile runs its first token in the forward after. A stream whose token
        reaches max_tokens is left out of the launch; one that samples a stop token has its
        row dropped. The tokens, logits and stats are those of the plain loop."""
        self.rows_stepped = 0
        if not self.states:
            if self._ahead is not None and callable(self._ahead[0]):
                self._ahead[0]()  # a launch whose streams all left: its work is still counted
            self._ahead = None
            self.runner.release(self._last)
            self._last = None
            return {}
        try:
            if self._ahead is None:
                self._launch({})
            ran, out, solo, self.rows_stepped = self._ahead
            self._ahead = None
            steady = self._steady
            if callable(ran) and steady is not None and steady.out is out:
                ran.resolve()
                # the same streams, and each whose token ended may take the token after next
                if (steady.members == self._members and len(self.states) == len(steady.lanes)
                        and all(st.generated + 1 < st.req.max_tokens
                                for st, f in zip(steady.sts, out.finished) if f)):
                    return self._step_steady(steady)
            if callable(ran):  # an interleaved launch with exit rules: its ends are read now
                ran = ran()
            # a stream that left meanwhile is dropped (its lane may hold a new stream already)
            rows = [(row, lane) for row, lane, st in ran if self.states.get(lane) is st]
            if not rows:
                return {}
            lanes = [lane for _, lane in rows]
            self.steps += 1
            self.lane_steps += len(lanes)
            if solo:
                # a lone stream steps as it would alone (DecodeState's pipelined calls): a greedy
                # token is the step's own argmax, and a graph step already fed it into its next
                # replay and wrote it to the host
                st = self.states[lanes[0]]
                st.advanced(out)
                failed = {}
                try:
                    tok = st.sample()
                    st.copy_to_host(tok)
                    go_on = {lanes[0]: tok} if st.generated + 1 < st.req.max_tokens else {}
                except Exception as e:  # this stream's sampling alone: the streams joined since go on
                    failed, go_on = {lanes[0]: e}, {}
            else:
                # the rows are read (sampled) before the next launch overwrites the step's
                # buffers, and not after: the launch lets them go (`prev`) and copies nothing
                for row, lane in rows:
                    self.states[lane].advanced(out.row(row))
                toks, failed = self._sample([self.states[lane] for lane in lanes], out, [row for row, _ in rows])
                self._copy_to_host(toks)
                # each stream that goes on: its row of toks (no per-row tensor: one gather, if any)
                go_on = {lane: i for i, lane in enumerate(lanes) if lane not in failed
                         and self.states[lane].generated + 1 < self.states[lane].req.max_tokens}
            if go_on or len(self.states) > len(lanes):  # or streams joined since: their first token
                self._launch(go_on, skip=set(lanes) - set(go_on), values=None if solo else toks)
            if not solo:
                toks_h = self._host_tokens(len(lanes))
            else:
                toks_h = [-1] if failed else [st.host_token()]
        except Exception:
            self._ahead = None
            raise
        out: dict[int, Update] = {}
        for lane, t in zip(lanes, toks_h):
            st = self.states[lane]
            if lane in failed:  # its update is the error; the stream has left
                out[lane] = failed[lane]
                self.runner.release(st.out)
                del self.states[lane]
                self._members += 1
            elif st.accept(t):
                out[lane] = [t], None
            else:
                out[lane] = [t], st.finish()
                del self.states[lane]
                self._members += 1
        return out

    def _step_checked(self) -> dict[int, Update]:
        """One step of every checked stream (the module docstring): per window, one eager
        decode of its streams' decided tokens (each row at its own depth: L scheduling's
        warm-up included, its extension run first), their next tokens sampled in one call and
        read with their norms in one host read. A row whose norm passes its threshold ends its
        stream with no token (`DecodeState.decide`'s rule); a failed decode fails its window's
        streams, a failed sampling call its sampled streams, and the others go on."""
        groups: dict[int, list[DecodeState]] = {}
        for st in self.checked.values():
            groups.setdefault(st.req.window, []).append(st)
        updates: dict[int, Update] = {}
        for window, sts in groups.items():
            try:
                for st in sts:
                    st.extend_warmup()  # a stream whose first step at its full depth is this one
                out = self.runner.decode([st.lane for st in sts], [st.tok_id for st in sts], [st.pos for st in sts],
                                         [st.step_loops for st in sts], window,
                                         any(st.req.safety_threshold is not None for st in sts))
                out.resolve()
            except Exception as e:  # the shared step: each of its streams ends with its error
                for st in sts:
                    updates[st.lane] = e
                    del self.checked[st.lane]
                continue
            self.steps += 1
            self.lane_steps += len(sts)
            for row, st in enumerate(sts):
                st.advanced(out.row(row))
            rows = list(range(len(sts)))
            toks, failed = self._sample(sts, out, rows)
            if out.norm is not None:
                toks_h, norms = torch.stack([toks.double(), out.norm[:len(sts)].double()]).tolist()
            else:
                toks_h, norms = toks.tolist(), None
            for row, st in enumerate(sts):
                lane = st.lane
                if lane in failed:
                    updates[lane] = failed[lane]
                    self.runner.release(st.out)
                    del self.checked[lane]
                    continue
                limit = st.req.safety_threshold
                if limit is not None and norms[row] > limit:
                    st.reason = FINISH_SAFETY  # the token of an unsafe step is dropped
                    updates[lane] = [], st.finish()
                    del self.checked[lane]
                    continue
                t = int(toks_h[row])
                if st.accept(t):
                    updates[lane] = [t], None
                else:
                    updates[lane] = [t], st.finish()
                    del self.checked[lane]
        return updates

    def _step_steady(self, steady: "_Steady") -> dict[int, Update]:
        """`step` for an exit launch of the same plain greedy streams still waiting, none at its
        last token: the same rows launch again at once, each whose token ended at its next
        position with its greedy token on the device, each other going on with its token from
        where it stopped (the runner moves them on on the device: `Runner.interleave`), and the
        streams whose token ended take it after, while it runs. The tokens, logits and stats are
        those of `step`'s general path."""
        out, lanes, sts = steady.out, steady.lanes, steady.sts
        B = len(lanes)
        fin = out.finished
        ended = [row for row in range(B) if fin[row]]
        if ended:
            self.steps += 1
            self.lane_steps += len(ended)
        self.rows_stepped = B
        toks = out.greedy[:B]  # read by the next launch's load, before its passes overwrite it
        if steady.hist is None:  # the first repeat: the depths before the launch in flight
            steady.hist = np.full((B, EXIT_HISTORY), -1, dtype=np.int64)
            steady.turn = np.zeros(B, dtype=np.int64)
            for row, st in enumerate(sts):
                back = st.step_depths[-(EXIT_HISTORY - 1):]
                steady.hist[row, :len(back)] = back
                steady.turn[row] = len(back)
        starts = [0 if f else s + steady.passes for s, f in zip(steady.starts, fin)]
        if ended:
            idx = np.asarray(ended)
            steady.hist[idx, steady.turn[idx]] = np.asarray(out.depths)[idx]
            steady.turn[idx] = (steady.turn[idx] + 1) % EXIT_HISTORY
        # expected_remaining of each row from where it stands
        guess, start, depth = steady.hist.max(axis=1), np.asarray(starts), np.asarray(steady.depths)
        expected = (np.where(guess > start, guess, depth) - start).tolist()
        passes = chunk_passes(expected, self.runner.pass_overhead + self.host_cost.passes)
        positions = [p + 1 if f else p for p, f in zip(steady.positions, fin)]
        for row in ended:  # handed their rows before the next launch overwrites the buffers they view
            sts[row].advanced(out.row(row))
        rows = steady.rows
        nxt = self.runner.interleave(lanes, steady.tokens, positions, steady.depths, starts, passes,
                                     on_device=DeviceTokens(rows, toks, rows), prev=self._last, exits=steady.rules)
        self._last = nxt
        self._ahead = (self._ends(nxt, lanes, sts, starts, passes, steady.rules), nxt, False, B)
        steady.out, steady.positions, steady.starts, steady.passes = nxt, positions, starts, passes
        self._steady = steady
        # the rows midway through a token, as `_ends` leaves them (the general path reads them)
        self._iters.clear()
        self._iters.update((lane, s) for lane, s in zip(lanes, starts) if s)
        updates: dict[int, Update] = {}
        if ended:
            host = out.greedy_host  # read with the launch's ends
            for row in ended:
                lane, st, t = lanes[row], sts[row], host[row]
                if st.accept(t):
                    updates[lane] = [t], None
                else:  # a stop token: its row in the launch just made runs on, unread
                    updates[lane] = [t], st.finish()
                    del self.states[lane]
                    self._members += 1
        return updates

    def _launch(self, on_device: dict, skip: frozenset | set = frozenset(),
                values: torch.Tensor | None = None) -> None:
        """Launch the step of every waiting stream but `skip`. A stream's token is its decided
        token on the host, or one sampled on the device and not read yet (it then runs at the
        position after the one its host state last ran): on_device[lane], a one-element device
        tensor, or with `values` values[on_device[lane]]."""
        lanes = [lane for lane in self.states if lane not in skip]
        rules = [self.states[lane].req.early_exit for lane in lanes]
        exiting = any(r is not None for r in rules)
        # L scheduling's warm-up steps run whole tokens: each keeps its residual for the extension
        warming = bool(self._warm) and self._still_warming()
        # exit rules checked inside interleaved passes: every rule can be, and rows share a launch
        exit_interleaved = (self.interleave_exits and exiting and not warming
                            and all(r is None or r.interleaves for r in rules) and (len(lanes) > 1 or bool(self._iters)))
        if self._iters and not exit_interleaved and (exiting or warming or not self.interleave):
            # rows midway through a token finish it first: the plain (exit) step runs whole tokens
            self._launch_interleaved(sorted(self._iters), on_device, values, drain=True)
            return
        depth = ({lane: self.states[lane].step_loops for lane in lanes} if warming else
                 {lane: self.states[lane].req.loops for lane in lanes})
        mixed = len(set(depth.values())) > 1
        if exit_interleaved or (self.interleave and not exiting and not warming and (self._iters or mixed)):
            self._launch_interleaved(sorted(lanes), on_device, values)
            return
        # deepest first: the runner then runs each iteration over the rows that need it only
        lanes.sort(key=lambda lane: (-depth[lane], lane))
        sts = [self.states[lane] for lane in lanes]
        if warming:
            for st in sts:
                st.extend_warmup()  # a stream whose first step at its full depth is this one
        dev = self._device_tokens(lanes, on_device, values)
        exits = [st.req.early_exit for st in sts] if exiting else None
        out = self.runner.decode(lanes, [st.tok_id for st in sts], [st.pos for st in sts],
                                 [depth[lane] for lane in lanes], on_device=dev, prev=self._last, exits=exits)
        self._last = out
        self._ahead = ([(row, lane, self.states[lane]) for row, lane in enumerate(lanes)], out, len(lanes) == 1,
                       len(lanes))

    def _still_warming(self) -> bool:
        """Whether a stream of the batch is in L scheduling's warm-up (`_warm`: the lanes of
        streams that joined with one, pruned here once their warm-up is over or they left)."""
        self._warm = {lane for lane in self._warm if (st := self.states.get(lane)) is not None and st.warming}
        return bool(self._warm)

    def _launch_interleaved(self, lanes: list[int], on_device: dict, values: torch.Tensor | None,
                            drain: bool = False) -> None:
        """An interleaved launch over `lanes` (tokens as `_launch`'s): each row from where its
        token stands, for `chunk_passes` passes (drain: as many as the longest remainder, so
        that every row's token ends). The rows whose token ends come back with logits. A row
        with an exit rule counts, for the choice of passes, on `expected_remaining`."""
        sts = [self.states[lane] for lane in lanes]
        iters = self._iters
        starts, depths, rules, expected, tokens, positions = [], [], [], [], [], []
        for lane, st in zip(lanes, sts):  # one pass over the rows: a launch's host time is per row
            req = st.req
            s, d, r = iters.get(lane, 0), req.loops, req.early_exit
            starts.append(s)
            depths.append(d)
            rules.append(r)
            expected.append(d - s if r is None else expected_remaining(st.step_depths, d, s))
            tokens.append(st.tok_id if s == 0 else 0)
            positions.append(st.pos)
        exits = rules if any(r is not None for r in rules) else None
        overhead = self.runner.pass_overhead
        passes = (max(d - s for d, s in zip(depths, starts)) if drain else
                  chunk_passes(expected, overhead + (self.host_cost.passes if exits else 0.0)))
        out = self.runner.interleave(lanes, tokens, positions, depths, starts, passes,
                                     on_device=self._device_tokens(lanes, on_device, values), prev=self._last,
                                     exits=exits)
        self._last = out
        self._steady = None
        if exits is not None and not drain and all(st.plain_greedy for st in sts):
            # the next launch may be these rows again, moved on on the device (`_step_steady`)
            self._steady = _Steady(out, lanes, sts, depths, rules, positions, starts, passes, self._members)
        self._ahead = (self._ends(out, lanes, sts, starts, passes, exits), out, False, len(lanes))

    def _ends(self, out: StepOut, lanes: list[int], sts: list[DecodeState], starts: list[int], passes: int,
              exits) -> Callable[[], list] | list:
        """The rows of an interleaved launch whose token ended, as `step` reads them: with exit
        rules a callable that waits for the launch's ends (the host prepares meanwhile), else
        the list. A row whose token did not end has its iterations so far in `_iters`."""
        overhead = self.runner.pass_overhead
        launched, since = time.perf_counter(), self._ends_read
        self._ends_read = None
        read = False  # resolve runs once

        def resolve() -> None:
            nonlocal read
            if read:
                return
            read = True
            out.resolve()
            self._ends_read = time.perf_counter()
            if out.timing is not None and since is not None:
                start, end = out.timing
                self.host_cost.update(launched - since, start.elapsed_time(end) / 1e3, passes + overhead)

        def ended() -> list:
            """The rows whose token ended (the others' iterations so far into `_iters`)."""
            resolve()
            ran = []
            for row, (lane, st, s) in enumerate(zip(lanes, sts, starts)):
                if self.states.get(lane) is not st:  # left meanwhile (its lane may hold a new stream)
                    continue
                if out.finished[row]:
                    ran.append((row, lane, st))
                    self._iters.pop(lane, None)
                else:
                    self._iters[lane] = s + passes
            return ran
        ended.resolve = resolve
        # with exit rules the ends are on the device until the next step reads them; the host
        # prepares meanwhile, and `_iters` is exact again before the next launch
        return ended if exits is not None else ended()

    @staticmethod
    def _device_tokens(lanes: list[int], on_device: dict, values: torch.Tensor | None) -> DeviceTokens | None:
        rows = [i for i, lane in enumerate(lanes) if lane in on_device]
        if values is None:
            return DeviceTokens.of({i: on_device[lanes[i]] for i in rows})
        return DeviceTokens(rows, values, [on_device[lanes[i]] for i in rows]) if rows else None

    def _sample(self, sts: list[DecodeState], out: StepOut, step_rows: list[int]) -> tuple[torch.Tensor, dict]:
        """Every stream's next token (len(sts),) on the device from its logits. Greedy rows
        with no penalty take the step's own argmax (`out.greedy`, whose row step_rows[i] is
        sts[i]'s: a stream that left drops its row); every other row samples in one
        `Runner.sample` call, each on its own parameters and key. If that call raises, its
        streams fail ({lane: the exception}; their rows hold token 0) and the plain greedy
        streams go on."""
        plain = [r for r, st in enumerate(sts) if st.plain_greedy]
        if len(plain) == len(sts):
            if step_rows == list(range(len(sts))):
                return out.greedy[:len(sts)], {}
            return out.greedy.index_select(0, self._to_device(step_rows)), {}
        kept = set(plain)
        rows = [r for r in range(len(sts)) if r not in kept]
        got, failed = None, {}
        try:
            got = self._sample_states([sts[r] for r in rows])
        except Exception as e:
            failed = {sts[r].lane: e for r in rows}
        if not plain and got is not None:
            return got, failed
        toks = torch.zeros(len(sts), dtype=torch.long, device=self.runner.device)
        if plain:
            toks.index_copy_(0, self._to_device(plain),
                              out.greedy.index_select(0, self._to_device([step_rows[r] for r in plain])))
        if got is not None:
            toks.index_copy_(0, self._to_device(rows), got)
        return toks, failed

    def _sample_states(self, sts: list[DecodeState]) -> torch.Tensor:
        """The next token of each stream from its logits, (len(sts),) on the device: one
        `Runner.sample` call, each row on its own parameters, key and penalty."""
        seen = None
        if any(st.req.sampling.repetition_penalty != 1.0 for st in sts):
            V = sts[0].logits.shape[-1]
            seen = torch.cat([st.seen if st.seen is not None else
                              torch.zeros(1, V, dtype=torch.bool, device=self.runner.device) for st in sts])
        return self.runner.sample(torch.cat([st.logits for st in sts]), seen, [st.req.sampling for st in sts],
                                  [st.req.seed for st in sts], [st.pos for st in sts])

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """A small int64 host list on the device without a host sync: a pageable copy would
        wait for the step launched ahead, and the pipelining would be lost."""
        return device_tensor(values, self.runner.device)

    def _copy_to_host(self, toks: torch.Tensor) -> None:
        """Start copying the tokens to the host (pinned buffer + event on CUDA), before the
        next step is launched behind them on the same stream."""
        if toks.device.type != "cuda":
            self._host = toks.clone()  # toks may view the step's buffers, which the next launch overwrites
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
