"""The engine side of TinyLoop Serve: model, cache, generation, the in-process `Model` API
and (in `tinyloop.worker.serving.actor`) the Ray actor that serves it.

Names load lazily so that `tinyloop.worker.cli` can be imported without torch."""
import importlib

_EXPORTS = {
    "Model": "tinyloop.worker.api",
    "LoopedConfig": "tinyloop.worker.model.config",
    "PRESETS": "tinyloop.worker.model.config",
    "Generation": "tinyloop.worker.generation.decode",
    "FINISH_LENGTH": "tinyloop.worker.generation.decode",
    "FINISH_STOP": "tinyloop.worker.generation.decode",
    "FINISH_SAFETY": "tinyloop.worker.generation.decode",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tinyloop.worker' has no attribute {name!r}")
