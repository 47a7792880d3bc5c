"""The static, preallocated K/V cache of a worker.

One tensor each for K and V, (layers, slots, n_kv_heads, positions, head_dim), allocated
once. A request owns a slot (a lane of the batch dimension); a call at `loops=L` touches
layers [0, n_prelude + L·n_loop_layers) and the coda layers, nothing else. With a sliding
window W, a lane uses positions [0, W) as a ring: position p lives in slot p % W.
"""
from __future__ import annotations

import torch

from tinyloop.worker.model.config import LoopedConfig


class KVCache:
    def __init__(self, cfg: LoopedConfig, n_slots: int, max_seq_len: int, max_loops: int,
                 device: torch.device, dtype: torch.dtype):
        self.config = cfg
        self.n_slots, self.max_seq_len, self.max_loops = n_slots, max_seq_len, max_loops
        self.n_layers = cfg.n_cache_layers(max_loops)
        shape = (self.n_layers, n_slots, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # per lane: the seed of an input-injection model's initial latent state (the prelude
        # stage reads it through the rows' slots, so a captured stage serves any lane)
        self.seeds = torch.zeros(n_slots, device=device, dtype=torch.long)

    def seat(self, lane: int, seed: int) -> None:
        """The seed that the initial latent state of `lane`'s next tokens is drawn from."""
        self.seeds[lane].fill_(seed)

    def coda_layer(self, j: int) -> int:
        return self.config.coda_layer_index(j, self.max_loops)

    def layers_for(self, loops: int) -> list[int]:
        """The cache layers a call at `loops` reads and writes."""
        cfg = self.config
        upto = cfg.n_prelude + loops * cfg.n_loop_layers
        return list(range(upto)) + [self.coda_layer(j) for j in range(cfg.n_coda)]
