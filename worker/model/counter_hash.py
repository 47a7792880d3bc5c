"""splitmix64 on int64 device tensors: the counter-based hash behind every random number the
worker draws (the sampler's uniforms, Huginn's initial latent state). A draw is a pure
function of its counters, with no generator state and no host sync."""
from __future__ import annotations

import torch


def i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = i64(0x9E3779B97F4A7C15), i64(0xBF58476D1CE4E5B9), i64(0x94D049BB133111EB)


def shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ shr(x, 30)) * _M1
    x = (x ^ shr(x, 27)) * _M2
    return x ^ shr(x, 31)
