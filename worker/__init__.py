"""The engine side of TinyLoop Serve: model, cache, generation, the in-process `Model` API
and (in `tinyloop.worker.actor`) the Ray actor that serves it.

Names load lazily so that `tinyloop.worker.cli` can be imported without torch."""
import importlib

_EXPORTS = {
    "Model": "tinyloop.worker.api",
    "LoopedConfig": "tinyloop.worker.config",
    "PRESETS": "tinyloop.worker.config",
    "Generation": "tinyloop.worker.generate",
    "FINISH_LENGTH": "tinyloop.worker.generate",
    "FINISH_STOP": "tinyloop.worker.generate",
    "FINISH_SAFETY": "tinyloop.worker.generate",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tinyloop.worker' has no attribute {name!r}")
