"""Backends: the same engine runs the torch reference ops anywhere and Triton ops on CUDA.

Every op a backend provides has one signature, defined by its `<op>_ref` in
`tinyloop.kernels`; the Triton launchers beside them take the same arguments. How the Triton
ops launch (programmatic dependent launch, the projections' tiles) is Settings' (pdl,
gemv_tiles, int4_tiles, autotune), bound into each launcher here as explicit arguments.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyloop.kernels.exit_check import exit_check_ref
from tinyloop.kernels.exit_fill import exit_fill_ref, exit_fill_rows_ref, exit_publish_ref
from tinyloop.kernels.decode_attention import (decode_attention_ref, rope_chunk_attention_ref,
                                               rope_decode_attention_ref, rope_tree_attention_ref)
from tinyloop.kernels.hcache import h_cache_write_ref, h_decode_attention_ref, h_encode_ref, h_rows_ref
from tinyloop.kernels.interleave import interleave_next_ref, interleave_pass_ref, interleave_stop_ref
from tinyloop.kernels.rope import apply_rope_ref, rope_cache_write_ref
from tinyloop.kernels.tree_attention import tree_attention_ref


class Ops:
    """The torch reference backend: runs on any device, CPU included.

    pdl: the `pdl=` of the Triton launches the runner makes itself, whatever the backend (the
    captured decode step's and the device rounds' greedy_feed): None (Settings.pdl on: where
    the hardware allows it) or False (`Settings.launch_pdl`)."""
    name = "torch"
    invariant = False  # batch-invariant kernels (Settings.batch_invariant): the Triton backend's option
    autotune = False  # Settings.autotune: the Triton backend's projections
    apply_rope = staticmethod(apply_rope_ref)
    rope_cache_write = staticmethod(rope_cache_write_ref)
    decode_attention = staticmethod(decode_attention_ref)
    rope_decode_attention = staticmethod(rope_decode_attention_ref)
    rope_chunk_attention = staticmethod(rope_chunk_attention_ref)
    rope_tree_attention = staticmethod(rope_tree_attention_ref)
    tree_attention = staticmethod(tree_attention_ref)
    exit_check = staticmethod(exit_check_ref)  # early exit's check (worker/runner/early_exit.py)
    exit_fill = staticmethod(exit_fill_ref)  # its copy fill, the exit depth on the device (runner/solo_exit.py)
    exit_publish = staticmethod(exit_publish_ref)  # and the depth and token to the host
    exit_fill_rows = staticmethod(exit_fill_rows_ref)  # the copy fill of an interleaved launch's rows
    interleave_pass = staticmethod(interleave_pass_ref)  # an interleaved pass's rows (runner/stages.py)
    interleave_stop = staticmethod(interleave_stop_ref)  # its rows stopped by their exit rules
    interleave_next = staticmethod(interleave_next_ref)  # a launch's rows moved on to their next tokens
    # store-h caches (kernels/hcache.py)
    h_cache_write = staticmethod(h_cache_write_ref)
    h_rows = staticmethod(h_rows_ref)
    h_decode_attention = staticmethod(h_decode_attention_ref)

    def __init__(self, pdl: bool = True):
        self.pdl = None if pdl else False

    @staticmethod
    def h_encoded(layer, h, slots, idx):
        """ĥ (B, T, D) fp32: h at positions idx as the layer would store it (nothing written)."""
        return h_encode_ref(layer, h, slots, idx)[2]


class TritonOps(Ops):
    """Triton kernels for the decode hot path (CUDA only). invariant (Settings.batch_invariant):
    the projection and the decode attention in their batch-invariant forms, for any number of
    rows, and chunks of tokens attend through the decode attention kernel (`rope_chunk_attention`),
    so that every row is computed as the batch-1 decode step computes it.

    The Settings of how they launch, each bound into the launchers that take it: pdl
    (Settings.pdl) into every launcher that can use programmatic dependent launch (the
    projections, bf16 and INT4, the decode attention ops, rms_norm, and `pdl` for the runner's
    own greedy_feed); gemv_tiles / int4_tiles (Settings: a sweep's tiles JSON) into the bf16 /
    INT4 projections, whose tiles they take before the code's tables; autotune (Settings.autotune)
    into the bf16 projection."""
    name = "triton"

    def __init__(self, invariant: bool = False, int4_tiles: str | None = None, gemv_tiles: str | None = None,
                 pdl: bool = True, autotune: bool = False):
        import functools

        from tinyloop.kernels.decode_attention import (decode_attention, rope_chunk_attention, rope_decode_attention,
                                                       rope_tree_attention)
        from tinyloop.kernels.gemv import gemv
        from tinyloop.kernels.gemv import load_tables as load_gemv_tables
        super().__init__(pdl)
        self.invariant, self.autotune = invariant, autotune
        self.gemv_tables = load_gemv_tables(gemv_tiles) if gemv_tiles else None
        launch = {"pdl": self.pdl}
        gemv = functools.partial(gemv, **launch, tables=self.gemv_tables, autotune=autotune,
                                 **({"invariant": True} if invariant else {}))
        self.rope_decode_attention = functools.partial(rope_decode_attention, **launch,
                                                       **({"invariant": True} if invariant else {}))
        self.rope_chunk_attention = functools.partial(rope_chunk_attention, **launch)
        self.rope_tree_attention = functools.partial(rope_tree_attention, **launch)
        self.decode_attention = functools.partial(decode_attention, **launch)
        from tinyloop.kernels.int4_gemv import int4_gemv, int4_matmul, load_tables
        from tinyloop.worker.model.quant import route_gemv
        # the fused projection serves up to Settings.fused_rows lanes (Model passes it); a
        # quantized weight takes the INT4 launchers (fused epilogues alike), on a sweep's tiles
        # before the code's tables where Settings.int4_tiles names one
        self.gemv = route_gemv(gemv)
        tables = load_tables(int4_tiles) if int4_tiles else None
        self.int4 = (functools.partial(int4_gemv, tables=tables, **launch),
                     functools.partial(int4_matmul, tables=tables))
        from tinyloop.kernels.gemv import MAX_ROWS
        self.int4_rows = MAX_ROWS  # the rows int4_gemv takes in one call (a batched decode pass)
        from tinyloop.kernels.rmsnorm import rms_norm
        from tinyloop.kernels.rope import rope_cache_write
        from tinyloop.kernels.swiglu import swiglu
        self.rms_norm = functools.partial(rms_norm, **launch)
        self.swiglu = swiglu
        self.rope_cache_write = rope_cache_write
        from tinyloop.kernels.tree_attention import tree_attention
        self.tree_attention = tree_attention
        from tinyloop.kernels.exit_check import exit_check
        from tinyloop.kernels.exit_fill import exit_fill, exit_fill_rows, exit_publish
        self.exit_check = exit_check
        self.exit_fill = exit_fill
        self.exit_fill_rows = exit_fill_rows
        self.exit_publish = exit_publish
        from tinyloop.kernels.interleave import interleave_next, interleave_pass, interleave_stop
        self.interleave_pass = interleave_pass
        self.interleave_stop = interleave_stop
        self.interleave_next = interleave_next
        # store-h caches: the write and the fused decode read; the chunk paths' row reads stay
        # the torch reference's (gathers, no host sync)
        from tinyloop.kernels.hcache import h_cache_write, h_decode_attention
        self.h_cache_write = h_cache_write
        self.h_decode_attention = h_decode_attention


def select_ops(device: torch.device, backend: str | None = None, invariant: bool = False,
               int4_tiles: str | None = None, gemv_tiles: str | None = None, pdl: bool = True,
               autotune: bool = False) -> Ops:
    """The ops of `backend` (None: triton on CUDA, else torch); invariant: the Triton backend's
    batch-invariant kernels (the torch backend has no such form: ValueError); int4_tiles /
    gemv_tiles: a bench/int4_tiles.py / bench/tiles.py result whose tiles the Triton backend's
    INT4 / bf16 projections take first (the torch reference has no tiles); pdl, autotune:
    Settings' (`TritonOps`; the torch backend carries pdl for the runner's greedy_feed)."""
    backend = backend or ("triton" if device.type == "cuda" else "torch")
    if backend == "torch":
        if invariant:
            raise ValueError("batch_invariant needs the triton backend (the torch reference ops have no "
                             "batch-invariant form)")
        return Ops(pdl)
    if backend == "triton":
        from tinyloop.kernels._checks import interpreting
        if device.type != "cuda" and not interpreting():
            # (under TRITON_INTERPRET=1 the kernels run on the CPU: the tests' interpreted engine)
            raise ValueError(f"backend 'triton' needs a CUDA device, got {device}")
        return TritonOps(invariant, int4_tiles, gemv_tiles, pdl, autotune)
    raise ValueError(f"unknown backend {backend!r}: expected 'torch' or 'triton'")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A fresh prompt's attention: q (B, H, T, hd) at positions 0..T-1 over k/v (B, Hkv, T, hd)
    at the same positions, each query seeing the keys at or before it."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Attention where each key carries its absolute position (negative: empty slot).

    q (B, H, T, hd), k/v (B, Hkv, S, hd), q_pos (B, T), k_pos (S,) or (B, S).
    Query at p sees keys at positions in (p - window, p] (window 0: [0, p])."""
    kp = k_pos if k_pos.dim() == 2 else k_pos[None]
    kp, qp = kp[:, None, :], q_pos[:, :, None]                    # (B|1, 1, S), (B, T, 1)
    mask = (kp <= qp) & (kp >= 0)
    if window:
        mask = mask & (kp > qp - window)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None],
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1])
