"""RMSNorm, optionally fused with the residual add that precedes it.

    y = x * rsqrt(mean(x^2, -1) + eps) * weight

With ``residual``: h = x + residual (rounded to x.dtype, exactly as an unfused ``x + r`` would
be, so the residual stream is bit-identical to the unfused path) and y = rmsnorm(h); returns
(y, h).

With ``skip`` (the post-norm of a sandwich-norm layer, then its residual add): returns
skip + rmsnorm(x), rmsnorm(x) rounded to x.dtype first and the sum rounded once more, exactly
as the unfused ``skip + rms_norm(x)``. This call launches with programmatic dependent launch
where the GEMV does (``pdl``, `_launch.use_pdl`): it loads the norm weight, lets the next kernel
launch, then waits for the previous kernel's writes (x, the projection just before it in a
decode step).

Layout: x (..., D) with any leading dims, viewed as N = prod(leading) rows of D; weight (D,).
Dtypes: x / residual fp16, bf16 or fp32; weight any of those; math in fp32; y and h in x.dtype.
One program per row, BLOCK_D = next_power_of_2(D) so a row is a single load.
"""
import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_shape, interpreting
from ._launch import use_pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (N, D)
    residual_ptr,  # (N, D), read only when HAS_RESIDUAL
    weight_ptr,  # (D,)
    y_ptr,  # (N, D) contiguous
    h_ptr,  # (N, D) contiguous, written only when HAS_RESIDUAL
    skip_ptr,  # (N, D), read only when HAS_SKIP
    stride_x_n,
    stride_residual_n,
    stride_skip_n,
    D,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: N * D may exceed 2^31
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # never a kernel's output
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x_n + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual_n + offs, mask=mask, other=0.0)
        # Round h to the storage dtype before normalizing: the unfused path normalizes the
        # stored h, and the next layer adds to the stored h.
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row * D + offs, h, mask=mask)
        x = h
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = (xf * inv_rms * w).to(y_ptr.dtype.element_ty)
    if HAS_SKIP:
        skip = tl.load(skip_ptr + row * stride_skip_n + offs, mask=mask, other=0.0)
        y = (skip.to(tl.float32) + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * D + offs, y, mask=mask)


def _rows(t, D):
    """t (..., D) as (N, D) rows with a unit stride along D (reshape keeps a view when it can)."""
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x, weight, eps, residual=None, skip=None, *, pdl=None):
    """x (..., D), weight (D,) -> y (..., D); with residual (..., D) -> (y, h); with skip (..., D)
    -> skip + y (one of residual and skip at most). pdl: the skip launch's programmatic
    dependent launch (`_launch.use_pdl`: None, where the hardware allows it; never under the
    interpreter); the other launches wait for the previous kernel as usual."""
    op = "rms_norm"
    tensors = {"x": x, "weight": weight}
    if residual is not None and skip is not None:
        raise ValueError(f"{op}: takes residual (an add before the norm) or skip (an add after it), not both")
    if residual is not None:
        tensors["residual"] = residual
    if skip is not None:
        tensors["skip"] = skip
    check_device(op, **tensors)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_dtype(op, "weight", weight, FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dim, got shape {tuple(x.shape)}")
    D = x.shape[-1]
    check_shape(op, "weight", weight, (D,))
    if residual is not None:
        check_shape(op, "residual", residual, x.shape)
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual dtype {residual.dtype} must equal x dtype {x.dtype}")
    if skip is not None:
        check_shape(op, "skip", skip, x.shape)
        if skip.dtype != x.dtype:
            raise ValueError(f"{op}: skip dtype {skip.dtype} must equal x dtype {x.dtype}")

    x2 = _rows(x, D)
    weight = weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = _rows(residual, D)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        r2, h = x2, y  # never touched: HAS_RESIDUAL=False compiles the branch out
    s2 = x2 if skip is None else _rows(skip, D)
    N = x2.shape[0]
    if N > 0:
        BLOCK_D = triton.next_power_of_2(D)
        pdl = skip is not None and use_pdl(x.device, pdl) and not interpreting()
        _rms_norm_kernel[(N,)](
            x2, r2, weight, y, h, s2,
            x2.stride(0), r2.stride(0), s2.stride(0), D, float(eps),
            HAS_RESIDUAL=residual is not None,
            HAS_SKIP=skip is not None,
            PDL=pdl,
            BLOCK_D=BLOCK_D,
            num_warps=min(max(BLOCK_D // 256, 1), 16),
            launch_pdl=pdl,
        )
    return y if residual is None else (y, h)


def rms_norm_ref(x, weight, eps, residual=None, skip=None, *, pdl=None):
    """The spec, in plain torch (pdl: how the kernel launches, not what it computes)."""
    if skip is not None:
        return skip + rms_norm_ref(x, weight, eps)
    h = None
    if residual is not None:
        h = x + residual
        x = h
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if h is None else (y, h)
