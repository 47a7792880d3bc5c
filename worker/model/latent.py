"""The initial latent state of an input-injection model (Huginn), drawn from a counter-based
stream: entry c of the state at position p is a pure function of (seed, p, c).

The reference draws the state with the global torch generator, once per forward call, so a
token's state depends on how the calls were cut (a prompt at once, then token by token). Here
every path that reaches a position (prefill, decode step, resume, speculative verify, a batch
lane, a CUDA graph replay) draws the same numbers for it, and a seeded request is
reproducible. The distribution is the reference's: a normal truncated at three standard
deviations, sampled by inverting its CDF as torch.nn.init.trunc_normal_ does.
"""
from __future__ import annotations

import math

import torch

from tinyloop.kernels.counter_hash import shr, splitmix64

_STREAM = 0x4C41  # keeps these draws apart from the sampler's streams at the same (seed, position)
_LO, _HI = (1 + math.erf(-3 / math.sqrt(2))) / 2, (1 + math.erf(3 / math.sqrt(2))) / 2  # CDF at -3, 3


def truncated_normal(seeds: torch.Tensor, positions: torch.Tensor, dim: int) -> torch.Tensor:
    """seeds (B,) int64, positions (B, T) int64 -> (B, T, dim) fp32 standard normals truncated
    to [-3, 3]. No host sync and no generator state: a CUDA graph may capture it."""
    key = splitmix64(seeds.to(torch.int64) * 65536 + _STREAM)[:, None, None]            # (B, 1, 1)
    x = splitmix64(key ^ positions.to(torch.int64)[..., None])                           # (B, T, 1)
    x = splitmix64(x + torch.arange(dim, device=positions.device, dtype=torch.int64))    # (B, T, dim)
    u = (shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))                         # (0, 1)
    v = _LO + u * (_HI - _LO)
    return (torch.special.erfinv(2 * v - 1) * math.sqrt(2)).clamp_(-3.0, 3.0)
