"""SwiGLU activation: out = silu(gate) * up = gate * sigmoid(gate) * up.

Rounding: silu(gate) is rounded to gate.dtype before the product, which is rounded again --
exactly where the model's unfused ops (F.silu, then the multiply) and the gemv epilogue
(kernels/gemv.py) round, so prefill and decode compute the feed-forward the same way.

Layout: gate, up of one shape (..., F), unit stride along F; the leading dims may be strided
as long as they collapse to one row stride, so the two halves of a fused (gate | up)
projection's output, gu[..., :F] and gu[..., F:], go in as views with no copy. Dtypes fp16 /
bf16 / fp32, both equal; math in fp32; output (..., F) contiguous in gate.dtype. Programs over
(row, BLOCK elements of the row).
"""
import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype

BLOCK = 1024


@triton.jit
def _swiglu_kernel(
    gate_ptr,  # (R, F), unit stride along F
    up_ptr,  # (R, F), unit stride along F
    out_ptr,  # (R, F) contiguous
    F,
    stride_gate,
    stride_up,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: R * F may pass 2^31
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    g = tl.load(gate_ptr + row * stride_gate + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * F + offs, (silu * u).to(dtype), mask=mask)


def _row_stride(op: str, name: str, t: torch.Tensor) -> int:
    """The one stride between the rows of t viewed as (R, F), or a ValueError."""
    if t.dim() == 0:
        raise ValueError(f"{op}: {name} must be (..., F), got a 0-d tensor")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have unit stride along its last dim, got strides {t.stride()}")
    dims = [(n, s) for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1]
    for (_, outer), (n, inner) in zip(dims, dims[1:]):
        if outer != inner * n:
            raise ValueError(f"{op}: {name}'s leading dims must collapse to one row stride, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
    return dims[-1][1] if dims else t.shape[-1]


def swiglu(gate, up):
    """gate, up (..., F) -> silu(gate) * up (..., F) in gate.dtype, contiguous."""
    op = "swiglu"
    check_device(op, gate=gate, up=up)
    check_dtype(op, "gate", gate, FLOAT_DTYPES)
    if up.dtype != gate.dtype:
        raise ValueError(f"{op}: up dtype {up.dtype} must equal gate dtype {gate.dtype}")
    if up.shape != gate.shape:
        raise ValueError(f"{op}: up shape {tuple(up.shape)} must equal gate shape {tuple(gate.shape)}")
    stride_gate, stride_up = _row_stride(op, "gate", gate), _row_stride(op, "up", up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    F = gate.shape[-1]
    R = gate.numel() // F if F else 0
    if R and F:
        _swiglu_kernel[(R, triton.cdiv(F, BLOCK))](gate, up, out, F, stride_gate, stride_up, BLOCK=BLOCK,
                                                   num_warps=4)
    return out


def swiglu_ref(gate, up):
    """The spec, in plain torch: the model's unfused ops (silu rounded to the dtype, then the
    product)."""
    return (torch.nn.functional.silu(gate.float()).to(gate.dtype).float() * up.float()).to(gate.dtype)
