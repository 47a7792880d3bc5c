"""The static, preallocated cache of a worker, in one of the KV cache modes.

`kv` (KVCache): one tensor each for K and V, (layers, slots, n_kv_heads, positions, head_dim),
allocated once. The store-h modes (hcache.py) hold the normalized layer input h instead and
rebuild K and V from it at read time. A request owns a slot (a lane of the batch dimension); a
call at `loops=L` touches layers [0, n_prelude + L·n_loop_layers) and the coda layers, nothing
else. With a sliding window W, a lane uses positions [0, W) as a ring: position p lives in
slot p % W.

Every cache is a list of `Part`s, tensors whose first two dimensions are (part layers, slots):
what a resume handle copies, what a speculative round moves and what the memory accounting
measures is written once, over the parts, for every mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.model.settings import KV_MODES


def check_kv_mode(mode: str, cfg: LoopedConfig, max_loops: int) -> str:
    """The mode, or a ValueError naming the valid ones (or why this model cannot use it)."""
    if mode not in KV_MODES:
        raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, got {mode!r}")
    if mode == "delta-int8" and max_loops < 2:
        raise ValueError(f"kv_mode 'delta-int8' stores Δh between iterations of the shared block; a model "
                         f"with max_loops={max_loops} runs one iteration and has none (use 'h-int8')")
    return mode


@dataclass
class Part:
    """A cache tensor (part layers, n_slots, *per-lane shape) with the cache layers it holds
    (cache layer -> its index) and the dimension of the per-lane shape that is the position."""
    name: str
    tensor: torch.Tensor
    layers: dict[int, int]
    pos_dim: int

    def bytes_per_position(self) -> float:
        """Measured: the tensor's bytes per (layer, lane, position)."""
        t = self.tensor
        return t.nbytes / (t.shape[0] * t.shape[1] * t.shape[2 + self.pos_dim])


class CacheParts:
    """What every mode's cache does over its parts."""
    parts: list[Part]
    config: LoopedConfig
    n_slots: int
    max_seq_len: int
    max_loops: int
    mode: str

    def _init_common(self, cfg: LoopedConfig, n_slots: int, max_seq_len: int, max_loops: int,
                     device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.dtype = cfg, dtype  # dtype: the model's (what a handle's residual is in)
        self.n_slots, self.max_seq_len, self.max_loops = n_slots, max_seq_len, max_loops
        self.n_layers = cfg.n_cache_layers(max_loops)
        self.device = torch.device(device)
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

    # -- memory ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes the cache's tensors hold (measured, not computed from the config)."""
        return sum(part.tensor.nbytes for part in self.parts)

    def bytes_per_token_layer(self) -> float:
        """Bytes per token per cache layer, averaged over the layers (delta-int8's anchor
        layers hold more than its delta layers)."""
        return self.nbytes / (self.n_layers * self.n_slots * self.max_seq_len)

    def bytes_for(self, layers: list[int], positions: int) -> int:
        """Bytes that `positions` positions of `layers` take in this cache's encoding."""
        return int(sum(part.bytes_per_position() * positions * sum(l in part.layers for l in layers)
                       for part in self.parts))

    # -- lanes -------------------------------------------------------------------------------
    def copy_out(self, lane: int, used: int, alloc: int, positions: int) -> dict[str, torch.Tensor]:
        """Positions [0, positions) of cache layers [0, used) of `lane`, in buffers sized for
        cache layers [0, alloc) (a resume handle): {part name: (part's layers in [0, alloc),
        *per-lane shape with `positions`)}."""
        out = {}
        for part in self.parts:
            t = part.tensor
            n_alloc = sum(l < alloc for l in part.layers)
            shape = list(t.shape[2:])
            shape[part.pos_dim] = positions
            buf = torch.empty(n_alloc, *shape, dtype=t.dtype, device=t.device)
            idx = [part.layers[l] for l in range(used) if l in part.layers]
            if idx:
                src = t[torch.tensor(idx, device=t.device), lane]
                buf[:len(idx)] = src.narrow(1 + part.pos_dim, 0, positions)
            out[part.name] = buf
        return out

    def copy_in(self, lane: int, state: dict[str, torch.Tensor], used: int) -> None:
        """copy_out's layers [0, used) back into `lane`."""
        for part in self.parts:
            idx = [part.layers[l] for l in range(used) if l in part.layers]
            if not idx:
                continue
            buf = state[part.name]
            positions = buf.shape[1 + part.pos_dim]
            for i, layer_idx in enumerate(idx):  # part layers are contiguous per part, but not across
                part.tensor[layer_idx, lane].narrow(part.pos_dim, 0, positions).copy_(buf[i])

    def move(self, lane: int, layers: list[int], src: list[int], dst: list[int]) -> None:
        """Positions src -> dst of `lane` in `layers` (every src read before any dst written)."""
        device = self.device
        s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for part in self.parts:
            idx = [part.layers[l] for l in layers if l in part.layers]
            if not idx:
                continue
            view = part.tensor[:, lane].movedim(1 + part.pos_dim, 1)  # (part layers, positions, ...)
            li = torch.tensor(idx, device=device)[:, None]
            view[li, d[None]] = view[li, s[None]]  # gathered first


class KVCache(CacheParts):
    mode = "kv"

    def __init__(self, cfg: LoopedConfig, n_slots: int, max_seq_len: int, max_loops: int,
                 device: torch.device, dtype: torch.dtype):
        self._init_common(cfg, n_slots, max_seq_len, max_loops, device, dtype)
        shape = (self.n_layers, n_slots, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        every = {l: l for l in range(self.n_layers)}
        self.parts = [Part("k", self.k, every, 1), Part("v", self.v, every, 1)]


def make_cache(mode: str, cfg: LoopedConfig, n_slots: int, max_seq_len: int, max_loops: int,
               device: torch.device, dtype: torch.dtype) -> CacheParts:
    """The cache of `mode` (check_kv_mode's names)."""
    check_kv_mode(mode, cfg, max_loops)
    if mode == "kv":
        return KVCache(cfg, n_slots, max_seq_len, max_loops, device, dtype)
    from tinyloop.worker.model.hcache import DeltaCache, HCache
    if mode == "delta-int8":
        return DeltaCache(cfg, n_slots, max_seq_len, max_loops, device, dtype)
    return HCache(mode, cfg, n_slots, max_seq_len, max_loops, device, dtype)


def lane_bytes(mode: str, cfg: LoopedConfig, max_seq_len: int, max_loops: int, dtype: torch.dtype) -> int:
    """One lane's bytes in `mode`, measured on a one-lane, one-position cache on the meta
    device (no memory): what the lane count within a budget is worked out from."""
    c = make_cache(mode, cfg, 1, 1, max_loops, torch.device("meta"), dtype)
    return c.nbytes * max_seq_len
