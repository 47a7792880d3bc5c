"""Triton kernels of TinyLoop Serve, each beside its plain-torch reference (the spec).

The engine calls the ``*_ref`` functions on CPU and the launchers on CUDA; a launcher and its
reference take the same arguments and return the same thing.

Without a CUDA device the launchers run only under the Triton interpreter (CPU tensors), which
triton reads from TRITON_INTERPRET=1 at its first import: the test suite sets it.
"""
from .counter_hash import uniform, uniform_ref
from .decode_attention import (
    decode_attention,
    decode_attention_ref,
    rope_chunk_attention,
    rope_chunk_attention_ref,
    rope_decode_attention,
    rope_decode_attention_ref,
    rope_tree_attention,
    rope_tree_attention_ref,
)
from .gemv import ARGMAX_KEY_NONE, argmax_key_ref, gemv, gemv_ref
from .rmsnorm import rms_norm, rms_norm_ref
from .rope import apply_rope_ref, rope_cache_write, rope_cache_write_ref
from .sample_rows import (choose_rows, choose_rows_ref, draw_rows, draw_rows_ref, probs_rows, probs_rows_ref, verdict_rows,
                          verdict_rows_ref)
from .sampling import argmax, argmax_ref, greedy_feed, greedy_feed_ref, sample_top_k, sample_top_k_ref
from .swiglu import swiglu, swiglu_ref
from .tree_attention import ancestors_from_parents, tree_attention, tree_attention_ref

__all__ = [
    "ARGMAX_KEY_NONE",
    "ancestors_from_parents",
    "apply_rope_ref",
    "argmax",
    "argmax_key_ref",
    "argmax_ref",
    "choose_rows",
    "choose_rows_ref",
    "decode_attention",
    "decode_attention_ref",
    "draw_rows",
    "draw_rows_ref",
    "gemv",
    "gemv_ref",
    "greedy_feed",
    "greedy_feed_ref",
    "probs_rows",
    "probs_rows_ref",
    "rms_norm",
    "rms_norm_ref",
    "rope_cache_write",
    "rope_cache_write_ref",
    "rope_chunk_attention",
    "rope_chunk_attention_ref",
    "rope_decode_attention",
    "rope_decode_attention_ref",
    "rope_tree_attention",
    "rope_tree_attention_ref",
    "sample_top_k",
    "sample_top_k_ref",
    "swiglu",
    "swiglu_ref",
    "tree_attention",
    "tree_attention_ref",
    "uniform",
    "uniform_ref",
    "verdict_rows",
    "verdict_rows_ref",
]
