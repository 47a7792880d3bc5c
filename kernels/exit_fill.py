"""The end of one decode row's early-exit step inside a captured graph: the `copy` fill, its
exit depth read on the device, and the publication of that depth and the token to the host.

A token that stopped after e of its L iterations leaves the cache layers of iterations
[e, L) without its K/V; later tokens attend there, so the `copy` policy gives each of them
iteration e - 1's entries (worker/runner/early_exit.py). Where e is known on the host, that is
one gather and one scatter per cache tensor. Inside a captured step it is not: the exit check
writes e into the row's depth entry on the device. `exit_fill_ref` does the fill from there
with torch ops (a where over every candidate cell, a gather and a scatter per tensor);
`exit_fill` does it in one launch, one program per cell (its K and V), and a cell that does not
move touches no memory.

Arguments:

    k, v        (layers, slots, Hkv, S, hd) the cache tensors
    depth_row   (≥ 1,) int64   the row's depth entry: e, the iterations it ran (0: an idle row,
                               which moves nothing)
    slot_row, pos_row (≥ 1,) int64  the row's cache slot and position
    its, dst    (n,) int64     each candidate cell's iteration i (≥ 1) and cache layer
    src         (top, n) int64 row e - 1: each cell's source layer for a token that ran e

A cell moves where i ≥ e (and e ≥ 1): dst gets src[e - 1]'s entry. Every source layer is an
iteration below e, so no cell reads what another writes.

`exit_publish(depth_row, greedy, host)` writes host[0] = the row's depth entry (the
iterations it ran) and host[1] = its greedy token, host a (2,) int64 in pinned host memory
that the kernel writes through its device mapping (as kernels/sampling.greedy_feed's ring): a
copy to host memory captured in a graph is a node of its own, several microseconds of the
device's time, where this is one store of two words in a launch of one program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_device


def exit_fill_ref(k, v, depth_row, slot_row, pos_row, its, dst, src) -> None:
    e = depth_row[:1]
    moved = (its >= e) & (e > 0)
    source = torch.where(moved, src.index_select(0, e.clamp(1, src.shape[0]) - 1).view(-1), dst)
    # an idle row's position lies past the cache: it moves nothing, so any position serves
    slot, pos = slot_row[:1], pos_row[:1].clamp(max=k.shape[3] - 1)
    for t in (k, v):
        t[dst, slot, :, pos] = t[source, slot, :, pos]


@triton.jit
def _copy_cell(k_ptr, v_ptr, src, dst, base, hd, s_l, s_h, s_d, HD: tl.constexpr, BLOCK: tl.constexpr):
    """One (slot, position)'s K and V of every head: cache layer src into layer dst."""
    for o in range(0, HD, BLOCK):
        offs = o + tl.arange(0, BLOCK)
        m = offs < HD
        at = base + (offs // hd) * s_h + (offs % hd) * s_d
        tl.store(k_ptr + dst * s_l + at, tl.load(k_ptr + src * s_l + at, mask=m), mask=m)
        tl.store(v_ptr + dst * s_l + at, tl.load(v_ptr + src * s_l + at, mask=m), mask=m)


@triton.jit
def _exit_fill_kernel(k_ptr, v_ptr, depth_ptr, slot_ptr, pos_ptr, its_ptr, dst_ptr, src_ptr, n, top, hd,
                      s_l, s_s, s_h, s_p, s_d, HD: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    e = tl.load(depth_ptr)
    i = tl.load(its_ptr + c)
    if (e > 0) & (i >= e):
        src = tl.load(src_ptr + (tl.minimum(e, top) - 1) * n + c)
        dst = tl.load(dst_ptr + c)
        base = tl.load(slot_ptr) * s_s + tl.load(pos_ptr) * s_p
        _copy_cell(k_ptr, v_ptr, src, dst, base, hd, s_l, s_h, s_d, HD, BLOCK)


def exit_fill(k, v, depth_row, slot_row, pos_row, its, dst, src) -> None:
    """exit_fill_ref in one launch (module docstring)."""
    check_device("exit_fill", k=k, v=v, depth_row=depth_row, slot_row=slot_row, pos_row=pos_row, its=its,
                 dst=dst, src=src)
    if k.shape != v.shape or k.stride() != v.stride() or k.dim() != 5:
        raise ValueError(f"exit_fill: k and v must be alike (layers, slots, Hkv, S, hd), got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    n = its.shape[0]
    if dst.shape != (n,) or src.dim() != 2 or src.shape[1] != n or not src.is_contiguous():
        raise ValueError(f"exit_fill: its and dst must be (n,) and src a contiguous (top, n), got "
                         f"{tuple(its.shape)}, {tuple(dst.shape)}, {tuple(src.shape)}")
    if any(t.dtype != torch.long for t in (depth_row, slot_row, pos_row, its, dst, src)):
        raise ValueError("exit_fill: the row entries and the cell tables must be int64")
    if n == 0:
        return
    H, hd = k.shape[2], k.shape[4]
    HD = H * hd
    _exit_fill_kernel[(n,)](k, v, depth_row, slot_row, pos_row, its, dst, src, n, src.shape[0], hd,
                              *k.stride(), HD=HD, BLOCK=min(1024, triton.next_power_of_2(HD)))


def exit_publish_ref(depth_row, greedy, host) -> None:
    host[0] = depth_row[0]
    host[1] = greedy[0]


@triton.jit
def _exit_publish_kernel(depth_ptr, greedy_ptr, host_ptr):
    tl.store(host_ptr, tl.load(depth_ptr))
    tl.store(host_ptr + 1, tl.load(greedy_ptr))


def exit_publish(depth_row, greedy, host) -> None:
    """exit_publish_ref in one program (module docstring)."""
    check_device("exit_publish", depth_row=depth_row, greedy=greedy)
    if host.shape != (2,) or host.dtype != torch.long or not host.is_contiguous():
        raise ValueError(f"exit_publish: host must be a contiguous (2,) int64, got {tuple(host.shape)} {host.dtype}")
    if depth_row.dtype != torch.long or greedy.dtype != torch.long:
        raise ValueError("exit_publish: depth_row and greedy must be int64")
    if depth_row.is_cuda and not torch.cuda.is_current_stream_capturing() and not host.is_pinned():
        raise ValueError("exit_publish: host must be pinned host memory (the kernel writes it from the GPU)")
    _exit_publish_kernel[(1,)](depth_row, greedy, host)


# -- the fill of an interleaved launch's rows ------------------------------------------------
#
# An interleaved launch (worker/runner/stages.py `InterleavedStep`) checks its rows' exit rules
# after every pass, on the device: a row that stops after e of its L iterations leaves the cache
# layers of iterations [e, L) without its K/V at its position. At the launch's end each such row
# gets the `copy` fill: layer (e - 1, j) into layers (i, j) for e <= i < L, every block layer j.
#
#   ran       (B,) int64  the iterations each row's token has run (e; its depth L where no rule
#                         stopped it, 0 for an idle row)
#   depth     (B,) int64  each row's depth L
#   lanes, positions (B,) int64  each row's cache slot and token position
#   n_prelude, n_loop     the cache's layer layout: iteration i's block layer j is cache layer
#                         n_prelude + i · n_loop + j
#   top                   the largest depth the cache holds (its max_loops)
#
# A cell (row b, iteration i in [1, top), layer j) moves where 1 <= ran_b <= i < depth_b; its
# source is an iteration below ran_b, which no cell writes.


def exit_fill_rows_ref(k, v, ran, depth, lanes, positions, n_prelude: int, n_loop: int, top: int) -> None:
    dev = ran.device
    i = torch.arange(1, max(top, 1), device=dev)[None, :, None]   # (1, top - 1, 1)
    j = torch.arange(n_loop, device=dev)[None, None, :]           # (1, 1, n_loop)
    e, L = ran[:, None, None], depth[:, None, None]
    moved = ((e >= 1) & (i >= e) & (i < L)).expand(-1, -1, n_loop)
    dst = (n_prelude + i * n_loop + j).expand(moved.shape)
    src = torch.where(moved, n_prelude + (e - 1).clamp(min=0) * n_loop + j, dst)
    slot = lanes[:, None, None].expand(moved.shape)
    pos = positions.clamp(max=k.shape[3] - 1)[:, None, None].expand(moved.shape)
    dst, src, slot, pos = (t.reshape(-1) for t in (dst, src, slot, pos))
    for t in (k, v):
        t[dst, slot, :, pos] = t[src, slot, :, pos]  # gathered first: no cell reads what one writes


@triton.jit
def _exit_fill_rows_kernel(k_ptr, v_ptr, ran_ptr, depth_ptr, lanes_ptr, pos_ptr, n_prelude, n_loop, hd,
                           s_l, s_s, s_h, s_p, s_d, HD: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    i = 1 + c // n_loop
    j = c % n_loop
    e = tl.load(ran_ptr + b)
    if (e >= 1) & (i >= e) & (i < tl.load(depth_ptr + b)):
        src = n_prelude + (e - 1) * n_loop + j
        dst = n_prelude + i * n_loop + j
        base = tl.load(lanes_ptr + b) * s_s + tl.load(pos_ptr + b) * s_p
        _copy_cell(k_ptr, v_ptr, src, dst, base, hd, s_l, s_h, s_d, HD, BLOCK)


def exit_fill_rows(k, v, ran, depth, lanes, positions, n_prelude: int, n_loop: int, top: int) -> None:
    """exit_fill_rows_ref in one launch, one program per (row, cell); a cell that does not move
    touches no memory."""
    check_device("exit_fill_rows", k=k, v=v, ran=ran, depth=depth, lanes=lanes, positions=positions)
    if k.shape != v.shape or k.stride() != v.stride() or k.dim() != 5:
        raise ValueError(f"exit_fill_rows: k and v must be alike (layers, slots, Hkv, S, hd), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    B = ran.shape[0]
    for name, t in (("ran", ran), ("depth", depth), ("lanes", lanes), ("positions", positions)):
        if t.shape != (B,) or t.dtype != torch.long:
            raise ValueError(f"exit_fill_rows: {name} must be ({B},) int64, got {tuple(t.shape)} {t.dtype}")
    if n_prelude + top * n_loop > k.shape[0]:
        raise ValueError(f"exit_fill_rows: {top} iterations of {n_loop} layers after {n_prelude} do not fit "
                         f"the cache's {k.shape[0]} layers")
    if B == 0 or top < 2:
        return
    H, hd = k.shape[2], k.shape[4]
    HD = H * hd
    _exit_fill_rows_kernel[(B, (top - 1) * n_loop)](k, v, ran, depth, lanes, positions, n_prelude, n_loop, hd,
                                                    *k.stride(), HD=HD, BLOCK=min(1024, triton.next_power_of_2(HD)))
