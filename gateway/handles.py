"""Opaque resume-handle ids.

A handle id is base64url (no padding) of `version:u8 | worker index:u16 | restart epoch:u32 |
token:128 random bits`. The gateway routes a call to the worker with no lookup, the worker
tells a handle from before its restart (HANDLE_LOST) by the epoch, and the 128-bit token,
drawn by the worker with `secrets`, makes ids unguessable.
"""
from __future__ import annotations

import base64
import binascii
import struct
from typing import NamedTuple

VERSION = 1
_LAYOUT = struct.Struct(">BHI16s")
ENCODED_LEN = len(base64.urlsafe_b64encode(b"\0" * _LAYOUT.size).rstrip(b"="))


class HandleRef(NamedTuple):
    worker: int
    epoch: int
    token: bytes


def encode(worker: int, epoch: int, token: bytes) -> str:
    return base64.urlsafe_b64encode(_LAYOUT.pack(VERSION, worker, epoch, token)).rstrip(b"=").decode()


def decode(handle_id: str) -> HandleRef:
    """-> HandleRef; ValueError when the id is not one this service issued (in shape)."""
    if not isinstance(handle_id, str) or len(handle_id) != ENCODED_LEN:
        raise ValueError(f"malformed handle id: expected {ENCODED_LEN} base64url characters")
    try:
        raw = base64.urlsafe_b64decode(handle_id + "=" * (-len(handle_id) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("malformed handle id: not base64url") from None
    if len(raw) != _LAYOUT.size:
        raise ValueError("malformed handle id: wrong length")
    version, worker, epoch, token = _LAYOUT.unpack(raw)
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode() != handle_id:
        # the decoder also takes '+' and '/' (and other spellings of the same bytes): only the
        # exact id this service issued names a handle
        raise ValueError("malformed handle id: not the spelling this service issues (base64url, no padding)")
    if version != VERSION:
        raise ValueError(f"malformed handle id: unknown version {version}")
    return HandleRef(worker, epoch, token)
