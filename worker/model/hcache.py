"""Store-h caches: the normalized input h of each attention instead of its K and V.

`HCache` ("h", "h-int8", "h-int4"): one tensor of encoded h per cache layer, (layers, slots,
positions, Dq) with per-head fp16 scales (layers, slots, positions, n_heads) for the integer
encodings (kernels/hcache.py has the encodings and the math).

`DeltaCache` ("delta-int8"): the iteration axis. Block layer j's cache layer at iteration i >= 1
holds Δh = h^i − ĥ^(i−1) in int8 with a (positions, n_heads) fp16 scale grid; its first
iteration holds h⁰ in fp16 (the anchor), read as ĥ^i = h⁰ + Σ_{1..i} scale·Δh. The prelude and
coda layers are not on the loop's trajectory (each is its own function, run once), so they are
anchors too: h in fp16. Two tensors: anchors (prelude, iteration 0, coda) and deltas
(iterations 1..max_loops−1).

`layer(l)` is what the engine hands the ops: a `kernels.hcache.HLayer` of views into these
tensors, built once per cache layer.
"""
from __future__ import annotations

import torch

from tinyloop.kernels.hcache import HLayer
from tinyloop.worker.model.cache import CacheParts, Part
from tinyloop.worker.model.config import LoopedConfig

ENCODING = {"h": "h", "h-int8": "int8", "h-int4": "int4"}


class HCache(CacheParts):
    def __init__(self, mode: str, cfg: LoopedConfig, n_slots: int, max_seq_len: int, max_loops: int,
                 device: torch.device, dtype: torch.dtype):
        self._init_common(cfg, n_slots, max_seq_len, max_loops, device, dtype)
        self.mode, self.encoding = mode, ENCODING[mode]
        D, G, L = cfg.d_model, cfg.n_heads, self.n_layers
        every = {l: l for l in range(L)}
        if self.encoding == "h":
            self.h = torch.zeros(L, n_slots, max_seq_len, D, device=device, dtype=dtype)
            self.scale = None
            self.parts = [Part("h", self.h, every, 0)]
        else:
            width, qdtype = (D, torch.int8) if self.encoding == "int8" else (D // 2, torch.uint8)
            self.h = torch.zeros(L, n_slots, max_seq_len, width, device=device, dtype=qdtype)
            self.scale = torch.zeros(L, n_slots, max_seq_len, G, device=device, dtype=torch.float16)
            self.parts = [Part("h", self.h, every, 0), Part("scale", self.scale, every, 0)]
        self._layers = [HLayer(self.encoding, self.h[l], None if self.scale is None else self.scale[l])
                        for l in range(L)]

    def layer(self, l: int) -> HLayer:
        return self._layers[l]


class DeltaCache(CacheParts):
    mode = "delta-int8"

    def __init__(self, cfg: LoopedConfig, n_slots: int, max_seq_len: int, max_loops: int,
                 device: torch.device, dtype: torch.dtype):
        self._init_common(cfg, n_slots, max_seq_len, max_loops, device, dtype)
        D, G, J = cfg.d_model, cfg.n_heads, cfg.n_loop_layers
        first_delta = cfg.n_prelude + J                      # iteration 1, block layer 0
        n_delta = (max_loops - 1) * J
        anchors = [l for l in range(self.n_layers) if not first_delta <= l < first_delta + n_delta]
        self.anchor_of = {l: i for i, l in enumerate(anchors)}
        self.delta_of = {first_delta + i: i for i in range(n_delta)}
        self.anchor = torch.zeros(len(anchors), n_slots, max_seq_len, D, device=device, dtype=torch.float16)
        self.delta = torch.zeros(n_delta, n_slots, max_seq_len, D, device=device, dtype=torch.int8)
        self.scale = torch.zeros(n_delta, n_slots, max_seq_len, G, device=device, dtype=torch.float16)
        self.parts = [Part("anchor", self.anchor, self.anchor_of, 0), Part("delta", self.delta, self.delta_of, 0),
                      Part("scale", self.scale, self.delta_of, 0)]
        self._layers = [self._layer(l) for l in range(self.n_layers)]

    def _layer(self, l: int) -> HLayer:
        if l in self.anchor_of:
            return HLayer("fp16", self.anchor[self.anchor_of[l]])
        J = self.config.n_loop_layers
        d = self.delta_of[l]
        i, j = d // J + 1, d % J                             # iteration i >= 1, block layer j
        base = self.anchor[self.anchor_of[self.config.loop_layer_index(0, j)]]
        chain = slice(j, d, J)                               # iterations 1..i-1 of block layer j
        return HLayer("int8", self.delta[d], self.scale[d], base,
                      self.delta[chain] if i > 1 else None, self.scale[chain] if i > 1 else None)

    def layer(self, l: int) -> HLayer:
        return self._layers[l]
