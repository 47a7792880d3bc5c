"""INT4 projections with the dequantization fused: a GEMV for the decode step and a GEMM for
every other row count.

    y = x @ W.T,   W[n, k] = ((q[n, k] - zeros[n, g]) * scales[n, g]).to(x.dtype),  g = k // G

Layouts (worker/model/quant.py): ``qweight`` uint8 (N, K/2), column 2j in the low nibble of
byte j and 2j+1 in the high one; ``scales`` float16 (N, K/G); ``zeros`` uint8 (N, K/G); G (the
group size) even and dividing K. The dequantized weight is exact in fp32 and rounded to x's
dtype before it multiplies, so each kernel computes what kernels/gemv.py computes with the
weight `int4_dequantize_ref` gives: same options, same rounding points, the same tolerance.

``int4_gemv`` takes kernels.gemv's call (``norm_weight``, ``swiglu``, ``residual``,
``argmax_key``, ``out_dtype``, ``eviction_policy``, ``pdl``) for 1 <= M <= 16 rows.

- M = 1 (``_int4_gemv_kernel``): one program per BLOCK_N output rows, looping over the groups
  BLOCK_G at a time: a (BLOCK_N, BLOCK_G, G/2) tile of bytes, its two nibbles against x's even
  and odd columns, and the group's scale and zero broadcast along the last axis (no gather).
  Summed once at the end, as gemv's accumulator tile is; no split-K, so the epilogues need no
  atomics. With ``pdl`` the first tile of weights is loaded before the wait on the previous
  kernel and each next one a step ahead (gemv's PREFETCH).
- M > 1 (``_int4_matmul_kernel``): a (BLOCK_M, BLOCK_N) tile of y per program, K in BLOCK_K
  chunks, the weight chunk dequantized in registers (each column's scale and zero gathered by
  its group) and applied by two tl.dot (even and odd columns of x against the low and high
  nibbles). The decode step's options ride in its epilogue as in gemv's batched kernel.

``int4_matmul`` is that GEMM without options for any number of rows (prefill, verify, a
batched decode step's projections).

Row order: every launch takes a fixed tile per shape (the module's tables; the interpreter one
tile), never an autotuner's, and a float32 y or the argmax epilogue use the plain call's tile,
so each row is summed in one order whatever is asked of the call.
"""
import math

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_shape, interpreting
from ._launch import use_pdl
from .gemv import EVICTION_POLICIES, MAX_ROWS, _argmax_key_max, _device_name, _dot_wt


@triton.jit
def _load_q(q_rows, s_rows, z_rows, gs, js, row_mask, NG, HALF, HALF_G: tl.constexpr, EVICT: tl.constexpr):
    """Groups gs of the program's rows: bytes (BLOCK_N, BLOCK_G, HALF_G) uint8, scales and zeros
    (BLOCK_N, BLOCK_G, 1) fp32."""
    g_mask = gs < NG
    m = row_mask[:, None, None] & g_mask[None, :, None] & (js < HALF)[None, None, :]
    b = tl.load(q_rows[:, :, None] + (gs[:, None] * HALF + js[None, :])[None, :, :], mask=m, other=0,
                eviction_policy=EVICT)
    mg = row_mask[:, None] & g_mask[None, :]
    s = tl.load(s_rows + gs[None, :], mask=mg, other=0.0, eviction_policy=EVICT).to(tl.float32)
    z = tl.load(z_rows + gs[None, :], mask=mg, other=0, eviction_policy=EVICT).to(tl.float32)
    return b, s[:, :, None], z[:, :, None]


@triton.jit
def _dequant(b, s, z, dtype):
    """The two nibbles of bytes b as weights of x's dtype, widened to fp32: (low, high)."""
    lo = ((b & 0xF).to(tl.float32) - z) * s
    hi = ((b >> 4).to(tl.float32) - z) * s
    return lo.to(dtype).to(tl.float32), hi.to(dtype).to(tl.float32)


@triton.jit
def _x_pair(x_ptr, nw_ptr, gs, js, NG, HALF, G, ss, NORM: tl.constexpr):
    """x's even and odd columns of groups gs as (1, BLOCK_G, HALF_G) fp32 (times the norm weight
    with NORM), and ss plus their squares."""
    k = gs[:, None] * G + 2 * js[None, :]  # (BLOCK_G, HALF_G) even columns
    m = (gs < NG)[:, None] & (js < HALF)[None, :]
    xe = tl.load(x_ptr + k, mask=m, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + k + 1, mask=m, other=0.0).to(tl.float32)
    if NORM:
        ss += xe * xe + xo * xo
        xe = xe * tl.load(nw_ptr + k, mask=m, other=0.0).to(tl.float32)
        xo = xo * tl.load(nw_ptr + k + 1, mask=m, other=0.0).to(tl.float32)
    return xe[None, :, :], xo[None, :, :], ss


@triton.jit
def _int4_gemv_kernel(
    x_ptr,  # (K,)
    q_ptr,  # (N, K/2) uint8, or (2N, K/2) with SWIGLU
    s_ptr,  # (N, NG) scales, NG = K / G
    z_ptr,  # (N, NG) uint8 zeros
    nw_ptr,  # (K,) norm weight, read only when NORM
    res_ptr,  # (N,) residual, read only when RESIDUAL
    y_ptr,  # (N,)
    key_ptr,  # (1,) int64, written only when ARGMAX
    N,
    K,
    G,  # the group size
    eps,
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ARGMAX: tl.constexpr,
    EVICT: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,  # groups a step
    HALF_G: tl.constexpr,  # next_power_of_2(G / 2): bytes a group row
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    dtype = x_ptr.dtype.element_ty
    NG = K // G
    HALF = G // 2
    gl = tl.arange(0, BLOCK_G)
    js = tl.arange(0, HALF_G)

    r64 = rows.to(tl.int64)
    q_rows, s_rows, z_rows = q_ptr + r64[:, None] * (K // 2), s_ptr + r64[:, None] * NG, z_ptr + r64[:, None] * NG
    up = r64 + N
    uq_rows, us_rows, uz_rows = q_ptr + up[:, None] * (K // 2), s_ptr + up[:, None] * NG, z_ptr + up[:, None] * NG

    ss = tl.zeros([BLOCK_G, HALF_G], dtype=tl.float32)  # (ss and acc_up are dead code unless NORM / SWIGLU)
    acc = tl.zeros([BLOCK_N, BLOCK_G, HALF_G], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_G, HALF_G], dtype=tl.float32)
    if PREFETCH:
        # the weights never depend on the previous kernel: the first tile goes out before the wait
        b, s, z = _load_q(q_rows, s_rows, z_rows, gl, js, row_mask, NG, HALF, HALF_G, EVICT)
        ub, us, uz = b, s, z
        if SWIGLU:
            ub, us, uz = _load_q(uq_rows, us_rows, uz_rows, gl, js, row_mask, NG, HALF, HALF_G, EVICT)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    for g0 in range(0, NG, BLOCK_G):
        gs = g0 + gl
        xe, xo, ss = _x_pair(x_ptr, nw_ptr, gs, js, NG, HALF, G, ss, NORM)
        if not PREFETCH:
            b, s, z = _load_q(q_rows, s_rows, z_rows, gs, js, row_mask, NG, HALF, HALF_G, EVICT)
            if SWIGLU:
                ub, us, uz = _load_q(uq_rows, us_rows, uz_rows, gs, js, row_mask, NG, HALF, HALF_G, EVICT)
        lo, hi = _dequant(b, s, z, dtype)
        acc += lo * xe + hi * xo
        if SWIGLU:
            ulo, uhi = _dequant(ub, us, uz, dtype)
            acc_up += ulo * xe + uhi * xo
        if PREFETCH:
            b, s, z = _load_q(q_rows, s_rows, z_rows, gs + BLOCK_G, js, row_mask, NG, HALF, HALF_G, EVICT)
            if SWIGLU:
                ub, us, uz = _load_q(uq_rows, us_rows, uz_rows, gs + BLOCK_G, js, row_mask, NG, HALF, HALF_G,
                                     EVICT)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)

    # gemv's epilogue
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(tl.sum(ss, axis=1), axis=0) / K + eps)
        y *= inv_rms
    y = y.to(dtype).to(tl.float32)
    if SWIGLU:
        yu = tl.sum(tl.sum(acc_up, axis=2), axis=1)
        if NORM:
            yu *= inv_rms
        yu = yu.to(dtype).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dtype).to(tl.float32) * yu
    if RESIDUAL:
        y += tl.load(res_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    y = y.to(dtype)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)
    if ARGMAX:
        _argmax_key_max(key_ptr, y.to(tl.float32), rows, row_mask, N)


@triton.jit
def _w_chunk(q_rows, s_rows, z_rows, js, row_mask, k0, K, NG, G, dtype, EVICT: tl.constexpr):
    """Columns k0 + 2j (low nibbles) and k0 + 2j + 1 (high) of the program's weight rows, as
    (BLOCK_N, BLOCK_K/2) tiles of x's dtype; each column's scale and zero gathered by its group."""
    j = k0 // 2 + js
    jm = j < K // 2
    m = row_mask[:, None] & jm[None, :]
    b = tl.load(q_rows + j[None, :], mask=m, other=0, eviction_policy=EVICT)
    g = (2 * j) // G
    s = tl.load(s_rows + g[None, :], mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    z = tl.load(z_rows + g[None, :], mask=m, other=0, eviction_policy=EVICT).to(tl.float32)
    lo = (((b & 0xF).to(tl.float32) - z) * s).to(dtype)
    hi = (((b >> 4).to(tl.float32) - z) * s).to(dtype)
    return lo, hi


@triton.jit
def _int4_matmul_kernel(
    x_ptr,  # (M, K) contiguous
    q_ptr,  # (N, K/2) uint8, or (2N, K/2) with SWIGLU
    s_ptr,  # (N, NG)
    z_ptr,  # (N, NG) uint8
    nw_ptr,  # (K,) norm weight, read only when NORM
    res_ptr,  # (M, N) contiguous residual, read only when RESIDUAL
    y_ptr,  # (M, N) contiguous
    M,
    N,
    K,
    G,
    eps,
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    EVICT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns n = rows of W
    row_mask = rows < N
    js = tl.arange(0, BLOCK_K // 2)
    dtype = x_ptr.dtype.element_ty
    NG = K // G

    x_rows = x_ptr + ms.to(tl.int64)[:, None] * K
    r64 = rows.to(tl.int64)
    q_rows, s_rows, z_rows = q_ptr + r64[:, None] * (K // 2), s_ptr + r64[:, None] * NG, z_ptr + r64[:, None] * NG
    up = r64 + N
    uq_rows, us_rows, uz_rows = q_ptr + up[:, None] * (K // 2), s_ptr + up[:, None] * NG, z_ptr + up[:, None] * NG
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # (ss and acc_up are dead code unless NORM / SWIGLU)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + 2 * js  # even columns
        km = k < K
        xm = m_mask[:, None] & km[None, :]
        xe = tl.load(x_rows + k[None, :], mask=xm, other=0.0)
        xo = tl.load(x_rows + k[None, :] + 1, mask=xm, other=0.0)
        if NORM:
            # as gemv's batched kernel: x * norm weight rounded to x's dtype, the rsqrt after the dot
            xef, xof = xe.to(tl.float32), xo.to(tl.float32)
            ss += tl.sum(xef * xef + xof * xof, axis=1)
            xe = (xef * tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)[None, :]).to(dtype)
            xo = (xof * tl.load(nw_ptr + k + 1, mask=km, other=0.0).to(tl.float32)[None, :]).to(dtype)
        lo, hi = _w_chunk(q_rows, s_rows, z_rows, js, row_mask, k0, K, NG, G, dtype, EVICT)
        acc = _dot_wt(xo, hi, _dot_wt(xe, lo, acc, DOT_F32), DOT_F32)
        if SWIGLU:
            ulo, uhi = _w_chunk(uq_rows, us_rows, uz_rows, js, row_mask, k0, K, NG, G, dtype, EVICT)
            acc_up = _dot_wt(xo, uhi, _dot_wt(xe, ulo, acc_up, DOT_F32), DOT_F32)

    y = acc
    if NORM:
        inv_rms = tl.rsqrt(ss / K + eps)[:, None]
        y *= inv_rms
    y = y.to(dtype).to(tl.float32)
    if SWIGLU:
        yu = acc_up
        if NORM:
            yu *= inv_rms
        yu = yu.to(dtype).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dtype).to(tl.float32) * yu
    out_offs = ms.to(tl.int64)[:, None] * N + rows[None, :]
    out_mask = m_mask[:, None] & row_mask[None, :]
    if RESIDUAL:
        y += tl.load(res_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + out_offs, y.to(dtype).to(y_ptr.dtype.element_ty), mask=out_mask)


# Fixed M = 1 tiles by device name, then (N, K, G, NORM, SWIGLU, RESIDUAL, PDL): (BLOCK_N,
# BLOCK_G, num_warps, num_stages). None yet timed: every shape takes `default_tile`.
TILES: dict[str, dict[tuple, tuple[int, int, int, int]]] = {}


def default_tile(K: int, G: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_G, num_warps, num_stages) of an M = 1 launch: 1024 columns a step (a
    quarter of gemv's bf16 tile in bytes read, 512 bytes a row) over 8 rows, so bench-285m's
    2048-row projections still launch 256 programs, fewer steps with more loads in flight."""
    return 8, max(1, min(triton.next_power_of_2(K // G), max(1, 1024 // G))), 4, 2


def default_matmul_tile(M: int, N: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMM: 16-row tiles for a batched
    decode step (still bound by the weight read: wide N tiles, one weight tile a program for
    every row), 64 x 64 for prefill (the dot's inputs reused across the tile)."""
    if M <= 16:
        return 16, 32 if N <= 4096 else 64, 128, 4, 3
    return 64, 64, 128, 4, 3


def _check(op, x, qweight, scales, zeros, group_size, swiglu=False):
    check_device(op, x=x, qweight=qweight, scales=scales, zeros=zeros)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_dtype(op, "qweight", qweight, (torch.uint8,))
    check_dtype(op, "scales", scales, (torch.float16,))
    check_dtype(op, "zeros", zeros, (torch.uint8,))
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be (..., K), got a 0-d tensor")
    K = x.shape[-1]
    if group_size < 2 or group_size % 2 or K % group_size:
        raise ValueError(f"{op}: group_size must be even and divide K = {K}, got {group_size}")
    if qweight.dim() != 2 or qweight.shape[1] * 2 != K:
        raise ValueError(f"{op}: qweight must be (N, K/2) = (N, {K // 2}) uint8, got shape {tuple(qweight.shape)}")
    N = qweight.shape[0]
    check_shape(op, "scales", scales, (N, K // group_size))
    check_shape(op, "zeros", zeros, (N, K // group_size))
    if swiglu and N % 2:
        raise ValueError(f"{op}: swiglu needs a (gate | up) weight with an even row count, got {N}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    return N // 2 if swiglu else N, K


def int4_gemv(x, qweight, scales, zeros, group_size, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None,
              pdl=None, out_dtype=None, argmax_key=None, eviction_policy=""):
    """kernels.gemv with an INT4 weight: x (..., K) holding 1 <= M <= 16 rows -> y (..., N or F),
    the options and their checks as gemv's."""
    op = "int4_gemv"
    N, K = _check(op, x, qweight, scales, zeros, group_size, swiglu)
    M = math.prod(x.shape[:-1])
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"{op}: x (..., K) must hold 1 <= M <= {MAX_ROWS} rows, "
                         f"got shape {tuple(x.shape)} (M = {M})")
    if norm_weight is not None:
        check_dtype(op, "norm_weight", norm_weight, FLOAT_DTYPES)
        check_shape(op, "norm_weight", norm_weight, (K,))
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"{op}: out_dtype must be x's dtype {x.dtype} or torch.float32, got {out_dtype}")
    out_shape = (*x.shape[:-1], N)
    if residual is not None:
        check_shape(op, "residual", residual, out_shape)
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual dtype {residual.dtype} must equal x dtype {x.dtype}")
        residual = residual.contiguous()
    if argmax_key is not None:
        if M != 1:
            raise ValueError(f"{op}: argmax_key takes one row of x (M = 1), got M = {M}")
        check_shape(op, "argmax_key", argmax_key, (1,))
        check_dtype(op, "argmax_key", argmax_key, (torch.int64,))
    if eviction_policy not in EVICTION_POLICIES:
        raise ValueError(f"{op}: eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
    y = torch.empty(out_shape, dtype=out_dtype, device=x.device)
    flags = dict(NORM=norm_weight is not None, SWIGLU=bool(swiglu), RESIDUAL=residual is not None,
                 EVICT=eviction_policy)
    nw = None if norm_weight is None else norm_weight.contiguous()
    if M > 1:
        return _matmul(x.reshape(M, K).contiguous(), qweight, scales, zeros, group_size, nw, residual, y, eps, flags)
    x1 = x.reshape(K).contiguous()
    args = (x1, qweight, scales, zeros, x1 if nw is None else nw, y if residual is None else residual, y,
            y if argmax_key is None else argmax_key, N, K, group_size, float(eps))
    flags["ARGMAX"] = argmax_key is not None
    half_g = triton.next_power_of_2(group_size // 2)
    if interpreting():
        # wide tiles: the interpreter's cost is per program and per op, hardly per element
        bn, bg = min(128, triton.next_power_of_2(N)), min(4, triton.next_power_of_2(K // group_size))
        _int4_gemv_kernel[(triton.cdiv(N, bn),)](*args, **flags, PREFETCH=bool(pdl), PDL=False, BLOCK_N=bn,
                                                 BLOCK_G=bg, HALF_G=half_g)
        return y
    pdl = use_pdl(x.device) if pdl is None else pdl
    key = (N, K, group_size, flags["NORM"], flags["SWIGLU"], flags["RESIDUAL"], pdl)
    bn, bg, warps, stages = TILES.get(_device_name(x.device), {}).get(key) or default_tile(K, group_size)
    _int4_gemv_kernel[(triton.cdiv(N, bn),)](*args, **flags, PREFETCH=pdl, PDL=pdl, BLOCK_N=bn, BLOCK_G=bg,
                                             HALF_G=half_g, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


def int4_matmul(x, qweight, scales, zeros, group_size, eviction_policy=""):
    """x (..., K), any number of rows M -> x @ W.T (..., N) in x's dtype."""
    N, K = _check("int4_matmul", x, qweight, scales, zeros, group_size)
    M = math.prod(x.shape[:-1])
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    flags = dict(NORM=False, SWIGLU=False, RESIDUAL=False, EVICT=eviction_policy)
    return _matmul(x.reshape(M, K).contiguous(), qweight, scales, zeros, group_size, None, None, y, 1e-6, flags)


def _matmul(x, qweight, scales, zeros, group_size, nw, residual, y, eps, flags):
    """The GEMM's launch: x (M, K) contiguous, y and residual contiguous (M, N) in memory."""
    M, K = x.shape
    N = y.shape[-1]
    args = (x, qweight, scales, zeros, x if nw is None else nw, y if residual is None else residual, y,
            M, N, K, group_size, float(eps))
    # fp32 dots for fp32 x (exact products, no tf32) and for bf16 under the interpreter (gemv's reason)
    dot_f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting())
    if interpreting():
        bn = min(64, max(16, triton.next_power_of_2(N)))
        _int4_matmul_kernel[(triton.cdiv(M, 16), triton.cdiv(N, bn))](*args, **flags, DOT_F32=dot_f32, BLOCK_M=16,
                                                                     BLOCK_N=bn, BLOCK_K=64)
        return y
    bm, bn, bk, warps, stages = default_matmul_tile(M, N)
    _int4_matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](*args, **flags, DOT_F32=dot_f32, BLOCK_M=bm,
                                                                 BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                                                 num_stages=stages)
    return y


def int4_dequantize_ref(qweight, scales, zeros, group_size):
    """The weight (N, K) in fp32, exactly: (q - z) * s."""
    q = torch.stack([qweight & 0xF, qweight >> 4], -1).reshape(qweight.shape[0], -1).float()
    return (q - zeros.float().repeat_interleave(group_size, 1)) * scales.float().repeat_interleave(group_size, 1)


def int4_gemv_ref(x, qweight, scales, zeros, group_size, **options):
    """The spec: kernels.gemv's reference on the dequantized weight, rounded to x's dtype."""
    from .gemv import gemv_ref
    return gemv_ref(x, int4_dequantize_ref(qweight, scales, zeros, group_size).to(x.dtype), **options)


def int4_matmul_ref(x, qweight, scales, zeros, group_size, eviction_policy=""):
    """x @ W.T with W dequantized and rounded to x's dtype, fp32 sums rounded once."""
    w = int4_dequantize_ref(qweight, scales, zeros, group_size).to(x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)
