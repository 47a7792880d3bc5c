"""Generation loops: prefill, decode, L scheduling, safety stop, mixed-depth batches.

`stream()` is a generator over one cache lane: it yields lists of new token ids as they are
decided and returns a `Finish`. The in-process API drains it; the Ray actor steps it, so a
cancelled request stops within one decode step. Its per-token state is a `DecodeState`,
which worker/batcher.py can also step together with other streams in one forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator

import torch

from tinyloop.worker.runner.engine import Counters, Engine, Pass
from tinyloop.worker.generation.sampling import SamplingParams, sample

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
    speculative: dict | None = None   # {draft_loops, verify_loops, draft_ahead, k_branches}: worker/speculative.py


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


def device_tensor(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """torch.tensor(data) on `device`, with no host sync: a copy to the GPU from pageable
    memory waits for all the work queued before it (a prefill just launched, a step launched
    ahead); from pinned memory it is queued like a kernel."""
    t = torch.tensor(data, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _seen_mask(engine: Engine, tokens: list[list[int]]) -> torch.Tensor:
    """(B, V) bool: the tokens of each (non-empty) prompt. scatter_ takes True as a scalar;
    `seen[i, j] = True` would copy it to the GPU from pageable memory, which waits for all the
    work queued before it (a prefill just launched)."""
    V = engine.config.vocab_size
    device = engine.cache.k.device
    seen = torch.zeros(len(tokens), V, dtype=torch.bool, device=device)
    width = max(map(len, tokens))
    # rows padded with their first token: marking it twice is harmless
    seen.scatter_(1, device_tensor([t + t[:1] * (width - len(t)) for t in tokens], device), True)
    return seen


def prefill(engine: Engine, lane: int, tokens: list[int], loops: int, window: int,
            track_norm: bool = False):
    """Run the prompt through the model at `loops` into `lane`: (last logits (1, V), norm_max).
    A fresh prompt on the full cache replays captured prefill stages when the engine has them
    for its length (worker/graphs.py); otherwise it runs eagerly."""
    if engine.graphs is not None and window == 0 and not track_norm:
        logits = engine.graphs.prefill.run(lane, tokens, loops)
        if logits is not None:
            return logits, None
    device = engine.cache.k.device
    T = len(tokens)
    t = device_tensor([tokens], device)
    p = engine.make_pass(slice(lane, lane + 1), torch.arange(T, device=device)[None], T, window, track_norm)
    return engine.forward(t, p, loops)[:, -1], p.norm_max


PAD_ID = 0  # pads a prompt to its bucket: any id does, no real token sees a pad


def prefill_buckets(max_seq_len: int, max_len: int) -> list[int]:
    """The prompt lengths a padded prefill is built for: powers of two from 16, and the top
    (the smaller of max_seq_len and max_len) when that is not one."""
    top = min(max_seq_len, max_len)
    buckets = [1 << k for k in range(4, top.bit_length()) if 1 << k <= top]
    return buckets + [top] if top >= 16 and top not in buckets else buckets


class StagedPass:
    """A pass as stages over static buffers (the engine, its Pass p, tokens, the residual x and
    the logits, set by the subclass): "prelude" embeds the tokens and runs the prelude into x,
    iteration i runs in place on x (with per-lane `depth`, a mixed-depth batch), "coda" runs the
    coda and writes `coda_logits` of its output. Each stage is what one CUDA graph captures
    (worker/graphs.py)."""

    depth: torch.Tensor | None = None

    @torch.no_grad()
    def run(self, stage) -> None:
        """One stage, eagerly (what a graph captures)."""
        e, p = self.engine, self.p
        if stage == "prelude":
            self.x.copy_(e.embed_prelude(self.tokens, p))
        elif stage == "coda":
            self.logits.copy_(self.coda_logits(e.coda(self.x, p)))
        else:
            self.x.copy_(e.run_loops(self.x, p, stage, stage + 1, depth=self.depth))

    def coda_logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PaddedPrefill(StagedPass):
    """The prefill of a fresh prompt (positions 0..T-1, full cache, no norm tracking) padded to
    `bucket` tokens on `lane`, as stages over static buffers, so that each stage is captured
    once as a CUDA graph (worker/graphs.py) and replayed for any prompt of up to `bucket`
    tokens. The same stages run eagerly anywhere (`prefill_padded`).

    Stages: "prelude" (embed and prelude into the residual buffer), iteration i (in place on
    the residual, with iteration i's cache layers), "coda" (the coda, then the logits at the
    last real token, read through a device index). So any depth composes from few graphs.

    Pads sit at positions T..bucket-1 and write K/V there. That is harmless: attention is
    causal, so no real token sees them, and every later step writes a position before it
    attends to it. The buffers may be views of larger ones shared by every lane and bucket
    (`prefill_buffers`): their stages never run at once."""

    def __init__(self, engine: Engine, lane: int, bucket: int, buffers: tuple | None = None):
        tokens, last, x, logits = buffers if buffers is not None else prefill_buffers(engine, bucket)
        device = engine.cache.k.device
        self.engine, self.lane, self.bucket = engine, lane, bucket
        self.tokens, self.x = tokens[:, :bucket], x[:, :bucket]   # (1, bucket), (1, bucket, D)
        self.last, self.logits = last, logits                     # (1,) index T-1, (1, V) output
        self.p = engine.make_pass(slice(lane, lane + 1), torch.arange(bucket, device=device)[None], bucket)
        self.p.rope_rows()  # now, outside any capture: every stage's graph reads them (see Pass)

    @staticmethod
    def stages(loops: int) -> list:
        return ["prelude", *range(loops), "coda"]

    def coda_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The coda stage's logits: the last real token's, (1, V)."""
        return self.engine.logits(h.index_select(1, self.last))[:, -1]

    def __call__(self, tokens: list[int], loops: int, run=None) -> torch.Tensor:
        """Prefill `tokens` (1 <= T <= bucket) at `loops`: the last logits (1, V). run(stage)
        runs a stage: `self.run` (eager) or a captured graph's replay."""
        self._load_tokens(tokens)
        self._run(self.stages(loops), len(tokens), run)
        return self.logits.clone()  # the buffer is the next prefill's

    def build(self, tokens: list[int], loops: int, run=None) -> torch.Tensor:
        """A resume handle's prefill: the prelude and iterations [0, loops) over `tokens`; the
        residual entering iteration `loops` (1, T, D)."""
        self._load_tokens(tokens)
        self._run(self.stages(loops)[:-1], len(tokens), run)
        return self.x[:, :len(tokens)].clone()

    def resume(self, residual: torch.Tensor, start: int, stop: int, run=None) -> torch.Tensor:
        """Iterations [start, stop) and the coda over a prompt's residual (1, T, D) entering
        iteration `start` (its cache layers below hold the prompt's K/V): the last logits."""
        T = residual.shape[1]
        self.x[:, :T].copy_(residual)
        self.x[:, T:].zero_()  # pads: any finite value does
        self.last.fill_(T - 1)
        self._run([*range(start, stop), "coda"], T, run)
        return self.logits.clone()

    def _load_tokens(self, tokens: list[int]) -> None:
        src = torch.tensor([tokens + [PAD_ID] * (self.bucket - len(tokens))])
        if self.tokens.is_cuda:
            src = src.pin_memory()
        self.tokens.copy_(src, non_blocking=True)
        self.last.fill_(len(tokens) - 1)

    def _run(self, stages: list, T: int, run) -> None:
        e = self.engine
        before = e.counters.snapshot()
        for stage in stages:
            (run or self.run)(stage)
        # count what the prompt needs, as the unpadded passes do (a replay counts nothing)
        n = sum(1 for s in stages if isinstance(s, int))
        e.counters.loop_iterations = before.loop_iterations + n
        e.counters.loop_token_iterations = before.loop_token_iterations + n * T


def prefill_buffers(engine: Engine, bucket: int) -> tuple:
    """Static buffers of a padded prefill of up to `bucket` tokens: tokens, last index,
    residual, logits."""
    cfg, device = engine.config, engine.cache.k.device
    dtype = engine.model.tok_embeddings.weight.dtype
    return (torch.zeros(1, bucket, dtype=torch.long, device=device),
            torch.zeros(1, dtype=torch.long, device=device),
            torch.zeros(1, bucket, cfg.d_model, dtype=dtype, device=device),
            torch.zeros(1, cfg.vocab_size, dtype=torch.float32, device=device))


class BatchStep(StagedPass):
    """One decode step of lanes [0, bucket), as stages over static buffers, so that each stage
    is captured once as a CUDA graph (worker/graphs.py) and any mix of per-lane depths replays
    from a few graphs. The same stages run eagerly anywhere.

    Inputs per lane: the token, its position and its depth (`Engine.run_loops(depth=...)`);
    a lane that takes no part in the step is idle: token 0, position `max_seq_len` (outside
    the cache: `rope_decode_attention` neither writes nor reads its cache) and depth 0.
    Stages: "prelude" (embed and prelude), iteration i (every lane, a lane past its depth
    carries its residual through), "coda" (the coda and the logits of every lane). No stage
    computes RoPE rows: each attention gathers its lanes' rows of the model's tables at the
    positions in the buffer. The buffers may be views of larger ones shared by every bucket
    (`batch_buffers`): their stages never run at once."""

    def __init__(self, engine: Engine, bucket: int, buffers: tuple | None = None):
        ctl, x, logits = buffers if buffers is not None else batch_buffers(engine, bucket)
        self.engine, self.bucket = engine, bucket
        self.ctl = ctl[:, :bucket]                       # (3, bucket) int64: tokens, positions, depths
        self.tokens, self.depth = self.ctl[0, :, None], self.ctl[2]
        self.x, self.logits = x[:bucket], logits[:bucket]  # (bucket, 1, D), (bucket, V)
        S = engine.cache.max_seq_len
        # no rope: rows kept in this pass would go stale, its positions change every step
        self.p = Pass(slice(0, bucket), self.ctl[1, :, None], S + 1)

    stages = staticmethod(PaddedPrefill.stages)  # the same stage names: prelude, each iteration, coda

    def coda_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The coda stage's logits: each lane's, (bucket, V)."""
        return self.engine.logits(h)[:, -1]

    def __call__(self, tokens: list[int], positions: list[int], depths: list[int], run=None,
                 on_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Step the lanes: logits (bucket, V), a view of the static output that the next step
        overwrites. Lists of `bucket` entries (idle lanes as above); run(stage) runs a stage:
        `self.run` (eager) or a captured graph's replay. on_device (lane indices, tokens), both
        device tensors: those lanes' tokens, sampled on the device and not read on the host
        yet (a pipelined step); they replace the host list's entries."""
        src = torch.tensor([tokens, positions, depths])
        if self.ctl.is_cuda:
            src = src.pin_memory()
        self.ctl.copy_(src, non_blocking=True)
        if on_device is not None:
            self.ctl[0].index_copy_(0, *on_device)
        e, loops = self.engine, max(depths)
        before = e.counters.snapshot()
        for stage in self.stages(loops):
            (run or self.run)(stage)
        # count what ran, as the eager run_loops does: every lane of the bucket, each iteration
        e.counters.loop_iterations = before.loop_iterations + loops
        e.counters.loop_token_iterations = before.loop_token_iterations + loops * self.bucket
        return self.logits


def batch_buffers(engine: Engine, bucket: int) -> tuple:
    """Static buffers of a batched decode step of up to `bucket` lanes: (tokens, positions,
    depths), residual, logits."""
    cfg, device = engine.config, engine.cache.k.device
    dtype = engine.model.tok_embeddings.weight.dtype
    return (torch.zeros(3, bucket, dtype=torch.long, device=device),
            torch.zeros(bucket, 1, cfg.d_model, dtype=dtype, device=device),
            torch.zeros(bucket, cfg.vocab_size, dtype=torch.float32, device=device))


def batch_buckets(n_slots: int) -> list[int]:
    """The lane counts a batched step is built for: powers of two from 2, and n_slots."""
    buckets = [1 << k for k in range(1, n_slots.bit_length()) if 1 << k < n_slots]
    return buckets + [n_slots] if n_slots > 1 else []


def prefill_padded(engine: Engine, lane: int, tokens: list[int], loops: int, bucket: int) -> torch.Tensor:
    """The padded prefill, eagerly: last logits (1, V)."""
    return PaddedPrefill(engine, lane, bucket)(tokens, loops)


def stream(engine: Engine, lane: int, req: Request) -> TokenStream:
    """Prefill the prompt at `req.loops`, then decode."""
    return (yield from decode_steps(start(engine, lane, req)))


def start(engine: Engine, lane: int, req: Request) -> "DecodeState":
    """Prefill the prompt into `lane` at `req.loops`: the state that decides the first token."""
    before = engine.counters.snapshot()
    logits, norm = prefill(engine, lane, req.prompt, req.loops, req.window, req.safety_threshold is not None)
    return DecodeState(engine, lane, req, logits, norm, engine.counters.since(before))


def decode_steps(st: "DecodeState", pipelined: bool = True) -> TokenStream:
    """One stream decoding alone: decide a token, then run the model on it, until it finishes.

    Pipelined (when the stream needs nothing from the host to run its next step): the model
    step for the decided token is launched before the token is read on the host, so on CUDA
    the device runs step t while the host yields token t-1. Sample on the device -> start the
    token's copy to the host -> launch the step (unless max_tokens is reached) -> wait for the
    copy only -> yield -> accept. A stop token discards the launched step (`DecodeState.discard`).
    The tokens, logits, finish and stats are those of the plain loop, bitwise; on CPU the copy
    is synchronous and the same code runs in the same order."""
    while True:
        if not (pipelined and st.pipelinable):
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

    A step is decide (sample the token at `pos` from `logits`) -> accept (record it; stop?) ->
    run the model on it at `pos` for the next logits. `advance` runs that alone on the lane
    (L scheduling, the safety check, windows, CUDA graphs); worker/batcher.py runs it for many
    states in one forward and hands each its logits row through `advanced`. Sampling is
    per state, keyed by (seed, absolute position), so both paths draw the same tokens. Alone,
    a step may be launched ahead of the host (`speculate`, see `decode_steps`) and dropped
    (`discard`) when its token turns out to end the stream.

    `work` counts the loop-block work this stream needed (prompt plus L per decode step),
    whichever path ran it, so its stats do not depend on what else shared the engine."""

    def __init__(self, engine: Engine, lane: int, req: Request, logits: torch.Tensor,
                 norm: torch.Tensor | None, prompt_work: Counters):
        device = engine.cache.k.device
        self.engine, self.lane, self.req = engine, lane, req
        self.logits, self.norm = logits, norm   # (1, V) predicts the token at pos; (1,) or None
        self.pos = len(req.prompt)               # absolute position of the token being decided
        # the tokens seen so far, for the repetition penalty only
        self.seen = _seen_mask(engine, [req.prompt]) if req.sampling.repetition_penalty != 1.0 else None
        self.seed = device_tensor([req.seed], device)
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
        self._buf: torch.Tensor | None = None    # a pinned buffer for tokens copied there
        self._copied: torch.cuda.Event | None = None
        self._undo: tuple | None = None          # (norm, pos, work) before a speculative step
        self._graph = None                       # the DecodeGraph whose replay produced `logits`, if one did

    @property
    def batchable(self) -> bool:
        """Whether a step of this stream may run inside a batched forward: plain decode on the
        full cache, at one depth throughout, with no per-step safety check."""
        return self.warm_L is None and self.req.safety_threshold is None and self.req.window == 0

    @property
    def pipelinable(self) -> bool:
        """Whether the next step may be launched before the host knows the token: no safety
        check (it decides on the host) and no L scheduling (its steps depend on the count)."""
        return self.warm_L is None and self.req.safety_threshold is None

    def sample(self) -> torch.Tensor:
        """The token at `pos`, (1,) int64 on the device (no host sync). Greedy with no penalty
        after a graph step: the argmax the graph computed, which the next replay takes as its
        input where it stands (DecodeGraph.step)."""
        p = self.req.sampling
        if self._graph is not None and p.greedy and p.repetition_penalty == 1.0:
            self.tok = self._graph.greedy
            return self.tok
        pos = None if p.greedy else torch.full((1,), self.pos, dtype=torch.long, device=self.seed.device)
        self.tok = sample(self.logits, self.seen, p, self.seed, pos)
        return self.tok

    def copy_to_host(self, tok: torch.Tensor) -> None:
        """Start bringing the sampled token to the host, with an event to wait on (CUDA); on
        CPU the token is already there. A graph step's own greedy token needs no copy: the
        replay wrote it to the graph's pinned host ring (kernels.greedy_feed), in the slot of
        its position, which the next replay leaves alone; anything else is copied into a
        pinned buffer."""
        if tok.device.type != "cuda":
            self._host, self._slot = tok, 0
            return
        if self._copied is None:
            self._buf = torch.empty(1, dtype=torch.long, pin_memory=True)
            self._copied = torch.cuda.Event()
        if self._graph is not None and tok is self._graph.greedy:
            self._host, self._slot = self._graph.host, self.pos % 2
        else:
            self._buf.copy_(tok, non_blocking=True)
            self._host, self._slot = self._buf, 0
        self._copied.record()

    def host_token(self) -> int:
        """The token `copy_to_host` started bringing over, once it is there (the step
        launched after it keeps running)."""
        if self._copied is not None:
            self._copied.synchronize()
        return int(self._host[self._slot])

    def speculate(self) -> None:
        """`advance` before the host has read the decided token (pipelined decode), keeping
        what `discard` restores."""
        self._undo = (self.norm, self.pos, self.work)
        self.advance()

    def discard(self) -> None:
        """The token of the speculative step ended the stream: its position and stats are as
        if the step never ran; the engine's counters keep it, since it ran. The logits are
        not restored: the stream is over (`finish` drops them), and keeping them would cost a
        copy per token, since a graph step writes its logits over the last ones. The step
        wrote K/V at `pos` of the lane's layers. That is harmless: whatever reads the lane
        later (a new prefill, a resume, a decode step) writes a position before it attends to
        it."""
        self.norm, self.pos, self.work = self._undo
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

    def advance(self) -> None:
        """Run the decided token alone on the lane: the next logits. A pipelined decode calls
        it before `accept` of that token; nothing here reads what accept writes except the
        step count of L scheduling, which is never pipelined."""
        engine, req, pos = self.engine, self.req, self.pos
        device = self.seed.device
        step = self.generated - 1  # decode steps taken so far
        before = engine.counters.snapshot()
        if self.warm_L is not None and step == req.warmup_tokens and self.warm_x:
            _catch_up(engine, self.lane, self.warm_x, pos - len(self.warm_x), self.warm_L, req.loops, req.window)
            self.warm_x.clear()
        L = self.warm_L if self.warm_L is not None and step < req.warmup_tokens else req.loops
        track = req.safety_threshold is not None
        graph = engine.graphs.get(L, self.lane) if engine.graphs is not None else None
        self._graph = None
        if graph is not None and L == req.loops and not track and req.window == 0:
            logits = graph.step(self.tok, pos)
            self._graph = graph
            engine.counters.loop_iterations += L
            engine.counters.loop_token_iterations += L
        else:
            p = engine.make_pass(slice(self.lane, self.lane + 1), torch.full((1, 1), pos, device=device),
                                 pos + 1, req.window, track)
            x = engine.embed_prelude(self.tok.view(1, 1), p)
            x = engine.run_loops(x, p, 0, L)
            if L != req.loops:
                self.warm_x.append(x)
            logits = engine.logits(engine.coda(x, p))[:, -1]
            self.norm = p.norm_max
        self.work = self.work.plus(engine.counters.since(before))
        self.logits = logits
        self.pos += 1

    def advanced(self, logits: torch.Tensor, graph=None) -> None:
        """A batched forward ran the decided token at `pos` at depth req.loops: its row (1, V);
        graph: the lane's DecodeGraph when that forward was its replay (see `sample`)."""
        L = self.req.loops
        self.work = self.work.plus(Counters(L, L))
        self.logits = logits
        self._graph = graph
        self.pos += 1

    def finish(self) -> Finish:
        """The stream is over: its finish reason and stats. The state lets go of its logits
        (a graph's buffer, or a row of a batched step's output) whichever loop ran it."""
        self.logits, self._graph = None, None
        return Finish(self.reason, {"prompt_tokens": len(self.req.prompt), "completion_tokens": self.generated,
                                    "loop_iterations": self.work.loop_iterations,
                                    "loop_token_iterations": self.work.loop_token_iterations,
                                    **self.extra_stats})


def _catch_up(engine: Engine, lane: int, warm_x: list[torch.Tensor], first_pos: int,
              warm_L: int, loops: int, window: int) -> None:
    """L scheduling: tokens decoded at warm_L lack iterations [warm_L, loops) in the cache.
    Run exactly those iterations over them as one chunk, from their saved residual (the
    warm-start primitive), then the coda, so later tokens see a cache as if all ran at `loops`."""
    device = engine.cache.k.device
    x = torch.cat(warm_x, 1)  # (1, n, D)
    n = x.shape[1]
    pos = torch.arange(first_pos, first_pos + n, device=device)[None]
    p = engine.make_pass(slice(lane, lane + 1), pos, first_pos + n, window)
    engine.coda(engine.run_loops(x, p, warm_L, loops), p)


def batch(engine: Engine, prompts: list[list[int]], lane_loops: list[int], max_tokens: int,
          sampling: SamplingParams, seeds: list[int], window: int, stop_ids: frozenset[int]):
    """Mixed-depth batch over lanes 0..B-1. The caller orders lanes by descending depth, so
    iteration i runs on a prefix of the batch. Returns (per-lane generated ids, reasons).
    A graph-backed engine on the full cache runs the decode steps as captured batched steps
    (`BatchStep`), in which finished lanes idle."""
    device = engine.cache.k.device
    stepper = engine.graphs.batch if engine.graphs is not None and window == 0 else None
    B = len(prompts)
    first = torch.cat([prefill(engine, b, prompts[b], lane_loops[b], window)[0] for b in range(B)], 0)
    seen = _seen_mask(engine, prompts)
    seed = device_tensor(seeds, device)
    pos = device_tensor([len(p) for p in prompts], device)
    out: list[list[int]] = [[] for _ in range(B)]
    reasons = [FINISH_LENGTH] * B
    done = [False] * B
    logits = first
    while True:
        tok = sample(logits, seen, sampling, seed, pos)
        toks = tok.tolist()
        for b, t in enumerate(toks):
            if done[b]:
                continue
            out[b].append(t)
            if t in stop_ids:
                done[b], reasons[b] = True, FINISH_STOP
            elif len(out[b]) >= max_tokens:
                done[b] = True
        if all(done):
            return out, reasons
        seen.scatter_(1, tok[:, None], True)
        active = device_tensor([not d for d in done], device, torch.bool)
        if stepper is not None:
            S = engine.cache.max_seq_len
            logits = stepper.run([0 if d else t for d, t in zip(done, toks)],
                                 [S if d else q for d, q in zip(done, pos.tolist())],
                                 [0 if d else L for d, L in zip(done, lane_loops)]).clone()
        else:
            # finished lanes keep stepping (static shapes) at a frozen position in their own slot
            p = engine.make_pass(slice(0, B), pos[:, None], int(pos.max()) + 1, window)
            logits = engine.forward(tok[:, None], p, lane_loops[0], lane_loops)[:, -1]
        pos = pos + active.long()
