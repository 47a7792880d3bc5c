"""Depth-consistency and uncertainty scoring, and the hidden-state trajectory.

These compare the same weights at two depths, so they share work along the iteration
axis: the first min(L_a, L_b) iterations run once."""
from __future__ import annotations

import torch

from tinyloop.worker.runner.runner import Runner


def uncertainty(runner: Runner, lane: int, prompt: list[int], L_lo: int, L_hi: int):
    """-> (next-token logits at L_hi (V,), KL(p_hi || p_lo)) from one pass whose first L_lo
    iterations are shared by both depths."""
    x = runner.build(lane, prompt, L_lo).residual
    logits_lo = runner.extend(lane, x, L_lo, L_lo).logits[0]
    logits_hi = runner.extend(lane, x, L_lo, L_hi).logits[0]
    logp_hi, logp_lo = logits_hi.log_softmax(-1), logits_lo.log_softmax(-1)
    kl = torch.sum(logp_hi.exp() * (logp_hi - logp_lo))
    return logits_hi, float(kl.clamp_min(0.0))


def trajectory(runner: Runner, lane: int, tokens: list[int], n_loops: int):
    """-> (labels, hidden (n_stages, D) fp32) for the last position."""
    return runner.trace(lane, tokens, n_loops)


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first generated token where a and b differ; -1 when they agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))
