"""The per-pass bookkeeping of an interleaved decode launch (worker/runner/stages.py
`InterleavedStep`): rows that each sit at their own iteration share one pass of the shared
block, so before the pass every row needs its cache rows for that iteration, its position (or
none, past its depth) and whether the pass counts for it; after, its iteration moves on.

The cache is one tensor over every layer and lane, seen layer-flattened: row r of
(layers · n_slots, Hkv, S, hd) is cache layer r // n_slots of lane r % n_slots. A row's loop
layer j at iteration i on lane s is flat row (n_prelude + i · n_loop + j) · n_slots + s, so
iterations step a row by stride = n_loop · n_slots and its layers by n_slots.

Arguments:

    base      (B,) int64  in / out: each row's flat row of loop layer 0 at the iteration it runs
                          next; advanced by `stride` (every row, live or not)
    last      (B,) int64  the same at the row's last iteration (depth - 1); a row is live while
                          base <= last (an idle row of depth 0 never is)
    positions (B,) int64  each row's token position
    outside   int         the position that touches no cache (max_seq_len): a row that is not
                          live attends there, so it writes and reads nothing
    stride, n_slots       as above
    rows      (n_loop, B) int64 out: min(base, last) + j · n_slots (a row past its depth keeps
                          its last iteration's layers, valid rows that it does not touch)
    pos       (B,) int64  out: positions where live, else outside
    live      (B,) bool   out: base <= last
    order, xrows          optional, (B,) int64: order out, each row's xrows entry (its lane's row of
                          an exit state's buffers) where live, else n_slots (the idle rows' row):
                          the rows an exit check of the pass reads

One launch (`interleave_pass`) of one program does what the reference does in six.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_dtype, check_shape

MAX_ROWS = 4096  # one program holds every row


def _check_rows(op: str, B: int, **vectors) -> None:
    """B within one program's rows, and each of `vectors` a contiguous (B,) int64 vector."""
    if not 1 <= B <= MAX_ROWS:
        raise ValueError(f"{op}: 1 to {MAX_ROWS} rows, got {B}")
    for name, t in vectors.items():
        check_shape(op, name, t, (B,))
        check_dtype(op, name, t, (torch.long,))
        if t.stride(0) != 1:
            raise ValueError(f"{op}: {name} must be contiguous")


def interleave_pass_ref(base, last, positions, outside: int, stride: int, n_slots: int, rows, pos, live,
                        order=None, xrows=None) -> None:
    live.copy_(base <= last)
    if order is not None:
        order.copy_(torch.where(live, xrows, n_slots))
    pos.copy_(positions.masked_fill(~live, outside))
    j = torch.arange(rows.shape[0], device=base.device)[:, None]
    rows.copy_(torch.minimum(base, last)[None] + j * n_slots)
    base.add_(stride)


@triton.jit
def _interleave_pass_kernel(base_ptr, last_ptr, positions_ptr, rows_ptr, pos_ptr, live_ptr, order_ptr, xrows_ptr, B,
                            outside, stride, n_slots, N_LOOP: tl.constexpr, ORDER: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < B
    base = tl.load(base_ptr + offs, mask=m, other=0)
    last = tl.load(last_ptr + offs, mask=m, other=0)
    live = base <= last
    if ORDER:
        xr = tl.load(xrows_ptr + offs, mask=m, other=0)
        tl.store(order_ptr + offs, tl.where(live, xr, n_slots), mask=m)
    p = tl.load(positions_ptr + offs, mask=m, other=0)
    tl.store(pos_ptr + offs, tl.where(live, p, outside), mask=m)
    tl.store(live_ptr + offs, live.to(tl.int8), mask=m)
    row = tl.minimum(base, last)
    for j in tl.static_range(N_LOOP):
        tl.store(rows_ptr + j * B + offs, row + j * n_slots, mask=m)
    tl.store(base_ptr + offs, base + stride, mask=m)


def interleave_pass(base, last, positions, outside: int, stride: int, n_slots: int, rows, pos, live,
                    order=None, xrows=None) -> None:
    """interleave_pass_ref in one launch (module docstring)."""
    if (order is None) != (xrows is None):
        raise ValueError("interleave_pass: order and xrows come together")
    extra = {} if order is None else {"order": order, "xrows": xrows}
    check_device("interleave_pass", base=base, last=last, positions=positions, rows=rows, pos=pos, live=live,
                 **extra)
    B = base.shape[0]
    _check_rows("interleave_pass", B, base=base, last=last, positions=positions, pos=pos, **extra)
    check_shape("interleave_pass", "live", live, (B,))
    check_dtype("interleave_pass", "live", live, (torch.bool,))
    check_dtype("interleave_pass", "rows", rows, (torch.long,))
    if rows.dim() != 2 or rows.shape[1] != B or rows.shape[0] < 1:
        raise ValueError(f"interleave_pass: rows must be (n_loop, {B}), got {tuple(rows.shape)}")
    if not (rows.is_contiguous() and live.is_contiguous()):
        raise ValueError("interleave_pass: every tensor must be contiguous")
    _interleave_pass_kernel[(1,)](base, last, positions, rows, pos, live.view(torch.int8),
                                  order if order is not None else base, xrows if xrows is not None else base, B,
                                  outside, stride, n_slots, N_LOOP=rows.shape[0], ORDER=order is not None,
                                  BLOCK=max(16, triton.next_power_of_2(B)))


# -- a row's stop by its exit rule, and the rows moved on to their next tokens ------------------
#
# interleave_stop (after an exit check of an interleaved pass): a row its rule stopped has ran <
# depth (ran: the iterations it ran, set by the check; depth: its token's full depth), and its
# last flat row is pulled back to its loop layer 0 at iteration ran - 1 (so base > last from the
# next pass on: it is live no more): last = min(last, ((ran - 1) · n_loop + n_prelude) · n_slots
# + lane). A row still going (ran = depth) keeps its last.
#
# interleave_next (the "next" stage of a launch that repeats the last load's rows): ctl (9, B) the
# control rows as the launch before left them (0 token, 1 position, 3 start, 5 base, 6 last; the
# others as loaded), loaded (>= 10, B) each row as it would start its next token (row 9: 1 for a
# loaded row). A loaded row whose iterations passed its last (base > last: its token ended) takes
# loaded's rows, one position on (loaded's position moves on too), its token greedy[b]; a loaded
# row still going keeps its rows with start 1 (midway: no prelude, its criteria kept) and token 0;
# an idle row takes loaded's (idle) rows.


def interleave_stop_ref(ran, depth, last, lanes, n_prelude: int, n_loop: int, n_slots: int) -> None:
    stopped = ((ran - 1) * n_loop + n_prelude) * n_slots + lanes
    torch.where(ran < depth, torch.minimum(last, stopped), last, out=last)


@triton.jit
def _interleave_stop_kernel(ran_ptr, depth_ptr, last_ptr, lanes_ptr, B, n_prelude, n_loop, n_slots,
                            BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < B
    ran = tl.load(ran_ptr + offs, mask=m, other=0)
    depth = tl.load(depth_ptr + offs, mask=m, other=0)
    last = tl.load(last_ptr + offs, mask=m, other=0)
    lane = tl.load(lanes_ptr + offs, mask=m, other=0)
    stopped = ((ran - 1) * n_loop + n_prelude) * n_slots + lane
    tl.store(last_ptr + offs, tl.where(ran < depth, tl.minimum(last, stopped), last), mask=m)


def interleave_stop(ran, depth, last, lanes, n_prelude: int, n_loop: int, n_slots: int) -> None:
    """interleave_stop_ref in one launch (the comment above)."""
    check_device("interleave_stop", ran=ran, depth=depth, last=last, lanes=lanes)
    B = last.shape[0]
    _check_rows("interleave_stop", B, ran=ran, depth=depth, last=last, lanes=lanes)
    _interleave_stop_kernel[(1,)](ran, depth, last, lanes, B, n_prelude, n_loop, n_slots,
                                  BLOCK=max(16, triton.next_power_of_2(B)))


def interleave_next_ref(ctl, loaded, greedy) -> None:
    live = loaded[9]
    ended = (ctl[5] > ctl[6]).long() * live
    loaded[1].add_(ended)
    going = ended < live
    torch.where(going, ctl, loaded[:9], out=ctl)
    ctl[3].copy_(going)
    torch.mul(greedy, ended, out=ctl[0])


@triton.jit
def _interleave_next_kernel(ctl_ptr, loaded_ptr, greedy_ptr, B, ctl_stride, loaded_stride, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < B
    live = tl.load(loaded_ptr + 9 * loaded_stride + offs, mask=m, other=0)
    base = tl.load(ctl_ptr + 5 * ctl_stride + offs, mask=m, other=0)
    last = tl.load(ctl_ptr + 6 * ctl_stride + offs, mask=m, other=0)
    ended = (base > last) & (live != 0)
    going = (live != 0) & ~ended
    pos = tl.load(loaded_ptr + loaded_stride + offs, mask=m, other=0) + ended.to(tl.int64)
    tl.store(loaded_ptr + loaded_stride + offs, pos, mask=m)
    for k in tl.static_range(9):
        mine = tl.load(ctl_ptr + k * ctl_stride + offs, mask=m, other=0)
        fresh = tl.load(loaded_ptr + k * loaded_stride + offs, mask=m, other=0)
        if k == 1:
            fresh = pos
        v = tl.where(going, mine, fresh)
        if k == 0:
            v = tl.where(ended, tl.load(greedy_ptr + offs, mask=m, other=0), 0)
        if k == 3:
            v = going.to(tl.int64)
        tl.store(ctl_ptr + k * ctl_stride + offs, v, mask=m)


def interleave_next(ctl, loaded, greedy) -> None:
    """interleave_next_ref in one launch (the comment above)."""
    check_device("interleave_next", ctl=ctl, loaded=loaded, greedy=greedy)
    B = ctl.shape[1]
    _check_rows("interleave_next", B, greedy=greedy)
    if ctl.shape[0] != 9 or loaded.dim() != 2 or loaded.shape[0] < 10 or loaded.shape[1] != B:
        raise ValueError(f"interleave_next: ctl (9, B) and loaded (>= 10, B), got {tuple(ctl.shape)} and "
                         f"{tuple(loaded.shape)}")
    for name, t in (("ctl", ctl), ("loaded", loaded)):
        check_dtype("interleave_next", name, t, (torch.long,))
        if t.stride(-1) != 1:
            raise ValueError(f"interleave_next: {name}'s rows must be contiguous")
    _interleave_next_kernel[(1,)](ctl, loaded, greedy, B, ctl.stride(0), loaded.stride(0),
                                  BLOCK=max(16, triton.next_power_of_2(B)))
