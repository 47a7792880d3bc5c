"""INT4 projections with the dequantization fused: a GEMV for the decode step and a GEMM for
every other row count; INT2 (dual-bit's copy of the shared block) by the same kernels.

    y = x @ W.T,   W[n, k] = ((q[n, k] - zeros[n, g]) * scales[n, g]).to(x.dtype),  g = k // G

Layouts (worker/model/quant.py): ``qweight`` uint8 (N, K/CPB) with CPB = 8 / bits codes a byte,
column CPB·j + c in bits [c·bits, (c + 1)·bits) of byte j (INT4: column 2j in the low nibble,
2j+1 in the high one); ``scales`` float16 (N, K/G); ``zeros`` uint8 (N, K/G); G (the group size)
a multiple of CPB dividing K. The dequantized weight is exact in fp32 and rounded to x's dtype
before it multiplies, so each kernel computes what kernels/gemv.py computes with the weight
`int4_dequantize_ref` gives: same options, same rounding points, the same tolerance.

``int4_gemv`` takes kernels.gemv's call (``norm_weight``, ``swiglu``, ``residual``,
``argmax_key``, ``out_dtype``, ``eviction_policy``, ``pdl``) for 1 <= M <= 16 rows.

- M = 1 (``_int4_gemv_kernel``): one program per BLOCK_N output rows, looping over the groups
  BLOCK_G at a time: a (BLOCK_N, BLOCK_G, G/CPB) tile of bytes, each code position c against
  x's columns CPB·j + c, the group's scale and zero broadcast along the last axis (no gather).
  Summed once at the end, as gemv's accumulator tile is; no split-K, so the epilogues need no
  atomics. With ``pdl`` the first tile of weights is loaded before the wait on the previous
  kernel and each next one a step ahead (gemv's PREFETCH).
- M > 1 (``_int4_matmul_kernel``): a (BLOCK_M, BLOCK_N) tile of y per program, K in BLOCK_K
  chunks, the chunk's bytes loaded once and dequantized in registers (each byte's scale and
  zero gathered by its group), one tl.dot per code position (x's columns CPB·j + c). The
  decode step's options ride in its epilogue as in gemv's batched kernel.

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
from .gemv import MAX_ROWS, _argmax_key_max, _device_name, _dot_wt, check_options


@triton.jit
def _load_q(q_rows, s_rows, z_rows, gs, js, row_mask, NG, BYTES, BYTES_G: tl.constexpr, EVICT: tl.constexpr):
    """Groups gs of the program's rows: bytes (BLOCK_N, BLOCK_G, BYTES_G) uint8, scales and zeros
    (BLOCK_N, BLOCK_G, 1) fp32."""
    g_mask = gs < NG
    m = row_mask[:, None, None] & g_mask[None, :, None] & (js < BYTES)[None, None, :]
    b = tl.load(q_rows[:, :, None] + (gs[:, None] * BYTES + js[None, :])[None, :, :], mask=m, other=0,
                eviction_policy=EVICT)
    mg = row_mask[:, None] & g_mask[None, :]
    s = tl.load(s_rows + gs[None, :], mask=mg, other=0.0, eviction_policy=EVICT).to(tl.float32)
    z = tl.load(z_rows + gs[None, :], mask=mg, other=0, eviction_policy=EVICT).to(tl.float32)
    return b, s[:, :, None], z[:, :, None]


@triton.jit
def _dequant(b, s, z, c: tl.constexpr, BITS: tl.constexpr, dtype):
    """Code c of each byte of b (bits [c·BITS, (c+1)·BITS)) as weights of x's dtype, widened to
    fp32."""
    q = (b >> (c * BITS)) & ((1 << BITS) - 1)
    return ((q.to(tl.float32) - z) * s).to(dtype).to(tl.float32)


@triton.jit
def _x_at(x_ptr, nw_ptr, gs, js, c: tl.constexpr, NG, BYTES, G, ss, NORM: tl.constexpr, CPB: tl.constexpr):
    """x at the columns of code c of groups gs' bytes (column g·G + CPB·j + c) as (1, BLOCK_G,
    BYTES_G) fp32 (times the norm weight with NORM), and ss plus its squares."""
    k = gs[:, None] * G + CPB * js[None, :] + c
    m = (gs < NG)[:, None] & (js < BYTES)[None, :]
    xv = tl.load(x_ptr + k, mask=m, other=0.0).to(tl.float32)
    if NORM:
        ss += xv * xv
        xv = xv * tl.load(nw_ptr + k, mask=m, other=0.0).to(tl.float32)
    return xv[None, :, :], ss


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
    BITS: tl.constexpr,  # 4 or 2 (dual-bit's copy): CPB = 8 / BITS codes a byte
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,  # groups a step
    BYTES_G: tl.constexpr,  # next_power_of_2(G / CPB): bytes a group row
):
    CPB: tl.constexpr = 8 // BITS
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    dtype = x_ptr.dtype.element_ty
    NG = K // G
    BYTES = G // CPB
    gl = tl.arange(0, BLOCK_G)
    js = tl.arange(0, BYTES_G)

    r64 = rows.to(tl.int64)
    q_rows, s_rows, z_rows = q_ptr + r64[:, None] * (K // CPB), s_ptr + r64[:, None] * NG, z_ptr + r64[:, None] * NG
    up = r64 + N
    uq_rows, us_rows, uz_rows = q_ptr + up[:, None] * (K // CPB), s_ptr + up[:, None] * NG, z_ptr + up[:, None] * NG

    ss = tl.zeros([BLOCK_G, BYTES_G], dtype=tl.float32)  # (ss and acc_up are dead code unless NORM / SWIGLU)
    acc = tl.zeros([BLOCK_N, BLOCK_G, BYTES_G], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_G, BYTES_G], dtype=tl.float32)
    if PREFETCH:
        # the weights never depend on the previous kernel: the first tile goes out before the wait
        b, s, z = _load_q(q_rows, s_rows, z_rows, gl, js, row_mask, NG, BYTES, BYTES_G, EVICT)
        ub, us, uz = b, s, z
        if SWIGLU:
            ub, us, uz = _load_q(uq_rows, us_rows, uz_rows, gl, js, row_mask, NG, BYTES, BYTES_G, EVICT)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    for g0 in range(0, NG, BLOCK_G):
        gs = g0 + gl
        if not PREFETCH:
            b, s, z = _load_q(q_rows, s_rows, z_rows, gs, js, row_mask, NG, BYTES, BYTES_G, EVICT)
            if SWIGLU:
                ub, us, uz = _load_q(uq_rows, us_rows, uz_rows, gs, js, row_mask, NG, BYTES, BYTES_G, EVICT)
        for c in tl.static_range(CPB):
            xv, ss = _x_at(x_ptr, nw_ptr, gs, js, c, NG, BYTES, G, ss, NORM, CPB)
            acc += _dequant(b, s, z, c, BITS, dtype) * xv
            if SWIGLU:
                acc_up += _dequant(ub, us, uz, c, BITS, dtype) * xv
        if PREFETCH:
            b, s, z = _load_q(q_rows, s_rows, z_rows, gs + BLOCK_G, js, row_mask, NG, BYTES, BYTES_G, EVICT)
            if SWIGLU:
                ub, us, uz = _load_q(uq_rows, us_rows, uz_rows, gs + BLOCK_G, js, row_mask, NG, BYTES, BYTES_G,
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
def _w_bytes(q_rows, s_rows, z_rows, js, row_mask, k0, K, G, CPB: tl.constexpr, EVICT: tl.constexpr):
    """The bytes of columns [k0, k0 + BLOCK_K) of the program's weight rows (BLOCK_N,
    BLOCK_K/CPB), and each byte's scale and zero (gathered by its group) in fp32."""
    j = k0 // CPB + js
    m = row_mask[:, None] & (j < K // CPB)[None, :]
    b = tl.load(q_rows + j[None, :], mask=m, other=0, eviction_policy=EVICT)
    g = (CPB * j) // G
    s = tl.load(s_rows + g[None, :], mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    z = tl.load(z_rows + g[None, :], mask=m, other=0, eviction_policy=EVICT).to(tl.float32)
    return b, s, z


@triton.jit
def _x_cols(x_rows, nw_ptr, k, km, m_mask, ss, NORM: tl.constexpr, dtype):
    """The (BLOCK_M, BLOCK_K/CPB) x tile at columns k (one code position); with NORM, times the
    norm weight rounded back to x's dtype (gemv's batched kernel), and ss plus each row's squares."""
    xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
    if NORM:
        xf = xv.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        xv = (xf * tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)[None, :]).to(dtype)
    return xv, ss


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
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    CPB: tl.constexpr = 8 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns n = rows of W
    row_mask = rows < N
    js = tl.arange(0, BLOCK_K // CPB)
    dtype = x_ptr.dtype.element_ty
    NG = K // G

    x_rows = x_ptr + ms.to(tl.int64)[:, None] * K
    r64 = rows.to(tl.int64)
    q_rows, s_rows, z_rows = q_ptr + r64[:, None] * (K // CPB), s_ptr + r64[:, None] * NG, z_ptr + r64[:, None] * NG
    up = r64 + N
    uq_rows, us_rows, uz_rows = q_ptr + up[:, None] * (K // CPB), s_ptr + up[:, None] * NG, z_ptr + up[:, None] * NG
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # (ss and acc_up are dead code unless NORM / SWIGLU)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b, s, z = _w_bytes(q_rows, s_rows, z_rows, js, row_mask, k0, K, G, CPB, EVICT)
        if SWIGLU:
            ub, us, uz = _w_bytes(uq_rows, us_rows, uz_rows, js, row_mask, k0, K, G, CPB, EVICT)
        # one dot per code position c of a byte: x's columns k0 + CPB·j + c against code c
        for c in tl.static_range(CPB):
            k = k0 + CPB * js + c
            xv, ss = _x_cols(x_rows, nw_ptr, k, k < K, m_mask, ss, NORM, dtype)
            acc = _dot_wt(xv, _dequant(b, s, z, c, BITS, dtype).to(dtype), acc, DOT_F32)
            if SWIGLU:
                acc_up = _dot_wt(xv, _dequant(ub, us, uz, c, BITS, dtype).to(dtype), acc_up, DOT_F32)

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
    """(BLOCK_N, BLOCK_G, num_warps, num_stages) of an M = 1 launch: 1024 columns a step (512
    contiguous bytes of a row) over 4 rows, 2 KB a step: one 16-byte load per thread of 4 warps,
    and bench-285m's 2048-row projections launch 512 programs (untimed: a starting point for a
    sweep in the decode step, as bench/tiles.py does for gemv)."""
    return 4, max(1, min(triton.next_power_of_2(K // G), max(1, 1024 // G))), 4, 2


def default_matmul_tile(M: int, N: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMM: 16-row tiles for a batched
    decode step (still bound by the weight read: wide N tiles, one weight tile a program for
    every row), 64 x 64 for prefill (the dot's inputs reused across the tile)."""
    if M <= 16:
        return 16, 32 if N <= 4096 else 64, 128, 4, 3
    return 64, 64, 128, 4, 3


BITS = (4, 2)  # the code widths the kernels read (2: dual-bit's copy of the shared block)


def _check(op, x, qweight, scales, zeros, group_size, bits, swiglu=False):
    check_device(op, x=x, qweight=qweight, scales=scales, zeros=zeros)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_dtype(op, "qweight", qweight, (torch.uint8,))
    check_dtype(op, "scales", scales, (torch.float16,))
    check_dtype(op, "zeros", zeros, (torch.uint8,))
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be (..., K), got a 0-d tensor")
    if bits not in BITS:
        raise ValueError(f"{op}: bits must be one of {BITS}, got {bits}")
    K, cpb = x.shape[-1], 8 // bits
    if group_size < cpb or group_size % cpb or K % group_size:
        raise ValueError(f"{op}: group_size must be a multiple of {cpb} dividing K = {K}, got {group_size}")
    if qweight.dim() != 2 or qweight.shape[1] * cpb != K:
        raise ValueError(f"{op}: qweight must be (N, K/{cpb}) = (N, {K // cpb}) uint8, "
                         f"got shape {tuple(qweight.shape)}")
    N = qweight.shape[0]
    check_shape(op, "scales", scales, (N, K // group_size))
    check_shape(op, "zeros", zeros, (N, K // group_size))
    if swiglu and N % 2:
        raise ValueError(f"{op}: swiglu needs a (gate | up) weight with an even row count, got {N}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    return N // 2 if swiglu else N, K


def int4_gemv(x, qweight, scales, zeros, group_size, *, bits=4, norm_weight=None, eps=1e-6, swiglu=False,
              residual=None, pdl=None, out_dtype=None, argmax_key=None, eviction_policy=""):
    """kernels.gemv with an INT4 weight (bits=2: an INT2 one, four codes a byte, column 4j + c in
    bits [2c, 2c + 2)): x (..., K) holding 1 <= M <= 16 rows -> y (..., N or F), the options
    and their checks as gemv's."""
    op = "int4_gemv"
    N, K = _check(op, x, qweight, scales, zeros, group_size, bits, swiglu)
    M = math.prod(x.shape[:-1])
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"{op}: x (..., K) must hold 1 <= M <= {MAX_ROWS} rows, "
                         f"got shape {tuple(x.shape)} (M = {M})")
    y, residual = check_options(op, x, N, M, norm_weight, out_dtype, residual, argmax_key, eviction_policy)
    flags = dict(NORM=norm_weight is not None, SWIGLU=bool(swiglu), RESIDUAL=residual is not None,
                 EVICT=eviction_policy, BITS=bits)
    nw = None if norm_weight is None else norm_weight.contiguous()
    if M > 1:
        return _matmul(x.reshape(M, K).contiguous(), qweight, scales, zeros, group_size, nw, residual, y, eps, flags)
    x1 = x.reshape(K).contiguous()
    args = (x1, qweight, scales, zeros, x1 if nw is None else nw, y if residual is None else residual, y,
            y if argmax_key is None else argmax_key, N, K, group_size, float(eps))
    flags["ARGMAX"] = argmax_key is not None
    bytes_g = triton.next_power_of_2(group_size * bits // 8)
    if interpreting():
        # wide tiles: the interpreter's cost is per program and per op, hardly per element
        bn, bg = min(128, triton.next_power_of_2(N)), min(4, triton.next_power_of_2(K // group_size))
        _int4_gemv_kernel[(triton.cdiv(N, bn),)](*args, **flags, PREFETCH=bool(pdl), PDL=False, BLOCK_N=bn,
                                                 BLOCK_G=bg, BYTES_G=bytes_g)
        return y
    pdl = use_pdl(x.device) if pdl is None else pdl
    key = (N, K, group_size, bits, flags["NORM"], flags["SWIGLU"], flags["RESIDUAL"], pdl)
    bn, bg, warps, stages = TILES.get(_device_name(x.device), {}).get(key) or default_tile(K, group_size)
    _int4_gemv_kernel[(triton.cdiv(N, bn),)](*args, **flags, PREFETCH=pdl, PDL=pdl, BLOCK_N=bn, BLOCK_G=bg,
                                             BYTES_G=bytes_g, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


def int4_matmul(x, qweight, scales, zeros, group_size, bits=4, eviction_policy=""):
    """x (..., K), any number of rows M -> x @ W.T (..., N) in x's dtype (bits as int4_gemv's)."""
    N, K = _check("int4_matmul", x, qweight, scales, zeros, group_size, bits)
    M = math.prod(x.shape[:-1])
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    flags = dict(NORM=False, SWIGLU=False, RESIDUAL=False, EVICT=eviction_policy, BITS=bits)
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


def int4_dequantize_ref(qweight, scales, zeros, group_size, bits=4):
    """The weight (N, K) in fp32, exactly: (q - z) * s."""
    mask = (1 << bits) - 1
    q = torch.stack([(qweight >> (bits * c)) & mask for c in range(8 // bits)], -1).reshape(qweight.shape[0], -1)
    q = q.float()
    return (q - zeros.float().repeat_interleave(group_size, 1)) * scales.float().repeat_interleave(group_size, 1)


def int4_gemv_ref(x, qweight, scales, zeros, group_size, bits=4, **options):
    """The spec: kernels.gemv's reference on the dequantized weight, rounded to x's dtype."""
    from .gemv import gemv_ref
    return gemv_ref(x, int4_dequantize_ref(qweight, scales, zeros, group_size, bits).to(x.dtype), **options)


def int4_matmul_ref(x, qweight, scales, zeros, group_size, bits=4, eviction_policy=""):
    """x @ W.T with W dequantized and rounded to x's dtype, fp32 sums rounded once."""
    w = int4_dequantize_ref(qweight, scales, zeros, group_size, bits).to(x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)
