"""Decode attention (one query token per sequence) over a static KV cache, split-K.

    o[b, h] = softmax(scale * q[b, h] . K[b, h // G, :n_b]^T) V[b, h // G, :n_b]
    n_b = min(seq_lens[b], S),  G = H // Hkv (GQA group)

Slots j < n_b are valid, in any order, so the same kernel serves a linear cache and a ring
buffer sliding window (S == window, every filled slot valid). n_b == 0 gives a zero output.

Flash-decoding in two launches: the split kernel runs one program per (b, kv head, split of S);
the program loads each K / V tile once for all G query heads of its group (a (G, hd) x
(hd, BLOCK_N) dot) and keeps an online softmax, writing the partial (max m, sum l, unnormalized
acc) of its split. The merge kernel, one program per (b, h), combines the splits of its head
into o. The grids depend only on B, H, Hkv and S, never on seq_lens, so the launches need no
host sync and can be captured in a CUDA graph; splits past n_b write neutral partials
(m = -inf, l = 0, acc = 0).

Layouts: q (B, H, hd); k_cache, v_cache (B, Hkv, S, hd), any strides, row b the cache of query
row b; seq_lens (B,) int32 / int64 on the device. With ``slots`` (B,) int32 / int64 on the
device, any stride, the caches are whole layers (n_slots, Hkv, S, hd), n_slots any size, and
row b attends over cache row slots[b] (K[b] above is K[slots[b]]): the split kernel loads the
slot in-kernel, so a captured graph serves whichever lanes the slots tensor names at replay.
Rows may share a slot (the op only reads). Without slots the kernel takes the slot-less path
it always had (a constexpr: no load). Dtypes: q and caches share fp16 / bf16 / fp32; softmax
and accumulation in fp32 (scores in the log2 domain, scale folded into log2(e)); output
(B, H, hd) in q.dtype. hd need not be a power of two (masked to BLOCK_D).

``rope_decode_attention`` fuses the RoPE / K-V cache write of the new token (``rope_cache_write``
of kernels/rope.py, a launch of its own per layer) into the split kernel. With p_b = positions[b]:

    q_rot = rot(q[b, 0]),  k_new = rot(k[b, 0]),  v_new = v[b, 0]        (rotate-half, as rope.py)
    live (0 <= p_b < S):  K[b, :, p_b] = k_new, V[b, :, p_b] = v_new;
                          o[b, h] = softmax(scale * q_rot[h] . [K[b, h // G, :p_b]; k_new]^T) [...; v_new]
    idle (otherwise):     no write; o[b, h] = v_new[h // G] (the new key alone)

which is rope_cache_write then decode_attention(seq_lens = p_b + 1) for a live lane, with cos /
sin gathered from the tables at row p_b. The lane's p_b cached slots are spread evenly over its
active splits: as many as splits of SPLIT_LEN slots would need (the launcher's LANE_SPLIT_LEN, at
most the grid's split length), but no more than MAX_ACTIVE,
which the launcher sets to what one wave of programs holds (a long context takes longer splits
rather than a second wave; the grid keeps a full cache's splits); split 0 is always active (it
holds the new key). A program of any other split exits at once, before the PDL wait, writing
nothing, so a short context in a long cache costs the programs it uses. Every active program
rotates its group's q heads with its lane's row (row 0 for an idle lane: its rotation reaches
nothing, and a position outside [0, S) is never a row read); the program of split 0 also rotates
the new key, starts its online softmax from it (m = s_new, l = 1, acc = v_new, so p_b = 0 needs
no cache slot) and stores k_new, v_new into slot p_b. Every program reads slots [start, min(end,
p_b)) only, never slot p_b itself, so no program reads what another writes; an idle lane reads
no slot at all (batched decode pads with idle lanes, which must cost nothing). A lane with one
active split (p_b <= SPLIT_LEN, every idle lane, or MAX_ACTIVE = 1) has o written by that split:
acc / l, which is the merge of one partial bit for bit. The merge kernel reads positions too
(before its wait), skips such a lane and merges the active splits of the others. As with
decode_attention the grids depend on B, Hkv and S only. The slot is the position itself: a ring
buffer (slot = position % W, every slot valid once wrapped) is not served by this op.

Batch invariance (``invariant=True``). By default the launcher picks the grid's split length
(`_split_len`) and MAX_ACTIVE (`_one_wave`) from B, to fill the GPU at any batch size, so a
lane's cached slots are grouped into different splits at different B: its partials, their
merge, and so its output's last bits change with how many lanes share the step. With invariant
the launcher uses what a B = 1 call of the same cache shape uses, functions of Hkv, S, hd and
the device only. A lane's active splits and spans then follow its own position alone, every
program computes from its lane's q, k, v and cache alone (same shapes, same compiled kernel),
and the merge of a (b, h) reads that lane's partials alone: a row's output is bit for bit what
a B = 1 call on that row gives, at any B and with any other lanes. The price is the grid of a
batch-1 step for every lane (more programs than one wave at large B, where the default takes
longer splits instead); the engine asks for it where bitwise agreement across batch shapes is
the contract. "The same compiled kernel" includes Triton's specialization of integer arguments
and pointers by divisibility by 16: strides and offsets like the engine's (views of one fused
projection, whatever row) keep it; a copy with other strides compiles alike for the values but
is not what the bitwise guarantee covers.

Chunks (``rope_chunk_attention``): T tokens a sequence at positions (B, T), each row (b, t) as
if it were a decode step of its own at p = positions[b, t] over the sequence's cache, in which
the chunk's other tokens are already written. Flattened to B * T rows (row b * T + t on cache
row slots[b]), it is two launches of the split kernel. First WRITE_ONLY, over a (B * T, Hkv, 1)
grid: each live row's split-0 program rotates its k and stores k_new, v_new into slot p through
`_rope_new_kv`, the code the normal launch stores them with (so the bits are the same), and
exits: no partials, no o, no merge. Then the normal launch with invariant=True over the B * T
rows: each row reads slots [0, p) of its cache row, which hold the cache before the chunk and
the chunk's tokens at lower positions, and attends to its own new key from registers, so row
(b, t) is bitwise rope_decode_attention(invariant=True) of that token alone once the lower
positions are written, which is what T sequential decode steps at consecutive positions give.
That launch also stores each live row's k_new, v_new again, into a slot the rows of the same
sequence at higher positions read concurrently: the op's contract above forbids live rows
sharing a cache row for this reason, but here each store writes the bits the write-only launch
already put there, so a reader sees the same values before and after it. Two live rows of one
sequence at the same position are still the caller's error (their stores differ). Idle rows
(positions outside [0, S)) write nothing and output their own v, as the decode op's idle lanes.
With PDL the attention launch's wait covers the write-only launch's stores (the wait is for the
whole previous grid), and slots are expanded to rows on the device: no host sync, capturable.

Trees (``rope_tree_attention``): the nodes of a speculative draft tree, T rows a sequence, each
row (b, t) with a RoPE position, a write slot, a depth and the cache slots of its ancestors at
depths 0 .. depth - 1, over a prefix of base[b] slots. The row attends to a virtual sequence of
n = base + depth cached keys (virtual position j < base is slot j, j >= base the ancestor slot
ancestor_slots[b, t, j - base]) plus its own new key, and its new k / v go to its write slot.
It is the chunk's two launches with the TREE constexpr, which changes only addresses: the split
kernel's tile loop loads the key and value of position j from the slot gathered for it
(`_tile_slots`), k_new / v_new are stored at the write slot, and n_cached (of `_lane_splits`,
in the split and the merge kernel) is base + depth instead of the position. Everything that
computes numbers (rotation at the row's position, dots, online softmax, merge) is the decode
path's code with the invariant split parameters of n cached slots, so a node at position base +
depth is, bit for bit, rope_decode_attention(invariant=True) at that position on a cache whose
slots base, base + 1, ... hold its ancestors' k / v: what decoding its branch linearly gives,
since each ancestor wrote at its own write slot the bits that branch's decode step at the
ancestor's position writes. Each write slot is stored by both launches with the same bits, so a
descendant reading it concurrently sees one value, in whatever order the rows come (the
write-only launch has stored every row's before any attends). A row at a position other than
base + depth (a pad) computes the same over its virtual sequence, rotated at its position; an
idle row (position outside [0, S)) reads and writes nothing. Depth and base are clamped in the
kernels to [0, D] and [0, S], and a write slot outside [0, S) stores nothing, so unchecked CUDA
values stay inside the tensors; the ancestor slots themselves are the caller's there (checked
on CPU).

Both ops launch their split and merge kernels with programmatic dependent launch where the
GEMV does (``pdl``: `_launch.use_pdl`'s, None where the hardware allows it, Hopper and later;
never under the interpreter). Each kernel lets the next one launch at once,
then waits for the previous kernel's writes: the merge kernel launches while the split kernel
runs (and waits for its partials), and the projection after the merge starts loading its
weights while the merge drains. decode_attention's split and merge kernels read nothing
before the wait. rope_decode_attention's split kernel loads positions[b] and its cos / sin rows
before it (and a program with no slot of its lane exits there), with ``slots`` its lane's
cache slot too (with TREE the row's write slot, depth and base), and its merge kernel loads
positions[b] (with TREE the depth and base), since they never come from the projection launched
just before (which writes q, k, v): the contract is that positions, slots, the tree's tensors
and the tables are not written by a kernel launched with PDL since the last ordinary launch in
the stream (only such a kernel can still be running). The engine's tables never change, and it
writes positions (and slots) by a host copy or fill before the step (or, in a captured step,
`greedy_feed` at the end of the step before, which lets no kernel launch before it completes).

Layouts: q (B, 1, H, hd), k, v (B, 1, Hkv, hd), any strides (views of one fused projection);
cos, sin (P, hd // 2) fp32 tables, row p the angles of position p, P >= S (a row for every cache
slot), any strides; positions (B,) int64; caches as above, slots too: with ``slots`` row b
writes slot p_b of cache row slots[b] and reads that row (K[b] above is K[slots[b]]), an idle
row neither writes nor reads it. A cache row that a live row uses must be no other row's (rows
run concurrently: two live rows on one cache row are the caller's error, not checked); idle rows
may share any. q, k, v fp16 / bf16 / fp32, caches in q.dtype; the rotation is fp32, q_rot is
rounded to q.dtype and the new k / v to the cache dtype before use, as the unfused pair does.
hd even.

Slots are checked for shape and dtype always, and for range ([0, n_slots), else ValueError)
wherever that needs no host sync: on CPU tensors (the references, the interpreter). A CUDA launch
never reads them on the host, so it stays capturable; there the range is the caller's. The
references take the same ``slots`` and run each row alone on its cache row's one-row view
(`_checks.by_slot`): bitwise the slot-less reference of that row, writes landing in the caller's
cache.
"""
import functools
import math

import torch
import triton
import triton.language as tl

from ._checks import (
    FLOAT_DTYPES,
    by_slot,
    cache_layout,
    check_device,
    check_dtype,
    check_rank,
    check_shape,
    check_slots,
    interpreting,
    slots_arg,
)
from ._launch import sm_count, use_pdl
from .rope import rope_cache_write_ref

LOG2E = math.log2(math.e)
# A split shorter than this costs more in partial traffic than it wins in parallelism.
MIN_SPLIT_LEN = 256
MAX_SPLITS = 64
# Software-pipeline stages of the split kernels' K / V loop (Triton's default, made explicit):
# three keep the next tiles' K / V loads in flight while one tile is consumed, which a split's
# few iterations need to hide the memory latency; fewer stages leave it exposed.
SPLIT_STAGES = 3
# rope_decode_attention's shortest split of a lane's cached slots (a lane takes as many splits of
# at least this many slots as it has, up to one wave of programs: `_lane_splits`). Short enough
# that a lane of a thousand tokens spreads over several programs (a small batch leaves most SMs
# idle otherwise), long enough that a short context stays in one split, where more splits would
# add partial writes and a merge for no parallelism worth having; long contexts reach the
# one-wave cap whatever this is.
LANE_SPLIT_LEN = 128
# K / V slots a tile of the split kernels' loop on CUDA (`_block_n`).
SPLIT_BLOCK_N = 128


@triton.jit
def _tile_slots(offs_n, mask_n, anc_row, stride_anc_d, base, TREE: tl.constexpr):
    """The cache slot of each position of a tile: the position itself, or with TREE the virtual
    sequence's slot (position j < base is slot j, j >= base the ancestor slot anc_row[j - base])."""
    if TREE:
        tail = offs_n >= base
        anc = tl.load(anc_row + (offs_n - base) * stride_anc_d, mask=mask_n & tail, other=0)
        return tl.where(tail, anc, offs_n)
    else:
        return offs_n


@triton.jit
def _attend_slots(q, k_base, v_base, stride_kc_s, stride_kc_d, stride_vc_s, stride_vc_d,
                  start, end, offs_d, mask_d, m, l, acc, qk_scale, anc_row, stride_anc_d, base,
                  BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, TREE: tl.constexpr):
    """Online softmax of the group's queries q (BLOCK_G, BLOCK_D) over cache positions [start,
    end), continuing from the running (m, l, acc): returns the updated triple. Position j is
    cache slot j, or with TREE the slot `_tile_slots` gathers for it (anc_row, stride_anc_d and
    base unused otherwise); only the addresses differ, every number is computed alike."""
    # Every tile of this loop holds at least one valid slot, so m is finite after the first.
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot_n = _tile_slots(offs_n, mask_n, anc_row, stride_anc_d, base, TREE)
        k = tl.load(k_base + slot_n[None, :] * stride_kc_s + offs_d[:, None] * stride_kc_d,
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slot_n[:, None] * stride_vc_s + offs_d[None, :] * stride_vc_d,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, b, heads, split, H, HD, NUM_SPLITS,
                    mask_g, offs_d, mask_d):
    """Store this split's partial (m, l, acc) of the group's heads, for the merge kernel."""
    part = (b * H + heads) * NUM_SPLITS + split  # (BLOCK_G,) row of the partial tensors
    tl.store(m_ptr + part, m, mask=mask_g)
    tl.store(l_ptr + part, l, mask=mask_g)
    tl.store(acc_ptr + part[:, None] * HD + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _load_rotated(row_ptr, stride_d, offs_d, partner_d, mask, cos, sin_signed):
    """rot(x) in fp32 of the rows at row_ptr: x[d] * cos[d mod h] + x[partner(d)] * sin_signed[d].

    Rotate-half as one (..., BLOCK_D) tile rather than two halves (rope.py), so q stays the
    (BLOCK_G, BLOCK_D) operand of the dot: partner(d) = d + h and sin_signed = -sin in the first
    half, partner(d) = d - h and sin_signed = +sin in the second (the caller builds both)."""
    x = tl.load(row_ptr + offs_d * stride_d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row_ptr + partner_d * stride_d, mask=mask, other=0.0).to(tl.float32)
    return x * cos + x_partner * sin_signed


@triton.jit
def _cache_lane(slots_ptr, stride_slots, b, SLOTS: tl.constexpr):
    """The cache row (first-dim index) that batch row b reads and writes: slots[b] with SLOTS,
    else b itself (no load: the slot-less launch keeps the code it had before slots existed)."""
    if SLOTS:
        return tl.load(slots_ptr + b * stride_slots).to(tl.int64)
    else:
        return b


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """Launched with programmatic dependent launch: let the next kernel launch now (the merge
    after a split kernel; the GEMV after the merge, which loads its first weights while this
    drains), then wait for the previous kernel's writes. A kernel that starts with it reads
    nothing before the wait."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _decode_attention_split_kernel(
    q_ptr,  # (B, H, hd)
    k_cache_ptr,  # (B, Hkv, S, hd), or (n_slots, Hkv, S, hd) with SLOTS
    v_cache_ptr,  # likewise
    seq_lens_ptr,  # (B,)
    slots_ptr,  # (B,) int32 / int64 with SLOTS: row b's cache slot (else unused)
    m_ptr,  # (B, H, NUM_SPLITS) fp32
    l_ptr,  # (B, H, NUM_SPLITS) fp32
    acc_ptr,  # (B, H, NUM_SPLITS, hd) fp32
    stride_q_b, stride_q_h, stride_q_d,
    stride_kc_b, stride_kc_h, stride_kc_s, stride_kc_d,
    stride_vc_b, stride_vc_h, stride_vc_s, stride_vc_d,
    stride_slots,
    H, S, HD, GROUP, NUM_SPLITS, SPLIT_LEN,
    qk_scale,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    SLOTS: tl.constexpr,
):
    _pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    kv_len = tl.minimum(tl.load(seq_lens_ptr + b).to(tl.int32), S)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # (BLOCK_G,) query heads sharing this kv head
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HD
    q = tl.load(q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    lane = _cache_lane(slots_ptr, stride_slots, b, SLOTS)
    k_base = k_cache_ptr + lane * stride_kc_b + kvh * stride_kc_h
    v_base = v_cache_ptr + lane * stride_vc_b + kvh * stride_vc_h

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m, l, acc = _attend_slots(q, k_base, v_base, stride_kc_s, stride_kc_d, stride_vc_s, stride_vc_d,
                              start, end, offs_d, mask_d, m, l, acc, qk_scale, k_base, 0, 0,
                              BLOCK_N, INPUT_PRECISION, False)
    _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, b, heads, split, H, HD, NUM_SPLITS,
                    mask_g, offs_d, mask_d)


@triton.jit
def _tree_cached(b, live, depth_ptr, stride_depth, base_ptr, stride_base, ROWS_PER_SEQ, S, MAX_DEPTH):
    """(cached slots before the new token, prefix length) of rope_tree_attention's row b: its
    virtual sequence of base + depth positions (0 for an idle row, as the decode op's), base
    that of the row's sequence b // ROWS_PER_SEQ. Clamped to depth in [0, MAX_DEPTH] and base in
    [0, S], so a CUDA launch, whose values nobody checks, never reads past ancestor_slots' row
    or the cache row (the range checks are on CPU tensors only, as the slots')."""
    depth = tl.minimum(tl.maximum(tl.load(depth_ptr + b * stride_depth), 0), MAX_DEPTH)
    base = tl.minimum(tl.maximum(tl.load(base_ptr + (b // ROWS_PER_SEQ) * stride_base), 0), S)
    return tl.where(live, base + depth, 0).to(tl.int32), base.to(tl.int32)


@triton.jit
def _lane_splits(n_cached, SPLIT_LEN, MAX_ACTIVE):
    """(active splits, slots per split) of rope_decode_attention's lane with n_cached slots before
    its new token: as many splits of at most SPLIT_LEN slots as the slots need, but at most
    MAX_ACTIVE, with the slots spread evenly over them, so a long context takes longer splits
    rather than a second wave of programs; at least split 0, which holds the new key. No active
    split is empty."""
    n = tl.minimum(tl.maximum(tl.cdiv(n_cached, SPLIT_LEN), 1), MAX_ACTIVE)
    span = tl.cdiv(tl.maximum(n_cached, 1), n)
    return tl.maximum(tl.cdiv(n_cached, span), 1), span


@triton.jit
def _rope_new_kv(k_row, stride_k_d, v_row, stride_v_d, k_slot, v_slot, stride_kc_d, stride_vc_d, live,
                 offs_d, partner, mask_d, cos, sin_signed):
    """The new token's k_new = rot(k) and v_new, each rounded to its cache's dtype, stored into
    its cache slot (k_slot, v_slot) when the row is live. One function for the normal and the
    WRITE_ONLY launch, so both store the same bits."""
    k_new = _load_rotated(k_row, stride_k_d, offs_d, partner, mask_d, cos,
                          sin_signed).to(k_slot.dtype.element_ty)  # (BLOCK_D,)
    v_new = tl.load(v_row + offs_d * stride_v_d, mask=mask_d, other=0.0).to(v_slot.dtype.element_ty)
    if live:  # an `if`, not `mask_d & live`: the interpreter types that mask int32 and rejects it
        tl.store(k_slot + offs_d * stride_kc_d, k_new, mask=mask_d)
        tl.store(v_slot + offs_d * stride_vc_d, v_new, mask=mask_d)
    return k_new, v_new


@triton.jit
def _rope_decode_attention_split_kernel(
    q_ptr,  # (B, H, hd): q[:, 0]
    k_ptr,  # (B, Hkv, hd): k[:, 0]
    v_ptr,  # (B, Hkv, hd): v[:, 0]
    cos_ptr,  # (P, hd // 2) fp32, P >= S
    sin_ptr,  # (P, hd // 2) fp32
    positions_ptr,  # (B,) int64
    slots_ptr,  # (B,) int32 / int64 with SLOTS: row b's cache slot (else unused)
    k_cache_ptr,  # (B, Hkv, S, hd), or (n_slots, Hkv, S, hd) with SLOTS
    v_cache_ptr,  # likewise
    m_ptr,  # (B, H, NUM_SPLITS) fp32
    l_ptr,  # (B, H, NUM_SPLITS) fp32
    acc_ptr,  # (B, H, NUM_SPLITS, hd) fp32
    o_ptr,  # (B, H, hd) contiguous: written here for a lane with one active split
    stride_q_b, stride_q_h, stride_q_d,
    stride_k_b, stride_k_h, stride_k_d,
    stride_v_b, stride_v_h, stride_v_d,
    stride_cos_p, stride_cos_d,
    stride_sin_p, stride_sin_d,
    stride_pos, stride_slots,
    stride_kc_b, stride_kc_h, stride_kc_s, stride_kc_d,
    stride_vc_b, stride_vc_h, stride_vc_s, stride_vc_d,
    H, S, HD, GROUP, NUM_SPLITS, SPLIT_LEN,
    qk_scale,
    MAX_ACTIVE,  # a lane's most active splits, <= NUM_SPLITS
    write_slots_ptr,  # (B,) int64 with TREE: row b's write slot (else unused, as the next three)
    depth_ptr,  # (B,) int64 with TREE: row b's depth
    anc_ptr,  # (B, MAX_DEPTH) int64 with TREE: row b's ancestors' slots at depths 0 .. depth - 1
    base_ptr,  # (B // ROWS_PER_SEQ,) int64 with TREE: each sequence's prefix length
    stride_ws, stride_depth, stride_anc_b, stride_anc_d, stride_base,
    ROWS_PER_SEQ, MAX_DEPTH,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    SLOTS: tl.constexpr,
    WRITE_ONLY: tl.constexpr,  # store k_new, v_new (split 0, the only one launched) and exit
    TREE: tl.constexpr,  # rope_tree_attention: a gathered virtual sequence, a write slot apart
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    # Before the wait: positions and cos / sin are not the previous kernel's (module docstring).
    pos = tl.load(positions_ptr + b * stride_pos)
    live = (pos >= 0) & (pos < S)
    row = tl.where(live, pos, 0)  # of the tables: in range, since P >= S
    if TREE:  # its tree's tensors come from where positions do: before the wait too
        n_cached, base = _tree_cached(b, live, depth_ptr, stride_depth, base_ptr, stride_base,
                                      ROWS_PER_SEQ, S, MAX_DEPTH)
        slot = tl.load(write_slots_ptr + b * stride_ws)  # where k_new, v_new go: not pos
        write = live & (slot >= 0) & (slot < S)  # a slot outside the cache row: no store at all
    else:
        n_cached = row.to(tl.int32)  # cache slots before the new token
        base = n_cached  # unused
        slot = pos
        write = live
    # A split past the lane's cached slots has nothing to add: it exits here, before the wait
    # and with nothing written (the merge reads the lane's active splits only). Split 0 always
    # runs: it holds the new key.
    n_active, span = _lane_splits(n_cached, SPLIT_LEN, MAX_ACTIVE)
    if split >= n_active:
        return
    start = split * span
    end = tl.minimum(start + span, n_cached)  # never slot pos itself: split 0 writes it
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HD
    HALF = HD // 2
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    pair = tl.where(first, offs_d, offs_d - HALF)  # column of cos / sin
    cos = tl.load(cos_ptr + row * stride_cos_p + pair * stride_cos_d, mask=mask_d, other=0.0)
    sin = tl.load(sin_ptr + row * stride_sin_p + pair * stride_sin_d, mask=mask_d, other=0.0)
    sin = tl.where(first, -sin, sin)
    # The row's cache slot, before the wait too: slots come from where positions do.
    lane = _cache_lane(slots_ptr, stride_slots, b, SLOTS)
    if PDL:
        tl.extra.cuda.gdc_wait()  # q, k, v: the projection launched just before writes them
    k_base = k_cache_ptr + lane * stride_kc_b + kvh * stride_kc_h
    v_base = v_cache_ptr + lane * stride_vc_b + kvh * stride_vc_h
    k_row = k_ptr + b * stride_k_b + kvh * stride_k_h
    v_row = v_ptr + b * stride_v_b + kvh * stride_v_h
    if WRITE_ONLY:  # rope_chunk_attention's first launch: the cache write alone
        _rope_new_kv(k_row, stride_k_d, v_row, stride_v_d, k_base + slot * stride_kc_s,
                     v_base + slot * stride_vc_s, stride_kc_d, stride_vc_d, write, offs_d, partner, mask_d,
                     cos, sin)
        return

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # (BLOCK_G,) query heads sharing this kv head
    # Round q_rot to q's dtype as rope_cache_write does: the dot then sees the same operands.
    q = _load_rotated(q_ptr + b * stride_q_b + heads[:, None] * stride_q_h, stride_q_d,
                      offs_d[None, :], partner[None, :], mask_g[:, None] & mask_d[None, :],
                      cos[None, :], sin[None, :]).to(q_ptr.dtype.element_ty)  # (BLOCK_G, BLOCK_D)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if split == 0:
        # The new token: its key is the first of split 0's online softmax (one score per head,
        # so l = 1 and acc = v_new), then it goes into the cache for the next steps.
        k_new, v_new = _rope_new_kv(k_row, stride_k_d, v_row, stride_v_d, k_base + slot * stride_kc_s,
                                    v_base + slot * stride_vc_s, stride_kc_d, stride_vc_d, write, offs_d,
                                    partner, mask_d, cos, sin)
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
        l = tl.full([BLOCK_G], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + v_new.to(tl.float32)[None, :]
    m, l, acc = _attend_slots(q, k_base, v_base, stride_kc_s, stride_kc_d, stride_vc_s, stride_vc_d,
                              start, end, offs_d, mask_d, m, l, acc, qk_scale, anc_ptr + b * stride_anc_b,
                              stride_anc_d, base, BLOCK_N, INPUT_PRECISION, TREE)
    if n_active == 1:
        # The lane's only split: its softmax is complete, and it writes o itself (the merge of
        # one partial is this division, bit for bit; the merge kernel skips the lane).
        o = acc / l[:, None]
        tl.store(o_ptr + (b * H + heads)[:, None] * HD + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mask_g[:, None] & mask_d[None, :])
    else:
        _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, b, heads, split, H, HD, NUM_SPLITS,
                        mask_g, offs_d, mask_d)


@triton.jit
def _decode_attention_merge_kernel(
    m_ptr,  # (B, H, NUM_SPLITS) fp32
    l_ptr,  # (B, H, NUM_SPLITS) fp32
    acc_ptr,  # (B, H, NUM_SPLITS, hd) fp32
    o_ptr,  # (B, H, hd) contiguous
    positions_ptr,  # (B,) ROPE only: rope_decode_attention's positions
    stride_pos, H, S, HD, NUM_SPLITS, SPLIT_LEN,
    MAX_ACTIVE,  # ROPE only: rope_decode_attention's
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    ROPE: tl.constexpr,
    # TREE only (with ROPE): rope_tree_attention's, as its split kernel takes them; defaults
    # for every other launch (hcache's among them)
    depth_ptr=0, base_ptr=0, stride_depth=0, stride_base=0, ROWS_PER_SEQ=1, MAX_DEPTH=0,
    TREE: tl.constexpr = False,
):
    """o of each (b, h) from its splits' partials. decode_attention's split kernel writes every
    split; rope_decode_attention's writes the lane's active splits only, and none when there is
    one (it wrote o itself): the merge reads the positions (with TREE the row's depth and base
    too) to know which."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0).to(tl.int64)  # b * H + h
    n_splits = NUM_SPLITS
    if ROPE:  # the positions before the wait, as the split kernel reads them
        pos = tl.load(positions_ptr + (bh // H) * stride_pos)
        live = (pos >= 0) & (pos < S)
        if TREE:
            n_cached, _ = _tree_cached(bh // H, live, depth_ptr, stride_depth, base_ptr, stride_base,
                                       ROWS_PER_SEQ, S, MAX_DEPTH)
        else:
            n_cached = tl.where(live, pos, 0).to(tl.int32)
        n_splits, _ = _lane_splits(n_cached, SPLIT_LEN, MAX_ACTIVE)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if ROPE:
        if n_splits > 1:
            _merge_splits(m_ptr, l_ptr, acc_ptr, o_ptr, bh, HD, NUM_SPLITS, n_splits, BLOCK_SPLITS, BLOCK_D)
    else:
        _merge_splits(m_ptr, l_ptr, acc_ptr, o_ptr, bh, HD, NUM_SPLITS, n_splits, BLOCK_SPLITS, BLOCK_D)


@triton.jit
def _merge_splits(m_ptr, l_ptr, acc_ptr, o_ptr, bh, HD, NUM_SPLITS, n_splits,
                  BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """o[bh] from the partials of its first n_splits splits."""
    offs_s = tl.arange(0, BLOCK_SPLITS)
    mask_s = offs_s < n_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HD
    m = tl.load(m_ptr + bh * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))
    l = tl.load(l_ptr + bh * NUM_SPLITS + offs_s, mask=mask_s, other=0.0)
    acc = tl.load(acc_ptr + (bh * NUM_SPLITS + offs_s[:, None]) * HD + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_SPLITS, BLOCK_D)
    m_max = tl.max(m, axis=0)
    # An empty sequence has every m = -inf: shift by 0 instead, so weights are 0, not NaN.
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    l_total = tl.sum(l * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(l_total == 0.0, 1.0, l_total)
    tl.store(o_ptr + bh * HD + offs_d, o.to(o_ptr.dtype.element_ty), mask=mask_d)


def _block_d(hd: int) -> int:
    return max(16, triton.next_power_of_2(max(hd, 1)))


def _block_n(block_d: int) -> int:
    # The interpreter pays per tile, a GPU per register: small tiles on CPU keep tests exercising
    # the multi-tile loop on short caches.
    # On CUDA, 128 slots a tile (one K and one V load of 32 KB per iteration at hd 128): half the
    # loop iterations of 64, so fewer dependent round trips to memory per split.
    if interpreting():
        return 16
    return SPLIT_BLOCK_N if block_d <= 128 else 32


def _split_stages(B: int, Hkv: int, device: torch.device, rope: bool) -> int:
    """The split kernel's software-pipeline stages: SPLIT_STAGES, but one where rope_decode_attention's
    (row, kv head) pairs alone fill more than a wave. Three stages take 139 KB of shared memory
    at hd 128, so one program runs per SM; one stage takes far less, so several share an SM and
    the grid runs in one wave, which saves more than the pipelining of each program's loop gives
    (bench/attention_tiles.py sweeps it; a grid of one wave keeps the pipelining). The stages
    change no row's result: the tiles and their order stay."""
    if rope and device.type == "cuda" and B * Hkv > sm_count(device):
        return 1
    return SPLIT_STAGES


def _split_len(B: int, Hkv: int, S: int, device: torch.device, block_n: int) -> int:
    """Slots per split: enough splits for ~2 programs per SM, none shorter than MIN_SPLIT_LEN."""
    if device.type != "cuda":
        return triton.cdiv(max(S, 1), block_n) * block_n  # interpreter: one split, small grid
    splits = min(max(triton.cdiv(2 * sm_count(device), B * Hkv), 1), MAX_SPLITS)
    split_len = max(MIN_SPLIT_LEN, triton.cdiv(S, splits))
    return triton.cdiv(split_len, block_n) * block_n


def _check_cache_dtypes(op, q, k_cache, v_cache):
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} must equal q dtype {q.dtype}")


def _check(op, q, k_cache, v_cache, seq_lens, slots):
    check_device(op, q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens,
                 **({} if slots is None else {"slots": slots}))
    check_rank(op, "q", q, 3, "(B, H, hd)")
    B, H, hd = q.shape
    check_rank(op, "k_cache", k_cache, 4, cache_layout(slots))
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    rows = B if slots is None else k_cache.shape[0]
    check_shape(op, "k_cache", k_cache, (rows, Hkv, S, hd))
    check_shape(op, "v_cache", v_cache, (rows, Hkv, S, hd))
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{op}: query heads {H} must be a multiple of kv heads {Hkv}")
    if slots is not None:
        check_slots(op, slots, B, rows)
    check_shape(op, "seq_lens", seq_lens, (B,))
    check_dtype(op, "seq_lens", seq_lens, (torch.int32, torch.int64))
    check_dtype(op, "q", q, FLOAT_DTYPES)
    _check_cache_dtypes(op, q, k_cache, v_cache)


def _check_rope(op, q, k, v, cos, sin, positions, k_cache, v_cache, slots, chunk=False):
    """rope_decode_attention's inputs (one token a lane), or with chunk rope_chunk_attention's:
    T tokens a sequence, positions (B, T), slots required."""
    if chunk and slots is None:
        raise ValueError(f"{op}: slots (B,) is required: the cache row of each sequence, which "
                         f"the chunk's tokens write and read")
    check_device(op, q=q, k=k, v=v, cos=cos, sin=sin, positions=positions,
                 k_cache=k_cache, v_cache=v_cache, **({} if slots is None else {"slots": slots}))
    tok = "T" if chunk else "1"
    check_rank(op, "q", q, 4, f"(B, {tok}, H, hd)")
    B, T, H, hd = q.shape
    if T != 1 and not chunk:
        raise ValueError(f"{op}: one new token per lane, q must have shape (B, 1, H, hd), "
                         f"got {tuple(q.shape)}")
    if hd % 2:
        raise ValueError(f"{op}: head dim must be even for rotate-half RoPE, got {hd}")
    check_rank(op, "k", k, 4, f"(B, {tok}, Hkv, hd)")
    Hkv = k.shape[2]
    check_shape(op, "k", k, (B, T, Hkv, hd))
    check_shape(op, "v", v, (B, T, Hkv, hd))
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{op}: query heads {H} must be a multiple of kv heads {Hkv}")
    check_shape(op, "positions", positions, (B, T) if chunk else (B,))
    check_rank(op, "k_cache", k_cache, 4, cache_layout(slots))
    S = k_cache.shape[2]
    rows = B if slots is None else k_cache.shape[0]
    if slots is not None:
        check_slots(op, slots, B, rows)
    check_rank(op, "cos", cos, 2, "(P, hd // 2)")
    if cos.shape[0] < S or cos.shape[1] != hd // 2:
        raise ValueError(f"{op}: cos must have shape (P, {hd // 2}) with P >= S = {S} (a row per "
                         f"cache slot), got {tuple(cos.shape)}")
    check_shape(op, "sin", sin, tuple(cos.shape))
    check_shape(op, "k_cache", k_cache, (rows, Hkv, S, hd))
    check_shape(op, "v_cache", v_cache, (rows, Hkv, S, hd))
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(op, name, t, FLOAT_DTYPES)
    check_dtype(op, "cos", cos, (torch.float32,))
    check_dtype(op, "sin", sin, (torch.float32,))
    check_dtype(op, "positions", positions, (torch.int64,))
    _check_cache_dtypes(op, q, k_cache, v_cache)


def _split_and_merge(split_kernel, inputs, strides, q, Hkv, S, scale, split_len, positions=None,
                     max_active=None, lane_split_len=None, has_slots=False, write_only=False, tree=None,
                     pdl=None, tile=None):
    """Launch a split kernel taking (*inputs, m, l, acc, *strides, H, S, HD, GROUP, NUM_SPLITS,
    SPLIT_LEN, qk_scale) over the (B, Hkv, num_splits) grid, num_splits = cdiv(S, split_len), then
    the merge: o (B, H, hd). has_slots: the SLOTS constexpr (inputs and strides then carry the
    slots tensor and its stride; without, a stand-in the kernel never reads).
    positions: rope_decode_attention's, whose split kernel also takes o (after acc) and
    max_active (after qk_scale; default num_splits), and writes its lanes' active splits only
    (_lane_splits of lane_split_len slots at least, default split_len <= it).
    write_only: rope_decode_attention's WRITE_ONLY launch, split 0 of each (row, kv head) alone:
    no partials, no o, no merge (returns None).
    tree: rope_tree_attention's (write_slots, depth, ancestor_slots, base) rows (`_tree_rows`),
    the TREE constexpr of both kernels; None: stand-ins the kernels never read.
    pdl: both launches' programmatic dependent launch (`use_pdl`).
    tile: the split kernel's (BLOCK_N, num_stages); None: (`_block_n`, `_split_stages`).
    q is the (B, H, hd) query (rotated or not): it gives the shapes, dtype and device."""
    B, H, hd = q.shape
    # the write-only kernel stores no o and no partials: one-row stand-ins for its pointers
    o = torch.empty((1 if write_only else B, H, hd), dtype=q.dtype, device=q.device)
    if B * H * hd == 0:
        return None if write_only else o
    BLOCK_D = _block_d(hd)
    num_splits = triton.cdiv(max(S, 1), split_len)
    max_active = min(max_active or num_splits, num_splits)
    lane_split_len = split_len if lane_split_len is None else lane_split_len
    parts = 1 if write_only else B
    m = torch.empty((parts, H, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((parts, H, num_splits, hd), dtype=torch.float32, device=q.device)
    pdl = use_pdl(q.device, pdl) and not interpreting()
    rope = positions is not None
    block_n, stages = tile if tile is not None else (_block_n(BLOCK_D), _split_stages(B, Hkv, q.device, rope))
    if block_n < 16 or block_n & (block_n - 1) or stages < 1:
        raise ValueError(f"split tile {tile!r}: BLOCK_N a power of two >= 16 and at least one stage")
    if rope:
        tree_args = _tree_args(tree, positions)
    split_kernel[(B, Hkv, 1 if write_only else num_splits)](
        *inputs, m, l, acc, *((o,) if rope else ()), *strides,
        H, S, hd, H // Hkv, num_splits, lane_split_len if rope else split_len,
        float(scale) * LOG2E,
        *((max_active, *tree_args) if rope else ()),
        # tl.dot needs every dim >= 16; padded group rows load nothing (masked).
        BLOCK_G=max(16, triton.next_power_of_2(H // Hkv)),
        BLOCK_N=block_n,
        BLOCK_D=BLOCK_D,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PDL=pdl,
        SLOTS=has_slots,
        **({"WRITE_ONLY": write_only, "TREE": tree is not None} if rope else {}),
        num_warps=4,
        num_stages=stages,
        launch_pdl=pdl,
    )
    if write_only:
        return None
    _decode_attention_merge_kernel[(B * H,)](
        m, l, acc, o, positions if rope else o, positions.stride(0) if rope else 0,
        H, S, hd, num_splits, lane_split_len if rope else split_len, max_active,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        BLOCK_D=BLOCK_D,
        PDL=pdl,
        ROPE=rope,
        # the tree's depth and base, their strides, ROWS_PER_SEQ and MAX_DEPTH (`_tree_args`)
        **({} if tree is None else {"depth_ptr": tree_args[1], "base_ptr": tree_args[3],
                                    "stride_depth": tree_args[5], "stride_base": tree_args[8],
                                    "ROWS_PER_SEQ": tree_args[9], "MAX_DEPTH": tree_args[10], "TREE": True}),
        num_warps=1 if BLOCK_D <= 64 else 2,
        launch_pdl=pdl,
    )
    return o


def _tree_args(tree, stand_in):
    """The rope split kernel's TREE arguments from `_tree_rows`' tuple (write_slots (R,), depth
    (R,), ancestor_slots (R, D), base (R // T,), T): the four tensors, their five strides,
    ROWS_PER_SEQ = T and MAX_DEPTH = D. Without a tree (or with D = 0, no ancestor to read)
    stand_in takes the place of what the kernel never reads."""
    if tree is None:
        return (stand_in,) * 4 + (0,) * 5 + (1, 0)
    write_slots, depth, anc, base, T = tree
    D = anc.shape[1]
    if D == 0:  # an empty tensor's pointer may be null, which a launch refuses
        anc = stand_in[:, None]
    return (write_slots, depth, anc, base, write_slots.stride(0), depth.stride(0), anc.stride(0),
            anc.stride(1), base.stride(0), T, D)


def _decode_attention(q, k_cache, v_cache, seq_lens, scale, split_len, slots=None, pdl=None):
    """decode_attention with an explicit split length (slots per split); tests use it to
    force many splits on short caches."""
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    slots_t, stride_slots = slots_arg(slots, seq_lens)
    return _split_and_merge(_decode_attention_split_kernel, (q, k_cache, v_cache, seq_lens, slots_t),
                            (*q.stride(), *k_cache.stride(), *v_cache.stride(), stride_slots),
                            q, Hkv, S, scale, split_len, has_slots=slots is not None, pdl=pdl)


def decode_attention(q, k_cache, v_cache, seq_lens, scale, slots=None, *, pdl=None):
    """q (B, H, hd), caches (B, Hkv, S, hd), seq_lens (B,) -> o (B, H, hd) in q.dtype.

    slots (B,) int32 / int64 on the caches' device: the caches are whole layers (n_slots, Hkv,
    S, hd) and row b attends over cache slot slots[b] (read only: rows may share a slot).
    pdl: programmatic dependent launch (module docstring; None: where the hardware allows it)."""
    _check("decode_attention", q, k_cache, v_cache, seq_lens, slots)
    B, H, hd = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    return _decode_attention(q, k_cache, v_cache, seq_lens, scale,
                             _split_len(B, Hkv, S, q.device, _block_n(_block_d(hd))), slots, pdl)


def _rope_decode_attention(q, k, v, cos, sin, positions, k_cache, v_cache, scale, split_len, max_active=None,
                          lane_split_len=None, slots=None, write_only=False, tree=None, pdl=None, tile=None):
    """rope_decode_attention with an explicit split length (slots per split) and most active
    splits a lane (default: a full cache's); tests use them to force many splits on short caches,
    and longer ones than split_len. write_only: the WRITE_ONLY launch (the cache write alone,
    returns None; the split parameters then matter not). tree: rope_tree_attention's rows
    (`_tree_rows`): each row's virtual sequence and write slot."""
    q, k, v = q[:, 0], k[:, 0], v[:, 0]  # views: drop T = 1
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    slots_t, stride_slots = slots_arg(slots, positions)
    return _split_and_merge(_rope_decode_attention_split_kernel,
                            (q, k, v, cos, sin, positions, slots_t, k_cache, v_cache),
                            (*q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(),
                             *positions.stride(), stride_slots, *k_cache.stride(), *v_cache.stride()),
                            q, Hkv, S, scale, split_len, positions, max_active, lane_split_len,
                            has_slots=slots is not None, write_only=write_only, tree=tree, pdl=pdl, tile=tile)


def _one_wave(B: int, Hkv: int, device: torch.device) -> int | None:
    """rope_decode_attention's most active splits a lane on CUDA (None elsewhere: a full
    cache's): what one wave of split programs holds. With SPLIT_STAGES = 3 a program takes 139 KB
    of shared memory at hd 128, so one runs per SM. A lane whose context would need more splits
    takes longer ones instead: a second wave would run after the first, nearly doubling the split
    kernel's latency, while longer splits in one wave only lengthen each program's loop. Shorter
    contexts need fewer splits than the cap and keep theirs."""
    return max(sm_count(device) // (B * Hkv), 1) if device.type == "cuda" else None


def _rope_splits(B: int, Hkv: int, S: int, hd: int, device: torch.device, invariant: bool) -> tuple:
    """rope_decode_attention's (split_len, max_active, lane_split_len) for B rows. invariant:
    those of B = 1, whatever B is, so they are functions of Hkv, S, hd and the device alone."""
    rows = 1 if invariant else B
    split_len = _split_len(rows, Hkv, S, device, _block_n(_block_d(hd)))
    return split_len, _one_wave(rows, Hkv, device), min(split_len, LANE_SPLIT_LEN)


def rope_decode_attention(q, k, v, cos, sin, positions, k_cache, v_cache, scale, slots=None, invariant=False, *,
                          pdl=None, tile=None):
    """RoPE + cache write of one new token per lane + decode attention, in one split launch and
    the merge: q (B, 1, H, hd), k, v (B, 1, Hkv, hd), cos, sin tables (P >= S, hd // 2) gathered
    at positions (B,) int64, caches (B, Hkv, S, hd) written in place -> o (B, H, hd) in q.dtype.

    slots (B,) int32 / int64 on the caches' device: the caches are whole layers (n_slots, Hkv,
    S, hd) and row b writes and reads cache slot slots[b] (an idle row neither). A slot a live
    row uses must be no other row's (the caller's error otherwise: the rows run concurrently).

    invariant: launch with B = 1's split parameters (module docstring, "Batch invariance"), so
    a row's output is bit for bit the same at any B (and as a row of rope_chunk_attention);
    otherwise they follow B, which fills the GPU better but groups a row's partials by B.
    pdl: programmatic dependent launch (module docstring; None: where the hardware allows it).
    tile: the split kernel's (BLOCK_N, num_stages), for sweeps (bench/attention_tiles.py); None:
    the default. A tile changes no row's result beyond its order of K / V slots per tile."""
    _check_rope("rope_decode_attention", q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    B, _, H, hd = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    return _rope_decode_attention(q, k, v, cos, sin, positions, k_cache, v_cache, scale,
                                  *_rope_splits(B, Hkv, S, hd, q.device, invariant), slots, pdl=pdl, tile=tile)


def _rope_chunk_attention(q, k, v, cos, sin, positions, k_cache, v_cache, scale, slots, split_len,
                          max_active=None, lane_split_len=None, tree=None, pdl=None):
    """rope_chunk_attention with explicit split parameters (as _rope_decode_attention's): the
    write-only launch over the B * T rows, then the attention launch over them. q, k, v become
    (B * T, 1, ., hd) rows: views where the strides allow it (the engine's projections), copies
    otherwise; each row carries its sequence's slot. tree: `_tree_rows`' tuple, both launches
    with TREE (rope_tree_attention)."""
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    rows = B * T
    q, k, v = q.reshape(rows, 1, H, hd), k.reshape(rows, 1, Hkv, hd), v.reshape(rows, 1, Hkv, hd)
    pos = positions.reshape(rows)
    row_slots = slots[:, None].expand(B, T).reshape(rows)  # a copy on the device: no host sync
    args = (q, k, v, cos, sin, pos, k_cache, v_cache, scale, split_len, max_active, lane_split_len)
    _rope_decode_attention(*args, slots=row_slots, write_only=True, tree=tree, pdl=pdl)
    o = _rope_decode_attention(*args, slots=row_slots, tree=tree, pdl=pdl)  # (B * T, H, hd)
    return o.view(B, T, H, hd).permute(0, 2, 1, 3)


def rope_chunk_attention(q, k, v, cos, sin, positions, k_cache, v_cache, scale, slots, *, pdl=None):
    """RoPE + cache write + causal attention of a chunk of T tokens a sequence (a speculative
    verify, a prefill chunk): q (B, T, H, hd), k, v (B, T, Hkv, hd), positions (B, T) int64,
    slots (B,) (required: sequence b's cache row), tables and caches as rope_decode_attention's
    -> o (B, H, T, hd) in q.dtype (a view of a (B, T, H, hd) tensor).

    Row (b, t) is, bit for bit, rope_decode_attention(invariant=True) of that token alone at
    positions[b, t] once the sequence's other chunk tokens are in the cache (module docstring,
    "Chunks"). A live position of a sequence must be no other row's of it (the caller's error
    otherwise, not checked: the rows run concurrently); an idle one (outside [0, S)) writes and
    reads nothing and outputs its own v. pdl: as rope_decode_attention's."""
    _check_rope("rope_chunk_attention", q, k, v, cos, sin, positions, k_cache, v_cache, slots, chunk=True)
    B, T, H, hd = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    return _rope_chunk_attention(q, k, v, cos, sin, positions, k_cache, v_cache, scale, slots,
                                 *_rope_splits(B * T, Hkv, S, hd, q.device, invariant=True), pdl=pdl)


def _tree_rows(write_slots, depth, ancestor_slots, base):
    """rope_tree_attention's (B, T) tensors flattened to the B * T rows of its launches (views
    where the strides allow, as the chunk's q, k, v), base kept per sequence: the kernels read
    base[row // T], so no copy expands it. -> the `tree` tuple of _rope_decode_attention."""
    B, T, D = ancestor_slots.shape
    return (write_slots.reshape(B * T), depth.reshape(B * T), ancestor_slots.reshape(B * T, D), base, T)


def _rope_tree_attention(q, k, v, cos, sin, positions, write_slots, depth, ancestor_slots, base, k_cache,
                         v_cache, scale, slots, split_len, max_active=None, lane_split_len=None, pdl=None):
    """rope_tree_attention with explicit split parameters (as _rope_chunk_attention's): the
    write-only launch over the B * T rows (each stores at its write slot), then the attention
    launch over them, both with TREE."""
    return _rope_chunk_attention(q, k, v, cos, sin, positions, k_cache, v_cache, scale, slots, split_len, max_active,
                                 lane_split_len, tree=_tree_rows(write_slots, depth, ancestor_slots, base), pdl=pdl)


def rope_tree_attention(q, k, v, cos, sin, positions, write_slots, depth, ancestor_slots, base, k_cache, v_cache,
                        scale, slots, *, pdl=None):
    """RoPE + cache write + attention of a draft tree's nodes (a speculative tree verify): q (B,
    T, H, hd), k, v (B, T, Hkv, hd), positions (B, T) int64 (each row's RoPE position),
    write_slots (B, T) int64 (the cache slot its rotated k / v go to), depth (B, T) int64 >= 0,
    ancestor_slots (B, T, D) int64 (D >= every depth: the slots of the row's ancestors at depths
    0 .. depth - 1, later entries unused), base (B,) int64 (the prefix length), slots (B,)
    (required: sequence b's cache row), tables and caches as rope_decode_attention's -> o (B, H,
    T, hd) in q.dtype (a view of a (B, T, H, hd) tensor).

    Row (b, t) attends to the virtual sequence of base[b] + depth[b, t] cached keys (position j
    < base is slot j, j >= base slot ancestor_slots[b, t, j - base]) plus its own new key, with
    the splits of an invariant decode step over that many: where positions == base + depth (a
    real node) it is, bit for bit, rope_decode_attention(invariant=True) at that position with
    the node's ancestors at the linear slots base, base + 1, ... (module docstring, "Trees").
    A row at another position (a pad) computes the same over its virtual sequence, rotated at
    its position. A live write slot must be no other live row's of its sequence (the caller's
    error otherwise, not checked: the rows run concurrently); an idle row (position outside
    [0, S)) writes and reads nothing and outputs its own v. pdl: as rope_decode_attention's."""
    op = "rope_tree_attention"
    _check_rope(op, q, k, v, cos, sin, positions, k_cache, v_cache, slots, chunk=True)
    check_device(op, q=q, write_slots=write_slots, depth=depth, ancestor_slots=ancestor_slots, base=base)
    _check_tree(op, positions, write_slots, depth, ancestor_slots, base, k_cache.shape[2])
    B, T, H, hd = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    return _rope_tree_attention(q, k, v, cos, sin, positions, write_slots, depth, ancestor_slots, base, k_cache,
                                v_cache, scale, slots, *_rope_splits(B * T, Hkv, S, hd, q.device, invariant=True),
                                pdl=pdl)


def _check_tree(op, positions, write_slots, depth, ancestor_slots, base, S):
    """rope_tree_attention's tree tensors (positions (B, T) already checked): shapes and dtypes
    always, values where reading them costs no host sync (CPU tensors, as check_slots): depth in
    [0, D], base in [0, S], and for a live row (position in [0, S)) its write slot and its
    ancestors' slots inside the cache row."""
    B, T = positions.shape
    check_shape(op, "write_slots", write_slots, (B, T))
    check_shape(op, "depth", depth, (B, T))
    check_rank(op, "ancestor_slots", ancestor_slots, 3, "(B, T, D)")
    D = ancestor_slots.shape[2]
    check_shape(op, "ancestor_slots", ancestor_slots, (B, T, D))
    check_shape(op, "base", base, (B,))
    for name, t in (("write_slots", write_slots), ("depth", depth), ("ancestor_slots", ancestor_slots),
                    ("base", base)):
        check_dtype(op, name, t, (torch.int64,))
    if positions.device.type != "cpu":
        return
    live = (positions >= 0) & (positions < S)
    for b, row in enumerate(depth.tolist()):
        for t, d in enumerate(row):
            if not 0 <= d <= D:
                raise ValueError(f"{op}: depth[{b}, {t}] = {d} is outside [0, D = {D}]: ancestor_slots "
                                 f"(B, T, D) holds D ancestors a row")
    for b, n in enumerate(base.tolist()):
        if not 0 <= n <= S:
            raise ValueError(f"{op}: base[{b}] = {n} is outside [0, S = {S}]: the prefix is cache slots [0, base)")
    for b, t in live.nonzero().tolist():
        w = int(write_slots[b, t])
        if not 0 <= w < S:
            raise ValueError(f"{op}: write_slots[{b}, {t}] = {w} is outside [0, S = {S}) of a live row "
                             f"(position {int(positions[b, t])})")
        for i, a in enumerate(ancestor_slots[b, t, :int(depth[b, t])].tolist()):
            if not 0 <= a < S:
                raise ValueError(f"{op}: ancestor_slots[{b}, {t}, {i}] = {a} is outside [0, S = {S}) "
                                 f"(row depth {int(depth[b, t])})")


def masked_attention_ref(q, k_cache, v_cache, mask, scale):
    """q (B, H, T, hd), caches (B, Hkv, S, hd), mask (B, T, S) bool -> (B, H, T, hd) in q.dtype.

    fp32 softmax attention with GQA; a query with no allowed slot gets a zero output."""
    G = q.shape[1] // k_cache.shape[1]
    k = k_cache.float().repeat_interleave(G, dim=1)  # (B, H, S, hd)
    v = v_cache.float().repeat_interleave(G, dim=1)  # (B, H, S, hd)
    s = torch.einsum("bhtd,bhsd->bhts", q.float(), k) * scale  # (B, H, T, S)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(mask.any(-1)[:, None, :, None], p, 0.0)  # all -inf rows are NaN: zero them
    return torch.einsum("bhts,bhsd->bhtd", p, v).to(q.dtype)


def decode_attention_ref(q, k_cache, v_cache, seq_lens, scale, slots=None):
    """The spec, in plain torch. With slots, each row alone on its cache slot's view."""
    if slots is not None:
        return by_slot("decode_attention_ref", slots, q.shape[0], k_cache, lambda b, s:
                       decode_attention_ref(q[b], k_cache[s], v_cache[s], seq_lens[b], scale))
    if q.shape[0] > 1:  # row by row: each reads its own length, as it does with slots
        return torch.cat([decode_attention_ref(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1], seq_lens[b:b + 1],
                                               scale) for b in range(q.shape[0])])
    # read only the positions the row attends to: the cost follows the context, not the
    # cache's allocated length (a reference may sync)
    S = max(1, min(k_cache.shape[2], int(seq_lens.max()) if seq_lens.numel() else 0))
    k_cache, v_cache = k_cache[:, :, :S], v_cache[:, :, :S]
    valid = torch.arange(S, device=q.device)[None, :] < seq_lens[:, None]  # (B, S)
    return masked_attention_ref(q[:, :, None], k_cache, v_cache, valid[:, None], scale)[:, :, 0]


def rope_decode_attention_ref(q, k, v, cos, sin, positions, k_cache, v_cache, scale, slots=None,
                              invariant=False):
    """The spec, in plain torch: rope_cache_write at rows p_b of the tables then decode_attention
    over p_b + 1 slots for a live lane; an idle lane (p_b outside [0, S)) writes nothing and
    outputs its own v, rounded to the cache dtype as if it had gone through the cache. Writes the
    caches in place. With slots, each row alone on its cache slot's view (its writes land there).
    invariant is the launcher's argument, with nothing to change here: the reference computes
    row by row, so a row's output never depends on the batch."""
    if slots is not None:
        return by_slot("rope_decode_attention_ref", slots, q.shape[0], k_cache, lambda b, s:
                       rope_decode_attention_ref(q[b], k[b], v[b], cos, sin, positions[b], k_cache[s],
                                                 v_cache[s], scale))
    S = k_cache.shape[2]
    live = (positions >= 0) & (positions < S)  # (B,)
    rows = torch.where(live, positions, 0)[:, None]  # (B, 1): row 0 for an idle lane, as the kernel
    q_rot = rope_cache_write_ref(q, k, v, cos[rows], sin[rows], positions[:, None], k_cache, v_cache)[:, :, 0]
    o = decode_attention_ref(q_rot, k_cache, v_cache, torch.where(live, positions + 1, 0), scale)
    G = q.shape[2] // k.shape[2]
    v_alone = v[:, 0].to(v_cache.dtype).repeat_interleave(G, dim=1).to(q.dtype)  # (B, H, hd)
    return torch.where(live[:, None, None], o, v_alone)


def rope_chunk_attention_ref(q, k, v, cos, sin, positions, k_cache, v_cache, scale, slots):
    """The spec, in plain torch: rope_cache_write of the whole chunk (rows positions[b, t] of
    the tables; an idle position writes nothing), then decode_attention of each token over its
    p + 1 slots; an idle token outputs its own v as rope_decode_attention_ref's idle lane.
    Writes the caches in place. -> (B, H, T, hd) in q.dtype. Each sequence alone on its cache
    slot's view (its writes land there)."""
    if slots is None:
        raise ValueError("rope_chunk_attention_ref: slots (B,) is required: the cache row of each "
                         "sequence, which the chunk's tokens write and read")
    return by_slot("rope_chunk_attention_ref", slots, q.shape[0], k_cache, lambda b, s:
                   _rope_chunk_attention_ref(q[b], k[b], v[b], cos, sin, positions[b], k_cache[s],
                                             v_cache[s], scale))


def _rope_chunk_attention_ref(q, k, v, cos, sin, positions, k_cache, v_cache, scale):
    """rope_chunk_attention_ref over caches (B, Hkv, S, hd), row b the cache of sequence b."""
    B, T, H, hd = q.shape
    if T == 0:
        return torch.empty((B, H, 0, hd), dtype=q.dtype, device=q.device)
    S = k_cache.shape[2]
    live = (positions >= 0) & (positions < S)  # (B, T)
    rows = torch.where(live, positions, 0)  # row 0 for an idle token, as the kernel
    q_rot = rope_cache_write_ref(q, k, v, cos[rows], sin[rows], positions, k_cache, v_cache)  # (B, H, T, hd)
    o = torch.stack([decode_attention_ref(q_rot[:, :, t], k_cache, v_cache,
                                          torch.where(live[:, t], positions[:, t] + 1, 0), scale)
                     for t in range(T)], dim=2)  # (B, H, T, hd)
    G = H // k.shape[2]
    v_alone = v.to(v_cache.dtype).repeat_interleave(G, dim=2).to(q.dtype).transpose(1, 2)  # (B, H, T, hd)
    return torch.where(live[:, None, :, None], o, v_alone)


def rope_tree_attention_ref(q, k, v, cos, sin, positions, write_slots, depth, ancestor_slots, base, k_cache,
                            v_cache, scale, slots):
    """The spec, in plain torch: rope_cache_write of every live row at its write slot (rows
    positions[b, t] of the tables; an idle row writes nothing), then per live row
    decode_attention over its virtual sequence, gathered from the cache: slots [0, base), its
    ancestors' slots, its own write slot last; an idle row outputs its own v as
    rope_decode_attention_ref's idle lane. Writes the caches in place. -> (B, H, T, hd) in
    q.dtype. Each sequence alone on its cache slot's view (its writes land there)."""
    op = "rope_tree_attention_ref"
    if slots is None:
        raise ValueError(f"{op}: slots (B,) is required: the cache row of each sequence, which "
                         f"the tree's nodes write and read")
    _check_tree(op, positions, write_slots, depth, ancestor_slots, base, k_cache.shape[2])
    return by_slot(op, slots, q.shape[0], k_cache, lambda b, s:
                   _rope_tree_attention_ref(q[b], k[b], v[b], cos, sin, positions[b], write_slots[b], depth[b],
                                            ancestor_slots[b], base[b], k_cache[s], v_cache[s], scale))


def _rope_tree_attention_ref(q, k, v, cos, sin, positions, write_slots, depth, ancestor_slots, base, k_cache,
                             v_cache, scale):
    """rope_tree_attention_ref of one sequence (B = 1 slices) on its cache row (1, Hkv, S, hd)."""
    _, T, H, hd = q.shape
    S = k_cache.shape[2]
    live = (positions >= 0) & (positions < S)  # (1, T)
    rows = torch.where(live, positions, 0)  # row 0 for an idle row, as the kernel
    q_rot = rope_cache_write_ref(q, k, v, cos[rows], sin[rows], torch.where(live, write_slots, -1),
                                 k_cache, v_cache)  # (1, H, T, hd)
    G = H // k.shape[2]
    o = v.to(v_cache.dtype).repeat_interleave(G, dim=2).to(q.dtype).transpose(1, 2).clone()  # idle: own v
    n = int(base[0])
    for t in live[0].nonzero()[:, 0].tolist():
        idx = torch.cat([torch.arange(n, device=q.device), ancestor_slots[0, t, :int(depth[0, t])],
                         write_slots[0, t:t + 1]])  # the virtual sequence, the row's own key last
        o[:, :, t] = decode_attention_ref(q_rot[:, :, t], k_cache[:, :, idx], v_cache[:, :, idx],
                                          torch.tensor([idx.numel()], device=q.device), scale)
    return o
