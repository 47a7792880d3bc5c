"""The sampler's counter-based uniforms in one launch.

``uniform``: seed, position (n,) int64 -> (n,) float64 in [0, 1), for the random stream
``stream`` (a small non-negative int):

    x = splitmix64(seed * 4 + stream)
    x = splitmix64(x ^ position)
    u = (x >> 11) * 2**-53                     (logical shift: the top 53 bits)

with splitmix64(x) = z ^ (z >> 31), z = ((y ^ (y >> 27)) * M2), y = ((x + G) ^ ((x + G) >> 30)) * M1
in wrapping unsigned 64-bit arithmetic (Steele, Lea and Flood 2014). Integer arithmetic and an
exact conversion: the launch equals ``uniform_ref`` (plain torch, the spec) bit for bit, where
the reference spends some thirty elementwise launches on the same numbers (each int64 op of the
hash is one). A sampled step draws one uniform per row, a sampled speculative round several per
position. ``splitmix64`` on int64 tensors is also Huginn's initial-state hash (worker/model/latent.py).
"""
import torch
import triton
import triton.language as tl

from ._checks import check_device, check_dtype

# splitmix64's constants (unsigned 64-bit), as ints and as the kernel's constexprs (a jitted
# function reads no other globals)
GOLDEN, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_GOLDEN, _M1, _M2 = tl.constexpr(GOLDEN), tl.constexpr(M1), tl.constexpr(M2)
BLOCK = 128


def i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


def shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 tensors, elementwise (wrapping, as the unsigned hash)."""
    x = x + i64(GOLDEN)
    x = (x ^ shr(x, 30)) * i64(M1)
    x = (x ^ shr(x, 27)) * i64(M2)
    return x ^ shr(x, 31)


def uniform_ref(seed: torch.Tensor, position: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """The spec in plain torch: seed, position int64 (broadcast) -> float64 uniforms in [0, 1)."""
    x = splitmix64(seed.to(torch.int64) * 4 + stream)
    x = splitmix64(x ^ position.to(torch.int64))
    return shr(x, 11).to(torch.float64) * (1.0 / (1 << 53))


@triton.jit
def _splitmix64(x):
    x = x + tl.full(x.shape, _GOLDEN, tl.uint64)
    x = (x ^ (x >> 30)) * tl.full(x.shape, _M1, tl.uint64)
    x = (x ^ (x >> 27)) * tl.full(x.shape, _M2, tl.uint64)
    return x ^ (x >> 31)


@triton.jit
def uniform_of(seed, pos, stream):
    """The uniform of int64 seed and position (scalars or blocks) on `stream`, a float64 in
    [0, 1): `uniform`'s numbers, for kernels that draw their own (kernels/sample_rows.py)."""
    x = _splitmix64(seed.to(tl.uint64, bitcast=True) * 4 + stream)
    x = _splitmix64(x ^ pos.to(tl.uint64, bitcast=True))
    return (x >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, n, stream, stride_seed, stride_pos, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    seed = tl.load(seed_ptr + i * stride_seed, mask=m, other=0)
    pos = tl.load(pos_ptr + i * stride_pos, mask=m, other=0)
    tl.store(out_ptr + i, uniform_of(seed, pos, stream), mask=m)


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """seed, position: (n,) int64 (or broadcastable to one length: a seed of one element
    serves every position) -> (n,) float64 uniforms, no host sync."""
    op = "uniform"
    check_device(op, seed=seed, position=position)
    check_dtype(op, "seed", seed, (torch.int64,))
    check_dtype(op, "position", position, (torch.int64,))
    if seed.dim() != 1 or position.dim() != 1:
        raise ValueError(f"{op}: seed and position must be 1-D, got {tuple(seed.shape)} and {tuple(position.shape)}")
    if not 0 <= stream < 1 << 16:
        raise ValueError(f"{op}: stream must be in [0, 65535], got {stream}")
    seed, position = torch.broadcast_tensors(seed, position)  # a stride-0 view, no copy
    n = seed.shape[0]
    out = torch.empty(n, dtype=torch.float64, device=seed.device)
    if n:
        _uniform_kernel[(triton.cdiv(n, BLOCK),)](seed, position, out, n, stream, seed.stride(0),
                                                  position.stride(0), BLOCK=BLOCK)
    return out
