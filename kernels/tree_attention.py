"""Tree attention: verify a draft tree of T nodes in one pass over the cache.

Node t of row b has its K / V already in the cache at slot P_b + t (P_b = prefix_lens[b]). Query
t attends to every prefix slot j < P_b and to node slot P_b + u iff bit u of ancestors[b, t] is
set (u is t itself or an ancestor of t):

    allowed[b, t, j] = j < P_b  or  (0 <= j - P_b < T and (ancestors[b, t] >> (j - P_b)) & 1)
    o[b, h, t] = softmax(scale * q[b, h, t] . K[b, h // G]^T  masked by allowed) V[b, h // G]

A chain (parents = [-1, 0, 1, ...]) makes this causal attention over the chunk, so the same
kernel serves chunked prefill and chain speculation. T <= 63 so the mask fits one int64.

One program per (b, kv head, tile of BLOCK_M rows of the G x T (query head, node) pairs that
share the kv head): K / V tiles are loaded once for the whole group and all nodes; online
softmax over slots [0, min(P_b + T, S)), with the mask built from the bits on the fly.

Layouts: q (B, H, T, hd); k_cache, v_cache (B, Hkv, S, hd), any strides, row b the cache of
query row b; prefix_lens (B,) int32 / int64; ancestors (B, T) int64. With ``slots`` (B,) int32 /
int64 on the device the caches are whole layers (n_slots, Hkv, S, hd) of any n_slots and row b
attends over cache row slots[b] (K[b] above is K[slots[b]]), loaded in-kernel so a captured
graph serves any lanes; rows may share a slot (the op only reads). Without slots the kernel
keeps the slot-less path (a constexpr: no load). Slots outside [0, n_slots) raise ValueError
where that needs no host sync (CPU tensors: the reference, the interpreter); a CUDA launch
leaves the range to the caller. The reference with slots runs each row alone on its cache
row's one-row view. Dtypes: q and caches share fp16 / bf16 / fp32; fp32 softmax and
accumulation; output (B, H, T, hd) contiguous in q.dtype. A query with no allowed slot (only
from a malformed mask) outputs zeros.
"""
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
from .decode_attention import LOG2E, masked_attention_ref

MAX_NODES = 63


@triton.jit
def _tree_attention_kernel(
    q_ptr,  # (B, H, T, hd)
    k_cache_ptr,  # (B, Hkv, S, hd), or (n_slots, Hkv, S, hd) with SLOTS
    v_cache_ptr,  # likewise
    prefix_lens_ptr,  # (B,)
    ancestors_ptr,  # (B, T) int64
    slots_ptr,  # (B,) int32 / int64 with SLOTS: row b's cache slot (else unused)
    o_ptr,  # (B, H, T, hd) contiguous
    stride_q_b, stride_q_h, stride_q_t, stride_q_d,
    stride_kc_b, stride_kc_h, stride_kc_s, stride_kc_d,
    stride_vc_b, stride_vc_h, stride_vc_s, stride_vc_d,
    stride_anc_b, stride_anc_t,
    stride_slots,
    H, T, S, HD, GROUP,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SLOTS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) index g * T + t
    mask_m = rows < GROUP * T
    heads = kvh * GROUP + rows // T
    nodes = rows % T
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HD
    q = tl.load(q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + nodes[:, None] * stride_q_t
                + offs_d[None, :] * stride_q_d,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    anc = tl.load(ancestors_ptr + b * stride_anc_b + nodes * stride_anc_t, mask=mask_m, other=0)
    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    end = tl.minimum(prefix_len + T, S)
    if SLOTS:
        lane = tl.load(slots_ptr + b * stride_slots).to(tl.int64)  # the row's cache slot
    else:
        lane = b
    k_base = k_cache_ptr + lane * stride_kc_b + kvh * stride_kc_h
    v_base = v_cache_ptr + lane * stride_vc_b + kvh * stride_vc_h

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        node_u = offs_n - prefix_len  # (BLOCK_N,) node index of a slot, negative in the prefix
        is_node = node_u >= 0
        bit = (anc[:, None] >> tl.where(is_node, node_u, 0).to(tl.int64)[None, :]) & 1
        allowed = mask_n[None, :] & ((~is_node)[None, :] | (is_node[None, :] & (bit != 0)))
        k = tl.load(k_base + offs_n[None, :] * stride_kc_s + offs_d[:, None] * stride_kc_d,
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row can see a whole tile masked before it saw any slot (a node not under the first
        # nodes): shift by 0 then, so alpha and p are 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * stride_vc_s + offs_d[None, :] * stride_vc_d,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m = m_new

    o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(o_ptr + ((b * H + heads[:, None]) * T + nodes[:, None]) * HD + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def tree_attention(q, k_cache, v_cache, prefix_lens, ancestors, scale, slots=None):
    """q (B, H, T, hd), caches (B, Hkv, S, hd), prefix_lens (B,), ancestors (B, T) int64
    -> o (B, H, T, hd) in q.dtype.

    slots (B,) int32 / int64 on the caches' device: the caches are whole layers (n_slots, Hkv,
    S, hd) and row b attends over cache slot slots[b] (read only: rows may share a slot)."""
    op = "tree_attention"
    check_device(op, q=q, k_cache=k_cache, v_cache=v_cache, prefix_lens=prefix_lens,
                 ancestors=ancestors, **({} if slots is None else {"slots": slots}))
    check_rank(op, "q", q, 4, "(B, H, T, hd)")
    B, H, T, hd = q.shape
    if T > MAX_NODES:
        raise ValueError(f"{op}: at most {MAX_NODES} tree nodes fit the int64 mask, got T={T}")
    check_rank(op, "k_cache", k_cache, 4, cache_layout(slots))
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    rows = B if slots is None else k_cache.shape[0]
    check_shape(op, "k_cache", k_cache, (rows, Hkv, S, hd))
    check_shape(op, "v_cache", v_cache, (rows, Hkv, S, hd))
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{op}: query heads {H} must be a multiple of kv heads {Hkv}")
    if slots is not None:
        check_slots(op, slots, B, rows)
    check_shape(op, "prefix_lens", prefix_lens, (B,))
    check_dtype(op, "prefix_lens", prefix_lens, (torch.int32, torch.int64))
    check_shape(op, "ancestors", ancestors, (B, T))
    check_dtype(op, "ancestors", ancestors, (torch.int64,))
    check_dtype(op, "q", q, FLOAT_DTYPES)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} must equal q dtype {q.dtype}")

    o = torch.empty((B, H, T, hd), dtype=q.dtype, device=q.device)
    if B * H * T * hd == 0:
        return o
    group = H // Hkv
    BLOCK_D = max(16, triton.next_power_of_2(hd))
    # tl.dot needs every dim >= 16; rows past G * T load nothing (masked).
    BLOCK_M = min(64, max(16, triton.next_power_of_2(group * T)))
    if interpreting():
        BLOCK_N = 16  # small tiles: the CPU tests exercise the multi-tile loop on short caches
    else:
        BLOCK_N = 64 if BLOCK_D <= 128 else 32
    slots_t, stride_slots = slots_arg(slots, prefix_lens)
    _tree_attention_kernel[(B, Hkv, triton.cdiv(group * T, BLOCK_M))](
        q, k_cache, v_cache, prefix_lens, ancestors, slots_t, o,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *ancestors.stride(), stride_slots,
        H, T, S, hd, group,
        float(scale) * LOG2E,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SLOTS=slots is not None,
        num_warps=4,
    )
    return o


def ancestors_from_parents(parents):
    """parents (B, T) int64 (-1: child of the prefix; parents[b, t] < t) -> (B, T) int64 mask
    with bit u of [b, t] set iff u == t or u is an ancestor of t. Device ops only, no host sync."""
    if parents.dim() != 2:
        raise ValueError(f"ancestors_from_parents: parents must be 2-D (B, T), got {tuple(parents.shape)}")
    B, T = parents.shape
    if T > MAX_NODES:
        raise ValueError(f"ancestors_from_parents: at most {MAX_NODES} nodes, got T={T}")
    parents = parents.to(torch.int64)
    anc = torch.zeros((B, T), dtype=torch.int64, device=parents.device)
    for t in range(T):
        p = parents[:, t]  # (B,)
        inherited = anc.gather(1, p.clamp(min=0)[:, None])[:, 0]  # parent's row, filled since p < t
        anc[:, t] = torch.where(p >= 0, inherited, 0) | (1 << t)
    return anc


def tree_attention_ref(q, k_cache, v_cache, prefix_lens, ancestors, scale, slots=None):
    """The spec, in plain torch: a dense (B, T, S) mask. With slots, each row alone on its
    cache slot's view."""
    if slots is not None:
        return by_slot("tree_attention_ref", slots, q.shape[0], k_cache, lambda b, s:
                       tree_attention_ref(q[b], k_cache[s], v_cache[s], prefix_lens[b], ancestors[b], scale))
    T, S = q.shape[2], k_cache.shape[2]
    slots = torch.arange(S, device=q.device)[None, :]  # (1, S)
    node_u = slots - prefix_lens[:, None].to(torch.int64)  # (B, S)
    is_node = (node_u >= 0) & (node_u < T)
    bit = (ancestors[:, :, None] >> node_u.clamp(0, MAX_NODES - 1)[:, None, :]) & 1  # (B, T, S)
    allowed = (node_u < 0)[:, None, :] | (is_node[:, None, :] & (bit != 0))
    return masked_attention_ref(q, k_cache, v_cache, allowed, scale)
