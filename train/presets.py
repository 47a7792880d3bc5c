"""Training presets. `default` is the shipped embedded model (worker/assets/default.tinyloop).

default: bytes, d_model 320, 5 heads of 64 sharing 1 K/V head, SwiGLU 704; 1 prelude layer,
a 2-layer shared block, 1 coda layer: 3.77M parameters, 7.5 MB in fp16 (<= 8 MB). It is trained
with L drawn uniformly from [1, 12] per step and runs at any L up to max_loops = 16.

bpe-8m: the candidate successor (train/run_h200.sh): BPE (vocab set by --vocab-size, 2048 there),
d_model 384, 6 heads of 64 with as many K/V heads (multi-head attention, as Ouro: K and V
together are twice h, so the store-h cache modes halve its cache), SwiGLU 1024; the same
1 + 2·L + 1 layers: 7.87M parameters at vocab 2048, 15.7 MB in fp16 (<= 16 MB). Trained with L
from [1, 16], P(L) proportional to L.
"""
from __future__ import annotations

from tinyloop.worker.model.config import PRESETS as WORKER_PRESETS
from tinyloop.worker.model.config import LoopedConfig

TRAIN_PRESETS: dict[str, LoopedConfig] = {
    "default": LoopedConfig(vocab_size=256, d_model=320, n_heads=5, n_kv_heads=1, d_ff=704,
                            n_prelude=1, n_loop_layers=2, n_coda=1, default_loops=8, max_loops=16,
                            max_seq_len=2048),
    "bpe-8m": LoopedConfig(vocab_size=2048, d_model=384, n_heads=6, n_kv_heads=6, d_ff=1024,
                           n_prelude=1, n_loop_layers=2, n_coda=1, default_loops=8, max_loops=16,
                           max_seq_len=2048),
    # ~100M-parameter benchmark model for speculative / cache-quality benchmarks (BPE vocab
    # set by --vocab-size); not shipped.
    "bench-100m": LoopedConfig(vocab_size=16384, d_model=1024, n_heads=16, n_kv_heads=4, d_ff=2816,
                               n_prelude=2, n_loop_layers=4, n_coda=2, default_loops=8, max_loops=32,
                               max_seq_len=2048),
}


def get_preset(name: str) -> LoopedConfig:
    presets = {**WORKER_PRESETS, **TRAIN_PRESETS}
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}: choose from {sorted(presets)}")
    return presets[name]


def preset_names() -> list[str]:
    return sorted({*WORKER_PRESETS, *TRAIN_PRESETS})
