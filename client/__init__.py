"""The TinyLoop client: generated stubs (`tinyloop_pb2`, `tinyloop_pb2_grpc`), the blocking
`TinyLoopClient` and `AsyncTinyLoopClient`, and the wire-side CLI commands.

Names load lazily, so `tinyloop --help` does not import grpc."""
import importlib

_EXPORTS = {name: "tinyloop.client.client" for name in (
    "TinyLoopClient", "AsyncTinyLoopClient", "TinyLoopError", "Chunk", "Complete", "Handle",
    "GenerateStream", "AsyncGenerateStream")}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tinyloop.client' has no attribute {name!r}")
