"""Depth-consistency and uncertainty scoring, and the hidden-state trajectory.

These compare the same weights at two depths, so they share work along the iteration
axis: the first min(L_a, L_b) iterations run once."""
from __future__ import annotations

import torch

from tinyloop.worker.runner.engine import Engine


def uncertainty(engine: Engine, lane: int, prompt: list[int], L_lo: int, L_hi: int):
    """-> (next-token logits at L_hi (V,), KL(p_hi || p_lo)) from one pass whose first L_lo
    iterations are shared by both depths."""
    device = engine.cache.k.device
    T = len(prompt)
    p = engine.make_pass(slice(lane, lane + 1), torch.arange(T, device=device)[None], T)
    x = engine.embed_prelude(torch.tensor([prompt], dtype=torch.long, device=device), p)
    x = engine.run_loops(x, p, 0, L_lo)
    logits_lo = engine.logits(engine.coda(x, p)[:, -1:])[0, -1]
    x = engine.run_loops(x, p, L_lo, L_hi)
    logits_hi = engine.logits(engine.coda(x, p)[:, -1:])[0, -1]
    logp_hi, logp_lo = logits_hi.log_softmax(-1), logits_lo.log_softmax(-1)
    kl = torch.sum(logp_hi.exp() * (logp_hi - logp_lo))
    return logits_hi, float(kl.clamp_min(0.0))


def trajectory(engine: Engine, lane: int, tokens: list[int], n_loops: int):
    """-> (labels, hidden (n_stages, D) fp32) for the last position."""
    device = engine.cache.k.device
    T = len(tokens)
    trace: list = []
    p = engine.make_pass(slice(lane, lane + 1), torch.arange(T, device=device)[None], T, trace=trace)
    engine.forward(torch.tensor([tokens], dtype=torch.long, device=device), p, n_loops)
    labels = [label for label, _ in trace]
    return labels, torch.cat([h for _, h in trace], 0)


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first generated token where a and b differ; -1 when they agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))
