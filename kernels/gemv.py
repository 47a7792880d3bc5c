"""Batch-1 projection (GEMV) with the decode step's neighbours fused in.

    y = x @ W.T                        x (K,), W (N, K) row-major (an nn.Linear weight)

A batch-1 decode step reads every weight once and does two FLOPs per weight: it is bound by
memory bandwidth, and at these sizes also by the small kernels between the projections. Each
option folds one of them into the projection that reads its input or writes its output:

- ``norm_weight``: RMSNorm of x first: y = rmsnorm(x) @ W.T, computed as
  (W @ (x * norm_weight)) * rsqrt(mean(x^2) + eps) in fp32 -- the same algebra with the
  scale applied after the dot, so each program sums x^2 from the chunks it loads anyway and
  no normalized vector is written and read back. (The unfused path rounds the normalized x
  to x.dtype before its dot; this one does not, so the two differ by that rounding.)
- ``swiglu``: W is the fused (gate | up) projection of shape (2F, K) and y (F,) is
  silu(x @ W_gate.T) * (x @ W_up.T), each product rounded to x.dtype first (as the unfused
  projection's output is), then silu and the product rounded as ``swiglu`` does.
- ``residual`` (N,): y = residual + (x @ W.T rounded to x.dtype), rounded once more, exactly
  like the unfused ``residual + linear(x, W)``.

Layout: one program per BLOCK_N output rows, looping over K in BLOCK_K chunks and
accumulating a (BLOCK_N, BLOCK_K) fp32 tile that is reduced once at the end. No split-K: a
program owns its rows, which keeps the epilogues (silu, the residual) free of atomics; the
row block is small enough that even the 2048-row projections launch a few hundred programs.
The block sizes are autotuned per (N, K) on CUDA; under the interpreter one config runs.

``pdl`` (on by default on Hopper and later; TINYLOOP_PDL=0 turns it off): programmatic
dependent launch, so a projection starts while the previous kernel drains, with its first
weight chunk loaded before it waits and each next chunk loaded one step ahead (bench/gemv.py
times both launches; on the H200 it takes batch-1 decode at L = 8 from 0.539 to 0.510 ms).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_shape, interpreting


@triton.jit
def _load_w(w_rows, up_rows, k, row_mask, K, SWIGLU: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile at columns k (and its up-projection tile)."""
    m = row_mask[:, None] & (k < K)[None, :]
    w = tl.load(w_rows + k[None, :], mask=m, other=0.0)
    up = w
    if SWIGLU:
        up = tl.load(up_rows + k[None, :], mask=m, other=0.0)
    return w, up


@triton.jit
def _gemv_kernel(
    x_ptr,  # (K,)
    w_ptr,  # (N, K) or (2N, K) with SWIGLU, unit stride along K
    nw_ptr,  # (K,) norm weight, read only when NORM
    res_ptr,  # (N,) residual, read only when RESIDUAL
    y_ptr,  # (N,)
    N,
    K,
    stride_w,
    eps,
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty

    if NORM:
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_rows = w_rows
    if SWIGLU:
        up_rows = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_w
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PREFETCH:
        # Each iteration loads the next chunk's weights ahead of its own FMAs. With PDL
        # (programmatic dependent launch) this kernel may start while the previous one drains:
        # the weights never depend on it, so the first chunk's load goes out before the wait,
        # and x, the residual and everything after wait for the previous kernel's writes.
        w, up = _load_w(w_rows, up_rows, cols, row_mask, K, SWIGLU)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_mask = k < K
        xv = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        if NORM:
            ss += xv * xv
            xv = xv * tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        xv = xv[None, :]
        if not PREFETCH:
            w, up = _load_w(w_rows, up_rows, k, row_mask, K, SWIGLU)
        acc += w.to(tl.float32) * xv
        if SWIGLU:
            acc_up += up.to(tl.float32) * xv
        if PREFETCH:
            w, up = _load_w(w_rows, up_rows, k + BLOCK_K, row_mask, K, SWIGLU)

    y = tl.sum(acc, axis=1)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        y *= inv_rms
    y = y.to(dtype).to(tl.float32)
    if SWIGLU:
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up *= inv_rms
        up = up.to(dtype).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dtype).to(tl.float32) * up
    if RESIDUAL:
        y += tl.load(res_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


# (BLOCK_N, BLOCK_K, num_warps, num_stages): the configs that won the autotuning of every
# projection of bench-285m and the Ouro-1.4B head on the H200, with and without PDL, out of
# 48 tiles of 1K to 8K weights (bench/results/gemv-cuda.json). Fewer configs keep a cold
# start's compile-and-benchmark pass to seconds.
_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [(2, 1024, 4, 1), (2, 1024, 4, 3), (2, 1024, 8, 3), (4, 256, 4, 3), (4, 256, 8, 1),
                          (4, 1024, 4, 3), (8, 256, 4, 1), (8, 512, 4, 1), (8, 512, 8, 1), (8, 1024, 4, 1),
                          (16, 512, 4, 1)]
]
_gemv_tuned = triton.autotune(
    configs=_CONFIGS, key=["N", "K", "NORM", "SWIGLU", "RESIDUAL", "PDL"],
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles),
)(_gemv_kernel)


def gemv(x, weight, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None, pdl=None):
    """x (..., K) holding one row, weight (N, K) (with swiglu: (2F, K)) -> y (..., N or F).

    The leading dims of x (e.g. (1, 1) of a decode step) are kept. Options as in the module
    docstring; all tensors share x's dtype except norm_weight, which may be any float dtype.
    pdl: launch with programmatic dependent launch and weight prefetch (default: `use_pdl`);
    under the interpreter it selects the prefetching loop alone."""
    op = "gemv"
    tensors = {"x": x, "weight": weight}
    if norm_weight is not None:
        tensors["norm_weight"] = norm_weight
    if residual is not None:
        tensors["residual"] = residual
    check_device(op, **tensors)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    if x.dim() < 1 or x.numel() != x.shape[-1]:
        raise ValueError(f"{op}: x must hold a single row (..., K), got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"{op}: weight must be 2-D (N, K) with unit stride along K, "
                         f"got shape {tuple(weight.shape)} strides {weight.stride()}")
    K = x.shape[-1]
    if weight.shape[1] != K:
        raise ValueError(f"{op}: weight must have K = {K} columns, got shape {tuple(weight.shape)}")
    N = weight.shape[0]
    if swiglu:
        if N % 2:
            raise ValueError(f"{op}: swiglu needs a (gate | up) weight with an even row count, got {N}")
        N //= 2
    if norm_weight is not None:
        check_dtype(op, "norm_weight", norm_weight, FLOAT_DTYPES)
        check_shape(op, "norm_weight", norm_weight, (K,))
    out_shape = (*x.shape[:-1], N)
    if residual is not None:
        check_shape(op, "residual", residual, out_shape)
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual dtype {residual.dtype} must equal x dtype {x.dtype}")
        residual = residual.contiguous()
    x1 = x.reshape(K).contiguous()
    y = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    args = (x1, weight, x1 if norm_weight is None else norm_weight.contiguous(),
            y if residual is None else residual, y, N, K, weight.stride(0), float(eps))
    flags = dict(NORM=norm_weight is not None, SWIGLU=bool(swiglu), RESIDUAL=residual is not None)
    if interpreting():
        _gemv_kernel[(triton.cdiv(N, 8),)](*args, **flags, PREFETCH=bool(pdl), PDL=False, BLOCK_N=8, BLOCK_K=64)
    else:
        pdl = use_pdl(x.device) if pdl is None else pdl
        _gemv_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, **flags, PREFETCH=pdl, PDL=pdl,
                                                                     launch_pdl=pdl)
    return y


def use_pdl(device) -> bool:
    """Programmatic dependent launch: on for Hopper and later unless TINYLOOP_PDL=0 (read once
    per process and device, not per launch)."""
    if device.type != "cuda":
        return False
    return _pdl_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _pdl_on(index: int) -> bool:
    return os.environ.get("TINYLOOP_PDL", "1") != "0" and torch.cuda.get_device_capability(index)[0] >= 9


def gemv_ref(x, weight, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None, pdl=None):
    """The spec, in plain torch: the unfused ops, each rounding where the fused kernel does."""
    y = (x.float() * (1 if norm_weight is None else norm_weight.float())) @ weight.float().t()
    if norm_weight is not None:
        y = y * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    if swiglu:
        gate, up = y.float().chunk(2, -1)
        y = (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)
    if residual is not None:
        y = (residual.float() + y.float()).to(x.dtype)
    return y
