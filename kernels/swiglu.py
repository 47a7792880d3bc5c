"""SwiGLU activation: out = silu(gate) * up = gate * sigmoid(gate) * up.

Layout: gate, up of one shape (any), contiguous, treated as flat vectors. Dtypes fp16 / bf16 /
fp32, both equal; math in fp32; output in gate.dtype. One program per BLOCK elements.
"""
import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype

BLOCK = 1024


@triton.jit
def _swiglu_kernel(
    gate_ptr,  # (N,) contiguous
    up_ptr,  # (N,) contiguous
    out_ptr,  # (N,) contiguous
    N,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: N may pass 2^31
    mask = offs < N
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate, up):
    """gate, up (...) -> silu(gate) * up (...) in gate.dtype."""
    op = "swiglu"
    check_device(op, gate=gate, up=up)
    check_dtype(op, "gate", gate, FLOAT_DTYPES)
    if up.dtype != gate.dtype:
        raise ValueError(f"{op}: up dtype {up.dtype} must equal gate dtype {gate.dtype}")
    if up.shape != gate.shape:
        raise ValueError(f"{op}: up shape {tuple(up.shape)} must equal gate shape {tuple(gate.shape)}")
    for name, t in (("gate", gate), ("up", up)):
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    out = torch.empty_like(gate)
    N = gate.numel()
    if N:
        _swiglu_kernel[(triton.cdiv(N, BLOCK),)](gate, up, out, N, BLOCK=BLOCK, num_warps=4)
    return out


def swiglu_ref(gate, up):
    """The spec, in plain torch."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
