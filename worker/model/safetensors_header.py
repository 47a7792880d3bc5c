"""A safetensors file's header, read and checked without torch (`tinyloop serve` checks a
model directory before it starts any worker), so that a truncated or foreign file is named as
such instead of failing inside the loader."""
from __future__ import annotations

import json
import os
import struct

from tinyloop.worker.model.errors import CheckpointError


def read_header(path: str) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}} of a safetensors file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated (header says {n} bytes, file has {size - 8})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated (tensor data needs {8 + n + end} bytes, file has {size})")
    return header
