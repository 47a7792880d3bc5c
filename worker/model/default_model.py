"""The embedded default model: the trained checkpoint shipped in `assets/` when present,
otherwise a deterministic seeded tiny model written to the user cache on first use."""
from __future__ import annotations

from pathlib import Path

from tinyloop.worker.model.settings import cache_dir

ASSET = Path(__file__).parent.parent / "assets" / "default.tinyloop"
FALLBACK_SEED = 0


def default_model_path() -> str:
    if ASSET.exists():
        return str(ASSET)
    cache = Path(cache_dir())
    path = cache / f"default-tiny-seed{FALLBACK_SEED}.tinyloop"
    if not path.exists():
        from tinyloop.worker.model import checkpoint
        from tinyloop.worker.model.config import PRESETS
        cache.mkdir(parents=True, exist_ok=True)
        checkpoint.save(checkpoint.init_model(PRESETS["tiny"], FALLBACK_SEED), path)
    return str(path)
