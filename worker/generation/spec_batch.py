"""Several speculative chain streams' rounds run together: `SpecBatch`.

Each member's round is the one its own `SpeculativeStream` would run (speculative.py's module
docstring): k + 1 draft steps at its draft_loops from its decided token t at pos, each keeping
its residual, then the verify of the chunk [t, d_1 .. d_k] over iterations [draft_loops,
verify_loops) and the coda from those residuals, then the acceptance. Here the members' rounds
share their runner calls:

- Draft step i of every member still drafting (k >= i) is one `Runner.decode`, each row on its
  own lane at its own position (pos + i) and depth (its draft_loops). A greedy row's token is
  its own argmax of the step before, a sampled row's its draft from the step before's logits
  (`SpeculativeStream.draft`: the draw of its position), both on the device, read only with
  the round's decision. The members run in decreasing k, so each step's rows are the first
  rows of the step before's: a member with fewer drafts (k is cut near max_tokens) leaves the
  steps after its k-th and writes nothing past its chunk.
- The verifies are one `Runner.verify_many` per group of members with the same (k,
  draft_loops, verify_loops): one pass runs one span of iterations over chunks of one length.
- The greedy members' drafts and verifier tokens, every group's, come to the host in one read;
  a sampled member's decision (`sampler.chain_verdict`, on the device) in one read of its own.
  Each member's acceptance, tokens, stats and end are its stream's own
  (`SpeculativeStream.accept`, `round_done`).

Exactness. A member's draft steps are the steps it takes alone (on the CPU a batched decode
step's row is bitwise the step alone: batcher.py), its verify reads the same cache and
residuals (verify_many's logits are `verify`'s up to rounding: a masked chunk attention
instead of the tree pass), and its random numbers are its positions': so its tokens are those
of its standalone run (greedy: generate's at verify_loops), and so are its Finish stats (each
row's work is counted as the stream alone counts it). A stream here runs host-driven rounds
even on a runner with device rounds (`SpeculativeStream._on_device`): the same tokens, its
drafted count the drafts it made.

Failures. An error in a runner call that rows share fails every member among its rows; an
error in one member's own host work (its sampled draft, its acceptance) fails that member
alone. A failed member's update is the exception, and it has left (its stream closed).

All calls run on one thread (the worker's step thread), one at a time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tinyloop.worker.generation.batcher import Update
from tinyloop.worker.generation.speculative import SpeculativeStream
from tinyloop.worker.runner.engine import Counters
from tinyloop.worker.runner.runner import ChunksOut, DeviceTokens, Runner
from tinyloop.worker.runner.stages import device_tensor


@dataclass(eq=False)
class _Round:
    """One member's round in a step: the stream's plan (t at pos, k drafts) and what the
    round gathers (its work, a sampled member's drafts' q, its verify's logits; the drafts
    themselves sit in the step's device tensor)."""
    st: SpeculativeStream
    t: int
    pos: int
    k: int
    work: Counters = field(default_factory=Counters)
    qs: list = field(default_factory=list)  # a sampled member's drafts' q, (V,) each
    logits: torch.Tensor | None = None  # (k + 1, V)

    @property
    def lane(self) -> int:
        return self.st.lane

    @property
    def span(self) -> tuple[int, int, int]:
        """What a verify_many group shares: (k, draft_loops, verify_loops)."""
        return self.k, self.st.spec.draft_loops, self.st.spec.verify_loops


class SpecBatch:
    """Speculative chain streams (greedy or sampled) whose rounds run together, one round of
    every member per `step`.

    A stream comes in once its first `next` has emitted its prefill's token and before its
    first round (`add`; `SpeculativeStream.check_batchable` says why one cannot), and from then
    on only the batch steps it: its tokens and its Finish come in `step`'s updates, never from
    its own `next`."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.streams: dict[int, SpeculativeStream] = {}  # lane -> member, in the order they came

    def eligible(self, stream: SpeculativeStream) -> bool:
        """Whether `add` takes the stream now."""
        try:
            self._check(stream)
        except ValueError:
            return False
        return True

    def add(self, stream: SpeculativeStream) -> None:
        """Take in a started chain stream (its prefill's token emitted, not at its end, no
        device round in flight) on a lane no member holds; ValueError with the reason
        otherwise. It runs its next round in the next `step`."""
        self._check(stream)
        self.streams[stream.lane] = stream

    def _check(self, stream) -> None:
        if not isinstance(stream, SpeculativeStream):
            raise ValueError(f"a SpecBatch takes SpeculativeStreams, got {type(stream).__name__}")
        if stream.runner is not self.runner:
            raise ValueError(f"lane {stream.lane}: the stream runs on another runner than the batch's")
        stream.check_batchable()
        if stream.lane in self.streams:
            raise ValueError(f"lane {stream.lane} already has a stream in the batch")

    def leave(self, lane: int) -> None:
        """Take a member out (cancelled): its stream is closed and in no later step. Nothing of
        its rounds is in flight between two steps."""
        st = self.streams.pop(lane, None)
        if st is not None:
            st.close()

    def take(self, lane: int) -> SpeculativeStream | None:
        """Take a member out as it stands between two steps, not closed (None: no member on
        the lane): a greedy one goes on as plain decoding (`SpeculativeStream.handoff`), with
        the tokens its rounds here would have decided."""
        return self.streams.pop(lane, None)

    def __bool__(self) -> bool:
        return bool(self.streams)

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def lanes(self) -> list[int]:
        return list(self.streams)

    def step(self) -> dict[int, Update]:
        """One round of every member: {lane: (the tokens it emits, its Finish or None)}, or
        {lane: the exception that ended it}; a member that finished or failed has left. The
        tokens are those its stream's own round would emit (max_tokens and stop ids applied)."""
        updates: dict[int, Update] = {}
        rounds = []
        for lane, st in list(self.streams.items()):
            try:
                rounds.append(_Round(st, *st.round_plan()))
            except Exception as e:
                self._fail(lane, e, updates)
        if not rounds:
            return updates
        # decreasing k: each draft step's rows are the first rows of the step before's; then
        # by span, so a verify group is a run of rounds (stable: otherwise in the order they came)
        rounds.sort(key=lambda r: (-r.k, r.span[1:]))
        residuals, drafts = self._draft(rounds, updates)
        groups = self._verify(rounds, residuals, updates)
        self._accept(rounds, drafts, groups, updates)
        return updates

    def _draft(self, rounds: list[_Round], updates: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every member's k + 1 draft steps, step i one decode over the rounds with k >= i ->
        (residuals (M, K + 1, D): round m's step i's residual at [m, i]; greedy drafts
        (M, max(K, 1)) on the device: round m's step i's argmax at [m, i]), K the largest k."""
        runner, K = self.runner, rounds[0].k
        residuals = drafts = out = None
        try:
            for i in range(K + 1):
                live = [m for m, r in enumerate(rounds) if r.k >= i and r.lane not in updates]
                if not live:
                    break
                # step 0 feeds each round's decided token; step i > 0 its draft i, on the device
                # (drafts[m, i - 1]: a greedy row's argmax, a sampled row's draw)
                tokens = [rounds[m].t if i == 0 else 0 for m in live]
                on_device = DeviceTokens(list(range(len(live))), drafts[:, i - 1], live) if i else None
                try:
                    out = runner.decode([rounds[m].lane for m in live], tokens, [rounds[m].pos + i for m in live],
                                        [rounds[m].st.spec.draft_loops for m in live], on_device=on_device, prev=out)
                except Exception as e:  # the later steps' rows are among these: the drafting ends
                    for m in live:
                        self._fail(rounds[m].lane, e, updates)
                    break
                if residuals is None:
                    residuals = out.residual.new_empty(len(rounds), K + 1, out.residual.shape[-1])
                    drafts = out.greedy.new_empty(len(rounds), max(K, 1))
                if live == list(range(len(live))):
                    residuals[:len(live), i] = out.residual[:, 0]
                    if i < K:
                        drafts[:len(live), i] = out.greedy
                else:  # a sampled member failed in an earlier step: its row is gone
                    idx = device_tensor(live, runner.device)
                    residuals[:, i].index_copy_(0, idx, out.residual[:, 0])
                    if i < K:
                        drafts[:, i].index_copy_(0, idx, out.greedy)
                for row, m in enumerate(live):
                    r = rounds[m]
                    it = out.row(row).iterations
                    r.work = r.work.plus(Counters(it, it))
                    if i < r.k and not r.st.greedy:
                        try:
                            drafts[m, i:i + 1], q = r.st.draft(out.logits[row], r.pos + i + 1)
                        except Exception as e:
                            self._fail(r.lane, e, updates)
                            continue
                        r.qs.append(q)
        finally:
            runner.release(out)  # the residuals are copied: the step's buffers are free
        return residuals, drafts

    def _verify(self, rounds: list[_Round], residuals: torch.Tensor | None,
                updates: dict) -> list[tuple[list[int], ChunksOut]]:
        """One verify_many per group of rounds with the same span (a run of the sorted rounds)
        -> [(the group's rounds, its output)]; each round gets its logits and its row's work."""
        groups = []
        for (k, Ld, Lv), ms in itertools.groupby(range(len(rounds)), key=lambda m: rounds[m].span):
            ms = [m for m in ms if rounds[m].lane not in updates]
            if not ms:
                continue
            if ms == list(range(ms[0], ms[-1] + 1)):
                x = residuals[ms[0]:ms[-1] + 1, :k + 1]
            else:
                x = residuals.index_select(0, device_tensor(ms, self.runner.device))[:, :k + 1]
            try:
                out = self.runner.verify_many([rounds[m].lane for m in ms], x, [rounds[m].pos for m in ms], Ld, Lv)
            except Exception as e:
                for m in ms:
                    self._fail(rounds[m].lane, e, updates)
                continue
            for b, m in enumerate(ms):
                rounds[m].logits = out.logits[b]
                rounds[m].work = rounds[m].work.plus(out.works[b])
            groups.append((ms, out))
        return groups

    def _accept(self, rounds: list[_Round], drafts: torch.Tensor | None,
                groups: list[tuple[list[int], ChunksOut]], updates: dict) -> None:
        """Each verified member's decision, its stream's tokens and end. The greedy members'
        drafts and verifier tokens come to the host in one read (a group's rows all, for
        one slice each)."""
        pieces, read = [], []
        for ms, out in groups:
            if any(rounds[m].st.greedy for m in ms):
                k = rounds[ms[0]].k
                rows = (drafts[ms[0]:ms[-1] + 1] if ms == list(range(ms[0], ms[-1] + 1))
                        else drafts.index_select(0, device_tensor(ms, self.runner.device)))
                pieces += [rows[:, :k].reshape(-1), out.logits.argmax(-1).reshape(-1)]
                read.append((ms, k))
        host: dict[int, tuple[list[int], list[int]]] = {}  # round -> (drafts, verifier tokens)
        if pieces:
            try:
                vals = torch.cat(pieces).tolist()
            except Exception as e:
                for ms, _ in read:
                    for m in ms:
                        self._fail(rounds[m].lane, e, updates)
                vals = None
            at = 0
            for ms, k in read if vals is not None else ():
                B = len(ms)
                d, t = vals[at:at + B * k], vals[at + B * k:at + B * (2 * k + 1)]
                at += B * (2 * k + 1)
                for b, m in enumerate(ms):
                    host[m] = d[b * k:(b + 1) * k], t[b * (k + 1):(b + 1) * (k + 1)]
        for ms, _ in groups:
            for m in ms:
                r = rounds[m]
                if r.lane in updates:
                    continue
                try:
                    if r.st.greedy:
                        d, t = host[m]
                        toks, n_acc = r.st.accept(r.pos, d, None, None, t)
                    else:
                        toks, n_acc = r.st.accept(r.pos, drafts[m, :r.k], r.qs, r.logits, None)
                    emitted, finish = r.st.round_done(toks, r.k, n_acc, r.work)
                except Exception as e:
                    self._fail(r.lane, e, updates)
                    continue
                updates[r.lane] = emitted, finish
                if finish is not None:
                    del self.streams[r.lane]

    def _fail(self, lane: int, e: Exception, updates: dict) -> None:
        updates[lane] = e
        st = self.streams.pop(lane, None)
        if st is not None:
            st.close()
