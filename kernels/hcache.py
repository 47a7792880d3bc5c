"""Store-h cache: the normalized layer input h instead of K and V, and K / V rebuilt from it.

In a weight-shared loop the W_k / W_v that read a cache layer are the ones that wrote it, so a
layer may hold h (the input of the attention's projections, one D-vector per token) and
rebuild at read time

    K = RoPE(W_k·ĥ + b_k, position),   V = W_v·ĥ

where ĥ is h as stored. Encodings (D = d_model, G = n_heads groups of D / G = head_dim):

    "h"     ĥ = h in the model dtype                                   (positions, D)
    "int8"  q = round(h / s) in [-127, 127], s = amax_group / 127     (positions, D) int8
    "int4"  q in [-7, 7], s = amax_group / 7, packed two per byte     (positions, D / 2) uint8
            (element 2i in the low nibble, 2i + 1 in the high one, each stored as q + 8)
    "fp16"  ĥ = h in fp16: delta-int8's anchor                       (positions, D) fp16

with s (positions, G) fp16: ĥ = s·q. The division uses the fp16 scale as stored, so ĥ is what
the reader sees. Delta: Δh = h − ĥ_prev, against the previous iteration's *reconstruction*, is
int8-encoded; ĥ = ĥ_prev + s·q then carries one rounding error, never a sum of them.

This file is the spec (`*_ref`, plain torch) and the Triton kernels beside it: the write side
(`h_cache_write`: quantize / pack / delta against the previous layer) and the read side fused
into decode attention (`h_decode_attention`: each split rebuilds the K and V of the positions it
reads from ĥ in tensor-core dots, never materializing them in memory).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_rank, check_slots, interpreting
from .decode_attention import _decode_attention_merge_kernel, _split_len, _store_partials
from .rope import apply_rope_ref

QMAX = {"int8": 127, "int4": 7}
ENCODINGS = ("h", "fp16", "int8", "int4")


def quantize_ref(h: torch.Tensor, groups: int, encoding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """h (..., D) -> (q, scale (..., groups) fp16): q int8 (..., D), or uint8 (..., D / 2) for int4."""
    qmax = QMAX[encoding]
    D = h.shape[-1]
    hf = h.float().reshape(*h.shape[:-1], groups, D // groups)     # (..., G, D / G)
    scale = (hf.abs().amax(-1) / qmax).to(torch.float16)          # (..., G)
    s = scale.float()[..., None]
    q = torch.where(s > 0, torch.round(hf / torch.where(s > 0, s, 1.0)), 0.0).clamp(-qmax, qmax)
    q = q.reshape(h.shape).to(torch.int8)
    if encoding == "int4":
        u = (q + 8).to(torch.uint8)                                # nibbles in [1, 15]
        q = u[..., 0::2] | (u[..., 1::2] << 4)                     # (..., D / 2)
    return q, scale


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, encoding: str) -> torch.Tensor:
    """(q, scale) -> ĥ (..., D) fp32."""
    if encoding == "int4":
        lo = (q & 0xF).to(torch.int16) - 8
        hi = (q >> 4).to(torch.int16) - 8
        q = torch.stack((lo, hi), -1).reshape(*q.shape[:-1], 2 * q.shape[-1])  # (..., D)
    G = scale.shape[-1]
    qf = q.float().reshape(*q.shape[:-1], G, q.shape[-1] // G)
    return (qf * scale.float()[..., None]).reshape(*q.shape)


def rebuild_kv_ref(h: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, k_bias: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ĥ (B, n, D) in the weights' dtype, cos / sin (B or 1, n, hd / 2) at the positions' RoPE
    rows -> K, V (B, Hkv, n, hd), K rotated, both in the weights' dtype."""
    B, n, _ = h.shape
    k = F.linear(h, wk)
    if k_bias is not None:
        k = k + k_bias
    v = F.linear(h, wv)
    k = apply_rope_ref(k.view(B, n, n_kv_heads, -1), cos, sin)
    return k.transpose(1, 2), v.view(B, n, n_kv_heads, -1).transpose(1, 2)


class HLayer:
    """One cache layer of a store-h cache, as the ops see it.

    q (n_slots, S, Dq) with scale (n_slots, S, G) fp16 (None for "h" / "fp16"): what this layer
    writes, in `encoding`. A delta layer also reads what it is a delta against: base (n_slots,
    S, D) fp16, the anchor (its block layer's first iteration), and chain_q / chain_scale
    (n, n_slots, S, D) int8 / (n, n_slots, S, G) fp16, the deltas of the iterations between
    (strided views of the cache's delta tensor). ĥ = base + Σ chain + this layer's own."""

    def __init__(self, encoding: str, q: torch.Tensor, scale: torch.Tensor | None = None,
                 base: torch.Tensor | None = None, chain_q: torch.Tensor | None = None,
                 chain_scale: torch.Tensor | None = None):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        self.encoding, self.q, self.scale = encoding, q, scale
        self.base, self.chain_q, self.chain_scale = base, chain_q, chain_scale

    @property
    def d_model(self) -> int:
        return self.q.shape[-1] * (2 if self.encoding == "int4" else 1)

    @property
    def max_seq_len(self) -> int:
        return self.q.shape[1]


def _gather(t: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (n_slots, S, X) at (slots[b], idx[b, t]) -> (B, T, X); idx clamped into [0, S)."""
    return t[slots[:, None], idx.clamp(0, t.shape[1] - 1)]


def h_prev_rows_ref(layer: HLayer, slots: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """What a delta layer's own part adds to: base + Σ chain at the rows (B, T, D) fp32; None
    for a layer that is no delta."""
    if layer.base is None:
        return None
    acc = _gather(layer.base, slots, idx).float()
    if layer.chain_q is not None:
        for i in range(layer.chain_q.shape[0]):
            acc = acc + dequantize_ref(_gather(layer.chain_q[i], slots, idx),
                                       _gather(layer.chain_scale[i], slots, idx), "int8")
    return acc


def h_rows_ref(layer: HLayer, slots: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """ĥ (B, T, D) fp32 at positions idx (B, T) of the slots' lanes (idx clamped into the cache)."""
    own = _gather(layer.q, slots, idx)
    own = own.float() if layer.scale is None else dequantize_ref(own, _gather(layer.scale, slots, idx), layer.encoding)
    prev = h_prev_rows_ref(layer, slots, idx)
    return own if prev is None else prev + own


def h_encode_ref(layer: HLayer, h: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor):
    """h (B, T, D) at positions idx -> (stored q, scale or None, ĥ fp32) for those rows."""
    prev = h_prev_rows_ref(layer, slots, idx)
    x = h.float() if prev is None else h.float() - prev
    if layer.scale is None:
        q, scale = x.to(layer.q.dtype), None
        own = q.float()
    else:
        q, scale = quantize_ref(x, layer.scale.shape[-1], layer.encoding)
        own = dequantize_ref(q, scale, layer.encoding)
    return q, scale, (own if prev is None else prev + own)


def h_cache_write_ref(h: torch.Tensor, write_idx: torch.Tensor, slots: torch.Tensor, layer: HLayer) -> None:
    """Encode h (B, T, D) into positions write_idx (B, T) of the slots' lanes; a position
    outside [0, S) writes nothing (boolean indexing syncs the host: reference use only)."""
    q, scale, _ = h_encode_ref(layer, h, slots, write_idx)
    valid = (write_idx >= 0) & (write_idx < layer.max_seq_len)
    lane = slots[:, None].expand_as(write_idx)
    at = (lane[valid], write_idx[valid])
    layer.q[at] = q[valid]
    if scale is not None:
        layer.scale[at] = scale[valid]


def h_decode_attention_ref(q, positions, layer: HLayer, wk, wv, k_bias, cos, sin, scale, slots):
    """Decode attention over a store-h layer, the new token's h already written: q (B, 1, H, hd)
    unrotated, positions (B,) (outside [0, S): an idle row, zero output) -> (B, H, hd) in q.dtype.
    Row b attends to positions [0, positions[b]] of lane slots[b], K / V rebuilt from ĥ."""
    from tinyloop.kernels.decode_attention import decode_attention_ref
    S = layer.max_seq_len
    live = (positions >= 0) & (positions < S)
    n = max(1, min(S, int(torch.where(live, positions + 1, 0).max())))
    idx = torch.arange(n, device=q.device)[None].expand(q.shape[0], n)
    hh = h_rows_ref(layer, slots, idx).to(wk.dtype)                      # (B, n, D)
    K, V = rebuild_kv_ref(hh, wk, wv, k_bias, cos[:n][None], sin[:n][None], wk.shape[0] // q.shape[-1])
    rows = torch.where(live, positions, 0)
    qr = apply_rope_ref(q, cos[rows][:, None], sin[rows][:, None])[:, 0]  # (B, H, hd)
    return decode_attention_ref(qr, K, V, torch.where(live, positions + 1, 0), scale)


# -- Triton: the write side --------------------------------------------------------------------------
ENC_ID = {"h": 0, "fp16": 0, "int8": 1, "int4": 2}
LOG2E = math.log2(math.e)


@triton.jit
def _round_half_even(x):
    """torch.round's rounding (half to even) of fp32 x, |x| small enough that x + 0.5 is exact."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _prev_rows(base_ptr, cq_ptr, cs_ptr, lane, pos, offs, mask, group,
               stride_base_b, stride_base_s, stride_cq_c, stride_cq_b, stride_cq_s,
               stride_cs_c, stride_cs_b, stride_cs_s, N_CHAIN):
    """base + Σ chain (fp32) at (lane, pos (broadcastable to offs), offs): what a delta adds to,
    in the reference's order (the anchor, then each iteration's delta)."""
    acc = tl.load(base_ptr + lane * stride_base_b + pos * stride_base_s + offs, mask=mask, other=0.0).to(tl.float32)
    for c in range(N_CHAIN):
        q = tl.load(cq_ptr + c * stride_cq_c + lane * stride_cq_b + pos * stride_cq_s + offs, mask=mask, other=0)
        sc = tl.load(cs_ptr + c * stride_cs_c + lane * stride_cs_b + pos * stride_cs_s + group, mask=mask, other=0.0)
        acc = acc + q.to(tl.float32) * sc.to(tl.float32)
    return acc


@triton.jit
def _h_cache_write_kernel(
    h_ptr,       # (B, T, D) contiguous
    idx_ptr,     # (B, T) int64 write positions (outside [0, S): no write)
    slots_ptr,   # (B,) the rows' cache lanes
    hq_ptr,      # (n_slots, S, Dq) the layer's own encoded h, rows contiguous
    hs_ptr,      # (n_slots, S, G) fp16 scales (ENC > 0), rows contiguous
    base_ptr,    # (n_slots, S, D) fp16 anchor (DELTA), rows contiguous
    cq_ptr,      # (N_CHAIN, n_slots, S, D) int8 deltas of the iterations between (DELTA)
    cs_ptr,      # (N_CHAIN, n_slots, S, G) fp16 their scales
    stride_idx_b, stride_idx_t, stride_slots,
    stride_hq_b, stride_hq_s, stride_hs_b, stride_hs_s, stride_base_b, stride_base_s,
    stride_cq_c, stride_cq_b, stride_cq_s, stride_cs_c, stride_cs_b, stride_cs_s,
    T, S, D, GS, N_CHAIN, QMAX,
    ENC: tl.constexpr,       # 0: store as is (h / fp16), 1: int8, 2: int4 packed
    DELTA: tl.constexpr,
    BLOCK_P: tl.constexpr,   # >= GS / 2: the group's element pairs
):
    """One program per (row, head group): the group's GS elements as GS / 2 (even, odd) pairs,
    so int4 packs a pair into one byte without a shuffle."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    b, t = row // T, row % T
    offs_p = tl.arange(0, BLOCK_P)
    pos = tl.load(idx_ptr + b * stride_idx_b + t * stride_idx_t) + 0 * offs_p   # (BLOCK_P,): the row's position
    valid = (pos >= 0) & (pos < S)
    pos = tl.where(valid, pos, 0)
    lane = tl.load(slots_ptr + b * stride_slots).to(tl.int64)
    mask = (offs_p < GS // 2) & valid
    even = g * GS + 2 * offs_p
    xe = tl.load(h_ptr + row * D + even, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(h_ptr + row * D + even + 1, mask=mask, other=0.0).to(tl.float32)
    if DELTA:
        xe -= _prev_rows(base_ptr, cq_ptr, cs_ptr, lane, pos, even, mask, g, stride_base_b, stride_base_s,
                         stride_cq_c, stride_cq_b, stride_cq_s, stride_cs_c, stride_cs_b, stride_cs_s, N_CHAIN)
        xo -= _prev_rows(base_ptr, cq_ptr, cs_ptr, lane, pos, even + 1, mask, g, stride_base_b, stride_base_s,
                         stride_cq_c, stride_cq_b, stride_cq_s, stride_cs_c, stride_cs_b, stride_cs_s, N_CHAIN)
    out = hq_ptr + lane * stride_hq_b + pos * stride_hq_s
    if ENC == 0:
        tl.store(out + even, xe.to(hq_ptr.dtype.element_ty), mask=mask)
        tl.store(out + even + 1, xo.to(hq_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.maximum(tl.max(tl.abs(xe), axis=0), tl.max(tl.abs(xo), axis=0))
        scale16 = tl.math.div_rn(amax, QMAX * 1.0).to(tl.float16)
        s = scale16.to(tl.float32)
        div = tl.where(s > 0, s, 1.0)
        qe = tl.where(s > 0, _round_half_even(tl.math.div_rn(xe, div)), 0.0)
        qo = tl.where(s > 0, _round_half_even(tl.math.div_rn(xo, div)), 0.0)
        qe = tl.minimum(tl.maximum(qe, -QMAX * 1.0), QMAX * 1.0).to(tl.int32)
        qo = tl.minimum(tl.maximum(qo, -QMAX * 1.0), QMAX * 1.0).to(tl.int32)
        if ENC == 1:
            tl.store(out + even, qe.to(tl.int8), mask=mask)
            tl.store(out + even + 1, qo.to(tl.int8), mask=mask)
        else:
            byte = ((qe + 8) | ((qo + 8) << 4)).to(tl.uint8)
            tl.store(out + g * (GS // 2) + offs_p, byte, mask=mask)
        # every pair lane stores the group's one scale: the same value to the same address
        tl.store(hs_ptr + lane * stride_hs_b + pos * stride_hs_s + g + 0 * offs_p, scale16 + tl.zeros_like(xe).to(tl.float16),
                 mask=mask)


def _layer_args(layer: HLayer):
    """The layer's pointers and strides as the kernels take them (stand-ins where unused)."""
    q = layer.q
    scale = layer.scale if layer.scale is not None else q
    base = layer.base if layer.base is not None else q
    cq = layer.chain_q if layer.chain_q is not None else q[None]
    cs = layer.chain_scale if layer.chain_scale is not None else scale[None]
    n_chain = 0 if layer.chain_q is None else layer.chain_q.shape[0]
    for name, t in (("q", q), ("scale", scale), ("base", base)):
        if t.stride(-1) != 1:
            raise ValueError(f"store-h layer: {name} rows must be contiguous, got strides {t.stride()}")
    return (q, scale, base, cq, cs), (q.stride(0), q.stride(1), scale.stride(0), scale.stride(1), base.stride(0),
                                      base.stride(1), cq.stride(0), cq.stride(1), cq.stride(2), cs.stride(0),
                                      cs.stride(1), cs.stride(2)), n_chain


def _check_layer(op: str, layer: HLayer, slots: torch.Tensor, B: int) -> None:
    check_device(op, q=layer.q, slots=slots)
    check_slots(op, slots, B, layer.q.shape[0])
    if layer.encoding in ("int8", "int4"):
        check_dtype(op, "scale", layer.scale, (torch.float16,))


def h_cache_write(h: torch.Tensor, write_idx: torch.Tensor, slots: torch.Tensor, layer: HLayer) -> None:
    """h_cache_write_ref as one launch: h (B, T, D) fp16 / bf16 / fp32, write_idx (B, T) int64,
    slots (B,) -> the layer's tensors written in place (no host sync: capturable)."""
    op = "h_cache_write"
    check_rank(op, "h", h, 3, "(B, T, D)")
    B, T, D = h.shape
    check_dtype(op, "h", h, FLOAT_DTYPES)
    _check_layer(op, layer, slots, B)
    if D != layer.d_model:
        raise ValueError(f"{op}: h has {D} features, the layer stores {layer.d_model}")
    if tuple(write_idx.shape) != (B, T):
        raise ValueError(f"{op}: write_idx must have shape {(B, T)}, got {tuple(write_idx.shape)}")
    if B * T == 0:
        return
    h = h.contiguous()
    G = layer.scale.shape[-1] if layer.scale is not None else 1  # an unscaled layer: one group, the row
    GS = D // G
    tensors, strides, n_chain = _layer_args(layer)
    _h_cache_write_kernel[(B * T, G)](
        h, write_idx, slots, *tensors, write_idx.stride(0), write_idx.stride(1), slots.stride(0), *strides,
        T, layer.max_seq_len, D, GS, n_chain, QMAX.get(layer.encoding, 1),
        ENC=ENC_ID[layer.encoding], DELTA=layer.base is not None,
        BLOCK_P=max(2, triton.next_power_of_2(max(GS // 2, 1))), num_warps=1)


# -- Triton: the read side, fused into decode attention -------------------------------------------------
@triton.jit
def _load_h_tile(hq_ptr, hs_ptr, base_ptr, cq_ptr, cs_ptr, lane, offs_n, offs_k, mask,
                 stride_hq_b, stride_hq_s, stride_hs_b, stride_hs_s, stride_base_b, stride_base_s,
                 stride_cq_c, stride_cq_b, stride_cq_s, stride_cs_c, stride_cs_b, stride_cs_s,
                 GS, N_CHAIN, ENC: tl.constexpr, DELTA: tl.constexpr):
    """ĥ (BLOCK_N, BLOCK_K) fp32 at positions offs_n, features offs_k of one lane."""
    pos = offs_n[:, None]
    feat = offs_k[None, :]
    group = feat // GS
    own = hq_ptr + lane * stride_hq_b + pos * stride_hq_s
    if ENC == 0:
        x = tl.load(own + feat, mask=mask, other=0.0).to(tl.float32)
    else:
        if ENC == 1:
            q = tl.load(own + feat, mask=mask, other=0).to(tl.int32)
        else:
            byte = tl.load(own + feat // 2, mask=mask, other=0).to(tl.int32)
            q = tl.where(feat % 2 == 0, byte & 15, byte >> 4) - 8
        sc = tl.load(hs_ptr + lane * stride_hs_b + pos * stride_hs_s + group, mask=mask, other=0.0)
        x = q.to(tl.float32) * sc.to(tl.float32)
    if DELTA:
        x = _prev_rows(base_ptr, cq_ptr, cs_ptr, lane, pos, feat, mask, group, stride_base_b, stride_base_s,
                       stride_cq_c, stride_cq_b, stride_cq_s, stride_cs_c, stride_cs_b, stride_cs_s, N_CHAIN) + x
    return x


@triton.jit
def _h_decode_attention_split_kernel(
    q_ptr,          # (B, H, hd) unrotated
    positions_ptr,  # (B,) int64: the new token's (its h written); outside [0, S): idle row
    slots_ptr,      # (B,)
    hq_ptr, hs_ptr, base_ptr, cq_ptr, cs_ptr,   # the layer (see _h_cache_write_kernel)
    wk_ptr,         # (Hkv·hd, D) rows contiguous
    wv_ptr,         # (Hkv·hd, D) rows contiguous
    kb_ptr,         # (Hkv·hd,) k bias (HAS_BIAS)
    cos_ptr, sin_ptr,  # (P, hd / 2) fp32 tables
    m_ptr, l_ptr, acc_ptr,  # partials (B, H, NUM_SPLITS[, hd]) fp32
    stride_q_b, stride_q_h, stride_pos, stride_slots,
    stride_hq_b, stride_hq_s, stride_hs_b, stride_hs_s, stride_base_b, stride_base_s,
    stride_cq_c, stride_cq_b, stride_cq_s, stride_cs_c, stride_cs_b, stride_cs_s,
    stride_wk, stride_wv, stride_cos, stride_sin,
    H, S, HD, GROUP, NUM_SPLITS, SPLIT_LEN, D, GS, N_CHAIN,
    qk_scale,
    ENC: tl.constexpr, DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Program (b, kv head, split): for each tile of BLOCK_N positions of its split, ĥ tiles of
    BLOCK_K features times the head's W_k halves and W_v rows (three dots), K rotated at the
    tile's positions, then the online softmax of the group's queries, as decode_attention."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    pos_b = tl.load(positions_ptr + b * stride_pos)
    live = (pos_b >= 0) & (pos_b < S)
    kv_len = tl.where(live, pos_b + 1, 0).to(tl.int32)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, kv_len)
    row = tl.where(live, pos_b, 0)
    lane = tl.load(slots_ptr + b * stride_slots).to(tl.int64)
    wdt = wk_ptr.dtype.element_ty

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    half = HD // 2
    offs_h = tl.arange(0, BLOCK_HALF)
    mask_h = offs_h < half
    qm = mask_g[:, None] & mask_h[None, :]
    q_row = q_ptr + b * stride_q_b + heads[:, None] * stride_q_h
    q1 = tl.load(q_row + offs_h[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + half + offs_h[None, :], mask=qm, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + row * stride_cos + offs_h, mask=mask_h, other=0.0)[None, :]
    sn = tl.load(sin_ptr + row * stride_sin + offs_h, mask=mask_h, other=0.0)[None, :]
    q1r = (q1 * c - q2 * sn).to(q_ptr.dtype.element_ty).to(wdt)   # rounded as apply_rope_ref rounds
    q2r = (q2 * c + q1 * sn).to(q_ptr.dtype.element_ty).to(wdt)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HD
    w1 = wk_ptr + (kvh * HD + offs_h)[:, None] * stride_wk          # (BLOCK_HALF, 1) row pointers
    w2 = wk_ptr + (kvh * HD + half + offs_h)[:, None] * stride_wk
    wvr = wv_ptr + (kvh * HD + offs_d)[:, None] * stride_wv         # (BLOCK_D, 1)
    if HAS_BIAS:
        b1 = tl.load(kb_ptr + kvh * HD + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, :]
        b2 = tl.load(kb_ptr + kvh * HD + half + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, :]

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k1 = tl.zeros([BLOCK_N, BLOCK_HALF], tl.float32)
        k2 = tl.zeros([BLOCK_N, BLOCK_HALF], tl.float32)
        v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < D
            x = _load_h_tile(hq_ptr, hs_ptr, base_ptr, cq_ptr, cs_ptr, lane, offs_n, offs_k,
                             mask_n[:, None] & mask_k[None, :], stride_hq_b, stride_hq_s, stride_hs_b, stride_hs_s,
                             stride_base_b, stride_base_s, stride_cq_c, stride_cq_b, stride_cq_s, stride_cs_c,
                             stride_cs_b, stride_cs_s, GS, N_CHAIN, ENC, DELTA).to(wdt)  # (BLOCK_N, BLOCK_K)
            wm = mask_h[:, None] & mask_k[None, :]
            k1 += tl.dot(x, tl.trans(tl.load(w1 + offs_k[None, :], mask=wm, other=0.0)),
                         input_precision=INPUT_PRECISION)
            k2 += tl.dot(x, tl.trans(tl.load(w2 + offs_k[None, :], mask=wm, other=0.0)),
                         input_precision=INPUT_PRECISION)
            v += tl.dot(x, tl.trans(tl.load(wvr + offs_k[None, :], mask=mask_d[:, None] & mask_k[None, :], other=0.0)),
                        input_precision=INPUT_PRECISION)
        # the projections round to the weights' dtype, as F.linear's outputs do in the reference
        k1 = k1.to(wdt).to(tl.float32)
        k2 = k2.to(wdt).to(tl.float32)
        if HAS_BIAS:
            k1 = (k1 + b1).to(wdt).to(tl.float32)
            k2 = (k2 + b2).to(wdt).to(tl.float32)
        cn = tl.load(cos_ptr + offs_n[:, None] * stride_cos + offs_h[None, :], mask=mask_n[:, None] & mask_h[None, :],
                     other=0.0)
        sn_n = tl.load(sin_ptr + offs_n[:, None] * stride_sin + offs_h[None, :],
                       mask=mask_n[:, None] & mask_h[None, :], other=0.0)
        k1r = (k1 * cn - k2 * sn_n).to(wdt)
        k2r = (k2 * cn + k1 * sn_n).to(wdt)
        s = (tl.dot(q1r, tl.trans(k1r), input_precision=INPUT_PRECISION)
             + tl.dot(q2r, tl.trans(k2r), input_precision=INPUT_PRECISION)) * qk_scale  # (BLOCK_G, BLOCK_N)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(wdt), v.to(wdt), input_precision=INPUT_PRECISION)
        m = m_new
    _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, b, heads, split, H, HD, NUM_SPLITS, mask_g, offs_d, mask_d)


def h_decode_attention(q, positions, layer: HLayer, wk, wv, k_bias, cos, sin, scale, slots):
    """h_decode_attention_ref in a split launch and decode_attention's merge: q (B, 1, H, hd),
    positions (B,) int64, the layer's tensors, wk / wv (Hkv·hd, D) rows contiguous (fp16 / bf16 /
    fp32: the dots' dtype), k_bias (Hkv·hd,) or None, cos / sin (P >= S, hd / 2) fp32 tables,
    slots (B,) -> (B, H, hd) in q.dtype. The grids depend on B, Hkv and S only (capturable); a
    split past a row's length writes neutral partials."""
    op = "h_decode_attention"
    check_rank(op, "q", q, 4, "(B, 1, H, hd)")
    B, _, H, hd = q.shape
    _check_layer(op, layer, slots, B)
    check_dtype(op, "q", q, FLOAT_DTYPES)
    if wk.shape != wv.shape or wk.shape[1] != layer.d_model or wk.shape[0] % hd or wk.stride(1) != 1 or wv.stride(1) != 1:
        raise ValueError(f"{op}: wk / wv must be (Hkv·hd, {layer.d_model}) with contiguous rows, got "
                         f"{tuple(wk.shape)} / {tuple(wv.shape)}")
    Hkv = wk.shape[0] // hd
    if H % Hkv or hd % 2:
        raise ValueError(f"{op}: query heads {H} must be a multiple of kv heads {Hkv}, head dim {hd} even")
    S = layer.max_seq_len
    if cos.shape[0] < S or cos.shape[1] != hd // 2 or cos.dtype != torch.float32 or sin.shape != cos.shape:
        raise ValueError(f"{op}: cos / sin must be fp32 (P >= {S}, {hd // 2}), got {tuple(cos.shape)}")
    q3 = q[:, 0]
    o = torch.empty((B, H, hd), dtype=q.dtype, device=q.device)
    if B * H == 0:
        return o
    BLOCK_D = max(16, triton.next_power_of_2(hd))
    block_n = 16 if interpreting() else 64
    split_len = _split_len(B, Hkv, S, q.device, block_n)
    num_splits = triton.cdiv(max(S, 1), split_len)
    m = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty((B, H, num_splits, hd), dtype=torch.float32, device=q.device)
    tensors, strides, n_chain = _layer_args(layer)
    G = layer.scale.shape[-1] if layer.scale is not None else 1
    D = layer.d_model
    _h_decode_attention_split_kernel[(B, Hkv, num_splits)](
        q3, positions, slots, *tensors, wk, wv, k_bias if k_bias is not None else wk, cos, sin, m, lsum, acc,
        q3.stride(0), q3.stride(1), positions.stride(0), slots.stride(0), *strides,
        wk.stride(0), wv.stride(0), cos.stride(0), sin.stride(0),
        H, S, hd, H // Hkv, num_splits, split_len, D, D // G, n_chain, float(scale) * LOG2E,
        ENC=ENC_ID[layer.encoding], DELTA=layer.base is not None, HAS_BIAS=k_bias is not None,
        BLOCK_G=max(16, triton.next_power_of_2(H // Hkv)), BLOCK_N=block_n,
        BLOCK_HALF=max(16, triton.next_power_of_2(hd // 2)), BLOCK_D=BLOCK_D,
        BLOCK_K=16 if interpreting() else 64,
        INPUT_PRECISION="ieee" if wk.dtype == torch.float32 else "tf32", num_warps=8, num_stages=2)
    _decode_attention_merge_kernel[(B * H,)](
        m, lsum, acc, o, o, 0, H, S, hd, num_splits, split_len, num_splits,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits), BLOCK_D=BLOCK_D, PDL=False, ROPE=False,
        num_warps=1 if BLOCK_D <= 64 else 2)
    return o
