"""Small random checkpoints for the tests: one config per option the model offers."""
from __future__ import annotations

import dataclasses

import torch

from tinyloop.worker.model import checkpoint
from tinyloop.worker.model.config import PRESETS, LoopedConfig

TINY = PRESETS["tiny"]

# One config per option the model offers, so every option meets the parity tests.
CONFIGS = {
    "gqa-prelude-coda": TINY,
    "no-prelude-no-coda": dataclasses.replace(TINY, n_prelude=0, n_coda=0),
    "sandwich": dataclasses.replace(TINY, norm="sandwich"),
    "loop-final-norm": dataclasses.replace(TINY, loop_final_norm=True, n_kv_heads=1),
    "untied-2-layer-block": dataclasses.replace(TINY, tie_embeddings=False, n_loop_layers=2, n_kv_heads=4,
                                                n_prelude=2),
}


def write_checkpoint(path, cfg: LoopedConfig, seed: int = 0, std: float = 0.3) -> str:
    """std 0.3 keeps a random model's greedy output varied, so parity tests can fail."""
    checkpoint.save(checkpoint.init_model(cfg, seed, std), path, dtype=torch.float32)
    return str(path)


def damped_checkpoint(path, cfg: LoopedConfig, seed: int, damp: float) -> str:
    """A random model whose shared block moves the residual little per iteration, so a shallow
    draft agrees with the deep verifier often but not always: every accept / reject branch of
    speculative decoding runs (a plain std-0.3 random model accepts ~1/vocab of its drafts)."""
    model = checkpoint.init_model(cfg, seed, 0.3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("loop.") and name.endswith(("wo.weight", "w2.weight")):
                p.mul_(damp)
    checkpoint.save(model, path, dtype=torch.float32)
    return str(path)
