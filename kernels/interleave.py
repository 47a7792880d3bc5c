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

One launch (`interleave_pass`) of one program does what the reference does in six.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_dtype, check_shape

MAX_ROWS = 4096  # one program holds every row


def interleave_pass_ref(base, last, positions, outside: int, stride: int, n_slots: int, rows, pos, live) -> None:
    live.copy_(base <= last)
    pos.copy_(positions.masked_fill(~live, outside))
    j = torch.arange(rows.shape[0], device=base.device)[:, None]
    rows.copy_(torch.minimum(base, last)[None] + j * n_slots)
    base.add_(stride)


@triton.jit
def _interleave_pass_kernel(base_ptr, last_ptr, positions_ptr, rows_ptr, pos_ptr, live_ptr, B, outside,
                            stride, n_slots, N_LOOP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < B
    base = tl.load(base_ptr + offs, mask=m, other=0)
    last = tl.load(last_ptr + offs, mask=m, other=0)
    live = base <= last
    p = tl.load(positions_ptr + offs, mask=m, other=0)
    tl.store(pos_ptr + offs, tl.where(live, p, outside), mask=m)
    tl.store(live_ptr + offs, live.to(tl.int8), mask=m)
    row = tl.minimum(base, last)
    for j in tl.static_range(N_LOOP):
        tl.store(rows_ptr + j * B + offs, row + j * n_slots, mask=m)
    tl.store(base_ptr + offs, base + stride, mask=m)


def interleave_pass(base, last, positions, outside: int, stride: int, n_slots: int, rows, pos, live) -> None:
    """interleave_pass_ref in one launch (module docstring)."""
    check_device("interleave_pass", base=base, last=last, positions=positions, rows=rows, pos=pos, live=live)
    B = base.shape[0]
    if not 1 <= B <= MAX_ROWS:
        raise ValueError(f"interleave_pass: 1 to {MAX_ROWS} rows, got {B}")
    for name, t in (("base", base), ("last", last), ("positions", positions), ("pos", pos)):
        check_shape("interleave_pass", name, t, (B,))
        check_dtype("interleave_pass", name, t, (torch.long,))
    check_shape("interleave_pass", "live", live, (B,))
    check_dtype("interleave_pass", "live", live, (torch.bool,))
    check_dtype("interleave_pass", "rows", rows, (torch.long,))
    if rows.dim() != 2 or rows.shape[1] != B or rows.shape[0] < 1:
        raise ValueError(f"interleave_pass: rows must be (n_loop, {B}), got {tuple(rows.shape)}")
    if not all(t.is_contiguous() for t in (base, last, positions, rows, pos, live)):
        raise ValueError("interleave_pass: every tensor must be contiguous")
    _interleave_pass_kernel[(1,)](base, last, positions, rows, pos, live.view(torch.int8), B, outside, stride,
                                  n_slots, N_LOOP=rows.shape[0], BLOCK=max(16, triton.next_power_of_2(B)))
