"""RMSNorm, optionally fused with the residual add that precedes it.

    y = x * rsqrt(mean(x^2, -1) + eps) * weight

With ``residual``: h = x + residual (rounded to x.dtype, exactly as an unfused ``x + r`` would
be, so the residual stream is bit-identical to the unfused path) and y = rmsnorm(h); returns
(y, h).

Layout: x (..., D) with any leading dims, viewed as N = prod(leading) rows of D; weight (D,).
Dtypes: x / residual fp16, bf16 or fp32; weight any of those; math in fp32; y and h in x.dtype.
One program per row, BLOCK_D = next_power_of_2(D) so a row is a single load.
"""
import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_shape


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (N, D)
    residual_ptr,  # (N, D), read only when HAS_RESIDUAL
    weight_ptr,  # (D,)
    y_ptr,  # (N, D) contiguous
    h_ptr,  # (N, D) contiguous, written only when HAS_RESIDUAL
    stride_x_n,
    stride_residual_n,
    D,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: N * D may exceed 2^31
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
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
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + offs, (xf * inv_rms * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x, weight, eps, residual=None):
    """x (..., D), weight (D,) -> y (..., D); with residual (..., D) -> (y, h)."""
    op = "rms_norm"
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        tensors["residual"] = residual
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

    # reshape keeps a view when it can; the kernel needs only a unit stride along D.
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, D)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        r2, h = x2, y  # never touched: HAS_RESIDUAL=False compiles the branch out
    N = x2.shape[0]
    if N > 0:
        BLOCK_D = triton.next_power_of_2(D)
        _rms_norm_kernel[(N,)](
            x2, r2, weight, y, h,
            x2.stride(0), r2.stride(0), D, float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK_D=BLOCK_D,
            num_warps=min(max(BLOCK_D // 256, 1), 16),
        )
    return y if residual is None else (y, h)


def rms_norm_ref(x, weight, eps, residual=None):
    """The spec, in plain torch."""
    h = None
    if residual is not None:
        h = x + residual
        x = h
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if h is None else (y, h)
