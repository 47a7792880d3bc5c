"""Rotary position embedding fused with the K/V cache write of one decode / prefill chunk.

Rotation ("rotate-half": the first half of a head pairs with the second half), h = hd // 2:

    out[..., :h] = x1 * cos - x2 * sin
    out[..., h:] = x2 * cos + x1 * sin        x1 = x[..., :h], x2 = x[..., h:]

``rope_cache_write`` rotates q and k of every token, returns q_rot (B, H, T, hd) contiguous
(the layout the attention kernels read), and scatters rotated k and plain v into the cache:
k_cache[b, :, write_idx[b, t], :] = rot(k[b, t]). A write_idx outside [0, S) skips the write,
so padding tokens can carry -1. Two tokens of one row must not share a slot.

Layouts (all strided; q, k, v may be views into one fused projection output, the caches may
be views into a larger cache tensor):
    q (B, T, H, hd)   k, v (B, T, Hkv, hd)   cos, sin (B, T, hd // 2) fp32 (already gathered at
    each token's position)   write_idx (B, T) int64   k_cache, v_cache (B, Hkv, S, hd), row b
    the cache of row b; or, with ``slots`` (B,) int32 / int64 on the device, whole layers
    (n_slots, Hkv, S, hd) of any n_slots, row b writing cache row slots[b]
    (k_cache[slots[b], :, write_idx[b, t], :] = rot(k[b, t])). The kernel loads the slot itself
    (only in a program that writes), so a captured graph serves whichever lanes the slots tensor
    names at replay; without slots it keeps the slot-less path (a constexpr: no load). Rows that
    write must not share a cache row (the caller's error, not checked: they run concurrently).
    Slots outside [0, n_slots) raise ValueError where that needs no host sync (CPU tensors: the
    reference, the interpreter); a CUDA launch leaves the range to the caller. The reference with
    slots runs each row alone on its cache row's one-row view.
Dtypes: q, k, v, caches fp16 / bf16 / fp32; rotation math in fp32; q_rot in q.dtype, the cache
keeps its own dtype. hd must be even. One program per token, all heads of it in one tile, so
cos / sin are loaded once per token.
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
    slots_arg,
)


@triton.jit
def _rope_cache_write_kernel(
    q_ptr,  # (B, T, H, hd)
    k_ptr,  # (B, T, Hkv, hd)
    v_ptr,  # (B, T, Hkv, hd)
    cos_ptr,  # (B, T, hd // 2) fp32
    sin_ptr,  # (B, T, hd // 2) fp32
    write_idx_ptr,  # (B, T) int64
    slots_ptr,  # (B,) int32 / int64 with SLOTS: row b's cache slot (else unused)
    k_cache_ptr,  # (B, Hkv, S, hd), or (n_slots, Hkv, S, hd) with SLOTS
    v_cache_ptr,  # likewise
    q_out_ptr,  # (B, H, T, hd) contiguous
    stride_q_b, stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_t, stride_k_h, stride_k_d,
    stride_v_b, stride_v_t, stride_v_h, stride_v_d,
    stride_cos_b, stride_cos_t, stride_cos_d,
    stride_sin_b, stride_sin_t, stride_sin_d,
    stride_idx_b, stride_idx_t,
    stride_slots,
    stride_kc_b, stride_kc_h, stride_kc_s, stride_kc_d,
    stride_vc_b, stride_vc_h, stride_vc_s, stride_vc_d,
    T, H, HKV, S, HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    SLOTS: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_ptr + b * stride_cos_b + t * stride_cos_t + offs_d * stride_cos_d,
                  mask=mask_d, other=0.0)[None, :]
    sin = tl.load(sin_ptr + b * stride_sin_b + t * stride_sin_t + offs_d * stride_sin_d,
                  mask=mask_d, other=0.0)[None, :]

    # q: rotate all H heads, store at q_out[b, :, t, :].
    offs_h = tl.arange(0, BLOCK_H)
    mask_q = (offs_h < H)[:, None] & mask_d[None, :]
    q_row = q_ptr + b * stride_q_b + t * stride_q_t + offs_h[:, None] * stride_q_h
    q1 = tl.load(q_row + offs_d[None, :] * stride_q_d, mask=mask_q, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + (offs_d[None, :] + HALF) * stride_q_d, mask=mask_q, other=0.0).to(tl.float32)
    out_row = q_out_ptr + ((b * H + offs_h[:, None]) * T + t) * (2 * HALF)
    tl.store(out_row + offs_d[None, :], (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask_q)
    tl.store(out_row + HALF + offs_d[None, :], (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty),
             mask=mask_q)

    # k, v: write into the cache slot of this token, unless the slot is out of range.
    slot = tl.load(write_idx_ptr + b * stride_idx_b + t * stride_idx_t)
    if (slot >= 0) & (slot < S):
        if SLOTS:  # the row's cache slot: read only by a token that writes
            lane = tl.load(slots_ptr + b * stride_slots).to(tl.int64)
        else:
            lane = b
        offs_kh = tl.arange(0, BLOCK_HKV)
        mask_kv = (offs_kh < HKV)[:, None] & mask_d[None, :]
        k_row = k_ptr + b * stride_k_b + t * stride_k_t + offs_kh[:, None] * stride_k_h
        k1 = tl.load(k_row + offs_d[None, :] * stride_k_d, mask=mask_kv, other=0.0).to(tl.float32)
        k2 = tl.load(k_row + (offs_d[None, :] + HALF) * stride_k_d, mask=mask_kv, other=0.0).to(tl.float32)
        kc_row = k_cache_ptr + lane * stride_kc_b + offs_kh[:, None] * stride_kc_h + slot * stride_kc_s
        tl.store(kc_row + offs_d[None, :] * stride_kc_d,
                 (k1 * cos - k2 * sin).to(k_cache_ptr.dtype.element_ty), mask=mask_kv)
        tl.store(kc_row + (offs_d[None, :] + HALF) * stride_kc_d,
                 (k2 * cos + k1 * sin).to(k_cache_ptr.dtype.element_ty), mask=mask_kv)

        v_row = v_ptr + b * stride_v_b + t * stride_v_t + offs_kh[:, None] * stride_v_h
        vc_row = v_cache_ptr + lane * stride_vc_b + offs_kh[:, None] * stride_vc_h + slot * stride_vc_s
        for half in tl.static_range(2):
            v = tl.load(v_row + (offs_d[None, :] + half * HALF) * stride_v_d, mask=mask_kv, other=0.0)
            tl.store(vc_row + (offs_d[None, :] + half * HALF) * stride_vc_d,
                     v.to(v_cache_ptr.dtype.element_ty), mask=mask_kv)


def rope_cache_write(q, k, v, cos, sin, write_idx, k_cache, v_cache, slots=None):
    """Rotate q, k; write rotated k and v into the cache in place; return q_rot (B, H, T, hd).

    slots (B,) int32 / int64 on the caches' device: the caches are whole layers (n_slots, Hkv,
    S, hd) and row b writes into cache slot slots[b]. Rows that write must not share a slot
    (the caller's error otherwise: the rows run concurrently)."""
    op = "rope_cache_write"
    check_device(op, q=q, k=k, v=v, cos=cos, sin=sin, write_idx=write_idx,
                 k_cache=k_cache, v_cache=v_cache, **({} if slots is None else {"slots": slots}))
    check_rank(op, "q", q, 4, "(B, T, H, hd)")
    B, T, H, hd = q.shape
    if hd % 2:
        raise ValueError(f"{op}: head dim must be even for rotate-half RoPE, got {hd}")
    check_rank(op, "k", k, 4, "(B, T, Hkv, hd)")
    Hkv = k.shape[2]
    check_shape(op, "k", k, (B, T, Hkv, hd))
    check_shape(op, "v", v, (B, T, Hkv, hd))
    check_shape(op, "cos", cos, (B, T, hd // 2))
    check_shape(op, "sin", sin, (B, T, hd // 2))
    check_shape(op, "write_idx", write_idx, (B, T))
    check_rank(op, "k_cache", k_cache, 4, cache_layout(slots))
    S = k_cache.shape[2]
    rows = B if slots is None else k_cache.shape[0]
    check_shape(op, "k_cache", k_cache, (rows, Hkv, S, hd))
    check_shape(op, "v_cache", v_cache, (rows, Hkv, S, hd))
    if slots is not None:
        check_slots(op, slots, B, rows)
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(op, name, t, FLOAT_DTYPES)
    check_dtype(op, "cos", cos, (torch.float32,))
    check_dtype(op, "sin", sin, (torch.float32,))
    check_dtype(op, "write_idx", write_idx, (torch.int64,))

    q_out = torch.empty((B, H, T, hd), dtype=q.dtype, device=q.device)
    if B * T == 0:
        return q_out
    BLOCK_H = triton.next_power_of_2(H)
    BLOCK_HALF = triton.next_power_of_2(hd // 2)
    slots_t, stride_slots = slots_arg(slots, write_idx)
    _rope_cache_write_kernel[(B * T,)](
        q, k, v, cos, sin, write_idx, slots_t, k_cache, v_cache, q_out,
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(), *write_idx.stride(),
        stride_slots, *k_cache.stride(), *v_cache.stride(),
        T, H, Hkv, S, hd // 2,
        BLOCK_H=BLOCK_H,
        BLOCK_HKV=triton.next_power_of_2(Hkv),
        BLOCK_HALF=BLOCK_HALF,
        SLOTS=slots is not None,
        num_warps=4 if BLOCK_H * BLOCK_HALF >= 2048 else 1,
    )
    return q_out


def _rotate_fp32(x, cos, sin):
    """x (B, T, H, hd) -> rotated x in fp32 (B, T, H, hd); callers round once, to their dtype."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()  # (B, T, 1, hd // 2)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_ref(x, cos, sin):
    """x (B, T, H, hd), cos / sin (B, T, hd // 2) (or broadcastable to it) -> rotated x."""
    return _rotate_fp32(x, cos, sin).to(x.dtype)


def rope_cache_write_ref(q, k, v, cos, sin, write_idx, k_cache, v_cache, slots=None):
    """The spec, in plain torch (boolean indexing syncs the host: reference use only). With
    slots, each row alone on its cache slot's view (its writes land there)."""
    if slots is not None:
        return by_slot("rope_cache_write_ref", slots, q.shape[0], k_cache, lambda b, s:
                       rope_cache_write_ref(q[b], k[b], v[b], cos[b], sin[b], write_idx[b], k_cache[s],
                                            v_cache[s]))
    S = k_cache.shape[2]
    valid = (write_idx >= 0) & (write_idx < S)  # (B, T)
    batch = torch.arange(q.shape[0], device=q.device)[:, None].expand_as(write_idx)
    slots = (batch[valid], write_idx[valid])
    # permute is a view, so index_put_ lands in the caller's cache: (B, S, Hkv, hd)
    k_cache.permute(0, 2, 1, 3)[slots] = _rotate_fp32(k, cos, sin)[valid].to(k_cache.dtype)
    v_cache.permute(0, 2, 1, 3)[slots] = v[valid].to(v_cache.dtype)
    return apply_rope_ref(q, cos, sin).transpose(1, 2).contiguous()  # (B, H, T, hd)
