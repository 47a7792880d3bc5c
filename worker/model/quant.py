"""INT4 weights: the group-wise format, round-to-nearest quantization, the sign channel for
rounding that alternates across iterations, and the runtime weight (`QuantWeight`).

A weight W (N, K) of an nn.Linear is stored as, per row n and group g of `group_size`
consecutive columns (G = K / group_size groups a row):

    W[n, k] ~= (q[n, k] - zeros[n, g]) * scales[n, g],   g = k // group_size,  q in [0, 15]

- ``qweight`` uint8 (N, K/2): two 4-bit q per byte, column 2j in the low nibble, 2j+1 in the high.
- ``scales`` float16 (N, G) and ``zeros`` uint8 (N, G): asymmetric min/max per group (the range
  always holds 0, so an all-zero group dequantizes to zeros).
- ``sign`` uint8 (N, K/4), optional: the odd-iteration correction d[n, k] in {-1, 0, +1}, two
  bits a weight (d + 1), four a byte, column 4j in the lowest bits. Even iterations use q, odd
  ones q + d (`QuantWeight.odd`).

Why d is not simply "the other rounding direction": with t = W/s + z and r = t - q in
[-1/2, 1/2], always rounding the odd iteration the other way gives the pair an average error
of (sign(r) - 2r)/2, as large on average as round-to-nearest's r (uniform magnitudes on
[0, 1/2] both). The pair cancels only where it brings the pair's mean closer: d = sign(r)
where |r| > 1/4 (the mean q + d/2 lands on the half step next to t), 0 elsewhere. The mean
weight over a pair is then on a grid of half steps, error at most a quarter step, while each
iteration still reads 4-bit weights.

Dequantization is exact in fp32 ((q - z) is a small integer, s an fp16), and every consumer
(the torch reference here, the Triton kernels) rounds the dequantized weight to the
activations' dtype before it multiplies, so a quantized model computes what a model of that
dtype built from `dequantize`'s weights computes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

QUANT_VERSION = "1"  # `tinyloop.quant`'s "version": the layout above
SUPPORTED_QUANT_VERSIONS = ("1",)
METHODS = ("rtn", "gptq")
BITS = (4,)
QMAX = 15  # the largest 4-bit code
SUFFIXES = ("qweight", "scales", "zeros", "sign")


@dataclass(frozen=True)
class QuantSpec:
    """What `tinyloop quantize` writes (the file's `tinyloop.quant` metadata, as JSON)."""
    bits: int = 4
    group_size: int = 128
    method: str = "rtn"
    cancel_round: bool = False  # the file holds the sign channel of the loop block
    calib_tokens: int = 0       # GPTQ's calibration tokens (0 for RTN)
    dual_bit: bool = False      # served dual-bit by default (an INT2 copy of the block made at load)

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"group_size must be an even number >= 2 (two 4-bit codes a byte), "
                             f"got {self.group_size}")
        if self.dual_bit and self.bits != 4:
            raise ValueError(f"dual_bit makes its INT2 copy from INT4 weights: it needs bits 4, got {self.bits}")
        if self.method == "gptq" and self.calib_tokens < 1:
            raise ValueError(f"gptq needs calib_tokens >= 1, got {self.calib_tokens}")

    def to_meta(self) -> dict:
        return {"version": QUANT_VERSION, "bits": self.bits, "group_size": self.group_size,
                "method": self.method, "cancel_round": self.cancel_round, "calib_tokens": self.calib_tokens,
                "dual_bit": self.dual_bit}

    @classmethod
    def from_meta(cls, meta: dict, path: str) -> "QuantSpec":
        from tinyloop.worker.model.errors import CheckpointError
        version = meta.get("version")
        if version not in SUPPORTED_QUANT_VERSIONS:
            raise CheckpointError(f"{path}: unknown quantization version {version!r} "
                                  f"(supported: {SUPPORTED_QUANT_VERSIONS})")
        try:
            return cls(int(meta["bits"]), int(meta["group_size"]), meta["method"], bool(meta["cancel_round"]),
                       int(meta.get("calib_tokens", 0)), bool(meta.get("dual_bit", False)))
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: invalid tinyloop.quant: {e!r}") from None

    def describe(self) -> str:
        """The weight format in words, e.g. "int4-g128-gptq+cancel" (ModelInfo's)."""
        return f"int{self.bits}-g{self.group_size}-{self.method}" + ("+cancel" if self.cancel_round else "")


def check_shape(name: str, shape: tuple[int, ...], group_size: int) -> None:
    """A weight that the format holds: 2-D with group_size dividing its input dimension."""
    if len(shape) != 2:
        raise ValueError(f"{name}: only 2-D weights are quantized, got shape {tuple(shape)}")
    if shape[1] % group_size:
        raise ValueError(f"{name}: group size {group_size} does not divide the input dimension {shape[1]} "
                         f"(shape {tuple(shape)}); pick a group size that divides every quantized weight's")


# -- packing ---------------------------------------------------------------------------------
def pack4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K/2) uint8, column 2j in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], -1).reshape(packed.shape[0], -1)


def pack2(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 3], K % 4 == 0 -> (N, K/4) uint8, column 4j + c in bits [2c, 2c + 2)."""
    q = q.to(torch.uint8)
    return q[:, 0::4] | (q[:, 1::4] << 2) | (q[:, 2::4] << 4) | (q[:, 3::4] << 6)


def unpack2(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/4) uint8 -> (N, K) uint8 codes in [0, 3]."""
    return torch.stack([(packed >> s) & 0x3 for s in (0, 2, 4, 6)], -1).reshape(packed.shape[0], -1)


def pack_sign(d: torch.Tensor) -> torch.Tensor:
    """(N, K) corrections in {-1, 0, 1}, K % 4 == 0 -> (N, K/4) uint8, two bits (d + 1) each."""
    return pack2(d + 1)


def unpack_sign(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/4) uint8 -> (N, K) int8 corrections in {-1, 0, 1}."""
    return unpack2(packed).to(torch.int8) - 1


# -- round to nearest ---------------------------------------------------------------------
def group_params(w: torch.Tensor, group_size: int, qmax: int = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) fp32 -> scales (N, G) fp16, zeros (N, G) uint8: each group's [min, max] (0
    included) over qmax + 1 codes. The scale is rounded to fp16 first, and the codes are taken
    against that rounded scale, so the stored pair is what the rounding used."""
    N, K = w.shape
    g = w.reshape(N, K // group_size, group_size)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / qmax).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    zero = torch.round(-lo / scale.float()).clamp(0, qmax).to(torch.uint8)
    return scale, zero


def codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, qmax: int = QMAX
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q (N, K) uint8 round-to-nearest codes, t (N, K) fp32 the unrounded codes)."""
    s = scales.float().repeat_interleave(group_size, 1)
    z = zeros.float().repeat_interleave(group_size, 1)
    t = w.float() / s + z
    return torch.round(t).clamp(0, qmax).to(torch.uint8), t


def sign_channel(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The odd-iteration correction (module docstring): sign(t - q) where |t - q| > 1/4 and
    q + d stays a code, else 0. -> (N, K) int8."""
    r = t - q.float()
    d = torch.where(r.abs() > 0.25, torch.sign(r), torch.zeros_like(r))
    qd = q.float() + d
    return torch.where((qd >= 0) & (qd <= QMAX), d, torch.zeros_like(d)).to(torch.int8)


def dequantize_codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q - z) * s, exact in fp32 -> (N, K) fp32."""
    s = scales.float().repeat_interleave(group_size, 1)
    z = zeros.float().repeat_interleave(group_size, 1)
    return (q.float() - z) * s


def rtn(w: torch.Tensor, group_size: int, cancel_round: bool = False) -> dict[str, torch.Tensor]:
    """Round-to-nearest INT4 of w (N, K) -> the stored tensors by suffix (module docstring)."""
    w = w.float()
    scales, zeros = group_params(w, group_size)
    q, t = codes(w, scales, zeros, group_size)
    out = {"qweight": pack4(q), "scales": scales, "zeros": zeros}
    if cancel_round:
        out["sign"] = pack_sign(sign_channel(q, t))
    return out


# -- the runtime weight ---------------------------------------------------------------------
class QuantWeight:
    """A quantized weight where the model keeps a weight tensor (modules.py's `linear` and the
    fused projections take it in a weight's place: any weight that is not a tensor answers
    `linear`, `cat`, `split`, `nbytes` and `device`).

    kernels: (int4_gemv, int4_matmul), kernels/int4_gemv.py's launchers, on the Triton path
    (the model's `use_fast_path`); None: the torch reference, dequantize then multiply."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 sign: torch.Tensor | None = None, bits: int = 4):
        self.qweight, self.scales, self.zeros, self.group_size, self.sign = qweight, scales, zeros, group_size, sign
        self.bits = bits  # 4, or 2 for dual-bit's copy (`int2`): codes pack2's way
        self.kernels: tuple[Callable, Callable] | None = None

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], group_size: int) -> "QuantWeight":
        return cls(t["qweight"], t["scales"], t["zeros"], group_size, t.get("sign"))

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], 8 // self.bits * self.qweight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        """Bytes a projection reads (codes, scales, zeros; the sign channel is not read)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = unpack4(self.qweight) if self.bits == 4 else unpack2(self.qweight)
        return dequantize_codes(q, self.scales, self.zeros, self.group_size).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) @ W.T."""
        if self.kernels is not None:
            return self.kernels[1](x, self.qweight, self.scales, self.zeros, self.group_size, self.bits)
        from tinyloop.worker.model.modules import linear
        return linear(x, self.dequantize(x.dtype))

    def gemv(self, x: torch.Tensor, **options) -> torch.Tensor:
        """kernels.gemv's call (decode step: norm, SwiGLU, residual, argmax epilogues) on this weight."""
        return self.kernels[0](x, self.qweight, self.scales, self.zeros, self.group_size, bits=self.bits, **options)

    @staticmethod
    def cat(weights: list["QuantWeight"]) -> "QuantWeight":
        """The weights stacked along the output dim (a fused projection): rows are independent."""
        g = {(w.group_size, w.bits) for w in weights}
        if len(g) != 1:
            raise ValueError(f"fused weights must share one (group size, bits), got {sorted(g)}")
        signs = [w.sign for w in weights]
        sign = None if any(s is None for s in signs) else torch.cat(signs)
        group_size, bits = g.pop()
        return QuantWeight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]),
                           torch.cat([w.zeros for w in weights]), group_size, sign, bits)

    def split(self, sizes: list[int]) -> list["QuantWeight"]:
        """Row blocks of these sizes, views of this weight's tensors."""
        parts = [t.split(sizes) if t is not None else [None] * len(sizes)
                 for t in (self.qweight, self.scales, self.zeros, self.sign)]
        out = [QuantWeight(q, s, z, self.group_size, sg, self.bits) for q, s, z, sg in zip(*parts)]
        for w in out:
            w.kernels = self.kernels
        return out

    def odd(self) -> "QuantWeight":
        """The odd iterations' weight: codes q + d (the sign channel), same scales and zeros."""
        if self.sign is None:
            raise ValueError("the odd-iteration weight needs the sign channel (a file quantized with --cancel-round)")
        q = (unpack4(self.qweight).to(torch.int16) + unpack_sign(self.sign).to(torch.int16)).to(torch.uint8)
        return QuantWeight(pack4(q), self.scales, self.zeros, self.group_size)

    def stochastic(self, generator: torch.Generator) -> "QuantWeight":
        """One iteration's weight under cross-iteration stochastic rounding: q + d with
        probability 1/2 wherever the sign channel has d != 0, so that the expected weight is
        the pair mean q + d/2 and the iterations' rounding errors are independent."""
        if self.sign is None:
            raise ValueError("stochastic rounding needs the sign channel (a file quantized with --cancel-round)")
        d = unpack_sign(self.sign).to(torch.int16)
        flip = torch.rand(d.shape, generator=generator) < 0.5
        q = unpack4(self.qweight).to(torch.int16) + torch.where(flip.to(d.device), d, torch.zeros_like(d))
        return QuantWeight(pack4(q.to(torch.uint8)), self.scales, self.zeros, self.group_size)


    def int2(self) -> "QuantWeight":
        """Dual-bit's copy: this weight requantized to 2 bits (round to nearest of its
        dequantized values, each group's [min, max] over 4 codes), half the bytes to read."""
        if self.group_size % 4:
            raise ValueError(f"dual-bit packs four 2-bit codes a byte: it needs a group size that is a multiple "
                             f"of 4, got {self.group_size}")
        w = self.dequantize()
        scales, zeros = group_params(w, self.group_size, 3)
        return QuantWeight(pack2(codes(w, scales, zeros, self.group_size, 3)[0]), scales, zeros, self.group_size,
                           bits=2)


def route_gemv(gemv: Callable) -> Callable:
    """kernels.gemv, routing a quantized weight to its own launcher (QuantWeight.gemv)."""
    def routed(x, weight, **options):
        if isinstance(weight, QuantWeight):
            return weight.gemv(x, **options)
        return gemv(x, weight, **options)
    return routed

