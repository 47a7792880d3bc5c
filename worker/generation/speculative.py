"""Self-speculative decoding: the draft model is the same model at a shallower depth.

Chain. A round starts at position p with the token t_p already decided (emitted) but not yet
fed. The draft feeds t_p, d_1, ..., d_{k-1} one decode step at a time at `draft_loops` (L_d),
each step drafting the next token from its L_d logits, then feeds d_k through iterations
[0, L_d) only. Every step keeps its residual after L_d iterations.

Warm-start verification. Iteration i of a token reads only tokens <= it at iterations <= i, with
the weights every iteration shares, so the draft's cache layers [0, L_d) for the chunk
[t_p, d_1 .. d_k] are exactly the layers a verify at `verify_loops` (L_v) would write for the
tokens that get accepted. Verify therefore runs only iterations [L_d, L_v) over the chunk, from
the saved residuals, then the coda and the logits at every chunk position: each chunk token runs
L_v iterations in total, never more (the runner's counters prove it). Verifier logits at p + i
decide position p + i + 1: accept while the verifier's token equals the draft; the verifier's
token at the first mismatch (or the bonus after a fully accepted chunk) is the round's last
token and the next round's t_p.

Tree. K branches: branch b starts from the b-th most likely draft token after t_p, then a greedy
chain, k tokens deep. The 1 + K·k nodes sit in the cache breadth first after the prefix (node 0
is t_p at slot p, depth-i node of branch b at slot p + 1 + (i - 1)·K + b), so the nodes drafted
so far always fill a contiguous run of slots. One tree pass per depth drafts all branches; one
tree pass over every node verifies them all (compact mask: an int64 ancestor bitmask per node).
The accepted path's K / V then move from node slots to their linear slots p + depth in every
cache layer the verifier uses. With K = 1 the layout is the chain's.

Rollback. The cache is position addressed and every read is bounded by the reader's position
(or the nodes written so far), so K / V left by rejected tokens are overwritten before anything
reads them; nothing is copied back.

Handoff. Between two rounds the state is the one plain decoding at verify_loops would have:
t decided at p, every position < p holding K / V at all verify_loops iterations (the prefill
ran at verify_loops; a round's drafts wrote [0, L_d) of the accepted positions and the verify
[L_d, L_v) and the coda). A greedy stream (`SpeculativeStream`) can therefore end there and go
on as a plain `DecodeState` whose decided token waits to run (`SpeculativeStream.handoff`),
nothing recomputed: so the worker's scheduler moves it into its batched step once busy.

Batched rounds. Several chain streams' rounds can share their runner calls (`SpecBatch`,
spec_batch.py: each draft step index one decode over the members, their verifies one
`Runner.verify_many` pass); each stream's decisions, stats and end are still its own
(`round_plan`, `accept`, `round_done`), so its tokens are its standalone run's.

Sampling (temperature > 0). Chain: speculative sampling (Leviathan et al. 2023; Chen et al.
2023): d ~ q, accept with min(1, p(d) / q(d)), else draw from normalize(max(0, p - q)); the
emitted token is distributed as p. Tree: the K first tokens are deterministic proposals (top-K
of q), i.e. point masses; the multi-candidate form of the same rule (accept candidate x with
p'(x), else remove it from p' and renormalise, then draw from what is left) emits a token
distributed exactly as p, and in law it is a single draw y ~ p followed by "accept the child
whose token is y". That draw is the plain sampler's own (STREAM_TOKEN at the position), so a
seeded tree run emits the same tokens as a seeded `generate` at verify_loops. Every random
number is sampling.uniform(seed, absolute position, stream): reproducible on any path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tinyloop.kernels.tree_attention import MAX_NODES
from tinyloop.worker.generation.decode import FINISH_LENGTH, FINISH_STOP, DecodeState, Finish, Request
from tinyloop.worker.runner.sampler import STREAM_TOKEN, SamplingParams, chain_verdict, draw, probs, uniform
from tinyloop.worker.runner.engine import Counters
from tinyloop.worker.runner.runner import RoundOut, Runner, StepOut
from tinyloop.worker.runner.stages import TreeStages

MAX_DRAFT_AHEAD = 16
MAX_BRANCHES = 8


@dataclass(frozen=True)
class SpecParams:
    draft_loops: int
    verify_loops: int
    draft_ahead: int
    k_branches: int = 1
    tree: bool = False   # False: the chain path (k_branches must be 1); True: tree passes

    def check(self, max_loops: int) -> "SpecParams":
        """Raise ValueError with the argument's name and the reason."""
        for name in ("draft_loops", "verify_loops", "draft_ahead", "k_branches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an int, got {type(v).__name__}")
        if self.draft_loops < 1:
            raise ValueError(f"draft_loops must be >= 1, got {self.draft_loops}")
        if self.verify_loops > max_loops:
            raise ValueError(f"verify_loops={self.verify_loops} exceeds max_loops={max_loops}")
        if self.draft_loops >= self.verify_loops:
            raise ValueError(f"draft_loops={self.draft_loops} must be < verify_loops={self.verify_loops}")
        if not 1 <= self.draft_ahead <= MAX_DRAFT_AHEAD:
            raise ValueError(f"draft_ahead={self.draft_ahead} out of range [1, {MAX_DRAFT_AHEAD}]")
        if not 1 <= self.k_branches <= MAX_BRANCHES:
            raise ValueError(f"K_branches={self.k_branches} out of range [1, {MAX_BRANCHES}]")
        if not self.tree and self.k_branches != 1:
            raise ValueError("the chain path takes k_branches=1; use the tree path for more branches")
        if 1 + self.k_branches * self.draft_ahead > MAX_NODES:
            raise ValueError(f"a tree of 1 + K_branches·draft_ahead = {1 + self.k_branches * self.draft_ahead} "
                             f"nodes exceeds the {MAX_NODES} the tree mask holds")
        return self


class _Chooser:
    """The verifier's and the draft's token choices at absolute positions, for one request.
    fused: the sampler's launches (Settings.fused_sampler, the runner's), as the device rounds
    and plain sampling take them, so every path draws alike."""

    def __init__(self, sampling: SamplingParams, seed: int, device, fused: bool = False):
        self.sp, self.fused = sampling, fused
        self.greedy = sampling.greedy
        self.seed = torch.tensor([seed], device=device)
        self.device = device

    def _u(self, pos: int, stream: int) -> torch.Tensor:
        return uniform(self.seed, torch.tensor([pos], device=self.device), stream)

    def targets(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`target` of every row at once, on the device: logits (N, V), positions (N,) ->
        (N,) tokens (the argmax, or row n's STREAM_TOKEN draw at positions[n] from its p)."""
        if self.greedy:
            return logits.argmax(-1)
        return draw(probs(logits, self.sp, self.fused),
                    uniform(self.seed.expand(len(positions)), positions, STREAM_TOKEN), self.fused)

    def target(self, logits: torch.Tensor, pos: int) -> int:
        """The plain sampler's token at `pos` (argmax, or the STREAM_TOKEN draw from p)."""
        return int(self.targets(logits.view(1, -1), torch.tensor([pos], device=self.device))[0])

    def draft_on_device(self, logits: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled chain draft at `pos` from a draft step's logits (V,), left on the device:
        (its token (1,), its distribution q (V,))."""
        q = probs(logits.view(1, -1), self.sp, self.fused)
        return draw(q, self._u(pos, STREAM_TOKEN), self.fused), q[0]

    def verdict(self, logits: torch.Tensor, qs: torch.Tensor, drafts: torch.Tensor, pos: int) -> tuple[list[int], int]:
        """A sampled chain's decision (`sampler.chain_verdict`) on the device, read in one
        transfer: the verifier's logits (k + 1, V) over the chunk whose first token sits at pos,
        the drafts' q (k, V) and tokens (k,) -> (the round's tokens, drafts accepted)."""
        k = len(drafts)
        n, targets = chain_verdict(probs(logits, self.sp, self.fused), qs, drafts, self.seed,
                                   torch.arange(pos + 1, pos + k + 2, device=self.device), self.fused)
        both = torch.cat([n.view(1), targets]).tolist()
        return both[1:both[0] + 2], both[0]


class _Emitter:
    """Counts emitted tokens against max_tokens and stop ids; truncates a round's tokens."""

    def __init__(self, req: Request):
        self.req = req
        self.generated = 0
        self.reason: str | None = None

    def take(self, tokens: list[int]) -> list[int]:
        out = []
        for t in tokens:
            out.append(t)
            self.generated += 1
            if t in self.req.stop_ids:
                self.reason = FINISH_STOP
                break
            if self.generated >= self.req.max_tokens:
                self.reason = FINISH_LENGTH
                break
        return out


# -- the stream ----------------------------------------------------------------------------
def stream_speculative(runner: Runner, lane: int, req: Request, spec: SpecParams) -> "SpeculativeStream":
    """Prefill at verify_loops, then chain or tree rounds; yields each verify's tokens."""
    return SpeculativeStream(runner, lane, req, spec)


class SpeculativeStream:
    """One speculative stream on a cache lane, with the protocol of a plain `TokenStream`: each
    `next` yields the tokens it decided (the first: the prefill's token; then one round's), and
    the end raises StopIteration whose value is the `Finish`. Nothing runs before the first
    `next` (like a generator: the prefill is the first step).

    Handoff (the module's docstring): between two items, a greedy stream can end and go on as
    plain decoding at verify_loops from its decided token (`handoff`), which decides the tokens
    its rounds would have (greedy speculative output is generate's at verify_loops); the
    worker's scheduler does so once the worker is busy. Greedy only: a sampled chain's tokens
    are distributed as plain decoding's but are other draws (its accept / residual numbers),
    so handing it over would change its tokens mid-stream.

    Batched (chain streams, greedy or sampled): once its first `next` has emitted the
    prefill's token, a `SpecBatch` may run its rounds with other streams' (`check_batchable`);
    from then on the batch alone steps it, through `round_plan`, `draft`, `accept` and
    `round_done`, the pieces of its own chain round."""

    def __init__(self, runner: Runner, lane: int, req: Request, spec: SpecParams):
        self.runner, self.lane, self.req, self.spec = runner, lane, req, spec
        self._chooser = _Chooser(req.sampling, req.seed, runner.device, runner.settings.fused_sampler)
        self._emit = _Emitter(req)
        self._work = Counters()
        self._rounds = self._drafted = self._accepted = 0
        self._t: int | None = None          # the last emitted token, decided at _pos, not yet fed
        self._pos = len(req.prompt)
        self._last: StepOut | None = None   # the last draft step's outputs, let go at the next round
        self._over = False                  # finished, failed, closed or handed over
        self._ahead: RoundOut | None = None  # a device round launched, not read yet (_device_round)

    def __iter__(self) -> "SpeculativeStream":
        return self

    def __next__(self) -> list[int]:
        if self._over:
            raise StopIteration  # as a generator after its return
        if self._emit.reason is not None:
            raise StopIteration(self._finish())
        try:
            return self._emit.take(self._step())
        except BaseException:
            self._end()
            raise

    def close(self) -> None:
        """Stop here (cancelled): the stream lets go of what it holds and yields nothing more."""
        self._end()

    def _finish(self) -> Finish:
        """End the stream that reached max_tokens or a stop id: its Finish."""
        self._end()
        return Finish(self._emit.reason, {
            "prompt_tokens": len(self.req.prompt), "completion_tokens": self._emit.generated,
            "loop_iterations": self._work.loop_iterations,
            "loop_token_iterations": self._work.loop_token_iterations, **self.stats()})

    def _end(self) -> None:
        self._over = True
        self.runner.release(self._last)
        self._last = None
        self._ahead = None  # a round launched ahead runs on; what it writes is past what was decided

    def _step(self) -> list[int]:
        """The prefill's token, or one round's tokens (before max_tokens / stop truncate them)."""
        runner, spec, req = self.runner, self.spec, self.req
        if self._t is None:
            first = runner.prefill(self.lane, req.prompt, spec.verify_loops)
            self._work = first.work
            self._t = self._chooser.target(first.logits[0], self._pos)
            return [self._t]
        if self._on_device():
            toks, n_acc, w, k = self._device_round()
            return self._account(toks, k, n_acc, w)
        k = self._round_k()
        t, pos = self._t, self._pos
        if spec.tree:  # side branches sit past the linear positions: keep every node inside the cache
            k = min(k, (runner.cache.max_seq_len - pos - 1) // spec.k_branches)
            toks, n_acc, w = _tree_round(runner, self.lane, spec, self._chooser, t, pos, k)
        else:
            toks, n_acc, w, self._last = _chain_round(runner, self.lane, spec, self._chooser, t, pos, k,
                                                      self._last)
        return self._account(toks, k, n_acc, w)

    def _round_k(self) -> int:
        """The drafts of the next round: never past what max_tokens can still use (a round
        emits at most k + 1 tokens)."""
        return min(self.spec.draft_ahead, self.req.max_tokens - self._emit.generated - 1)

    def _account(self, toks: list[int], drafted: int, n_acc: int, work: Counters) -> list[int]:
        """A round that decided `toks` from `drafted` drafts, n_acc of them accepted, with
        `work`: the stats, and the decided token (toks[-1]) at its position. -> toks."""
        self._work = self._work.plus(work)
        self._rounds += 1
        self._drafted += drafted
        self._accepted += n_acc
        self._pos += len(toks)
        self._t = toks[-1]
        return toks

    def _on_device(self) -> bool:
        """Whether the next round runs whole on the device: a chain, greedy or sampled, with no
        repetition penalty (it reads the tokens so far), on a runner with device rounds, whose
        round stays inside the cache. A sampled round drafts what the host-driven round would
        (`_round_k`: its tokens depend on where the drafts stop), so one with nothing left to
        draft runs on the host."""
        spec, sp = self.spec, self.req.sampling
        if not self.runner.settings.device_rounds or spec.tree or sp.repetition_penalty != 1.0:
            return False
        if self._ahead is not None:
            return True
        k = spec.draft_ahead if sp.greedy else self._round_k()
        return k >= 1 and self.runner.round_fits(self._pos, k)

    def _device_round(self) -> tuple[list[int], int, Counters, int]:
        """One round on the device (runner.chain_round), its tokens read while the next round,
        launched first, runs: the next one starts where this one leaves the lane, so the GPU
        does not wait for the host between rounds. It is launched only where it can be needed
        (this round cannot reach max_tokens) and fits the cache; a stream that ends leaves it
        running unread (it writes only positions past what was decided).
        -> (the round's tokens, drafts accepted, its work, its drafts). A greedy round always drafts
        k = draft_ahead tokens (the emitter cuts what max_tokens does not take: the verifier's
        argmax decides the same tokens whatever k is). A sampled round drafts `_round_k`, as the
        host-driven round does, since a position's token depends on whether it is a draft's
        acceptance or the bonus draw; its next round is launched ahead only where that one too
        drafts draft_ahead whatever this one accepts."""
        runner, spec, sp = self.runner, self.spec, self.req.sampling
        D = spec.draft_ahead
        k = D if sp.greedy or self._ahead is not None else self._round_k()
        cur = self._ahead or runner.chain_round(self.lane, spec.draft_loops, spec.verify_loops, k,
                                                state=(self._t, self._pos), sampling=sp, seed=self.req.seed)
        self._ahead = None
        # the next round starts at most k + 1 positions on and writes k + 1 more
        left = self.req.max_tokens - self._emit.generated - (k + 1)   # tokens left after this round, at least
        if (left > 0 if sp.greedy else k == D and left - 1 >= D) and runner.round_fits(self._pos, k, rounds=2):
            self._ahead = runner.chain_round(self.lane, spec.draft_loops, spec.verify_loops, D, sampling=sp)
        n, toks = cur.result()
        return toks, n, cur.work, cur.k

    def stats(self) -> dict:
        """The speculative figures so far (the Finish's stats beside the token and work counts)."""
        rounds, drafted, accepted, spec = self._rounds, self._drafted, self._accepted, self.spec
        return {
            "verify_steps": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "accepted_per_verify": accepted / rounds if rounds else 0.0,
            "tokens_per_verify": (self._emit.generated - 1) / rounds if rounds else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "draft_loops": spec.draft_loops, "verify_loops": spec.verify_loops,
            "draft_ahead": spec.draft_ahead, "k_branches": spec.k_branches,
        }

    # -- rounds run by a SpecBatch (spec_batch.py): the same decisions and stats as `next` ------
    def check_batchable(self) -> None:
        """ValueError (the reason) unless a SpecBatch may run this stream's rounds now: a chain
        stream that has emitted its prefill's token, goes on, and has no device round in flight
        (`_ahead`: one launched ahead writes positions past what was decided and would be read
        by no one; a stream that has not run a round yet has none)."""
        if self.spec.tree:
            raise ValueError(f"lane {self.lane}: a tree stream (k_branches={self.spec.k_branches}) steps alone; "
                             "a SpecBatch takes chain streams")
        if self._over:
            raise ValueError(f"lane {self.lane}: the stream is over (finished, failed, closed or handed over)")
        if self._t is None:
            raise ValueError(f"lane {self.lane}: the stream has not emitted its prefill's token yet "
                             "(its first next() runs the prefill)")
        if self._emit.reason is not None:
            raise ValueError(f"lane {self.lane}: the stream has reached its end ({self._emit.reason}); "
                             "its next() gives the Finish")
        if self._ahead is not None:
            raise ValueError(f"lane {self.lane}: the stream has a device round in flight; "
                             "add it to a SpecBatch before its first round")

    @property
    def greedy(self) -> bool:
        return self._chooser.greedy

    def round_plan(self) -> tuple[int, int, int]:
        """The next chain round run elsewhere: (t, pos, k), the decided token and its position
        and the drafts to make, the chunk [t, d_1 .. d_k] at positions [pos, pos + k]. The
        stream lets go of its own last draft step (the batch's steps are others). ValueError
        when the chunk would pass the cache's end."""
        k, pos, S = self._round_k(), self._pos, self.runner.cache.max_seq_len
        if pos + k + 1 > S:
            raise ValueError(f"a chunk of {k + 1} tokens at {pos} passes the cache's {S} positions")
        self.runner.release(self._last)
        self._last = None
        return self._t, pos, k

    def draft(self, logits: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled chain's draft at `pos` from a draft step's logits (V,), on the device:
        its token (1,) and its q (V,)."""
        return self._chooser.draft_on_device(logits, pos)

    def accept(self, pos: int, drafts: list[int] | torch.Tensor, qs: list | None, logits: torch.Tensor | None,
               targets: list[int] | None) -> tuple[list[int], int]:
        """The round's decision (`_chain_accept`): greedy from targets, sampled from qs and logits."""
        return _chain_accept(self._chooser, pos, drafts, qs, logits, targets)

    def round_done(self, toks: list[int], k: int, n_acc: int, work: Counters) -> tuple[list[int], Finish | None]:
        """A round run elsewhere decided `toks` from k drafts, n_acc accepted, with `work` (its
        draft steps' and its verify's): the stats as the stream's own round counts them ->
        (the tokens it emits, max_tokens and stop ids applied; the Finish where they end it,
        the stream then over). An error ends the stream."""
        try:
            out = self._emit.take(self._account(toks, k, n_acc, work))
        except BaseException:
            self._end()
            raise
        return out, self._finish() if self._emit.reason is not None else None

    @property
    def can_handoff(self) -> bool:
        """Whether `handoff` may run now: a greedy stream (no repetition penalty) that has
        emitted its prefill's token and goes on."""
        sp = self.req.sampling
        return (not self._over and self._t is not None and self._emit.reason is None
                and sp.greedy and sp.repetition_penalty == 1.0)

    def handoff(self) -> DecodeState:
        """End this stream and return the plain decode at verify_loops that continues it: its
        decided token waits to run at `pos` (no logits, nothing to decide: a batcher runs it,
        `Batcher.add`), it counts the tokens emitted against max_tokens and the work so far, and
        its Finish stats keep the speculative figures of the rounds that ran. ValueError when
        the stream cannot be handed over (`can_handoff`)."""
        if not self.can_handoff:
            raise ValueError("only a started, unfinished greedy speculative stream can be handed over")
        req = dataclasses.replace(self.req, speculative=None, loops=self.spec.verify_loops)
        st = DecodeState.decided(self.runner, self.lane, req, self._t, self._pos, self._emit.generated, self._work)
        st.extra_stats = self.stats()
        self._end()
        return st


def _chain_round(runner: Runner, lane: int, spec: SpecParams, chooser: _Chooser, t: int, pos: int,
                 k: int, prev: StepOut | None) -> tuple[list[int], int, Counters, StepOut]:
    """Draft k tokens after t (at pos) with k + 1 decode steps at draft_loops, each fed the
    draft before it, then verify [t, d_1 .. d_k] from the draft steps' residuals.
    prev: the last round's last draft step, let go. -> (tokens decided this round, number of
    drafts accepted, the round's work, its last draft step's outputs).

    The drafts stay on the device (a greedy step's own argmax, or a sampled step's draw from
    its q, is the next step's token) until the round's one read, with the verifier's verdict.
    The last step's coda and head are not needed (only its residual is), and the verify
    overwrites its coda layers' K / V."""
    Ld, Lv = spec.draft_loops, spec.verify_loops
    work = Counters()
    out = prev
    residuals = drafts = qs = None
    tok = t
    for i in range(k + 1):
        out = runner.decode([lane], [tok], [pos + i], [Ld], prev=out)
        work = work.plus(out.work)
        if residuals is None:
            residuals = out.residual.new_empty(1, k + 1, out.residual.shape[-1])
            drafts = out.greedy.new_empty(k)
            qs = None if chooser.greedy else out.logits.new_empty(k, out.logits.shape[-1])
        residuals[:, i] = out.residual[:, 0]
        if i < k:
            if chooser.greedy:
                drafts[i:i + 1] = out.greedy
                tok = out.greedy  # the step's own buffer: its graph has fed it already
            else:
                drafts[i:i + 1], qs[i] = chooser.draft_on_device(out.logits[0], pos + i + 1)
                tok = drafts[i:i + 1]
    ver = runner.verify(lane, residuals, pos, Ld, Lv)
    work = work.plus(ver.work)
    if chooser.greedy:  # the verifier's tokens and the drafts in one read
        both = torch.cat([drafts, ver.logits.argmax(-1)]).tolist()
        toks, n_acc = _chain_accept(chooser, pos, both[:k], None, None, both[k:])
    else:
        toks, n_acc = chooser.verdict(ver.logits, qs, drafts, pos)
    return toks, n_acc, work, out


def _chain_accept(chooser: _Chooser, pos: int, drafts: list[int] | torch.Tensor, qs: list | None,
                  logits: torch.Tensor | None, targets: list[int] | None) -> tuple[list[int], int]:
    """A verified chain's decision: drafts d_1 .. d_k after the token at pos, against the
    verifier -> (the round's tokens, drafts accepted). Greedy: targets, the verifier's argmax
    at every chunk position (k + 1, on the host): accept while it equals the draft. Sampled:
    the drafts (k,) and their q (qs, (V,) each) on the device, decided by speculative sampling
    against the verifier's logits (k + 1, V) in one call and one read (`_Chooser.verdict`).
    The verifier's token at the first rejection, or the bonus after a fully accepted chunk, is
    the round's last token. Every random number is its position's: the same draws on any path
    that ran the round (a stream alone, a SpecBatch)."""
    k = len(drafts)
    if targets is not None:
        n_acc = next((i for i in range(k) if targets[i] != drafts[i]), k)
        return targets[:n_acc + 1], n_acc
    q = torch.stack(qs) if k else logits.new_empty(0, logits.shape[-1])
    return chooser.verdict(logits, q, drafts, pos)


def _tree_round(runner: Runner, lane: int, spec: SpecParams, chooser: _Chooser, t: int, pos: int,
                k: int) -> tuple[list[int], int, Counters]:
    """Draft a K-branch tree of depth k below t (at pos), verify all nodes in one tree pass,
    move the accepted path to its linear slots. -> (tokens decided, drafts accepted, work).

    Each draft depth runs the prelude and iterations [0, L_d) over every node with the tokens
    drafted so far, then the coda for that depth's logits; the verify continues from the last
    depth's residuals with iterations [L_d, L_v) and the coda. A node not drafted yet holds
    token 0 and writes K / V that nothing reads (a node attends to its ancestors only, all
    drafted at shallower depths) and the next depth rewrites. The tokens move on the device
    only; a round reads them and every node's verdict (the verifier's argmax, or its sampled
    token) in one transfer. An iteration
    counts the nodes it drafts (each depth's), then every node for the verify."""
    K = min(spec.k_branches, runner.config.vocab_size) if k else 1
    Ld, Lv = spec.draft_loops, spec.verify_loops
    N = 1 + K * k
    tr = runner.tree(lane, N, pos, TreeStages.span(0, Lv, prelude=True))
    tr.load_tree(t, pos, K, k)
    for i in range(k + 1):
        fresh = K if i else 1  # the nodes drafted at depth i
        for stage in ("prelude", *range(Ld)):
            tr.run(stage, fresh)
        if i < k:
            tr.run("coda")
            first = 1 + (i - 1) * K if i else 0
            _draft_depth(tr.logits[first:first + fresh], tr.tokens[0], i, K)
    for stage in (*range(Ld, Lv), "coda"):
        tr.run(stage)
    # every node's verdict on the device, each at the position after its own (a sampled one
    # the draw its walk would make there), read with the tokens in one transfer
    depth = torch.arange(N, device=tr.tokens.device).sub_(1).div_(K, rounding_mode="floor").add_(1)
    both = torch.cat([tr.tokens[0, :N], chooser.targets(tr.logits[:N], depth + (pos + 1))]).tolist()
    tokens, targets = both[:N], both[N:]
    out, path, cur = [], [], 0
    for i in range(1, k + 1):
        y = targets[cur]
        out.append(y)
        children = range(1, 1 + K) if i == 1 else [cur + K]
        nxt = next((c for c in children if tokens[c] == y), None)
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    else:  # bonus after a full branch
        out.append(targets[cur])
    _move_path(runner, lane, pos, path, Lv)
    return out, len(path), tr.work


def _draft_depth(logits: torch.Tensor, tokens: torch.Tensor, i: int, K: int) -> None:
    """The depth-(i + 1) nodes' tokens from the draft logits of depth i, on the device: the K
    most likely after the root (the branches' first tokens), then each branch's greedy next."""
    tokens[1 + i * K:1 + (i + 1) * K] = logits[0].topk(K).indices if i == 0 else logits.argmax(-1)


def _move_path(runner: Runner, lane: int, pos: int, path: list[int], loops: int) -> None:
    """Accepted nodes at depth 1..j: K / V from slot pos + node to pos + depth, in every cache
    layer a call at `loops` uses (prelude, iterations [0, loops), coda)."""
    moves = [(pos + node, pos + d) for d, node in enumerate(path, 1) if node != d]
    if not moves:
        return
    cache = runner.cache
    cache.move(lane, cache.layers_for(loops), [s for s, _ in moves], [d for _, d in moves])
