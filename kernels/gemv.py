"""Projection (GEMV) of one to 64 rows (any number, batch-invariant) with the decode step's
neighbours fused in.

    y = x @ W.T                x (M, K), 1 <= M <= 64 (any M >= 1 with invariant=True);
                               W (N, K) row-major (an nn.Linear weight)

x may carry any leading dims holding M = x.numel() / K rows (a batch-1 decode step's (1, 1, K),
a batched step's (B, 1, K) over its B lanes); y keeps them: (..., N). A decode step reads every
weight once and does 2M FLOPs per weight: up to M = 64 it is bound by memory bandwidth, and at
these sizes also by the small kernels between the projections. Each option folds one of them
into the projection that reads its input or writes its output, row by row:

- ``norm_weight``: RMSNorm of each row of x first: y = rmsnorm(x) @ W.T, computed as
  (W @ (x * norm_weight)) * rsqrt(mean(x^2) + eps) in fp32 -- the same algebra with the
  scale applied after the dot, so each program sums x^2 from the chunks it loads anyway and
  no normalized vector is written and read back. (The unfused path rounds the normalized x
  to x.dtype before its dot; this one does not, so the two differ by that rounding. In the
  batched kernel, x * norm_weight is rounded to x.dtype, the dtype tl.dot takes, before the
  dot.)
- ``swiglu``: W is the fused (gate | up) projection of shape (2F, K) and y (..., F) is
  silu(x @ W_gate.T) * (x @ W_up.T), each product rounded to x.dtype first (as the unfused
  projection's output is), then silu and the product rounded as ``swiglu`` does.
- ``residual`` (..., N), y's shape: y = residual + (x @ W.T rounded to x.dtype), rounded once
  more, exactly like the unfused ``residual + linear(x, W)``.
- ``argmax_key`` (M = 1, invariant or not): the argmax of y without reading y back -- each
  program maxes one int64 key (the order-preserving bits of its largest value, then N - 1 -
  its row) into the tensor with one atomic, skipped when the key it reads is already larger.
  The decode step's head leaves its greedy token this way (kernels.sampling.greedy_feed).

Layout, M = 1 (``_gemv_kernel``): one program per BLOCK_N output rows, looping over K in
BLOCK_K chunks and accumulating a (BLOCK_N, BLOCK_K) fp32 tile that is reduced once at the
end; a tile with BLOCK_K >= K takes a one-chunk path instead, every weight of the program
loaded at once (before the PDL wait) and each row reduced straight from the products. No
split-K: a program owns its rows, which keeps the epilogues (silu, the residual) free of
atomics; the row block is small enough that even the 2048-row projections launch a few hundred
programs. The tiles are fixed per device and shape (``tables``' entry, then `TILES`', else
`default_tile`); under the interpreter one tile runs.

Layout, any M, batch-invariant (``invariant=True``): ``_gemv_kernel`` with ROW_LOOP -- the M = 1
kernel's code and constexprs on a tile of its own (`tile`'s, made one chunk where the M = 1 tile
loops over K: `invariant_tile`; the interpreter's `INTERPRET_TILE`; with ``autotune`` the tile tuned for
the M = 1 plain call), one compiled function for every M of a tile, M = 1 included (M and ROWS
are not specialized) -- each program computing ROWS rows of x one after the other on its row
block, over cdiv(M, ROWS) * cdiv(N, BLOCK_N) programs (the row group fastest, so the groups of
one weight block run side by side and share its weights through L2). Each row runs the same
instructions, so row m of y is bit for bit what the invariant M = 1 call computes for row m
alone: a row's value depends only on its own inputs and the shape's fixed tile, never on M, on
ROWS, on which rows ride with it, or on which captured batch size runs it. (The plain M = 1
launch is the same code compiled without the row loop, left as the decode step has always run
it: on the same tile, the same sums in the same order. The batched kernel below sums in another
order, with a tile that may change with M, and stops at 64 rows.) A one-chunk tile loads its
weights once and keeps them in registers for all of its rows (each row's x loaded while the row
before it computes), so the weight is read from HBM once whatever M and each further row costs
its FMAs on the CUDA cores alone: bound by the HBM read for a few rows (about 2M FLOPs a weight
against 2 bytes), by the CUDA cores' FMAs past that. A multi-chunk tile (a sweep's `tables`
entry, the autotuner's) reads its weights again for each row, from L1 or L2
(`rows_per_program_of` gives it fewer rows a program). bench/gemv_invariant.py times the rows
per program and the tiles against the batched kernel and cuBLAS. All options work on every row,
but argmax_key (M = 1 only).

Layout, 2 <= M <= 64 (``_gemv_rows_kernel``): the same grid over N, but each (BLOCK_N, BLOCK_K)
weight tile is loaded once and applied to all M rows by one tl.dot of the tile with the
transpose of the (BLOCK_M, BLOCK_K) x tile (BLOCK_M 16, 32 or 64: `rows_block`; rows >= M
masked to zero; fp32 accumulation on the tensor cores, operands in x's dtype, fp32 x with exact
"ieee" products), accumulating y's transposed (BLOCK_N, BLOCK_M) tile. The weight rows are the
dot's row side: BLOCK_N >= 16 rows fill the tensor cores' 16-row operand, where x's few rows
would leave most of it padding, so the weights are read once per call whatever M and a batched
decode step's projections cost about a batch-1 step's. Fixed tiles per device, shape and
BLOCK_M (``tables``' entry, then `ROWS_TILES`', else `default_rows_tile`): a row's value does
not depend on how many rows of one BLOCK_M ride with it.

Tiles: ``tables`` is (M = 1 entries, M > 1 entries), keyed as TILES' and ROWS_TILES' per-device
dicts, taken before the code's tables (`table_entry`): a sweep's tiles (bench/tiles.py, read by
`load_tables`; Settings.gemv_tiles) run without editing the code. ``autotune``: a shape that no
table holds runs the autotuner's tile (per process) instead of the default one.

``pdl`` (None: where the hardware allows it, Hopper and later; the engine passes False with
Settings.pdl off): programmatic dependent launch, so a projection starts while the previous
kernel drains, with its first weight chunk loaded before it waits (the weight read, nearly all
of a projection's cost, then overlaps the previous kernel's tail; bench/gemv.py times both
launches). The GEMV kernel then loads each next chunk one step ahead in registers; the batched
kernel leaves the loop over the other chunks to Triton's software pipeliner and applies the
first chunk after it, or (its tile's PDL mode) waits first, or launches plain.
"""
import functools
import json
import math

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_shape, interpreting
from ._launch import device_index, sm_count, use_pdl

# An argmax key no row's key is below: what `argmax_key` holds before a projection maxes it.
ARGMAX_KEY_NONE = -(2**63)
_KEY_NONE = tl.constexpr(ARGMAX_KEY_NONE)


@triton.jit
def _load_w(w_rows, up_rows, k, row_mask, K, SWIGLU: tl.constexpr, EVICT: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile at columns k (and its up-projection tile), loaded with
    L2 eviction policy EVICT."""
    m = row_mask[:, None] & (k < K)[None, :]
    w = tl.load(w_rows + k[None, :], mask=m, other=0.0, eviction_policy=EVICT)
    up = w
    if SWIGLU:
        up = tl.load(up_rows + k[None, :], mask=m, other=0.0, eviction_policy=EVICT)
    return w, up


@triton.jit
def _x_chunk(x_ptr, nw_ptr, k, K, ss, NORM: tl.constexpr):
    """x's chunk at columns k as a (1, BLOCK_K) fp32 row (times the norm weight with NORM), and
    ss plus its squares."""
    k_mask = k < K
    xv = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    if NORM:
        ss += xv * xv
        xv = xv * tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    return xv[None, :], ss


# M and ROWS are not specialized: every launch of a tile with ROW_LOOP (the invariant calls, the
# M = 1 one included) is one compiled kernel, the same instructions for every row (Triton would
# otherwise compile M = 1 apart); without ROW_LOOP it is the plain M = 1 launch's kernel.
@triton.jit(do_not_specialize=["M", "ROWS"])
def _gemv_kernel(
    x_ptr,  # (M, K) contiguous
    w_ptr,  # (N, K) or (2N, K) with SWIGLU, unit stride along K
    nw_ptr,  # (K,) norm weight, read only when NORM
    res_ptr,  # (M, N) contiguous residual, read only when RESIDUAL
    y_ptr,  # (M, N) contiguous
    key_ptr,  # (1,) int64, written only when ARGMAX (M = 1)
    M,
    ROWS,  # with ROW_LOOP: the rows of x a program computes, one after the other
    N,
    K,
    stride_w,
    eps,
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ARGMAX: tl.constexpr,
    EVICT: tl.constexpr,  # the weight loads' L2 eviction policy: "", "evict_first", "evict_last"
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # BLOCK_K >= K (set by the `_gemv` heuristic)
    ROW_LOOP: tl.constexpr,  # a program computes rows m_first .. m_end - 1 in turn (else row pid % M)
):
    # With ROW_LOOP, program pid computes rows group * ROWS ... of x and y, one after the other,
    # on W's row block `block`, the row group fastest: the groups of one block run side by side
    # and share its weights through L2. Each row runs the same instructions whatever ROWS, M and
    # its place in the group, so its value never depends on them. Without it (the plain M = 1
    # launch) program pid computes row pid % M on row block pid // M. (One division per program.)
    pid = tl.program_id(0)
    if ROW_LOOP:
        groups = tl.cdiv(M, ROWS)
        block = pid // groups
        m_first = (pid - block * groups) * ROWS
        m_end = tl.minimum(m_first + ROWS, M)
    else:
        block = pid // M
        m_first = pid - block * M
        m_end = m_first + 1
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)

    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    up_rows = w_rows
    if SWIGLU:
        up_rows = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_w
    if ONE_CHUNK:
        # The program's weights are one tile: all of them go out at once, before the PDL wait,
        # and stay in registers for each of its rows, which is reduced straight from the
        # products (no accumulator tile, and the same sums as the loop's single iteration).
        w, up = _load_w(w_rows, up_rows, cols, row_mask, K, SWIGLU, EVICT)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if ROW_LOOP:
            _one_chunk_rows(w, up, m_first.to(tl.int64), m_end, x_ptr, nw_ptr, res_ptr, y_ptr, key_ptr, rows,
                            row_mask, cols, N, K, eps, NORM, SWIGLU, RESIDUAL, ARGMAX, BLOCK_K)
        else:
            _one_chunk_row(w, up, m_first.to(tl.int64), x_ptr, nw_ptr, res_ptr, y_ptr, key_ptr, rows,
                           row_mask, cols, N, K, eps, NORM, SWIGLU, RESIDUAL, ARGMAX, BLOCK_K)
    else:
        w = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)  # (replaced before any use)
        up = w
        if PREFETCH:
            # Each iteration loads the next chunk's weights ahead of its own FMAs (with
            # ROW_LOOP, the last chunk of a row loads the first one of the program's next row,
            # if any). With PDL (programmatic dependent launch) this kernel may start while the
            # previous one drains: the weights never depend on it, so the first chunk's load
            # goes out before the wait, and x, the residual and everything after wait for the
            # previous kernel's writes.
            w, up = _load_w(w_rows, up_rows, cols, row_mask, K, SWIGLU, EVICT)
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
                tl.extra.cuda.gdc_wait()
        if ROW_LOOP:
            for r in range(0, m_end - m_first):
                w, up = _chunks_row(w, up, m_first.to(tl.int64) + r, m_end, x_ptr, w_rows, up_rows, nw_ptr,
                                    res_ptr, y_ptr, key_ptr, rows, row_mask, cols, N, K, eps, NORM, SWIGLU,
                                    RESIDUAL, ARGMAX, EVICT, PREFETCH, BLOCK_N, BLOCK_K, True)
        else:
            _chunks_row(w, up, m_first.to(tl.int64), m_end, x_ptr, w_rows, up_rows, nw_ptr, res_ptr, y_ptr,
                        key_ptr, rows, row_mask, cols, N, K, eps, NORM, SWIGLU, RESIDUAL, ARGMAX, EVICT,
                        PREFETCH, BLOCK_N, BLOCK_K, False)


@triton.jit
def _one_chunk_row(w, up, m, x_ptr, nw_ptr, res_ptr, y_ptr, key_ptr, rows, row_mask, cols, N, K, eps,
                   NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Row m of y on the program's rows from a one-chunk tile (w, up) in registers."""
    xv, ss = _x_chunk(x_ptr + m * K, nw_ptr, cols, K, tl.zeros([BLOCK_K], dtype=tl.float32), NORM)
    _one_chunk_out(w, up, xv, ss, m, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, x_ptr,
                   NORM, SWIGLU, RESIDUAL, ARGMAX)


@triton.jit
def _one_chunk_out(w, up, xv, ss, m, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, x_ptr,
                   NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr):
    """Row m of y from a one-chunk tile (w, up) and the row's x as a (1, BLOCK_K) fp32 row (times
    the norm weight with NORM; ss its squares): each row reduced straight from the products."""
    y = tl.sum(w.to(tl.float32) * xv, axis=1)
    y_up = y
    if SWIGLU:
        y_up = tl.sum(up.to(tl.float32) * xv, axis=1)
    _row_out(y, y_up, ss, m, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, x_ptr,
             NORM, SWIGLU, RESIDUAL, ARGMAX)


@triton.jit
def _one_chunk_rows(w, up, m_first, m_end, x_ptr, nw_ptr, res_ptr, y_ptr, key_ptr, rows, row_mask, cols, N, K,
                    eps, NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Rows m_first .. m_end - 1 of y, one after the other, on the program's rows from a one-chunk
    tile (w, up) in registers: `_one_chunk_row`'s sums for each, but each row's x is loaded while
    the row before it computes (a row's FMAs are then all it waits for), and the norm weight once."""
    k_mask = cols < K
    nw = tl.zeros([BLOCK_K], dtype=tl.float32)  # (dead code unless NORM)
    if NORM:
        nw = tl.load(nw_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
    x_next = tl.load(x_ptr + m_first * K + cols, mask=k_mask, other=0.0)
    for r in range(0, m_end - m_first):
        m = m_first + r
        xv = x_next.to(tl.float32)
        # (tl.where, not `k_mask & ...`: see _chunks_row)
        x_next = tl.load(x_ptr + (m + 1) * K + cols, mask=tl.where(m + 1 < m_end, k_mask, False), other=0.0)
        ss = xv  # (dead code unless NORM)
        if NORM:
            ss = xv * xv  # `_x_chunk`'s 0 + x * x
            xv = xv * nw
        _one_chunk_out(w, up, xv[None, :], ss, m, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, x_ptr,
                       NORM, SWIGLU, RESIDUAL, ARGMAX)


@triton.jit
def _chunks_row(w, up, m, m_end, x_ptr, w_rows, up_rows, nw_ptr, res_ptr, y_ptr, key_ptr, rows, row_mask, cols,
                N, K, eps, NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                ARGMAX: tl.constexpr, EVICT: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ROW_LOOP: tl.constexpr):
    """Row m of y on the program's rows, looping over K in BLOCK_K chunks and accumulating a
    (BLOCK_N, BLOCK_K) fp32 tile reduced once at the end. With PREFETCH, (w, up) is the first
    chunk, loaded ahead, and each chunk loads the next; -> the chunk loaded last (with ROW_LOOP:
    the next row's first, where row m + 1 < m_end is the program's)."""
    x_row = x_ptr + m * K
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)  # (dead code unless NORM)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = acc
    if SWIGLU:
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        xv, ss = _x_chunk(x_row, nw_ptr, k, K, ss, NORM)
        if not PREFETCH:
            w, up = _load_w(w_rows, up_rows, k, row_mask, K, SWIGLU, EVICT)
        acc += w.to(tl.float32) * xv
        if SWIGLU:
            acc_up += up.to(tl.float32) * xv
        if PREFETCH:
            if ROW_LOOP:
                k_next = tl.where(k0 + BLOCK_K >= K, 0, k0 + BLOCK_K)
                # (tl.where, not `row_mask & ...`: the interpreter's `&` of a mask and a scalar
                # one is an integer tensor, which tl.load refuses as a mask)
                live = tl.where((m + 1 < m_end) | (k_next > 0), row_mask, False)
                w, up = _load_w(w_rows, up_rows, k_next + cols, live, K, SWIGLU, EVICT)
            else:
                w, up = _load_w(w_rows, up_rows, k + BLOCK_K, row_mask, K, SWIGLU, EVICT)
    y = tl.sum(acc, axis=1)
    y_up = y
    if SWIGLU:
        y_up = tl.sum(acc_up, axis=1)
    _row_out(y, y_up, ss, m, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, x_ptr,
             NORM, SWIGLU, RESIDUAL, ARGMAX)
    return w, up


@triton.jit
def _row_out(y, y_up, ss, m, rows, row_mask, res_ptr, y_ptr, key_ptr, N, K, eps, x_ptr,
             NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr):
    """Row m's epilogue on the program's rows: y (and the up projection's y_up) from the fp32
    sums, times the inverse RMS of x's squares summed in ss, silu, the residual, stored (and the
    argmax key maxed), rounding where the unfused ops round: to x's dtype."""
    dtype = x_ptr.dtype.element_ty
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        y *= inv_rms
    y = y.to(dtype).to(tl.float32)
    if SWIGLU:
        up = y_up
        if NORM:
            up *= inv_rms
        up = up.to(dtype).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dtype).to(tl.float32) * up
    offset = m * N
    if RESIDUAL:
        y += tl.load(res_ptr + offset + rows, mask=row_mask, other=0.0).to(tl.float32)
    y = y.to(dtype)
    tl.store(y_ptr + offset + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)
    if ARGMAX:
        _argmax_key_max(key_ptr, y.to(tl.float32), rows, row_mask, N)


@triton.jit
def _argmax_key_max(key_ptr, y, rows, row_mask, N):
    """Atomically max key_ptr[0] with the argmax key of this program's rows of y (fp32 values):
    the order-preserving bits of the value in the high word, N - 1 - row in the low word, so
    the largest key is the largest value at its first row (torch.argmax's tie rule). A program
    whose best cannot raise the key as it reads it skips the atomic."""
    y = tl.where(y == 0.0, 0.0, y)  # -0.0 and +0.0 are equal: one key prefix, the tie by row
    bits = y.to(tl.int32, bitcast=True)
    # Flipping the magnitude bits of negatives makes signed integer order equal float order.
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    keys = tl.where(row_mask, (ordered << 32) | (N - 1 - rows).to(tl.int64), _KEY_NONE)
    best = tl.max(keys, axis=0)
    # (Reading the key first lets most programs skip the atomic: once a large key is in, few can
    # raise it, where an atomic from every program would serialize them all on one address.)
    seen = tl.load(key_ptr, volatile=True)  # only ever lower than the key the atomics leave
    tl.atomic_max(key_ptr, best, mask=best > seen, sem="relaxed")


# The interpreter's one tile (BLOCK_N, BLOCK_K) of `_gemv_kernel` (M = 1, and any M invariant).
# It runs each program's block ops in numpy at a cost nearly flat in the block's size, so a
# launch costs about its program count: 32 rows a program keep the tests' projections (N >= 64)
# on several programs, so the row-block index and the argmax epilogue's merge across programs
# still run.
INTERPRET_TILE = (32, 64)

# Every M = 1 launch goes through this: a tile as wide as K takes the one-chunk path.
_gemv = triton.heuristics({"ONE_CHUNK": lambda args: args["BLOCK_K"] >= args["K"]})(_gemv_kernel)


# (BLOCK_N, BLOCK_K, num_warps, num_stages): the tiles that bench-285m's projections and the
# Ouro-1.4B head pick on Hopper, with and without PDL, from a wider sweep of 1K to 8K weights a
# program; a short list keeps a cold start's compile-and-benchmark pass to seconds.
_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [(2, 1024, 4, 1), (2, 1024, 4, 3), (2, 1024, 8, 3), (4, 256, 4, 3), (4, 256, 8, 1),
                          (4, 1024, 4, 3), (8, 256, 4, 1), (8, 512, 4, 1), (8, 512, 8, 1), (8, 1024, 4, 1),
                          (16, 512, 4, 1)]
]
_gemv_tuned = triton.autotune(
    configs=_CONFIGS, key=["N", "K", "NORM", "SWIGLU", "RESIDUAL", "ARGMAX", "PDL"],
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles),
)(_gemv)


# gemv's tile for a float32 y or the argmax epilogue, by kernel, shape and options: the one
# tuned for the plain call (`_launch_tuned`)
_PLAIN_CONFIG: dict[tuple, triton.Config] = {}

EVICTION_POLICIES = ("", "evict_first", "evict_last")  # gemv's eviction_policy (tl.load's)

MAX_ROWS = 16  # the INT4 kernels' rows of x a call (kernels/int4_gemv.py)
MAX_FUSED_ROWS = 64  # rows of x a call takes without invariant: one BLOCK_M tile of the batched kernel

# Fixed M = 1 tiles, by device name, then (N, K, NORM, SWIGLU, RESIDUAL, PDL): (BLOCK_N, BLOCK_K,
# num_warps, num_stages). Every launch takes a fixed tile: gemv's `tables` entry (a sweep's,
# Settings.gemv_tiles), else this table's, else `default_tile`'s. A tile sets the order each row
# is summed in, so fixed tiles make every worker process (every replica of a deployment) round
# the same logits the same way, near ties included. The autotuner picks a tile per process from
# standalone timings, where close races go either way, and a standalone winner need not be the
# best inside the decode step (its neighbours share the L2 and overlap it through PDL). It runs
# only with gemv's `autotune` (Settings.autotune), for shapes no table holds; `bench/tiles.py`
# sweeps a model's tiles in its decode step instead, writes them as a tiles file (`load_tables`)
# and prints the entries to add here. bench-285m's projections with PDL: q|k|v and gate|up the
# best tiles of such a sweep in the step; wo, w2 and the head one-chunk tiles (BLOCK_K >= K:
# every weight of a program loaded before its PDL wait, so the whole weight read overlaps the
# previous kernel's tail). q|k|v and gate|up keep multi-chunk tiles: one chunk did not pay for
# them in the step.
TILES: dict[str, dict[tuple, tuple[int, int, int, int]]] = {
    "NVIDIA H200": {
        (6144, 2048, True, False, False, True): (16, 512, 4, 1),    # q|k|v (+norm)
        (2048, 2048, False, False, True, True): (4, 2048, 4, 1),    # wo (+residual)
        (5632, 2048, True, True, False, True): (8, 512, 4, 1),      # gate|up (+norm, SwiGLU)
        (2048, 5632, False, False, True, True): (1, 8192, 4, 1),    # w2 (+residual)
        (32000, 2048, True, False, False, True): (4, 2048, 4, 1),   # head (+norm)
        # The Ouro-1.4B shapes' w2 (sandwich norm: no residual in the epilogue), one chunk as
        # bench-285m's, for the same overlap; their wo and head gain nothing from one chunk and
        # keep the default.
        (2048, 5632, False, False, False, True): (1, 8192, 4, 1),
    },
}


def default_tile(K: int, weight_bytes: int | None = None) -> tuple[int, int, int, int]:
    """The M = 1 tile of a shape TILES does not hold: (2, BLOCK_K, 4, 3), BLOCK_K the padded K
    up to 1024 (one chunk for K <= 1024): bench-285m's w2 and head tile in TILES before their
    one-chunk tiles, and as good as the best tile of a sweep of each projection of the Ouro-1.4B
    shapes (multi-chunk tiles), so a shape without an entry loses little. A one-chunk weight of
    fewer than SMALL_WEIGHT_BYTES (the default model's, which stay in the L2) takes one warp: its
    call is bound by latency, and one warp sums a row without a cross-warp step, which shortens
    the M = 1 call and, far more, an invariant call of a few rows, whose programs multiply with
    its rows (bench/gemv_invariant.py's `tile 2x1` variants)."""
    block_k = min(1024, triton.next_power_of_2(max(K, 16)))
    small = weight_bytes is not None and weight_bytes < SMALL_WEIGHT_BYTES and block_k >= K
    return 2, block_k, 1 if small else 4, 3


# The M = 2..64 launch's (BLOCK_N, BLOCK_K, num_warps, num_stages, PDL mode) per device, shape and
# BLOCK_M (N, K, norm, swiglu, residual, `rows_block(M)`), one tile for every M of a BLOCK_M, so a
# row's value does not depend on how many rows ride with it there. The PDL mode: "prefetch" (the
# first weight tile loaded before the wait), "wait" (the wait first), "off" (a plain launch, which
# waits for the previous kernel to finish); with PDL off (Settings.pdl) every launch is plain.
# Measured on the H200 by bench/rows_tiles.py (rows-tiles-cuda.json: weights read from HBM,
# back-to-back calls in a graph; the best mode of each of a sweep's three best plain tiles; at
# M = 4 and 16 for BLOCK_M 16, M = 32 and 64 for the others).
ROWS_TILES: dict[str, dict[tuple, tuple[int, int, int, int, str]]] = {
    "NVIDIA H200": {
        (6144, 2048, True, False, False, 16): (64, 256, 4, 3, "prefetch"),
        (2048, 2048, False, False, True, 16): (64, 128, 4, 6, "wait"),
        (5632, 2048, True, True, False, 16): (64, 256, 4, 3, "off"),
        (2048, 5632, False, False, True, 16): (16, 512, 4, 3, "off"),
        (32000, 2048, True, False, False, 16): (128, 64, 4, 6, "wait"),
        (6144, 2048, True, False, False, 32): (64, 256, 4, 3, "wait"),
        (2048, 2048, False, False, True, 32): (16, 256, 4, 6, "wait"),
        (5632, 2048, True, True, False, 32): (64, 128, 8, 4, "wait"),
        (2048, 5632, False, False, True, 32): (16, 256, 4, 6, "wait"),
        (32000, 2048, True, False, False, 32): (128, 128, 8, 4, "wait"),
        # 64 rows: slower than cuBLAS and the unfused ops for wqkv and w2 (Settings.fused_rows stops at 32)
        (6144, 2048, True, False, False, 64): (64, 128, 8, 4, "prefetch"),
        (2048, 2048, False, False, True, 64): (16, 256, 4, 4, "wait"),
        (5632, 2048, True, True, False, 64): (64, 128, 8, 4, "wait"),
        (2048, 5632, False, False, True, 64): (16, 256, 4, 4, "wait"),
        (32000, 2048, True, False, False, 64): (128, 128, 8, 4, "prefetch"),
    },
}
ROWS_PDL_MODES = ("prefetch", "wait", "off")


def default_rows_tile(N: int, block_m: int = 16) -> tuple[int, int, int, int, str]:
    """The tile of a shape ROWS_TILES does not hold: the weight rows are the dot's 16-row (or
    wider) operand, so BLOCK_N is at least 16; 16 up to 4096 rows (a 2048-row projection
    launches 128 programs, about one per SM), 64 beyond; tiles among the best of the H200 sweep
    whose shared-memory stages (weight tiles, SwiGLU's two, and the x tile of block_m rows) fit."""
    if N <= 4096:
        return (16, 512, 4, 3, "off") if block_m == 16 else (16, 256, 4, 6, "wait")
    return (64, 128, 8, 4, "wait")


def table_entry(code_table: dict, which: int, tables, device: torch.device, key: tuple):
    """The tile of `key`: tables[which] (a sweep's entries, `load_tables`; any mapping, asked
    `key in` first) before the code's table for the device; None where neither holds it.
    (kernels/int4_gemv.py looks its tiles up the same way.)"""
    if tables is not None and key in tables[which]:
        return tables[which][key]
    if device.type != "cuda":
        return None  # (the code's tables are per GPU name)
    return code_table.get(_device_name(device), {}).get(key)


def tile(device: torch.device, N: int, K: int, norm: bool, swiglu: bool, residual: bool,
         pdl: bool, tables=None, autotune: bool = False, invariant: bool = False) -> tuple[int, int, int, int] | None:
    """The M = 1 launch's (BLOCK_N, BLOCK_K, num_warps, num_stages) on a CUDA device: tables'
    (`table_entry`: a sweep's tile runs as it is), else TILES', else the default -- for an
    invariant call, made one chunk (`invariant_tile`); None: the autotuner picks (autotune, a
    shape no table holds)."""
    key = (N, K, norm, swiglu, residual, pdl)
    if tables is not None and key in tables[0]:
        return tables[0][key]
    # (the tables are for 2-byte weights: SwiGLU's gate and up are two N x K halves)
    t = table_entry(TILES, 0, None, device, key) or (None if autotune else default_tile(K, (1 + swiglu) * N * K * 2))
    return invariant_tile(t, K) if invariant and t is not None else t


def rows_tile(device: torch.device, N: int, K: int, norm: bool, swiglu: bool, residual: bool,
              block_m: int = 16, elem_bytes: int = 2, tables=None,
              autotune: bool = False) -> tuple[int, int, int, int, str] | None:
    """`tile` for M = 2..MAX_FUSED_ROWS rows of elem_bytes-byte elements (the same for every M of
    one `rows_block`): tables', else ROWS_TILES' (either for 2-byte x and weights alone: measured
    so), else the default, fitted to the shared memory its stages take; None: the autotuner picks (autotune, a
    shape no table holds)."""
    t = table_entry(ROWS_TILES, 1, tables, device, (N, K, norm, swiglu, residual, block_m)) \
        if elem_bytes == 2 else None
    if t is not None or autotune:
        return t
    return fit_rows_tile(default_rows_tile(N, block_m), block_m, swiglu, elem_bytes)


TILES_FORMAT = ('{"tiles": [[[N, K, norm, swiglu, residual, pdl], [BLOCK_N, BLOCK_K, num_warps, num_stages]], ...], '
                '"rows_tiles": [[[N, K, norm, swiglu, residual, BLOCK_M], [BLOCK_N, BLOCK_K, num_warps, '
                'num_stages, PDL mode]], ...]}')


def load_tables(path: str) -> tuple[dict, dict]:
    """(M = 1 entries, M > 1 entries) of a gemv tiles JSON (bench/tiles.py writes one), keyed as
    TILES' and ROWS_TILES' per-device dicts: an object with "tiles" and / or "rows_tiles", each a
    list of [key, tile] pairs (`TILES_FORMAT`; other fields, such as a sweep's timings, are
    ignored). A file that is not one, or an entry no launch could take -> ValueError naming the
    file, the entry and the form."""
    where = f"gemv tiles {path!r}"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a readable JSON file ({type(e).__name__}: {e}); expected {TILES_FORMAT}") \
            from None
    if not isinstance(data, dict) or not ("tiles" in data or "rows_tiles" in data):
        raise ValueError(f"{where}: expected an object with \"tiles\" and / or \"rows_tiles\": {TILES_FORMAT}")
    out = ({}, {})
    for which, name in enumerate(("tiles", "rows_tiles")):
        entries = data.get(name, [])
        if not isinstance(entries, list):
            raise ValueError(f"{where}: \"{name}\" must be a list of [key, tile] pairs ({TILES_FORMAT})")
        for i, entry in enumerate(entries):
            problem = _entry_problem(entry, rows=which == 1)
            if problem:
                raise ValueError(f"{where}: {name}[{i}] = {entry!r}: {problem} ({TILES_FORMAT})")
            key, t = entry
            out[which][tuple(key)] = tuple(t)
    return out


def _entry_problem(entry, rows: bool) -> str | None:
    """What makes entry no [key, tile] pair of a tiles file (None: it is one)."""
    if not isinstance(entry, list) or len(entry) != 2 or not all(isinstance(v, list) for v in entry):
        return "not a [key, tile] pair of lists"
    key, t = entry
    ints = lambda vs: all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in vs)  # noqa: E731
    pow2 = lambda vs: all(v & (v - 1) == 0 for v in vs)  # noqa: E731
    last = "BLOCK_M" if rows else "pdl"
    if len(key) != 6 or not ints(key[:2]) or not all(isinstance(v, bool) for v in key[2:5]):
        return f"a key is [N, K, norm, swiglu, residual, {last}]: N, K positive ints, the flags booleans"
    if rows and key[5] not in (16, 32, 64):
        return f"a rows key's BLOCK_M is 16, 32 or 64 (`rows_block`), got {key[5]!r}"
    if not rows and not isinstance(key[5], bool):
        return f"an M = 1 key's pdl is a boolean, got {key[5]!r}"
    size = 5 if rows else 4
    if len(t) != size or not ints(t[:4]) or not pow2(t[:3]):
        return (f"a tile is [BLOCK_N, BLOCK_K, num_warps, num_stages{', PDL mode' if rows else ''}]: "
                f"positive ints, the first three powers of two")
    if rows and (t[4] not in ROWS_PDL_MODES or t[0] < 16):
        return f"a rows tile's PDL mode is one of {ROWS_PDL_MODES} and its BLOCK_N >= 16 (tl.dot)"
    return None


ROWS_SMEM_BYTES = 160 * 1024  # the stages a rows tile may stage in shared memory (Hopper: 227 KB a block)


def fit_rows_tile(tile: tuple[int, int, int, int, str], block_m: int, swiglu: bool,
                  elem_bytes: int) -> tuple[int, int, int, int, str]:
    """tile with BLOCK_K, then num_stages, cut down until its pipelined stages (the weight tile,
    SwiGLU's second one and the x tile, of elem_bytes-byte elements) fit ROWS_SMEM_BYTES: a
    float32 model's rows, say, need twice a bf16 one's."""
    bn, bk, warps, stages, mode = tile
    per_k = (bn * (2 if swiglu else 1) + block_m) * elem_bytes
    while stages * bk * per_k > ROWS_SMEM_BYTES and bk > 64:
        bk //= 2
    while stages * bk * per_k > ROWS_SMEM_BYTES and stages > 2:
        stages -= 1
    return bn, bk, warps, stages, mode


@triton.jit
def _dot_wt(x, w, acc, DOT_F32: tl.constexpr):
    """acc + x @ w.T, in fp32 ("ieee": no tf32 rounding) when DOT_F32, else in x's dtype on the
    tensor cores with fp32 accumulation."""
    if DOT_F32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _rows_x(x_rows, nw_ptr, k, m_mask, K, ss, NORM: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) x tile at columns k; with NORM, times the norm weight (rounded
    back to x's dtype: tl.dot takes both operands in one dtype) and each row's sum of squares
    added to ss (the rsqrt scale goes on after the dot)."""
    k_mask = k < K
    xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    if NORM:
        xf = xv.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        xv = (xf * tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]).to(xv.dtype)
    return xv, ss


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _gemv_rows_kernel(
    x_ptr,  # (M, K) contiguous
    w_ptr,  # (N, K) or (2N, K) with SWIGLU, unit stride along K
    nw_ptr,  # (K,) norm weight, read only when NORM
    res_ptr,  # (M, N) contiguous residual, read only when RESIDUAL
    y_ptr,  # (M, N) contiguous
    M,
    N,
    K,
    stride_w,
    eps,
    M_BUCKET,  # unused: the autotuning key's BLOCK_M
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    EVICT: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_gemv_kernel for 2 <= M <= BLOCK_M rows of x (BLOCK_M: 16, 32 or 64): each weight tile is
    loaded once and applied to every row by one tl.dot of the tile with the (BLOCK_M, BLOCK_K) x
    tile's transpose (rows >= M zero), accumulating y's transposed (BLOCK_N, BLOCK_M) tile in
    fp32. The weight rows are the dot's M side ("swap AB"): a (BLOCK_N >= 16) row block fills the
    tensor cores' 16-row operand, where x's few rows would leave most of it padding, so a tile
    costs about what its weight read costs at any M."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns n = rows of W
    row_mask = rows < N
    ms = tl.arange(0, BLOCK_M)  # rows of x and y
    m_mask = ms < M
    cols = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty

    x_rows = x_ptr + ms[:, None] * K
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    up_rows = w_rows
    if SWIGLU:
        up_rows = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_w
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # (ss and acc_up are dead code unless NORM / SWIGLU)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = 0
    if PREFETCH:
        # The weights never depend on the previous kernel: with PDL the first chunk's tile is
        # loaded before the wait and applied after the loop over the other chunks (the loop
        # stays free for Triton's software pipeliner to stage its loads through shared memory).
        w0, up0 = _load_w(w_rows, up_rows, cols, row_mask, K, SWIGLU, EVICT)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        k_start = BLOCK_K
    elif PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    for k0 in range(k_start, K, BLOCK_K):
        xv, ss = _rows_x(x_rows, nw_ptr, k0 + cols, m_mask, K, ss, NORM)
        w, up = _load_w(w_rows, up_rows, k0 + cols, row_mask, K, SWIGLU, EVICT)
        acc = _dot_wt(w, xv, acc, DOT_F32)
        if SWIGLU:
            acc_up = _dot_wt(up, xv, acc_up, DOT_F32)
    if PREFETCH:
        xv, ss = _rows_x(x_rows, nw_ptr, cols, m_mask, K, ss, NORM)
        acc = _dot_wt(w0, xv, acc, DOT_F32)
        if SWIGLU:
            acc_up = _dot_wt(up0, xv, acc_up, DOT_F32)

    # the epilogue of _gemv_kernel, for each row of x (a column of the tile)
    y = acc
    if NORM:
        inv_rms = tl.rsqrt(ss / K + eps)[None, :]
        y *= inv_rms
    y = y.to(dtype).to(tl.float32)
    if SWIGLU:
        up = acc_up
        if NORM:
            up *= inv_rms
        up = up.to(dtype).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(dtype).to(tl.float32) * up
    out_offs = ms[None, :] * N + rows[:, None]
    out_mask = m_mask[None, :] & row_mask[:, None]
    if RESIDUAL:
        y += tl.load(res_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + out_offs, y.to(dtype).to(y_ptr.dtype.element_ty), mask=out_mask)


# The autotuner's (BLOCK_N, BLOCK_K, num_warps, num_stages) for M = 2..64 (gemv's `autotune`, a
# shape no table holds): the best of the H200 sweep (bench/rows_tiles.py) across bench-285m's
# projections. Even at M = 64 a call does 64 FLOPs per weight byte, below the tensor cores'
# ridge: a tile's job is to keep enough of the weight read in flight on every SM.
_ROWS_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [(16, 512, 4, 3), (32, 256, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3),
                          (64, 128, 8, 4), (128, 64, 4, 6), (128, 128, 8, 4)]
]
_gemv_rows_tuned = triton.autotune(
    configs=_ROWS_CONFIGS, key=["N", "K", "M_BUCKET", "NORM", "SWIGLU", "RESIDUAL", "PDL"],
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles),
)(_gemv_rows_kernel)


def rows_block(m: int) -> int:
    """The batched kernel's BLOCK_M for m rows: 16 (the tensor cores' narrowest operand), 32 or
    64. A tile is fixed per shape and BLOCK_M, so each row's value is the same for every m of
    one BLOCK_M."""
    return 16 if m <= 16 else 32 if m <= 32 else MAX_FUSED_ROWS


def check_options(op, x, N, M, norm_weight, out_dtype, residual, argmax_key, eviction_policy):
    """The fused options' checks, shared by gemv and int4_gemv: -> (the empty output, the
    residual made contiguous)."""
    K = x.shape[-1]
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
    return y, residual


def gemv(x, weight, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None, pdl=None, out_dtype=None,
         argmax_key=None, eviction_policy="", invariant=False, tables=None, autotune=False, rows_per_program=None):
    """x (..., K) holding 1 <= M <= 64 rows (any M >= 1 with invariant), weight (N, K) (with
    swiglu: (2F, K)) -> y (..., N or F).

    The leading dims of x (e.g. (1, 1) of a batch-1 decode step, (B, 1) of a batched one) are
    kept; residual has y's shape. M = 1 runs the GEMV kernel, M > 1 the batched one (one read
    of each weight tile for all rows). Options as in the module docstring; all tensors share
    x's dtype except norm_weight, which may be any float dtype.
    invariant: M > 1 runs the GEMV kernel too, each program computing rows_per_program rows
    of x in turn on its row block (module docstring, "batch-invariant"), so row m of y is bit
    for bit the invariant M = 1 call's y for row m of x (and of residual) alone, whatever M and
    the other rows (the plain M = 1 call on the same tile computes the same sums in the same order).
    rows_per_program: the rows of x a program of the invariant M > 1 call computes
    (`rows_per_program_of`'s default when None); it changes the launch's speed, never y.
    pdl: launch with programmatic dependent launch and weight prefetch (None: where the hardware
    allows it, `use_pdl`); under the interpreter it selects the prefetching loop alone.
    out_dtype: x.dtype (default) or torch.float32, y's dtype: the values are rounded to x.dtype
    all the same (with the plain call's tile: `_launch_tuned`), so a float32 y is exactly the
    default y's .float(), with no kernel to convert it (the decode step's logits).
    argmax_key: a (1,) int64 tensor, M = 1 only: each program maxes it (atomically) with the
    key of its largest entry of y (`argmax_key_ref`), so after the call it holds y's argmax if
    it held `ARGMAX_KEY_NONE` before (the decode step's greedy token, with no kernel reading
    the logits back: kernels.sampling.greedy_feed reads the key and sets it back). y is the
    y of the call without it (the plain call's tile).
    eviction_policy: the L2 eviction policy of the weight loads, as tl.load's: "" (the
    default), "evict_first" (a weight read once and streamed past) or "evict_last" (a weight
    read again soon: a looped model's shared block, read L times a token). y does not depend
    on it.
    tables: (M = 1 entries, M > 1 entries) whose tiles the launch takes before the code's
    TILES / ROWS_TILES (`tile`, `rows_tile`; a sweep's, `load_tables`); autotune: a shape no
    table holds runs the autotuner's tile instead of the default one. Neither applies under
    the interpreter, whose tile is fixed."""
    op = "gemv"
    tensors = {"x": x, "weight": weight}
    if argmax_key is not None:
        tensors["argmax_key"] = argmax_key
    if norm_weight is not None:
        tensors["norm_weight"] = norm_weight
    if residual is not None:
        tensors["residual"] = residual
    check_device(op, **tensors)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be (..., K), got a 0-d tensor")
    M = math.prod(x.shape[:-1])
    if invariant and M < 1:
        raise ValueError(f"{op}: x (..., K) must hold M >= 1 rows, got shape {tuple(x.shape)} (M = {M})")
    if not invariant and not 1 <= M <= MAX_FUSED_ROWS:
        raise ValueError(f"{op}: x (..., K) must hold 1 <= M <= {MAX_FUSED_ROWS} rows, got shape {tuple(x.shape)} "
                         f"(M = {M})" + ("; invariant=True takes any M >= 1" if M > MAX_FUSED_ROWS else ""))
    if rows_per_program is not None and rows_per_program < 1:
        raise ValueError(f"{op}: rows_per_program must be >= 1, got {rows_per_program}")
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
    y, residual = check_options(op, x, N, M, norm_weight, out_dtype, residual, argmax_key, eviction_policy)
    flags = dict(NORM=norm_weight is not None, SWIGLU=bool(swiglu), RESIDUAL=residual is not None,
                 EVICT=eviction_policy)
    xm = x.reshape(M, K).contiguous()
    if M > 1 and not invariant:
        return _gemv_rows(xm, weight, norm_weight, residual, y, M, N, K, eps, pdl, flags, tables, autotune)

    def args(out, key=argmax_key, rows=M, per=1):  # rows = 1: row 0 alone (the plain call `_launch_tuned` tunes)
        return (xm, weight, xm if norm_weight is None else norm_weight.contiguous(),
                out if residual is None else residual, out, out if key is None else key,
                rows, per, N, K, weight.stride(0), float(eps))
    flags["ARGMAX"] = argmax_key is not None
    # invariant: cdiv(M, per) programs per row block (`_gemv_kernel`: row group fastest), each
    # computing `per` rows, M = 1 too; else M = 1, the decode step's launch
    flags["ROW_LOOP"] = bool(invariant)
    if interpreting():
        per = rows_per_program_of(M, False, asked=rows_per_program)
        bn, bk = INTERPRET_TILE
        _gemv[(triton.cdiv(M, per) * triton.cdiv(N, bn),)](*args(y, per=per), **flags, PREFETCH=bool(pdl), PDL=False,
                                                          BLOCK_N=bn, BLOCK_K=bk)
        return y
    pdl = use_pdl(x.device, pdl)
    t = tile(x.device, N, K, flags["NORM"], flags["SWIGLU"], flags["RESIDUAL"], pdl, tables, autotune, invariant)
    if t is None:
        _launch_tuned(_gemv_tuned, N, args, y, x.dtype, (N, K, weight.stride(0), x.device, pdl, *flags.values()),
                      rows=M, per_rows=lambda c: invariant_rows(M, N, K, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], weight,
                                                                rows_per_program),
                      **flags, PREFETCH=pdl, PDL=pdl, launch_pdl=pdl)
        return y
    bn, bk, warps, stages = t
    per = invariant_rows(M, N, K, bn, bk, weight, rows_per_program)
    _gemv[(triton.cdiv(M, per) * triton.cdiv(N, bn),)](*args(y, per=per), **flags, PREFETCH=pdl, PDL=pdl, BLOCK_N=bn,
                                                       BLOCK_K=bk, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


# The weights a program of an invariant call holds in registers when its shape's tile loops over K:
# such a call takes a one-chunk tile of this many weights a row block instead (`invariant_tile`).
INVARIANT_ONE_CHUNK_WEIGHTS = 8192


def invariant_tile(t: tuple[int, int, int, int], K: int) -> tuple[int, int, int, int]:
    """The tile of an invariant call whose M = 1 tile is t = (BLOCK_N, BLOCK_K, num_warps,
    num_stages): t itself where it is one chunk (BLOCK_K >= K), where K pads past
    INVARIANT_ONE_CHUNK_WEIGHTS, or where padding K to a power of two adds more than an eighth
    (masked lanes that every row would carry, and fewer rows a program: such a tile, bench-285m's
    w2 with 5632 columns in 8192, is slower than its looping tile for the few rows of a batch-1
    step and a small batch); else a one-chunk tile of INVARIANT_ONE_CHUNK_WEIGHTS // K padded
    rows, 4 warps (with swiglu as many rows of each of its two weight tiles: gate|up's four rows
    of 2048 columns beat two, at one row and at many). A multi-chunk tile reads its weights once
    for each row a program computes, a one-chunk one once for all of them (`_gemv_kernel`), so
    the batched step's q|k|v and gate|up read their weights once whatever M; it changes the order
    the rows are summed in, the same for every M, M = 1 included."""
    k_pad = triton.next_power_of_2(K)
    rows = INVARIANT_ONE_CHUNK_WEIGHTS // k_pad
    if t[1] >= K or rows < 1 or 8 * k_pad > 9 * K:
        return t
    return rows, k_pad, 4, 1


# An invariant call's rows a program: a one-chunk tile keeps its weights in registers for all
# of them (one weight read whatever M, the rows' FMAs in turn); a multi-chunk tile reads its
# weights again for each row (from L1 or L2), so it takes fewer. Either way a program's rows run
# one after the other, so a call keeps at least PROGRAMS_PER_SM programs an SM. A weight under
# SMALL_WEIGHT_BYTES stays in the L2 between calls (a small model's): its call is bound by its
# latency, not by the weight read, and every row takes a program of its own.
INVARIANT_ROWS_ONE_CHUNK = 16
INVARIANT_ROWS = 4
PROGRAMS_PER_SM = 4
SMALL_WEIGHT_BYTES = 4 << 20


def rows_per_program_of(M: int, one_chunk: bool, blocks: int = 1, sms: int = 0, asked: int | None = None,
                        weight_bytes: int | None = None) -> int:
    """The rows of x each program of an M-row gemv over `blocks` row blocks computes on a GPU of
    `sms` SMs: `asked` (gemv's rows_per_program) if given; 1 for a weight of fewer than
    SMALL_WEIGHT_BYTES; else as many as keep PROGRAMS_PER_SM * sms programs (all M without sms),
    at most INVARIANT_ROWS_ONE_CHUNK for a one-chunk tile and INVARIANT_ROWS otherwise, evened
    out over the groups it makes; at most M. Every choice gives each row the same bits
    (`_gemv_kernel`)."""
    if asked is not None:
        return max(1, min(M, asked))
    if weight_bytes is not None and weight_bytes < SMALL_WEIGHT_BYTES:
        return 1
    per = min(M, INVARIANT_ROWS_ONE_CHUNK if one_chunk else INVARIANT_ROWS)
    if sms:
        per = max(1, min(per, M * blocks // (PROGRAMS_PER_SM * sms)))
    return triton.cdiv(M, triton.cdiv(M, per))  # the same count in every group but the last


def invariant_rows(M: int, N: int, K: int, block_n: int, block_k: int, weight: torch.Tensor,
                   asked: int | None = None) -> int:
    """The rows a program of gemv's M-row launch on a (block_n, block_k) tile of `weight` (its
    N output rows, K columns) computes: `rows_per_program_of` on the weight's device; 1 for one
    row."""
    if M == 1:
        return 1
    return rows_per_program_of(M, block_k >= K, triton.cdiv(N, block_n),
                               sm_count(weight.device), asked,
                               weight.numel() * weight.element_size())


def _device_name(device: torch.device) -> str:
    return _device_name_of(device_index(device))


@functools.lru_cache(maxsize=None)
def _device_name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _launch_tuned(tuned, N, args, y, dtype, key, rows=1, per_rows=None, **meta):
    """tuned[grid](*args(y), **meta) over cdiv(N, BLOCK_N) programs, times cdiv(rows, per_rows(tile))
    for rows > 1 rows of x (each program computing per_rows(tile) of them). A call that is not the
    plain one -- a y of another dtype than `dtype` (x's: a float32 y), the argmax epilogue, or
    gemv's invariant call of rows > 1 rows of x -- runs the tile tuned for the plain call (y of
    x's dtype, no argmax key, one row: `args(y, None)`, with rows > 1 `args(y, None, 1)`: row 0
    alone), found once per key (shape and options): the autotuner keys on every argument's
    dtype, not on M, and a tile of its own would sum each row in another order, so the logits
    would depend on how they were asked for (a float32 y would differ from the bf16 one widened,
    the logits with the argmax key from those without it, a row of a batch from the row
    alone)."""
    one_row = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    argmax = meta.get("ARGMAX", False)
    if y.dtype == dtype and not argmax and rows == 1:
        tuned[one_row](*args(y), **meta)
        return
    key = (tuned, dtype, *key)
    config = _PLAIN_CONFIG.get(key)
    if config is None:
        plain = dict(meta, ARGMAX=False) if argmax else meta
        scratch = torch.empty(y.shape, dtype=dtype, device=y.device)
        tuned[one_row](*(args(scratch, None) if rows == 1 else args(scratch, None, 1)), **plain)
        config = _PLAIN_CONFIG[key] = tuned.best_config
    per = per_rows(config) if rows > 1 else 1
    groups = triton.cdiv(rows, per)
    tuned.fn[(groups * triton.cdiv(N, config.kwargs["BLOCK_N"]),)](*args(y, per=per), **meta,
                                                                   **config.all_kwargs())  # as the autotuner launches it


def _gemv_rows(x, weight, norm_weight, residual, y, M, N, K, eps, pdl, flags, tables=None, autotune=False):
    """gemv's launch for 2 <= M <= MAX_FUSED_ROWS rows: x (M, K) contiguous, y and residual (..., N)
    contiguous, so (M, N) in memory."""
    bm = rows_block(M)

    def args(out, key=None):  # (no argmax key: M > 1)
        return (x, weight, x if norm_weight is None else norm_weight.contiguous(),
                out if residual is None else residual, out, M, N, K, weight.stride(0), float(eps), bm)
    # the dot in fp32: for fp32 x (exact products like gemv_ref's, not tf32), and for bf16 under
    # the interpreter, whose tl.dot multiplies bf16 bit patterns as integers (bf16 products are
    # exact in fp32, so this is the tensor cores' math)
    dot_f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting())
    flags = dict(flags, DOT_F32=dot_f32, BLOCK_M=bm)
    if interpreting():
        _gemv_rows_kernel[(triton.cdiv(N, 16),)](*args(y), **flags, PREFETCH=bool(pdl), PDL=False,
                                                 BLOCK_N=16, BLOCK_K=64)
        return y
    pdl = use_pdl(x.device, pdl)
    t = rows_tile(x.device, N, K, flags["NORM"], flags["SWIGLU"], flags["RESIDUAL"], bm, x.element_size(), tables,
                  autotune)
    if t is None:
        _launch_tuned(_gemv_rows_tuned, N, args, y, x.dtype,
                      (N, K, weight.stride(0), x.device, pdl, bm, *flags.values()),
                      **flags, PREFETCH=pdl, PDL=pdl, launch_pdl=pdl)
        return y
    bn, bk, warps, stages, mode = t
    pdl = pdl and mode != "off"
    _gemv_rows_kernel[(triton.cdiv(N, bn),)](*args(y), **flags, PREFETCH=pdl and mode == "prefetch", PDL=pdl,
                                             BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                                             launch_pdl=pdl)
    return y


def argmax_key_ref(y):
    """The argmax key of y (..., N) over its last dim, (...) int64: the largest of
    (order-preserving int32 bits of the fp32 value) << 32 | (N - 1 - index), -0.0 taken as +0.0;
    ((N - 1) - (key & 0xFFFFFFFF)) is y's torch.argmax (its first maximum)."""
    N = y.shape[-1]
    yf = y.float()
    bits = torch.where(yf == 0, torch.zeros_like(yf), yf).view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    idx = torch.arange(N - 1, -1, -1, device=y.device)
    return ((ordered << 32) | idx).amax(-1)


def gemv_ref(x, weight, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None, pdl=None,
             out_dtype=None, argmax_key=None, eviction_policy="", invariant=False, tables=None, autotune=False,
             rows_per_program=None, rounds_normed_x=None):
    """The spec, in plain torch: the unfused ops, each rounding where the fused kernel does,
    row by row over x's leading dims (the norm statistics are per row). (pdl and
    eviction_policy change how the kernel reads, not what it computes; invariant, tables and
    autotune, which summation order a row gets, and this spec has one of its own.)
    rounds_normed_x: whether x times the norm weight is rounded to x's dtype before the
    product, as the batched kernel does (its dot takes both operands in one dtype); None: as
    `gemv` runs, M > 1 rows without invariant. Unmodelled, that rounding moves a SwiGLU output
    past the projection tolerance at bench-285m's shapes, where the up value scales the gate's
    error."""
    xn = x.float()
    if norm_weight is not None:
        if rounds_normed_x is None:
            rounds_normed_x = math.prod(x.shape[:-1]) > 1 and not invariant
        xn = xn * norm_weight.float()
        if rounds_normed_x:
            xn = xn.to(x.dtype).float()
    y = xn @ weight.float().t()
    if norm_weight is not None:
        y = y * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    if swiglu:
        gate, up = y.float().chunk(2, -1)
        y = (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)
    if residual is not None:
        y = (residual.float() + y.float()).to(x.dtype)
    if argmax_key is not None:
        torch.maximum(argmax_key, argmax_key_ref(y).reshape(1), out=argmax_key)
    return y if out_dtype is None else y.to(out_dtype)
