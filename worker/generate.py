"""Generation loops: prefill, decode, L scheduling, safety stop, mixed-depth batches.

`stream()` is a generator over one cache lane: it yields lists of new token ids as they are
decided and returns a `Finish`. The in-process API drains it; the Ray actor steps it, so a
cancelled request stops within one decode step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator

import torch

from tinyloop.worker.engine import Engine
from tinyloop.worker.sampling import SamplingParams, sample

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


def _seen_mask(engine: Engine, tokens: list[list[int]]) -> torch.Tensor:
    V = engine.config.vocab_size
    seen = torch.zeros(len(tokens), V, dtype=torch.bool, device=engine.cache.k.device)
    for b, t in enumerate(tokens):
        seen[b, torch.tensor(t, dtype=torch.long, device=seen.device)] = True
    return seen


def prefill(engine: Engine, lane: int, tokens: list[int], loops: int, window: int,
            track_norm: bool = False):
    """Run the prompt through the model at `loops` into `lane`: (last logits (1, V), norm_max)."""
    device = engine.cache.k.device
    T = len(tokens)
    t = torch.tensor([tokens], dtype=torch.long, device=device)
    p = engine.make_pass(slice(lane, lane + 1), torch.arange(T, device=device)[None], T, window, track_norm)
    return engine.forward(t, p, loops)[:, -1], p.norm_max


def stream(engine: Engine, lane: int, req: Request) -> TokenStream:
    """Prefill the prompt at `req.loops`, then decode."""
    before = engine.counters.snapshot()
    logits, norm = prefill(engine, lane, req.prompt, req.loops, req.window, req.safety_threshold is not None)
    return (yield from decode(engine, lane, req, logits, norm, before))


def decode(engine: Engine, lane: int, req: Request, logits: torch.Tensor, norm: torch.Tensor | None,
           before) -> TokenStream:
    """Decode after the prompt sits in `lane`'s cache; `logits` (1, V) predict the first token."""
    device = engine.cache.k.device
    T = len(req.prompt)
    track = req.safety_threshold is not None
    seed = torch.tensor([req.seed], device=device)
    seen = _seen_mask(engine, [req.prompt])
    warm_L = req.warmup_loops if req.warmup_tokens else None
    warm_x: list[torch.Tensor] = []   # residual entering iteration warm_L, per warm-up position
    generated = 0
    reason = FINISH_LENGTH
    pos = T  # absolute position of the token being decided
    while True:
        tok = sample(logits, seen, req.sampling, seed, torch.tensor([pos], device=device))
        if track:
            tok_h, norm_h = torch.stack([tok.double(), norm.double()], 0).tolist()
            if norm_h[0] > req.safety_threshold:
                reason = FINISH_SAFETY
                break
            t = int(tok_h[0])
        else:
            t = int(tok.item())
        generated += 1
        yield [t]
        if t in req.stop_ids:
            reason = FINISH_STOP
            break
        if generated >= req.max_tokens:
            break
        seen[0, t] = True
        step = generated - 1  # decode steps taken so far
        if warm_L is not None and step == req.warmup_tokens and warm_x:
            _catch_up(engine, lane, warm_x, pos - len(warm_x), warm_L, req.loops, req.window)
            warm_x.clear()
        L = warm_L if warm_L is not None and step < req.warmup_tokens else req.loops
        graph = engine.graphs.get(L, lane) if engine.graphs is not None else None
        if graph is not None and L == req.loops and not track and req.window == 0:
            logits = graph.step(tok.view(1, 1), torch.full((1, 1), pos, device=device))
            engine.counters.loop_iterations += L
            engine.counters.loop_token_iterations += L
        else:
            p = engine.make_pass(slice(lane, lane + 1), torch.tensor([[pos]], device=device), pos + 1,
                                 req.window, track)
            x = engine.embed_prelude(tok.view(1, 1), p)
            x = engine.run_loops(x, p, 0, L)
            if L != req.loops:
                warm_x.append(x)
            logits = engine.logits(engine.coda(x, p))[:, -1]
            norm = p.norm_max
        pos += 1
    work = engine.counters.since(before)
    return Finish(reason, {"prompt_tokens": T, "completion_tokens": generated,
                           "loop_iterations": work.loop_iterations,
                           "loop_token_iterations": work.loop_token_iterations})


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
    iteration i runs on a prefix of the batch. Returns (per-lane generated ids, reasons)."""
    device = engine.cache.k.device
    B = len(prompts)
    first = torch.cat([prefill(engine, b, prompts[b], lane_loops[b], window)[0] for b in range(B)], 0)
    seen = _seen_mask(engine, prompts)
    seed = torch.tensor(seeds, device=device)
    pos = torch.tensor([len(p) for p in prompts], device=device)
    out: list[list[int]] = [[] for _ in range(B)]
    reasons = [FINISH_LENGTH] * B
    done = [False] * B
    logits = first
    while True:
        tok = sample(logits, seen, sampling, seed, pos)
        for b, t in enumerate(tok.tolist()):
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
        # finished lanes keep stepping (static shapes) at a frozen position in their own slot
        active = torch.tensor([not d for d in done], device=device)
        p = engine.make_pass(slice(0, B), pos[:, None], int(pos.max()) + 1, window)
        logits = engine.forward(tok[:, None], p, lane_loops[0], lane_loops)[:, -1]
        pos = pos + active.long()
