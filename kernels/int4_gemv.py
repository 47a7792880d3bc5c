"""INT4 projections with the dequantization fused: GEMVs for the decode step and a GEMM for
every other row count; INT2 (dual-bit's copy of the shared block) by the same kernels.

    y = x @ W.T,   W[n, k] = ((q[n, k] - zeros[n, g]) * scales[n, g]).to(x.dtype),  g = k // G

Layouts (worker/model/quant.py): ``qweight`` uint8 (N, K/CPB) with CPB = 8 / bits codes a byte,
column CPB·j + c in bits [c·bits, (c + 1)·bits) of byte j (INT4: column 2j in the low nibble,
2j+1 in the high one); ``scales`` float16 (N, K/G); ``zeros`` uint8 (N, K/G), below 2^bits; G
(the group size) a multiple of CPB dividing K. The dequantized weight is exact in fp32 and
rounded to x's dtype before it multiplies, so each kernel computes what kernels/gemv.py computes
with the weight `int4_dequantize_ref` gives: same options, same rounding points, the same
tolerance. The kernels reach that weight without a conversion instruction (Hopper issues them
at a fraction of the other ALU ops' rate, and a decode step's INT4 projections, their weights in
L2, are bound by the instructions spent per weight, not by the bytes): the code becomes the
float 2^m + q by one AND/OR into a float's mantissa, and the weight comes from 16-bit float
pair arithmetic that rounds once (`_pair_weights`; the block comment above `_pair_consts`).

``int4_gemv`` takes kernels.gemv's call (``norm_weight``, ``swiglu``, ``residual``,
``argmax_key``, ``out_dtype``, ``eviction_policy``, ``pdl``) for 1 <= M <= 16 rows.

- M = 1, the bytes kernel (``_int4_gemv_kernel``, any group size and bits, any float x): one
  program per BLOCK_N output rows, looping over the groups BLOCK_G at a time: a (BLOCK_N,
  BLOCK_G, G/CPB) tile of bytes, each code position c against x's columns CPB·j + c, the group's
  scale and zero broadcast along the last axis (no gather), fp32 FMAs summed once at the end.
- M = 1, the mma kernel (``_int4_gemv_mma_kernel``: INT4, G a multiple of 8, bf16 / fp16 x):
  the codes read as int32 words (8 columns each) a (BLOCK_N, BLOCK_G, G/8) tile a step, each
  word's fields j and j + 4 dequantized as one 16-bit pair, and the products on the tensor cores:
  x is the dot's left operand, its row 0 x's leading bf16 part and row 1 the rest (with the
  norm, x · norm_weight has up to 16 bits: two bf16 hold it exactly, so the fp32 product of the
  unfused path is kept), the other 14 rows zero. BLOCK_N >= 16 (tl.dot), so a 2048-row
  projection has few row blocks: SPLIT_K programs share a row block, each summing a slice of the
  groups; the block's last to finish (an atomic count) adds the slices' sums in slice order and
  runs the epilogue, so the order is one whichever finishes last.
- M = 1, the pairs kernel (``_int4_gemv_pairs_kernel``: INT4, G a multiple of 8, bf16 x): the mma
  kernel's words, tiles and K slices, each word's pairs turned into bf16 weights by three packed
  fmas of inline PTX (the block comment above `_PAIR_ASM`) and multiplied by x in fp32 FMAs: the
  fastest on the H200 at bench-285m's shapes (bench/results/int4-tiles-cuda.json).
- M = 2..16 on a pairs tile (``MATMUL_TILES`` or ``tile=``): the pairs kernel with a third grid
  axis over x's rows, each row on the programs of its own M = 1 call, so row m of y is bit for
  bit that call's (`_rows_tile`).
- M > 1 otherwise (``_int4_matmul_kernel``): a (BLOCK_M, BLOCK_N) tile of y per program, K in BLOCK_K
  chunks, the chunk's bytes loaded once and dequantized in registers (each byte's scale and
  zero gathered by its group), one tl.dot per code position (x's columns CPB·j + c). The
  decode step's options ride in its epilogue as in gemv's batched kernel.

With ``pdl`` the M = 1 kernels load their first tile of weights before the wait on the previous
kernel and each next one a step ahead (gemv's PREFETCH).

``int4_matmul`` is that GEMM without options for any number of rows (prefill, verify, a
batched decode step's projections).

Row order: every launch takes a fixed tile per shape (`TILES`, `MATMUL_TILES`, else the
defaults; the interpreter one tile; ``tile=`` an explicit one, for sweeps and tests), never an
autotuner's, and a float32 y or the argmax epilogue use the plain call's tile, so each row is
summed in one order whatever is asked of the call. bench/int4_tiles.py sweeps the tiles.
"""
import math

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_shape, interpreting
from ._launch import use_pdl
from .gemv import MAX_ROWS, _argmax_key_max, _dot_wt, check_options, table_entry


@triton.jit
def _load_q(q_rows, s_rows, z_rows, gs, js, row_mask, NG, BYTES, BYTES_G: tl.constexpr, EVICT: tl.constexpr,
            WDT: tl.constexpr):
    """Groups gs of the program's rows: bytes (BLOCK_N, BLOCK_G, BYTES_G) uint8, and the groups'
    `_pair_consts` (BLOCK_N, BLOCK_G, 1)."""
    g_mask = gs < NG
    m = row_mask[:, None, None] & g_mask[None, :, None] & (js < BYTES)[None, None, :]
    b = tl.load(q_rows[:, :, None] + (gs[:, None] * BYTES + js[None, :])[None, :, :], mask=m, other=0,
                eviction_policy=EVICT)
    mg = row_mask[:, None] & g_mask[None, :]
    s = tl.load(s_rows + gs[None, :], mask=mg, other=0.0, eviction_policy=EVICT)
    z = tl.load(z_rows + gs[None, :], mask=mg, other=0, eviction_policy=EVICT)
    zc, s_hi, s_lo = _pair_consts(s[:, :, None], z[:, :, None], WDT)
    return b, zc, s_hi, s_lo


@triton.jit
def _dequant(b, zc, s_hi, s_lo, c: tl.constexpr, BITS: tl.constexpr, WDT: tl.constexpr):
    """Code c of each byte of b (bits [c·BITS, (c+1)·BITS)) as weights of x's dtype, exact
    (`_pair_weights`; the code as 2^m + q by an OR, no int-to-float conversion)."""
    q = ((b >> (c * BITS)) & ((1 << BITS) - 1)).to(tl.uint16)
    if WDT == 1:
        code = (q | 0x6400).to(tl.float16, bitcast=True)
    else:
        code = (q | 0x4300).to(tl.bfloat16, bitcast=True)
    return _pair_weights(code, zc, s_hi, s_lo, WDT)


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
    WDT: tl.constexpr = 1 if dtype == tl.float16 else 2 if dtype == tl.float32 else 0  # `_pair_consts`
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
        b, zc, sh, sl = _load_q(q_rows, s_rows, z_rows, gl, js, row_mask, NG, BYTES, BYTES_G, EVICT, WDT)
        ub, uzc, ush, usl = b, zc, sh, sl
        if SWIGLU:
            ub, uzc, ush, usl = _load_q(uq_rows, us_rows, uz_rows, gl, js, row_mask, NG, BYTES, BYTES_G, EVICT,
                                        WDT)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    for g0 in range(0, NG, BLOCK_G):
        gs = g0 + gl
        if not PREFETCH:
            b, zc, sh, sl = _load_q(q_rows, s_rows, z_rows, gs, js, row_mask, NG, BYTES, BYTES_G, EVICT, WDT)
            if SWIGLU:
                ub, uzc, ush, usl = _load_q(uq_rows, us_rows, uz_rows, gs, js, row_mask, NG, BYTES, BYTES_G, EVICT,
                                            WDT)
        for c in tl.static_range(CPB):
            xv, ss = _x_at(x_ptr, nw_ptr, gs, js, c, NG, BYTES, G, ss, NORM, CPB)
            acc += _dequant(b, zc, sh, sl, c, BITS, WDT).to(tl.float32) * xv
            if SWIGLU:
                acc_up += _dequant(ub, uzc, ush, usl, c, BITS, WDT).to(tl.float32) * xv
        if PREFETCH:
            b, zc, sh, sl = _load_q(q_rows, s_rows, z_rows, gs + BLOCK_G, js, row_mask, NG, BYTES, BYTES_G, EVICT,
                                    WDT)
            if SWIGLU:
                ub, uzc, ush, usl = _load_q(uq_rows, us_rows, uz_rows, gs + BLOCK_G, js, row_mask, NG, BYTES, BYTES_G,
                                     EVICT, WDT)
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
def _w_bytes(q_rows, s_rows, z_rows, js, row_mask, k0, K, G, CPB: tl.constexpr, EVICT: tl.constexpr,
             WDT: tl.constexpr):
    """The bytes of columns [k0, k0 + BLOCK_K) of the program's weight rows (BLOCK_N,
    BLOCK_K/CPB), and the `_pair_consts` of each byte's group (gathered)."""
    j = k0 // CPB + js
    m = row_mask[:, None] & (j < K // CPB)[None, :]
    b = tl.load(q_rows + j[None, :], mask=m, other=0, eviction_policy=EVICT)
    g = (CPB * j) // G
    s = tl.load(s_rows + g[None, :], mask=m, other=0.0, eviction_policy=EVICT)
    z = tl.load(z_rows + g[None, :], mask=m, other=0, eviction_policy=EVICT)
    zc, s_hi, s_lo = _pair_consts(s, z, WDT)
    return b, zc, s_hi, s_lo


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
    WDT: tl.constexpr = 1 if dtype == tl.float16 else 2 if dtype == tl.float32 else 0  # `_pair_consts`
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
        b, zc, sh, sl = _w_bytes(q_rows, s_rows, z_rows, js, row_mask, k0, K, G, CPB, EVICT, WDT)
        if SWIGLU:
            ub, uzc, ush, usl = _w_bytes(uq_rows, us_rows, uz_rows, js, row_mask, k0, K, G, CPB, EVICT, WDT)
        # one dot per code position c of a byte: x's columns k0 + CPB·j + c against code c
        for c in tl.static_range(CPB):
            k = k0 + CPB * js + c
            xv, ss = _x_cols(x_rows, nw_ptr, k, k < K, m_mask, ss, NORM, dtype)
            acc = _dot_wt(xv, _dequant(b, zc, sh, sl, c, BITS, WDT), acc, DOT_F32)
            if SWIGLU:
                acc_up = _dot_wt(xv, _dequant(ub, uzc, ush, usl, c, BITS, WDT), acc_up, DOT_F32)

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


# -- the exact dequantization, without conversion instructions ------------------------------------
#
# A code q becomes the 16-bit float 2^m + q by an OR into its mantissa (bf16 128 + q, fp16
# 1024 + q): no int-to-float conversion. The mma kernel reads int32 words (column 8u + f in bits
# [4f, 4f + 4), the byte layout above read little-endian), and one AND/OR of a word shifted by 4j
# puts fields j and j + 4 in the two halves of one 32-bit register: a 16-bit float pair, so every
# step after it runs on packed pairs, two weights an instruction. The weight of x's dtype is then
# exact, as the spec rounds it:
#   n = (2^m + q) - (2^m + z)                                  exact (small integers)
#   bf16: w = fma(n, s_hi, n * s_lo) = RN_bf16(n · s)          s = s_hi + s_lo, s_hi s truncated
#         to bf16's 8 bits, s_lo the <= 3 bits left of fp16's 11; n · s_lo (<= 7 bits) is exact in
#         bf16, so the fma rounds the exact n · s once (no fp32 product rounded to bf16 after)
#   fp16: w = n * s = RN_fp16(n · s)                           one rounding of the exact product
#   fp32: w = float(n) * s                                     exact
# (n is exact because z < 2^BITS, which quant.group_params guarantees.)


@triton.jit
def _pair_consts(s, z, WDT: tl.constexpr):
    """Per-group constants of `_pair_weights` from scales s (fp16) and zeros z (uint8), any shape:
    (the zero as a pair code 2^m + z, s_hi, s_lo) for WDT 0 (bf16 x), 1 (fp16), 2 (fp32)."""
    if WDT == 1:
        zc = (z.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        s_hi = s
        s_lo = s
    else:
        zc = (z.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        sf = s.to(tl.float32)
        if WDT == 2:
            s_hi = sf
            s_lo = sf
        else:
            hi = sf.to(tl.uint32, bitcast=True) & 0xFFFF0000
            lo = (sf - hi.to(tl.float32, bitcast=True)).to(tl.uint32, bitcast=True) >> 16  # exact: <= 3 bits
            s_hi = (hi >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            s_lo = lo.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return zc, s_hi, s_lo


# The interpreter does bf16 arithmetic on the bit patterns as integers (kernels/gemv.py's dot
# note): under it the bf16 weights take the same rounding by integer ops on their fp32 value.
_INTERP = tl.constexpr(interpreting())


@triton.jit
def _pair_weights(p, zc, s_hi, s_lo, WDT: tl.constexpr):
    """The weights of codes p (pair values 2^m + q) with their group's constants (`_pair_consts`,
    broadcastable to p), in x's dtype: exactly RN((q - z) · s) (the block comment above)."""
    if WDT == 1:
        w = (p - zc) * s_hi
    elif WDT == 2:
        w = (p.to(tl.float32) - zc.to(tl.float32)) * s_hi
    elif _INTERP:
        v = (p.to(tl.float32) - zc.to(tl.float32)) * (s_hi.to(tl.float32) + s_lo.to(tl.float32))
        u = v.to(tl.uint32, bitcast=True)
        w = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        n = p - zc
        w = tl.fma(n, s_hi, n * s_lo)
    return w


@triton.jit
def _x_mma(xp, dtype):
    """x (8·BLOCK_G·WORDS_G,) fp32 in the weights' column order (times the norm weight: exact, up to
    twice x's bits) -> the dot's left operand (16, 8·BLOCK_G·WORDS_G) in x's dtype: row 0 x's
    leading part, row 1 the rest (exact: x·nw's 16 bits fit two bf16), the other rows zero."""
    if dtype == tl.bfloat16:
        hi_bits = xp.to(tl.uint32, bitcast=True) & 0xFFFF0000
        hi = hi_bits.to(tl.float32, bitcast=True)
        lo = ((xp - hi).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (hi_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        hi = xp.to(dtype)
        lo = (xp - hi.to(tl.float32)).to(dtype)
    r = tl.arange(0, 16)[:, None]
    return tl.where(r == 0, hi[None, :], tl.where(r == 1, lo[None, :], 0.0))


@triton.jit
def _mma_weights(wd, s, z, WDT: tl.constexpr, MAGIC):
    """Words wd (BLOCK_N, BLOCK_G, WORDS_G) int32 with their groups' scales and zeros (BLOCK_N,
    BLOCK_G) -> the weights (BLOCK_N, 8·BLOCK_G·WORDS_G) in x's dtype, exact (`_pair_weights`),
    word by word in the order (j1, j0, e) of field j = 2j1 + j0 + 4(1 - e): each pair (fields j + 4,
    j) is one 32-bit register, adjacent in the tile. (Joined high half first: the order in which
    Triton keeps a joined pair in one register as the AND/OR made it, with no half swaps.)"""
    zc, s_hi, s_lo = _pair_consts(s[:, :, None, None], z[:, :, None, None], WDT)
    PD: tl.constexpr = tl.float16 if WDT == 1 else tl.bfloat16
    m = ((wd >> 0) & 0x000F000F) | MAGIC
    w0 = _pair_weights(tl.join((m >> 16).to(tl.uint16), m.to(tl.uint16)).to(PD, bitcast=True), zc, s_hi, s_lo, WDT)
    m = ((wd >> 4) & 0x000F000F) | MAGIC
    w1 = _pair_weights(tl.join((m >> 16).to(tl.uint16), m.to(tl.uint16)).to(PD, bitcast=True), zc, s_hi, s_lo, WDT)
    m = ((wd >> 8) & 0x000F000F) | MAGIC
    w2 = _pair_weights(tl.join((m >> 16).to(tl.uint16), m.to(tl.uint16)).to(PD, bitcast=True), zc, s_hi, s_lo, WDT)
    m = ((wd >> 12) & 0x000F000F) | MAGIC
    w3 = _pair_weights(tl.join((m >> 16).to(tl.uint16), m.to(tl.uint16)).to(PD, bitcast=True), zc, s_hi, s_lo, WDT)
    # (R, GB, WG, e) each; joined (R, GB, WG, e, j0, j1), then e innermost
    w = tl.permute(tl.join(tl.join(w0, w1), tl.join(w2, w3)), (0, 1, 2, 5, 4, 3))
    R: tl.constexpr = wd.shape[0]
    GB: tl.constexpr = wd.shape[1]
    WG: tl.constexpr = wd.shape[2]
    return tl.reshape(w, (R, GB * WG * 8))


@triton.jit
def _load_group_words(q_rows, s_rows, z_rows, gs, us, row_mask, NG, WPG: tl.constexpr, EVICT: tl.constexpr):
    """Words us of groups gs (those below NG: the program's slice) of the program's rows (BLOCK_N,
    BLOCK_G, WORDS_G) int32, and the groups' scales and zeros (BLOCK_N, BLOCK_G)."""
    g_mask = gs < NG
    m = row_mask[:, None, None] & g_mask[None, :, None] & (us < WPG)[None, None, :]
    wd = tl.load(q_rows[:, :, None] + (gs[:, None] * WPG + us[None, :])[None, :, :], mask=m, other=0,
                 eviction_policy=EVICT)
    mg = row_mask[:, None] & g_mask[None, :]
    s = tl.load(s_rows + gs[None, :], mask=mg, other=0.0, eviction_policy=EVICT)
    z = tl.load(z_rows + gs[None, :], mask=mg, other=0, eviction_policy=EVICT)
    return wd, s, z


@triton.jit
def _load_step_words(q_rows, s_rows, z_rows, uq_rows, us_rows, uz_rows, gs, us, row_mask, g_hi, WPG: tl.constexpr,
                     EVICT: tl.constexpr, SWIGLU: tl.constexpr):
    """`_load_group_words` of the program's rows, and with SWIGLU of its up rows too (else the
    same tensors again: dead code)."""
    wd, s, z = _load_group_words(q_rows, s_rows, z_rows, gs, us, row_mask, g_hi, WPG, EVICT)
    uwd, usc, uz = wd, s, z
    if SWIGLU:
        uwd, usc, uz = _load_group_words(uq_rows, us_rows, uz_rows, gs, us, row_mask, g_hi, WPG, EVICT)
    return wd, s, z, uwd, usc, uz


@triton.jit
def _epilogue(y, yu, ss_sum, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, dtype, NORM: tl.constexpr,
              SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr):
    """gemv's epilogue on the rows' fp32 sums y (and yu, SwiGLU's up rows), ss_sum the sum of x^2."""
    if NORM:
        inv_rms = tl.rsqrt(ss_sum / K + eps)
        y *= inv_rms
    y = y.to(dtype).to(tl.float32)
    if SWIGLU:
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
def _int4_gemv_mma_kernel(
    x_ptr,  # (K,)
    q_ptr,  # (N, K/8) int32 words (qweight viewed as int32), or (2N, K/8) with SWIGLU
    s_ptr,  # (N, NG) scales, NG = K / G
    z_ptr,  # (N, NG) uint8 zeros
    nw_ptr,  # (K,) norm weight, read only when NORM
    res_ptr,  # (N,) residual, read only when RESIDUAL
    y_ptr,  # (N,)
    key_ptr,  # (1,) int64, written only when ARGMAX
    part_ptr,  # (SPLIT_K, 2, N) fp32: each K slice's row sums (SPLIT_K > 1)
    sq_ptr,  # (programs, SPLIT_K) fp32: each K slice's sum of x^2 (SPLIT_K > 1, NORM)
    cnt_ptr,  # (programs,) int32, zero between launches: the K slices done (SPLIT_K > 1)
    N,
    K,
    NW,  # words a row (K / 8)
    eps,
    MAGIC,  # the pair magic of x's dtype (an argument: a register operand, not an immediate rebuilt per use)
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ARGMAX: tl.constexpr,
    EVICT: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    G: tl.constexpr,  # the group size, a multiple of 8
    WDT: tl.constexpr,  # x's dtype: 0 bf16, 1 fp16
    DOT_F32: tl.constexpr,  # fp32 dots: the interpreter's
    BLOCK_N: tl.constexpr,  # >= 16 (tl.dot)
    BLOCK_G: tl.constexpr,  # groups a step
    WORDS_G: tl.constexpr,  # next_power_of_2(G / 8): words a group row
    SPLIT_K: tl.constexpr,  # programs a row block, each a slice of the groups
):
    WPG: tl.constexpr = G // 8
    pid = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    dtype = x_ptr.dtype.element_ty
    NG = K // G
    # this program's groups [g_lo, g_hi): whole steps, the slices in order along K
    per = tl.cdiv(tl.cdiv(NG, BLOCK_G), SPLIT_K) * BLOCK_G
    g_lo = pk * per
    g_hi = tl.minimum(NG, g_lo + per)
    gl = tl.arange(0, BLOCK_G)
    us = tl.arange(0, WORDS_G)

    r64 = rows.to(tl.int64)
    q_rows, s_rows, z_rows = q_ptr + r64[:, None] * NW, s_ptr + r64[:, None] * NG, z_ptr + r64[:, None] * NG
    up = r64 + N
    uq_rows, us_rows, uz_rows = q_ptr + up[:, None] * NW, s_ptr + up[:, None] * NG, z_ptr + up[:, None] * NG

    ps = tl.arange(0, BLOCK_G * WORDS_G * 8)
    ss = tl.zeros([BLOCK_G * WORDS_G * 8], dtype=tl.float32)  # (ss and acc_up are dead code unless NORM / SWIGLU)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        # the weights never depend on the previous kernel: the first tile goes out before the wait
        wd, s, z, uwd, usc, uz = _load_step_words(q_rows, s_rows, z_rows, uq_rows, us_rows, uz_rows, g_lo + gl, us,
                                                  row_mask, g_hi, WPG, EVICT, SWIGLU)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    for g0 in range(g_lo, g_hi, BLOCK_G):
        gs = g0 + gl
        if not PREFETCH:
            wd, s, z, uwd, usc, uz = _load_step_words(q_rows, s_rows, z_rows, uq_rows, us_rows, uz_rows, gs, us,
                                                      row_mask, g_hi, WPG, EVICT, SWIGLU)
        # x in the weights' column order (`_mma_weights`): position 4j1 + 2j0 + e of a word is
        # its column 4(1 - e) + 2j1 + j0, gathered straight from x (a few KB, in L1 after the
        # first row)
        g_of = g0 + ps // (WORDS_G * 8)
        k = g_of * G + (ps // 8 % WORDS_G) * 8 + 4 - 4 * (ps & 1) + 2 * ((ps >> 2) & 1) + ((ps >> 1) & 1)
        km = (g_of < g_hi) & (ps // 8 % WORDS_G < WPG)
        xv = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        if NORM:
            ss += xv * xv
            xv = xv * tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)
        xb = _x_mma(xv, dtype)
        acc = _dot_wt(xb, _mma_weights(wd, s, z, WDT, MAGIC), acc, DOT_F32)
        if SWIGLU:
            acc_up = _dot_wt(xb, _mma_weights(uwd, usc, uz, WDT, MAGIC), acc_up, DOT_F32)
        if PREFETCH:
            wd, s, z, uwd, usc, uz = _load_step_words(q_rows, s_rows, z_rows, uq_rows, us_rows, uz_rows, gs + BLOCK_G,
                                                      us, row_mask, g_hi, WPG, EVICT, SWIGLU)
    # rows 0 and 1 of the dot: x's leading part and the rest (`_x_mma`)
    _finish_rows(tl.sum(acc, axis=0), tl.sum(acc_up, axis=0), tl.sum(ss, axis=0), pid, pk, rows, row_mask, res_ptr,
                 y_ptr, key_ptr, part_ptr, sq_ptr, cnt_ptr, N, K, eps, dtype, NORM, SWIGLU, RESIDUAL, ARGMAX, SPLIT_K)


@triton.jit
def _finish_rows(y, yu, ss_sum, pid, pk, rows, row_mask, res_ptr, y_ptr, key_ptr, part_ptr, sq_ptr, cnt_ptr, N, K, eps,
                 dtype, NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    """A split-K row block's end: this slice's row sums y (yu, SwiGLU's up rows; ss_sum its sum of
    x^2) go to the epilogue, or with SPLIT_K > 1 to the block's partials, the last slice to finish
    adding them in slice order."""
    if SPLIT_K == 1:
        _epilogue(y, yu, ss_sum, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, dtype, NORM, SWIGLU,
                  RESIDUAL, ARGMAX)
    else:
        # Each slice leaves its sums; the last of a row block to finish (the counter) adds them in
        # slice order -- one order whichever finishes last, so the rows are summed the same way
        # every launch -- and runs the epilogue, then sets the counter back for the next launch.
        # (Everything here follows the PDL wait: the next launch cannot reach its counters first.)
        tl.store(part_ptr + pk * 2 * N + rows, y, mask=row_mask)
        if SWIGLU:
            tl.store(part_ptr + (pk * 2 + 1) * N + rows, yu, mask=row_mask)
        if NORM:
            tl.store(sq_ptr + pid * SPLIT_K + pk, ss_sum)
        tl.debug_barrier()  # every thread's sums stored before the (one-thread, releasing) count
        done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            y = tl.zeros([y.shape[0]], dtype=tl.float32)
            yu = tl.zeros([y.shape[0]], dtype=tl.float32)
            ss_sum = 0.0
            for i in tl.static_range(SPLIT_K):
                # .cg: from L2, never a line of this buffer an earlier launch left in this SM's L1
                y += tl.load(part_ptr + i * 2 * N + rows, mask=row_mask, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    yu += tl.load(part_ptr + (i * 2 + 1) * N + rows, mask=row_mask, other=0.0, cache_modifier=".cg")
                if NORM:
                    ss_sum += tl.load(sq_ptr + pid * SPLIT_K + i, cache_modifier=".cg")
            _epilogue(y, yu, ss_sum, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, dtype, NORM, SWIGLU,
                      RESIDUAL, ARGMAX)
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed")


# -- the pairs kernel: the mma kernel's words, the products as fp32 FMAs ----------------------------
#
# Each 16-bit float pair (fields j and j + 4 of a word, `_mma_weights`' AND/OR) becomes its two
# weights by three packed bf16 fmas in one inline-PTX block: n = p·1 - (2^7 + z) (exact),
# t = n·s_lo - 0 (exact), w = n·s_hi + t (= RN_bf16(n·s), the one rounding): two weights for
# 2.5 instructions, where Triton's bf16 arithmetic widens every operand to fp32 and rounds back.
# Each half of the pair is then the fp32 weight by one shift or AND (a bf16 is the top half of
# its fp32), and multiplies x (times the norm weight: exact in fp32) in fp32 FMAs -- no layout
# change for a tensor-core operand, and every program's rows reuse each x column they load.

_PAIR_ASM = tl.constexpr("""{
.reg .b32 t, u, one, nz, lo4, mg;
mov.b32 one, 0x3F803F80;
mov.b32 nz, 0x80008000;
mov.b32 lo4, 0x000F000F;
mov.b32 mg, 0x43004300;
lop3.b32 t, $1, lo4, mg, 0xEA;
fma.rn.bf16x2 t, t, one, $2;
fma.rn.bf16x2 u, t, $4, nz;
fma.rn.bf16x2 $0, t, $3, u;
}""")


@triton.jit
def _pair_fields(ws, nzc2, sh2, sl2, z, s):
    """Fields j (bits [0, 4) of each half of ws = word >> 4j) and j + 4 (bits [16, 20)) as the fp32
    values of their bf16 weights RN_bf16((q - z) · s), exactly: (field j, field j + 4). nzc2, sh2,
    sl2: `_pairs_consts`; z, s: the group's zero and scale (the interpreter's path)."""
    if _INTERP:
        v0 = ((ws & 0xF).to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)
        v1 = (((ws >> 16) & 0xF).to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)
        u0 = v0.to(tl.uint32, bitcast=True)
        u1 = v1.to(tl.uint32, bitcast=True)
        lo = ((u0 + 0x7FFF + ((u0 >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        hi = ((u1 + 0x7FFF + ((u1 >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        p = tl.inline_asm_elementwise(_PAIR_ASM, "=r,r,r,r,r", [ws, nzc2, sh2, sl2], dtype=tl.int32, is_pure=True,
                                      pack=1)
        lo = (p << 16).to(tl.float32, bitcast=True)
        hi = (p & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _pairs_consts(s, z):
    """A group's constants of `_PAIR_ASM` from its fp16 scale s and zero z, each a bf16 pair
    (both halves the same) in an int32: -(2^7 + z), s_hi, s_lo (`_pair_consts`)."""
    zc, s_hi, s_lo = _pair_consts(s, z, 0)
    nz = (zc.to(tl.uint16, bitcast=True).to(tl.int32) | 0x8000)
    hi = s_hi.to(tl.uint16, bitcast=True).to(tl.int32)
    lo = s_lo.to(tl.uint16, bitcast=True).to(tl.int32)
    return nz | (nz << 16), hi | (hi << 16), lo | (lo << 16)


@triton.jit
def _x_fields(x_ptr, nw_ptr, gs, us, g_hi, WPG: tl.constexpr, G: tl.constexpr, ss, NORM: tl.constexpr):
    """x at the eight fields of words us of groups gs (field f: column g·G + 8u + f), each
    (1, BLOCK_G, WORDS_G) fp32, times the norm weight with NORM (exact), and ss plus x's squares:
    one contiguous (BLOCK_G, WORDS_G, 8) load (a word's eight columns side by side, one vector a
    word), split into the fields in registers."""
    BG: tl.constexpr = gs.shape[0]
    WG: tl.constexpr = us.shape[0]
    fs = tl.arange(0, 8)
    k = (gs[:, None, None] * G + us[None, :, None] * 8) + fs[None, None, :]
    m = ((gs < g_hi)[:, None] & (us < WPG)[None, :])[:, :, None] & (fs < 8)[None, None, :]
    xv = tl.load(x_ptr + k, mask=m, other=0.0).to(tl.float32)
    if NORM:
        ss += tl.sum(xv * xv, axis=2)
        xv = xv * tl.load(nw_ptr + k, mask=m, other=0.0).to(tl.float32)
    # field f = 4a + 2b + c of (a, b, c): split c, then b, then a
    c0, c1 = tl.split(tl.reshape(xv, (BG, WG, 2, 2, 2)))
    b00, b01 = tl.split(c0)
    b10, b11 = tl.split(c1)
    x0, x4 = tl.split(b00)
    x2, x6 = tl.split(b01)
    x1, x5 = tl.split(b10)
    x3, x7 = tl.split(b11)
    return x0[None], x1[None], x2[None], x3[None], x4[None], x5[None], x6[None], x7[None], ss


@triton.jit
def _pairs_dot(acc, wd, s, z, x0, x1, x2, x3, x4, x5, x6, x7):
    """acc (BLOCK_N, BLOCK_G, WORDS_G) plus each word's eight weights times x's columns, in the
    fixed order of fields 0, 4, 1, 5, 2, 6, 3, 7."""
    nzc2, sh2, sl2 = _pairs_consts(s[:, :, None], z[:, :, None])
    zz = z[:, :, None]
    sc = s[:, :, None]
    lo, hi = _pair_fields(wd, nzc2, sh2, sl2, zz, sc)
    acc += lo * x0
    acc += hi * x4
    lo, hi = _pair_fields(wd >> 4, nzc2, sh2, sl2, zz, sc)
    acc += lo * x1
    acc += hi * x5
    lo, hi = _pair_fields(wd >> 8, nzc2, sh2, sl2, zz, sc)
    acc += lo * x2
    acc += hi * x6
    lo, hi = _pair_fields(wd >> 12, nzc2, sh2, sl2, zz, sc)
    acc += lo * x3
    acc += hi * x7
    return acc


@triton.jit
def _int4_gemv_pairs_kernel(
    x_ptr,  # (M, K) bf16: program_id(2) picks the row
    q_ptr,  # (N, K/8) int32 words, or (2N, K/8) with SWIGLU
    s_ptr,  # (N, NG) scales
    z_ptr,  # (N, NG) uint8 zeros
    nw_ptr,  # (K,) norm weight, read only when NORM
    res_ptr,  # (M, N) residual, read only when RESIDUAL
    y_ptr,  # (M, N)
    key_ptr,  # (1,) int64, written only when ARGMAX (M = 1)
    part_ptr,  # (M, SPLIT_K, 2, N) fp32 (SPLIT_K > 1)
    sq_ptr,  # (M, programs, SPLIT_K) fp32 (SPLIT_K > 1, NORM)
    cnt_ptr,  # (M, programs) int32, zero between launches (SPLIT_K > 1)
    N,
    K,
    NW,  # words a row (K / 8)
    eps,
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ARGMAX: tl.constexpr,
    EVICT: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    G: tl.constexpr,  # the group size, a multiple of 8
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,  # groups a step
    WORDS_G: tl.constexpr,  # next_power_of_2(G / 8)
    SPLIT_K: tl.constexpr,  # programs a row block, each a slice of the groups (the mma kernel's)
):
    WPG: tl.constexpr = G // 8
    pid = tl.program_id(0)
    pk = tl.program_id(1)
    # Row pm of x runs exactly the M = 1 launch's program on its own pointers: a row's y never
    # depends on the rows beside it (the batch-invariant issue's rule), at the cost of
    # dequantizing each weight once a row (L2 serves the rereads).
    pm = tl.program_id(2).to(tl.int64)
    x_ptr += pm * K
    y_ptr += pm * N
    res_ptr += pm * N
    part_ptr += pm * SPLIT_K * 2 * N
    sq_ptr += pm * tl.num_programs(0) * SPLIT_K
    cnt_ptr += pm * tl.num_programs(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    dtype = x_ptr.dtype.element_ty
    NG = K // G
    per = tl.cdiv(tl.cdiv(NG, BLOCK_G), SPLIT_K) * BLOCK_G
    g_lo = pk * per
    g_hi = tl.minimum(NG, g_lo + per)
    gl = tl.arange(0, BLOCK_G)
    us = tl.arange(0, WORDS_G)

    r64 = rows.to(tl.int64)
    q_rows, s_rows, z_rows = q_ptr + r64[:, None] * NW, s_ptr + r64[:, None] * NG, z_ptr + r64[:, None] * NG
    up = r64 + N
    uq_rows, us_rows, uz_rows = q_ptr + up[:, None] * NW, s_ptr + up[:, None] * NG, z_ptr + up[:, None] * NG

    ss = tl.zeros([BLOCK_G, WORDS_G], dtype=tl.float32)  # (ss and acc_up are dead code unless NORM / SWIGLU)
    acc = tl.zeros([BLOCK_N, BLOCK_G, WORDS_G], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_G, WORDS_G], dtype=tl.float32)
    if PREFETCH:
        # the weights never depend on the previous kernel: the first tile goes out before the wait
        wd, s, z, uwd, usc, uz = _load_step_words(q_rows, s_rows, z_rows, uq_rows, us_rows, uz_rows, g_lo + gl, us,
                                                  row_mask, g_hi, WPG, EVICT, SWIGLU)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    for g0 in range(g_lo, g_hi, BLOCK_G):
        gs = g0 + gl
        if not PREFETCH:
            wd, s, z, uwd, usc, uz = _load_step_words(q_rows, s_rows, z_rows, uq_rows, us_rows, uz_rows, gs, us,
                                                      row_mask, g_hi, WPG, EVICT, SWIGLU)
        x0, x1, x2, x3, x4, x5, x6, x7, ss = _x_fields(x_ptr, nw_ptr, gs, us, g_hi, WPG, G, ss, NORM)
        acc = _pairs_dot(acc, wd, s, z, x0, x1, x2, x3, x4, x5, x6, x7)
        if SWIGLU:
            acc_up = _pairs_dot(acc_up, uwd, usc, uz, x0, x1, x2, x3, x4, x5, x6, x7)
        if PREFETCH:
            wd, s, z, uwd, usc, uz = _load_step_words(q_rows, s_rows, z_rows, uq_rows, us_rows, uz_rows, gs + BLOCK_G,
                                                      us, row_mask, g_hi, WPG, EVICT, SWIGLU)
    _finish_rows(tl.sum(tl.sum(acc, axis=2), axis=1), tl.sum(tl.sum(acc_up, axis=2), axis=1),
                 tl.sum(tl.sum(ss, axis=1), axis=0), pid, pk, rows, row_mask, res_ptr, y_ptr, key_ptr, part_ptr,
                 sq_ptr, cnt_ptr, N, K, eps, dtype, NORM, SWIGLU, RESIDUAL, ARGMAX, SPLIT_K)


# M = 1 tiles: (kernel, BLOCK_N, BLOCK_G, num_warps, num_stages, SPLIT_K), kernel "bytes"
# (`_int4_gemv_kernel`: any group size and bits, fp32 FMAs, SPLIT_K 1), "mma"
# (`_int4_gemv_mma_kernel`: INT4, group size a multiple of 8, bf16 / fp16 x, BLOCK_N >= 16, the
# products on the tensor cores, SPLIT_K programs a row block each summing a slice of K, added in
# slice order by the last to finish: wide row blocks still fill the SMs) or "pairs"
# (`_int4_gemv_pairs_kernel`: the mma kernel's words and K slices with bf16 x, the weights by
# packed-pair PTX, fp32 FMA products). Fixed per device name, then (N, K, G, bits, NORM, SWIGLU,
# RESIDUAL, PDL); a shape without an entry takes `default_tile`. bench/int4_tiles.py sweeps them on the GPU and prints
# the entries to paste here (each tile fixes the order every row is summed in, so the table,
# not a per-process autotuner, decides).
TILES: dict[str, dict[tuple, tuple]] = {
    # bench/int4_tiles.py on the H200 (bench/results/int4-tiles-cuda-742b71c.json): bench-285m's projections
    "NVIDIA H200": {
        (6144, 2048, 128, 4, True, False, False, True): ('pairs', 128, 1, 4, 1, 8),
        (2048, 2048, 128, 4, False, False, True, True): ('pairs', 256, 1, 8, 1, 16),
        (5632, 2048, 128, 4, True, True, False, True): ('pairs', 32, 2, 4, 1, 2),
        (2048, 5632, 128, 4, False, False, True, True): ('pairs', 128, 1, 4, 1, 32),
    },
}

# M = 2..16 (int4_gemv's batched rows) and any-M int4_matmul tiles: the GEMM's (BLOCK_M, BLOCK_N,
# BLOCK_K, num_warps, num_stages), or for int4_gemv a pairs tile (`as_tile`'s form: the rows one
# by one), per device name, then (M bucket `_m_bucket`, N, K, G, bits, NORM, SWIGLU, RESIDUAL);
# else `default_matmul_tile`.
MATMUL_TILES: dict[str, dict[tuple, tuple]] = {
    # bench/int4_tiles.py --rows 4 16 (bench/results/int4-tiles-cuda.json) and --rows 8
    # (int4-tiles-rows8-cuda.json) on the H200: bench-285m's projections; a pairs tile runs the
    # rows one by one (`_rows_tile`), where it beat every GEMM tile that passed the sweep's check
    # (that sweep's reference did not round x times the norm weight as the GEMM does, so it
    # failed every GEMM tile of the SwiGLU projection: a new sweep compares them too)
    "NVIDIA H200": {
        (4, 6144, 2048, 128, 4, True, False, False): ('pairs', 128, 1, 4, 1, 4),
        (4, 2048, 2048, 128, 4, False, False, True): ('pairs', 256, 1, 8, 1, 8),
        (4, 5632, 2048, 128, 4, True, True, False): ('pairs', 32, 2, 4, 1, 1),
        (4, 2048, 5632, 128, 4, False, False, True): ('pairs', 128, 1, 4, 1, 16),
        (8, 6144, 2048, 128, 4, True, False, False): ('pairs', 128, 1, 4, 1, 4),
        (8, 2048, 2048, 128, 4, False, False, True): ('pairs', 256, 1, 8, 1, 8),
        (8, 5632, 2048, 128, 4, True, True, False): ('pairs', 32, 2, 4, 1, 1),
        (8, 2048, 5632, 128, 4, False, False, True): ('pairs', 128, 1, 4, 1, 16),
        (16, 6144, 2048, 128, 4, True, False, False): (16, 32, 256, 4, 3),
        (16, 2048, 2048, 128, 4, False, False, True): (16, 16, 256, 4, 3),
        (16, 5632, 2048, 128, 4, True, True, False): ('pairs', 32, 2, 4, 1, 1),
        (16, 2048, 5632, 128, 4, False, False, True): ('pairs', 128, 1, 4, 1, 16),
    },
}

GEMV_KERNELS = ("bytes", "mma", "pairs")


def default_tile(K: int, G: int) -> tuple[str, int, int, int, int, int]:
    """The M = 1 tile of a shape TILES does not hold: the bytes kernel, 1024 columns a step (512
    contiguous bytes of a row) over 4 rows, 2 KB a step: one 16-byte load per thread of 4 warps,
    and bench-285m's 2048-row projections launch 512 programs (untimed: the sweep's baseline)."""
    return "bytes", 4, max(1, min(triton.next_power_of_2(K // G), max(1, 1024 // G))), 4, 2, 1


def default_matmul_tile(M: int, N: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMM: 16-row tiles for a batched
    decode step (still bound by the weight read: wide N tiles, one weight tile a program for
    every row), 64 x 64 for prefill (the dot's inputs reused across the tile)."""
    if M <= 16:
        return 16, 32 if N <= 4096 else 64, 128, 4, 3
    return 64, 64, 128, 4, 3


def load_tables(path: str) -> tuple[dict, dict]:
    """(M = 1 entries, M > 1 entries) of a bench/int4_tiles.py JSON, keyed as TILES' and
    MATMUL_TILES' per-device dicts; a file that is not such a sweep -> ValueError."""
    import json
    try:
        data = json.loads(open(path).read())
        return ({tuple(k): tuple(t) for k, t in data.get("tiles", [])},
                {tuple(k): tuple(t) for k, t in data.get("matmul_tiles", [])})
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"int4 tiles {path!r}: not a bench/int4_tiles.py result ({type(e).__name__}: {e})") from None


def _m_bucket(m: int) -> int:
    """MATMUL_TILES' row bucket: 2-4, 5-8, 9-16, 17-64, then 65 and more."""
    return 4 if m <= 4 else 8 if m <= 8 else 16 if m <= 16 else 64 if m <= 64 else 65


def as_tile(t) -> tuple[str, int, int, int, int, int]:
    """An M = 1 tile as (kernel, BLOCK_N, BLOCK_G, num_warps, num_stages, SPLIT_K); a 4-tuple is a
    bytes kernel's, a 5-tuple one with SPLIT_K 1. Bad tiles -> ValueError."""
    t = tuple(t)
    if len(t) == 4:
        t = ("bytes", *t)
    if len(t) == 5:
        t = (*t, 1)
    if len(t) != 6 or t[0] not in GEMV_KERNELS or not all(isinstance(v, int) and v > 0 for v in t[1:]):
        raise ValueError(f"int4_gemv: a tile is (kernel in {GEMV_KERNELS}, BLOCK_N, BLOCK_G, num_warps, "
                         f"num_stages, SPLIT_K) of positive ints, got {t!r}")
    kind, bn, bg, warps, _, split = t
    if kind == "bytes" and split != 1:
        raise ValueError(f"int4_gemv: the bytes kernel does not split K (SPLIT_K 1), got {t!r}")
    if bn & (bn - 1) or bg & (bg - 1) or warps & (warps - 1):
        raise ValueError(f"int4_gemv: BLOCK_N, BLOCK_G and num_warps must be powers of two, got {t!r}")
    if kind == "mma" and bn < 16:
        raise ValueError(f"int4_gemv: the mma kernel's BLOCK_N must be >= 16 (tl.dot), got {t!r}")
    return t


def mma_fits(x: torch.Tensor, qweight: torch.Tensor, group_size: int, bits: int) -> bool:
    """Whether the mma kernel takes this call: INT4 codes read as int32 words (K a multiple of 8
    and qweight 4-byte aligned), whole words a group (G a multiple of 8), x bf16 or fp16."""
    return (bits == 4 and group_size % 8 == 0 and x.dtype in (torch.bfloat16, torch.float16)
            and qweight.data_ptr() % 4 == 0)


def fits(kind: str, x: torch.Tensor, qweight: torch.Tensor, group_size: int, bits: int) -> bool:
    """Whether an M = 1 kernel takes this call: the bytes kernel any; the mma kernel `mma_fits`;
    the pairs kernel the same words with bf16 x (its packed arithmetic is bf16's)."""
    if kind == "bytes":
        return True
    return mma_fits(x, qweight, group_size, bits) and (kind == "mma" or x.dtype == torch.bfloat16)


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
              residual=None, pdl=None, out_dtype=None, argmax_key=None, eviction_policy="", tile=None, tables=None):
    """kernels.gemv with an INT4 weight (bits=2: an INT2 one, four codes a byte, column 4j + c in
    bits [2c, 2c + 2)): x (..., K) holding 1 <= M <= 16 rows -> y (..., N or F), the options
    and their checks as gemv's. tile: an explicit tile instead of the tables' (M = 1: `as_tile`'s
    form; M > 1: the GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), or a pairs tile:
    each row of x its own M = 1 launch's programs, one launch, `_rows_tile`), for sweeps and
    tests; a tile the call does not fit (`fits`) -> ValueError. tables: (M = 1 entries, M > 1
    entries) keyed as TILES' and MATMUL_TILES' per-device dicts (`load_tables` of a sweep), taken
    before the code's tables (Settings.int4_tiles)."""
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
    pdl = use_pdl(x.device, pdl) if not interpreting() else bool(pdl)
    x1 = x.reshape(M, K).contiguous()
    if M > 1:
        t = _rows_tile(op, x, qweight, group_size, bits, flags, N, K, M, tile, tables)
        if t is None:
            return _matmul(x1, qweight, scales, zeros, group_size, nw, residual, y, eps, flags, tile, tables)
    elif tile is not None:
        t = as_tile(tile)
        if not fits(t[0], x, qweight, group_size, bits):
            raise ValueError(f"{op}: the {t[0]} kernel takes INT4 codes, a group size that is a multiple of 8 and "
                             f"{'bf16' if t[0] == 'pairs' else 'bf16 or fp16'} x, got bits={bits}, "
                             f"group_size={group_size}, x {x.dtype}")
    elif interpreting():
        # wide tiles: the interpreter's cost is per program and per op, hardly per element
        t = ("bytes", min(128, triton.next_power_of_2(N)), min(4, triton.next_power_of_2(K // group_size)), 4, 1, 1)
    else:
        key = (N, K, group_size, bits, flags["NORM"], flags["SWIGLU"], flags["RESIDUAL"], pdl)
        t = as_tile(table_entry(TILES, 0, tables, x.device, key) or default_tile(K, group_size))
        if not fits(t[0], x, qweight, group_size, bits):
            t = default_tile(K, group_size)  # (an fp32 x or a misaligned view of a tabled shape)
    kind, bn, bg, warps, stages, split = t
    launch = {} if interpreting() else dict(num_warps=warps, num_stages=stages, launch_pdl=pdl)
    flags["ARGMAX"] = argmax_key is not None
    rest = (x1 if nw is None else nw, y if residual is None else residual, y, y if argmax_key is None else argmax_key)
    grid = (triton.cdiv(N, bn),)
    if kind == "pairs":
        flags.pop("BITS")
        parts, sq, cnt = _split_buffers(x.device, N, grid[0], split, M) if split > 1 else (y, y, y)
        _int4_gemv_pairs_kernel[(grid[0], split, M)](
            x1, qweight.view(torch.int32), scales, zeros, *rest, parts, sq, cnt, N, K, K // 8, float(eps), **flags,
            PREFETCH=pdl, PDL=pdl and not interpreting(), G=group_size, BLOCK_N=bn, BLOCK_G=bg,
            WORDS_G=triton.next_power_of_2(group_size // 8), SPLIT_K=split, **launch)
        return y
    if kind == "mma":
        flags.pop("BITS")
        magic = 0x64006400 if x.dtype == torch.float16 else 0x43004300
        parts, sq, cnt = _split_buffers(x.device, N, grid[0], split) if split > 1 else (y, y, y)
        _int4_gemv_mma_kernel[(grid[0], split)](
            x1, qweight.view(torch.int32), scales, zeros, *rest, parts, sq, cnt, N, K, K // 8, float(eps), magic,
            **flags, PREFETCH=pdl, PDL=pdl and not interpreting(), G=group_size,
            WDT=1 if x.dtype == torch.float16 else 0, DOT_F32=interpreting(), BLOCK_N=bn, BLOCK_G=bg,
            WORDS_G=triton.next_power_of_2(group_size // 8), SPLIT_K=split, **launch)
        return y
    _int4_gemv_kernel[grid](x1, qweight, scales, zeros, *rest, N, K, group_size, float(eps), **flags, PREFETCH=pdl,
                            PDL=pdl and not interpreting(), BLOCK_N=bn, BLOCK_G=bg,
                            BYTES_G=triton.next_power_of_2(group_size * bits // 8), **launch)
    return y


def _rows_tile(op, x, qweight, group_size, bits, flags, N, K, M, tile, tables=None):
    """The pairs tile that runs an M > 1 call row by row (each row of x the M = 1 launch's
    programs, so its y is the M = 1 call's bit for bit), or None: the GEMM. An explicit kernel
    tile must be the pairs kernel's and fit; else MATMUL_TILES decides (a pairs entry where it
    was faster than the GEMM), never the interpreter's default."""
    if tile is not None:
        if not isinstance(tuple(tile)[0], str):
            return None
        t = as_tile(tile)
        if t[0] != "pairs" or not fits("pairs", x, qweight, group_size, bits):
            raise ValueError(f"{op}: M > 1 rows take a GEMM tile or the pairs kernel's (INT4 codes, a group size that "
                             f"is a multiple of 8, bf16 x), got {tuple(tile)!r} with bits={bits}, "
                             f"group_size={group_size}, x {x.dtype}")
        return t
    if interpreting():
        return None
    key = (_m_bucket(M), N, K, group_size, bits, flags["NORM"], flags["SWIGLU"], flags["RESIDUAL"])
    e = table_entry(MATMUL_TILES, 1, tables, x.device, key)
    if e is not None and isinstance(e[0], str) and fits("pairs", x, qweight, group_size, bits):
        return as_tile(e)
    return None


# The split mma launches' buffers, by (device, N, row blocks, SPLIT_K): each slice's row sums, its
# sum of x^2, and the row blocks' counters (zero between launches: the last slice sets its block's
# back). Launches of one shape share them one after another, in stream order, as a decode step
# (and its captured graph) runs them; they are made by the first (eager) launch of a shape.
_SPLIT_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device, N: int, blocks: int, split: int, rows: int = 1):
    """(rows of x: the pairs kernel's M > 1 launches, a set a row)"""
    key = (device, N, blocks, split, rows)
    b = _SPLIT_BUFFERS.get(key)
    if b is None:
        b = _SPLIT_BUFFERS[key] = (torch.empty(rows * split * 2 * N, dtype=torch.float32, device=device),
                                   torch.empty(rows * blocks * split, dtype=torch.float32, device=device),
                                   torch.zeros(rows * blocks, dtype=torch.int32, device=device))
    return b


def int4_matmul(x, qweight, scales, zeros, group_size, bits=4, eviction_policy="", tile=None, tables=None):
    """x (..., K), any number of rows M -> x @ W.T (..., N) in x's dtype (bits as int4_gemv's;
    tile: an explicit (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); tables as int4_gemv's)."""
    N, K = _check("int4_matmul", x, qweight, scales, zeros, group_size, bits)
    M = math.prod(x.shape[:-1])
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    flags = dict(NORM=False, SWIGLU=False, RESIDUAL=False, EVICT=eviction_policy, BITS=bits)
    return _matmul(x.reshape(M, K).contiguous(), qweight, scales, zeros, group_size, None, None, y, 1e-6, flags, tile,
                   tables)


def as_matmul_tile(t) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): powers of two, the dot's sides >= 16."""
    t = tuple(t)
    if (len(t) != 5 or not all(isinstance(v, int) and v > 0 and not v & (v - 1) for v in t[:4])
            or not isinstance(t[4], int) or t[4] < 1 or min(t[:3]) < 16):
        raise ValueError(f"int4_matmul: a tile is (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): powers of "
                         f"two, BLOCK_M/N/K >= 16, got {t!r}")
    return t


def _matmul(x, qweight, scales, zeros, group_size, nw, residual, y, eps, flags, tile=None, tables=None):
    """The GEMM's launch: x (M, K) contiguous, y and residual contiguous (M, N) in memory."""
    M, K = x.shape
    N = y.shape[-1]
    args = (x, qweight, scales, zeros, x if nw is None else nw, y if residual is None else residual, y,
            M, N, K, group_size, float(eps))
    # fp32 dots for fp32 x (exact products, no tf32) and for bf16 under the interpreter (gemv's reason)
    dot_f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting())
    cpb = 8 // flags["BITS"]
    if tile is not None:
        bm, bn, bk, warps, stages = as_matmul_tile(tile)
        if bk % cpb or bk // cpb < 16:
            raise ValueError(f"int4_matmul: BLOCK_K / {cpb} (a dot's K) must be >= 16, got {tile!r}")
    elif interpreting():
        bm, bn, bk, warps, stages = 16, min(64, max(16, triton.next_power_of_2(N))), 64, 4, 1
    else:
        key = (_m_bucket(M), N, K, group_size, flags["BITS"], flags["NORM"], flags["SWIGLU"], flags["RESIDUAL"])
        e = table_entry(MATMUL_TILES, 1, tables, x.device, key)
        # (a pairs entry the call does not fit: the GEMM's default)
        bm, bn, bk, warps, stages = e if e is not None and not isinstance(e[0], str) else default_matmul_tile(M, N)
    launch = {} if interpreting() else dict(num_warps=warps, num_stages=stages)
    _int4_matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](*args, **flags, DOT_F32=dot_f32, BLOCK_M=bm,
                                                                 BLOCK_N=bn, BLOCK_K=bk, **launch)
    return y


def int4_dequantize_ref(qweight, scales, zeros, group_size, bits=4):
    """The weight (N, K) in fp32, exactly: (q - z) * s."""
    mask = (1 << bits) - 1
    q = torch.stack([(qweight >> (bits * c)) & mask for c in range(8 // bits)], -1).reshape(qweight.shape[0], -1)
    q = q.float()
    return (q - zeros.float().repeat_interleave(group_size, 1)) * scales.float().repeat_interleave(group_size, 1)


def int4_gemv_ref(x, qweight, scales, zeros, group_size, bits=4, *, tile=None, tables=None, **options):
    """The spec: kernels.gemv's reference on the dequantized weight, rounded to x's dtype. x
    times the norm weight is rounded to x's dtype where `int4_gemv` (with this tile and these
    tables) runs the GEMM, whose dot takes it so (`_x_cols`); the M = 1 kernels and a pairs
    tile's rows keep it exact."""
    from .gemv import gemv_ref
    if options.get("norm_weight") is not None and "rounds_normed_x" not in options:
        M = math.prod(x.shape[:-1])
        swiglu = bool(options.get("swiglu"))
        flags = dict(NORM=True, SWIGLU=swiglu, RESIDUAL=options.get("residual") is not None)
        N = qweight.shape[0] // (2 if swiglu else 1)
        options["rounds_normed_x"] = M > 1 and _rows_tile("int4_gemv_ref", x, qweight, group_size, bits, flags, N,
                                                          x.shape[-1], M, tile, tables) is None
    return gemv_ref(x, int4_dequantize_ref(qweight, scales, zeros, group_size, bits).to(x.dtype), **options)


def int4_matmul_ref(x, qweight, scales, zeros, group_size, bits=4, eviction_policy=""):
    """x @ W.T with W dequantized and rounded to x's dtype, fp32 sums rounded once."""
    w = int4_dequantize_ref(qweight, scales, zeros, group_size, bits).to(x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)
