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

import torch
import torch.nn.functional as F

from tinyloop.kernels.rope import apply_rope_ref

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
