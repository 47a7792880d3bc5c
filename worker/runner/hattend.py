"""Attention against a store-h cache layer (kv_mode h, h-int8, h-int4, delta-int8).

The engine hands a layer `HAttend` instead of its K/V closure when the cache stores h: the
layer calls it with its raw projections and h (its normalized input). The new tokens' h is
encoded into the cache first (in a ring chunk: after the read, as the K/V path does), and every
key and value the attention reads, the new tokens' included, is rebuilt from ĥ as stored:

    K = RoPE(W_k·ĥ + b_k, position),  V = W_v·ĥ

so a position's K/V is the same whichever path (prefill, chunk, decode, verify, resume) reads it,
and the fresh projections k, v are not used. A decode step runs the backend's fused
`h_decode_attention` (Triton: the rebuild inside the split kernel); the chunk, ring and tree
paths rebuild the rows they read with torch ops and then attend as the K/V path does.
"""
from __future__ import annotations

import torch

from tinyloop.kernels.hcache import rebuild_kv_ref
from tinyloop.worker.model.ops import causal_attention, masked_attention


class HAttend:
    needs_h = True  # Attention passes its normalized input (modules.Attention.attend)

    def __init__(self, engine, layer: int, p, attention):
        self.e, self.p, self.att = engine, p, attention
        self.store = engine.cache.layer(layer)
        self.k_bias = getattr(attention, "k_bias", None)

    def __call__(self, q, k, v, h):
        p, ops, store, slots = self.p, self.e.ops, self.store, self.p.slots
        T, W = q.shape[1], p.window
        if p.tree is not None:
            return self._tree(q, h)
        model = self.e.model
        if W == 0 and T == 1:
            ops.h_cache_write(h, p.positions, slots, store)
            return ops.h_decode_attention(q, p.positions[:, 0], store, self.att.wk.weight, self.att.wv.weight,
                                          self.k_bias, model.rope_cos, model.rope_sin, self.e.scale,
                                          slots)[:, :, None]
        qr = ops.apply_rope(q, *p.rope_rows()).transpose(1, 2)            # (B, H, T, hd)
        if W == 0 or T == 1:
            ops.h_cache_write(h, p.positions if W == 0 else p.positions % W, slots, store)
            if W == 0:
                n = min(p.kv_len, store.max_seq_len)
                keys, vals = self._kv(torch.arange(n, device=q.device).expand(q.shape[0], n))
                if T == 1:
                    return ops.decode_attention(qr[:, :, 0], keys, vals, p.positions[:, 0] + 1,
                                                self.e.scale)[:, :, None]
                if T == p.kv_len:
                    return causal_attention(qr, keys, vals, self.e.scale)
                return masked_attention(qr, keys, vals, p.positions, torch.arange(n, device=q.device), 0,
                                        self.e.scale)
            keys, vals = self._kv(_ring_positions(p.positions[:, :1], W))
            return ops.decode_attention(qr[:, :, 0], keys, vals, p.seq_lens, self.e.scale)[:, :, None]
        return self._ring_chunk(qr, h)

    def _kv(self, kpos: torch.Tensor, hh: torch.Tensor | None = None):
        """K, V (B, Hkv, n, hd) of lane positions [0, n) (or the rows ĥ given), RoPE at kpos
        (B, n) (negative: an empty ring slot, rotated by row 0 and masked by the caller)."""
        if hh is None:
            idx = torch.arange(kpos.shape[1], device=kpos.device).expand_as(kpos)
            hh = self.e.ops.h_rows(self.store, self.p.slots, idx)
        model, att = self.e.model, self.att
        rows = kpos.clamp(min=0)
        return rebuild_kv_ref(hh.to(att.wk.weight.dtype), att.wk.weight, att.wv.weight, self.k_bias,
                              model.rope_cos[rows], model.rope_sin[rows], att.n_kv_heads)

    def _ring_chunk(self, qr, h):
        """T > 1 tokens on a ring of W: attend to (ring as it stands + chunk as it will be
        stored), then write the chunk's last W tokens (see Engine._attend_ring_chunk)."""
        p, ops, W = self.p, self.e.ops, self.p.window
        T = qr.shape[2]
        ring_pos = _ring_positions(p.positions[:, :1] - 1, W)             # (B, W); < 0 means empty
        k_ring, v_ring = self._kv(ring_pos)
        own = ops.h_encoded(self.store, h, p.slots, p.positions % W)     # (B, T, D) ĥ as stored
        k_new, v_new = self._kv(p.positions, own)
        out = masked_attention(qr, torch.cat([k_ring, k_new], 2), torch.cat([v_ring, v_new], 2), p.positions,
                               torch.cat([ring_pos, p.positions], 1), W, self.e.scale)
        tail = slice(max(0, T - W), T)
        ops.h_cache_write(h[:, tail], p.positions[:, tail] % W, p.slots, self.store)
        return out

    def _tree(self, q, h):
        """Write the nodes' h at their slots, then attend with the ancestor bitmask. A node's
        K is rotated at its RoPE position (the root's plus its depth), not at its slot."""
        p, ops, t = self.p, self.e.ops, self.p.tree
        if t.query_nodes is not None:
            raise ValueError("a store-h cache serves tree passes over every node (query_nodes is None)")
        ops.h_cache_write(h, t.slots, p.slots, self.store)
        n = min(p.kv_len, self.store.max_seq_len)
        kpos = torch.arange(n, device=q.device).expand(q.shape[0], n).scatter(1, t.slots, p.positions)
        keys, vals = self._kv(kpos)
        qr = ops.apply_rope(q, *p.rope_rows()).transpose(1, 2)            # (B, H, T, hd)
        return ops.tree_attention(qr, keys, vals, t.prefix_lens, t.ancestors, self.e.scale)


def _ring_positions(last: torch.Tensor, W: int) -> torch.Tensor:
    """last (B, 1), the newest position in the ring -> (B, W) the position each ring slot holds
    (negative: not written yet)."""
    slot = torch.arange(W, device=last.device)
    return last - (last - slot).remainder(W)
