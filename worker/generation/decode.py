"""Generation loops: prefill, decode, L scheduling, safety stop.

`stream()` is a generator over one cache lane: it yields lists of new token ids as they are
decided and returns a `Finish`. The in-process API drains it; the Ray actor steps it, so a
cancelled request stops within one decode step. Its per-token state is a `DecodeState`,
which generation/batcher.py can also step together with other streams in one runner step.
Everything here runs on the runner's stages (`runner.Runner`): whether a step replays a
captured graph or runs eagerly is the runner's business.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator

import torch

from tinyloop.worker.runner.sampler import SamplingParams
from tinyloop.worker.runner.early_exit import ExitRule, histogram
from tinyloop.worker.runner.engine import Counters
from tinyloop.worker.runner.runner import RowOut, Runner, StepOut
from tinyloop.worker.runner.stages import device_tensor
# Finish reasons (documented in docs/api.md).
FINISH_LENGTH = "length"      # max_tokens reached
FINISH_STOP = "stop"          # EOS or a stop token was produced (it is included)
FINISH_SAFETY = "safety"      # a residual norm exceeded safety_norm_threshold; that token is dropped


@dataclass
class Request:
    prompt: list[int]
    loops: int
    max_tokens: int
    sampling: SamplingParams
    seed: int
    window: int = 0
    warmup_tokens: int = 0
    warmup_loops: int | None = None
    safety_threshold: float | None = None
    stop_ids: frozenset[int] = frozenset()
    speculative: dict | None = None   # {draft_loops, verify_loops, draft_ahead, k_branches}: generation/speculative.py
    early_exit: ExitRule | None = None  # per-token adaptive depth of the decode steps: runner/early_exit.py


@dataclass
class Finish:
    reason: str
    stats: dict = field(default_factory=dict)


class Generation(list):
    """The full token stream (prompt + generated), plus why it stopped and what it cost."""

    def __init__(self, tokens, finish_reason: str, stats: dict):
        super().__init__(tokens)
        self.finish_reason = finish_reason
        self.stats = stats


TokenStream = Generator[list[int], None, Finish]


def seen_mask(runner: Runner, tokens: list[list[int]]) -> torch.Tensor:
    """(B, V) bool: the tokens of each (non-empty) prompt. scatter_ takes True as a scalar;
    `seen[i, j] = True` would copy it to the GPU from pageable memory, which waits for all the
    work queued before it (a prefill just launched)."""
    V = runner.config.vocab_size
    seen = torch.zeros(len(tokens), V, dtype=torch.bool, device=runner.device)
    width = max(map(len, tokens))
    # rows padded with their first token: marking it twice is harmless
    seen.scatter_(1, device_tensor([t + t[:1] * (width - len(t)) for t in tokens], runner.device), True)
    return seen


def stream(runner: Runner, lane: int, req: Request) -> TokenStream:
    """Prefill the prompt at `req.loops`, then decode."""
    return (yield from decode_steps(start(runner, lane, req)))


def start(runner: Runner, lane: int, req: Request) -> "DecodeState":
    """Prefill the prompt into `lane` at `req.loops`: the state that decides the first token."""
    out = runner.prefill(lane, req.prompt, req.loops, req.window, req.safety_threshold is not None)
    return DecodeState(runner, lane, req, out.logits, out.norm, out.work)


class Prefill:
    """A prompt prefilled in chunks into `lane` (chunked prefill): `run(n)` prefills its next n
    tokens at the request's depth; the chunk that ends the prompt returns the `DecodeState`.
    Its stats count every chunk's work; the largest residual norm is the largest of any chunk."""

    def __init__(self, runner: Runner, lane: int, req: Request):
        self.runner, self.lane, self.req = runner, lane, req
        self.done = 0
        self.work = Counters()
        self._norm: torch.Tensor | None = None

    @property
    def remaining(self) -> int:
        return len(self.req.prompt) - self.done

    def run(self, n: int) -> "DecodeState | None":
        a, b = self.done, min(len(self.req.prompt), self.done + max(1, n))
        out = self._chunk(a, b)
        self.work = self.work.plus(out.work)
        if out.norm is not None:
            self._norm = out.norm if self._norm is None else torch.maximum(self._norm, out.norm)
        self.done = b
        if self.remaining:
            return None
        return self._decode_state(out)

    def _chunk(self, a: int, b: int):
        """Prompt positions [a, b) into the lane: the chunk's outputs (its last logits)."""
        req = self.req
        return self.runner.chunk(self.lane, req.prompt[a:b], a, req.loops, req.window, req.safety_threshold is not None)

    def _decode_state(self, out) -> "DecodeState":
        """The decode state after the last chunk (`out`)."""
        return DecodeState(self.runner, self.lane, self.req, out.logits, self._norm, self.work)


    @property
    def joinable(self) -> bool:
        """Whether `prefill_together` can take it: nothing prefilled yet, the full cache, no
        safety check (a chunk's norm is tracked per prompt only by `run`)."""
        return self.done == 0 and not self.req.window and self.req.safety_threshold is None


def prefill_together(prefills: list[Prefill]) -> list[DecodeState]:
    """Whole fresh prompts of several lanes in one pass (`Runner.prefill_many`): their decode
    states, each what its own `run(len(prompt))` gives."""
    if not all(pre.joinable for pre in prefills):
        raise ValueError("prefill_together takes fresh prompts on the full cache with no safety check")
    runner = prefills[0].runner
    outs = runner.prefill_many([pre.lane for pre in prefills], [list(pre.req.prompt) for pre in prefills],
                               [pre.req.loops for pre in prefills])
    states = []
    for pre, out in zip(prefills, outs):
        pre.work = pre.work.plus(out.work)
        pre.done = len(pre.req.prompt)
        states.append(DecodeState(runner, pre.lane, pre.req, out.logits, None, pre.work))
    return states


def decode_steps(st: "DecodeState", pipelined: bool = True) -> TokenStream:
    """One stream decoding alone: decide a token, then run the model on it, until it finishes.

    Pipelined (when the stream needs nothing from the host to run its next step): the model
    step for the decided token is launched before the token is read on the host, so on CUDA
    the device runs step t while the host yields token t-1. Sample on the device -> start the
    token's copy to the host -> launch the step (unless max_tokens is reached) -> wait for the
    copy only -> yield -> accept. A stop token discards the launched step (`DecodeState.discard`).
    The tokens, logits, finish and stats are those of the plain loop, bitwise; on CPU the copy
    is synchronous and the same code runs in the same order."""
    pipelined = pipelined and st.pipelinable  # a request's: fixed for the stream
    while True:
        if not pipelined:
            t = st.decide()
            if t is None:
                break
            yield [t]
            if not st.accept(t):
                break
            st.advance()
            continue
        st.copy_to_host(st.sample())
        ahead = st.generated + 1 < st.req.max_tokens
        if ahead:
            st.speculate()
        t = st.host_token()
        yield [t]
        if not st.accept(t):
            if ahead:
                st.discard()
            break
    return st.finish()


class DecodeState:
    """The per-token state of one stream's decode: where it is, what it has seen, how it samples.

    A step is decide (sample the token at `pos` from the last step's logits) -> accept (record
    it; stop?) -> run the model on it at `pos` for the next logits. `advance` runs that alone on
    the lane; generation/batcher.py runs it for many states in one runner step and hands each
    its row through `advanced`. Sampling is per
    state, keyed by (seed, absolute position), so both paths draw the same tokens. Alone, a
    step may be launched ahead of the host (`speculate`, see `decode_steps`) and dropped
    (`discard`) when its token turns out to end the stream.

    `work` counts the loop-block work this stream needed (prompt plus L per decode step), as
    the runner counted it for this stream's calls, so its stats do not depend on what else
    shared the runner."""

    def __init__(self, runner: Runner, lane: int, req: Request, logits: torch.Tensor,
                 norm: torch.Tensor | None, prompt_work: Counters):
        device = runner.device
        self.runner, self.lane, self.req = runner, lane, req
        self.out: StepOut | None = None          # the last step's outputs (None: the prefill's)
        self._logits, self._norm = logits, norm  # the prefill's (1, V) logits, (1,) norm or None
        self.pos = len(req.prompt)               # absolute position of the token being decided
        # the tokens seen so far, for the repetition penalty only
        self.seen = seen_mask(runner, [req.prompt]) if req.sampling.repetition_penalty != 1.0 else None
        # greedy with no penalty: a batched step's own argmax is the token (Batcher._sample)
        self.plain_greedy = req.sampling.greedy and req.sampling.repetition_penalty == 1.0
        self.generated = 0
        self.reason = FINISH_LENGTH
        self.tok: torch.Tensor | None = None     # (1,) the token decided last, on the device
        self.tok_id = -1                         # the same token on the host, once accepted
        self.work = prompt_work.snapshot()
        self.extra_stats: dict = {}
        self.warm_L = req.warmup_loops if req.warmup_tokens else None
        self.warm_x: list[torch.Tensor] = []     # residual entering iteration warm_L, per warm-up position
        self._host: torch.Tensor | None = None   # pipelined decode: where the token lands on the host,
        self._slot = 0                           # at this index
        self._buf: torch.Tensor | None = None    # a pinned buffer for tokens copied there,
        self._buf_np = None                      # and a NumPy view of it
        self._cuda = device.type == "cuda"
        self._ring: torch.Tensor | None = None   # the last step's pinned host ring (StepOut.host),
        self._ring_np = None                     # and a NumPy view of it
        self._copied: torch.cuda.Event | None = None
        self._undo: tuple | None = None          # (out, pos, work) before a speculative step
        # a step launched and not ended yet (StepOut.pending): its work and depths count once it
        # has ended (`_count`), at the latest when its token is read (`host_token`)
        self._unended: StepOut | None = None
        self._src: StepOut | None = None         # the step whose token copy_to_host brings over
        self.exits = [req.early_exit] if req.early_exit is not None else None  # runner.decode's `exits`
        self.step_depths: list[int] = []         # iterations each decode step ran (early exit only)

    @classmethod
    def decided(cls, runner: Runner, lane: int, req: Request, tok_id: int, pos: int, generated: int,
                work: Counters) -> "DecodeState":
        """A stream whose token `tok_id` at `pos` is decided and accepted, and waits to run: the
        lane holds K / V at `req.loops` for every position < pos, `generated` tokens were
        emitted (tok_id the last) and `work` ran for them. It has no logits, so what it does
        first is run tok_id (`advance`, or a batched step: `Batcher.add`), never `decide`.
        A speculative stream handed over between rounds (speculative.SpeculativeStream.handoff).
        Plain greedy with no penalty only: the tokens seen for a repetition penalty are gone."""
        if not (req.sampling.greedy and req.sampling.repetition_penalty == 1.0):
            raise ValueError("a decided state continues plain greedy decoding with no repetition penalty")
        st = cls(runner, lane, req, None, None, work)
        st.pos, st.tok_id, st.generated = pos, tok_id, generated
        return st

    @property
    def logits(self) -> torch.Tensor:
        """(1, V): predicts the token at `pos` (read through the step's outputs: the runner may
        swap them for copies, see runner.StepOut.detach)."""
        return self._logits if self.out is None else self.out.logits

    @property
    def norm(self) -> torch.Tensor | None:
        return self._norm if self.out is None else self.out.norm

    @property
    def batchable(self) -> bool:
        """Whether a step of this stream may run inside a batched step: decode on the full
        cache with no per-step safety check, each step at `step_loops` (L scheduling included:
        the batch runs a warm-up step as a row of its depth, `advanced` keeps its residual and
        `extend_warmup` runs before the first step at the request's depth)."""
        return self.req.safety_threshold is None and self.req.window == 0

    @property
    def checked(self) -> bool:
        """The safety check or a sliding window: batched among themselves, one eager step per
        window, never launched ahead of the token (generation/batcher.py `_step_checked`)."""
        return not self.batchable

    @property
    def step_loops(self) -> int:
        """The depth of the decode step that runs the token at `pos`: warm_L for the first
        warmup_tokens decode steps (L scheduling), the request's loops after. By position, so
        a step launched before its token is accepted (a batched step) gets it right too."""
        if self.warm_L is not None and self.pos - len(self.req.prompt) < self.req.warmup_tokens:
            return self.warm_L
        return self.req.loops

    @property
    def warming(self) -> bool:
        """L scheduling not over: a decode step at warm_L still to run, or their extension."""
        return self.warm_L is not None and (bool(self.warm_x) or self.step_loops != self.req.loops)

    def extend_warmup(self) -> None:
        """L scheduling, before the first decode step at the request's depth: the tokens decoded
        at warm_L lack iterations [warm_L, loops) in the cache; run exactly those over them as
        one chunk from their saved residuals, then the coda, so later tokens see a cache as if
        all ran at `loops`. Nothing at any other step."""
        req = self.req
        if self.warm_L is None or not self.warm_x or self.pos - len(req.prompt) != req.warmup_tokens:
            return
        x = torch.cat(self.warm_x, 1)
        w = self.runner.extend(self.lane, x, self.warm_L, req.loops, self.pos - x.shape[1], req.window).work
        self.work = self.work.plus(w)
        self.warm_x.clear()

    @property
    def pipelinable(self) -> bool:
        """Whether the next step may be launched before the host knows the token: no safety
        check (it decides on the host) and no L scheduling (its steps depend on the count)."""
        return self.warm_L is None and self.req.safety_threshold is None

    def sample(self) -> torch.Tensor:
        """The token at `pos`, (1,) int64 on the device (no host sync). Greedy with no penalty
        after a step: the step's own argmax (a graph step computed it in its head's epilogue
        and fed it into its next run already)."""
        if self.plain_greedy and self.out is not None:
            self.tok = self.out.greedy
            return self.tok
        self.tok = self.runner.sample(self.logits, self.seen, [self.req.sampling], [self.req.seed], [self.pos])
        return self.tok

    def copy_to_host(self, tok: torch.Tensor) -> None:
        """Start bringing the sampled token to the host, with an event to wait on (CUDA); on
        CPU the token is already there. A step whose greedy token already went to the host
        (`StepOut.host`) needs no copy; anything else is copied into a pinned buffer."""
        self._src = out = self.out
        if not self._cuda:
            self._host, self._slot = tok, 0
            return
        if self._copied is None:
            self._buf = torch.empty(1, dtype=torch.long, pin_memory=True)
            self._buf_np = self._buf.numpy()
            self._copied = torch.cuda.Event()
        if out is not None and out.host is not None and tok is out.greedy:
            host, self._slot = out.host
            if host is not self._ring:  # read through a NumPy view of the same pinned memory:
                self._ring, self._ring_np = host, host.numpy()  # no tensor made per token
            self._host = self._ring_np
        else:
            self._buf.copy_(tok, non_blocking=True)
            self._host, self._slot = self._buf_np, 0
        self._copied.record()

    def host_token(self) -> int:
        """The token `copy_to_host` started bringing over, once it is there (the step
        launched after it keeps running). A step still pending ends first: the host reads its
        token once it is final."""
        if self._src is not None and self._src is self._unended:
            self._count()
        if self._copied is not None:
            self._copied.synchronize()
        return int(self._host[self._slot])

    def speculate(self) -> None:
        """`advance` before the host has read the decided token (pipelined decode), keeping
        what `discard` restores."""
        self._undo = (self.out, self.pos, self.work, len(self.step_depths))
        self.advance(ahead=True)

    def discard(self) -> None:
        """The token of the speculative step ended the stream: its position and stats are as
        if the step never ran; the runner's counters keep it, since it ran. The step wrote
        K/V at `pos` of the lane's layers. That is harmless: whatever reads the lane later (a
        new prefill, a resume, a decode step) writes a position before it attends to it."""
        self.runner.release(self.out)
        if self._unended is self.out:  # never counted: what counted meanwhile is the step before's
            self._unended = None
            self.out, self.pos = self._undo[:2]
        else:
            self.out, self.pos, self.work, n = self._undo
            del self.step_depths[n:]
        self._undo = None

    def decide(self) -> int | None:
        """Sample the token at `pos` on the host; None when the safety check stops the stream
        (the residual norm of the step that produced these logits exceeded the threshold)."""
        tok = self.sample()
        if self.req.safety_threshold is None:
            return int(tok.item())
        tok_h, norm_h = torch.stack([tok.double(), self.norm.double()], 0).tolist()
        if norm_h[0] > self.req.safety_threshold:
            self.reason = FINISH_SAFETY
            return None
        return int(tok_h[0])

    def accept(self, t: int) -> bool:
        """Record the decided token t; True when the stream goes on (t must be run)."""
        self.tok_id = t
        self.generated += 1
        if t in self.req.stop_ids:
            self.reason = FINISH_STOP
            return False
        if self.generated >= self.req.max_tokens:
            return False
        if self.seen is not None:
            self.seen[0, t].fill_(True)  # not `= True`: that copies True from pageable memory, a sync
        return True

    def advance(self, ahead: bool = False) -> None:
        """Run the decided token alone on the lane: the next logits. ahead (pipelined decode,
        before `accept` of that token): the token is the device tensor just sampled, and
        nothing ran since; otherwise it is the accepted host id (other streams may have run on
        the runner since this one sampled)."""
        runner, req, pos = self.runner, self.req, self.pos
        self.extend_warmup()
        L = self.step_loops
        token = self.tok if ahead else self.tok_id
        out = runner.decode([self.lane], [token], [pos], [L], req.window, req.safety_threshold is not None,
                            prev=self.out, exits=self.exits)
        if not ahead:
            out.resolve()
        if L != req.loops:
            self.warm_x.append(out.residual.clone())
        self.take(out)

    def advanced(self, out: StepOut) -> None:
        """A batched step ran the decided token at `pos`: its row of the step's outputs (a
        warm-up step's residual kept for `extend_warmup`)."""
        if self.warm_L is not None and self.step_loops != self.req.loops:
            self.warm_x.append(out.residual.clone())
        self.take(out)

    def take(self, out: StepOut) -> None:
        if self._unended is not None:
            self._count()
        if out.pending is not None:  # a step launched and not ended (a RowOut has ended)
            self._unended = out
        else:
            self._count(out)
        self.out = out
        self.pos += 1

    def _count(self, out: StepOut | None = None) -> None:
        """Count a step's work and depths: `out`, or else the step still pending (ended now)."""
        if out is None:
            out, self._unended = self._unended, None
            if out is None:
                return
            out.resolve()
        if type(out) is RowOut:  # a batched step's row, once per token: its iterations alone
            L, w = out.iterations, self.work
            self.work = Counters(w.loop_iterations + L, w.loop_token_iterations + L)
            if self.exits is not None:
                self.step_depths.append(L)
            return
        self.work = self.work.plus(out.work)
        if self.exits is not None:
            self.step_depths.extend(out.depths)

    def finish(self) -> Finish:
        """The stream is over: its finish reason and stats. The state lets go of its logits
        (a graph's buffer, or a row of a batched step's output) whichever path ran it."""
        self._count()
        self.runner.release(self.out)
        self._logits = self._norm = self.out = None
        stats = {"prompt_tokens": len(self.req.prompt), "completion_tokens": self.generated,
                 "loop_iterations": self.work.loop_iterations,
                 "loop_token_iterations": self.work.loop_token_iterations, **self.extra_stats}
        if self.exits is not None:
            stats.update(exit_stats(self.step_depths, self.req.loops))
        return Finish(self.reason, stats)


def exit_stats(depths: list[int], loops: int) -> dict:
    """The usage of an early-exit stream: iterations per decoded token, their mean and their
    histogram (entry d - 1: the tokens that ran d iterations; the prompt, and with it the first
    generated token, ran the full depth and is not counted)."""
    mean = sum(depths) / len(depths) if depths else float(loops)
    return {"iterations_per_token": mean, "iterations_histogram": histogram(depths, loops)}
