"""Sampling from a counter-based random stream.

Every random number is a pure function of (seed, absolute position, stream): a splitmix64
hash computed on the device. Any path that reaches the same position with the same logits
(fresh generate, resume, speculative verify, a batch lane) draws the same number, so seeded
sampling is path-independent. No generator state, no host synchronisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.worker.model.counter_hash import shr, splitmix64

# Independent streams at one position.
STREAM_TOKEN = 0        # the token drawn at a position
STREAM_ACCEPT = 1       # speculative accept test
STREAM_RESIDUAL = 2     # speculative resample from the residual distribution


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int = STREAM_TOKEN) -> torch.Tensor:
    """seed, position (B,) int64 -> (B,) float64 uniforms in [0, 1)."""
    x = splitmix64(seed.to(torch.int64) * 4 + stream)
    x = splitmix64(x ^ position.to(torch.int64))
    return shr(x, 11).to(torch.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (Keskar et al. 2019): seen tokens' positive logits are divided by
    the penalty, negative ones multiplied. logits (B, V) fp32, seen (B, V) bool (None when the
    penalty is 1: nothing reads it)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p. (B, V) fp32.
    The logits are shifted by their maximum before the temperature divides them, so any
    temperature > 0 gives finite scores: the best token's is 0, and a tiny temperature sends the
    others to -inf (greedy in the limit) rather than overflowing to inf - inf = NaN."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / p.temperature
    V = logits.shape[-1]
    if 0 < p.top_k < V:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    pr = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(pr, dim=-1, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        pr = pr.masked_fill(drop, 0.0)
        pr = pr / pr.sum(-1, keepdim=True)
    return pr


def draw(pr: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over tokens in descending-probability order. pr (B, V), u (B,) -> (B,)."""
    sorted_p, idx = torch.sort(pr.double(), dim=-1, descending=True, stable=True)
    cdf = sorted_p.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    pick = torch.searchsorted(cdf, target, right=True).clamp_max(pr.shape[-1] - 1)
    # never land on a zero-probability tail token through rounding at the very end
    # (a row with no positive probability, NaN logits from a diverged model, takes its first
    # token rather than an index of -1)
    n_pos = (sorted_p > 0).sum(-1, keepdim=True)
    pick = torch.minimum(pick, n_pos - 1).clamp_min(0)
    return idx.gather(-1, pick).squeeze(-1)


def sample(logits: torch.Tensor, seen: torch.Tensor | None, p: SamplingParams,
           seed: torch.Tensor, position: torch.Tensor | None) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,) int64, for the token at absolute `position` (B,)
    (greedy reads no random number: position may be None)."""
    logits = apply_repetition_penalty(logits.float(), seen, p.repetition_penalty)
    if p.greedy:
        return logits.argmax(-1)
    return draw(probs(logits, p), uniform(seed, position))
