"""The L2 set-aside for lines loaded with the evict-last hint (gemv's cache="keep").

From Ampere on, the L2 keeps evict-last ("persisting") lines only in a set-aside part of it,
whose size is a limit of the CUDA context (CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0 unless set):
with no set-aside the hint keeps nothing (on the H200 the kept projections of a looped block
then ran exactly as fast as unhinted ones: bench/results/l2-keep-cuda-noaside.json). Normal
and evict-first lines use the set-aside whenever evict-last lines do not fill it. The limit
belongs to this process's context and ends with it; no setting of the device changes.

The CUDA runtime's cudaDeviceSetLimit is not exposed by torch, so this calls the driver's
cuCtxSetLimit on the device's primary context (the one torch uses) through ctypes.
"""
from __future__ import annotations

import ctypes
import functools

import torch

_LIMIT_PERSISTING_L2 = 0x06  # CUlimit CU_LIMIT_PERSISTING_L2_CACHE_SIZE
_ATTR_MAX_PERSISTING_L2 = 108  # CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, call: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {name.value.decode() if name.value else rc}")


def _current(device: torch.device) -> int:
    """Make the device's primary context current on this thread; its index."""
    if device.type != "cuda":
        raise ValueError(f"the L2 set-aside needs a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    torch.cuda.synchronize(index)  # initialises the runtime: the primary context is now current
    return index


def max_set_aside(device: torch.device) -> int:
    """The largest L2 set-aside the device allows, in bytes (0: no persisting lines)."""
    index = _current(device)
    value = ctypes.c_int()
    _check(_driver().cuDeviceGetAttribute(ctypes.byref(value), _ATTR_MAX_PERSISTING_L2, index),
           "cuDeviceGetAttribute(MAX_PERSISTING_L2_CACHE_SIZE)")
    return value.value


def set_aside(device: torch.device, nbytes: int) -> int:
    """Set aside min(nbytes, max_set_aside) bytes of L2 for evict-last lines in this process's
    context; returns the size the driver granted (it rounds to its own granularity)."""
    if nbytes < 0:
        raise ValueError(f"set_aside: nbytes must be >= 0, got {nbytes}")
    nbytes = min(nbytes, max_set_aside(device))
    _current(device)
    _check(_driver().cuCtxSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(nbytes)),
           "cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE)")
    return set_aside_now(device)


def set_aside_now(device: torch.device) -> int:
    """The context's current L2 set-aside in bytes."""
    _current(device)
    value = ctypes.c_size_t()
    _check(_driver().cuCtxGetLimit(ctypes.byref(value), _LIMIT_PERSISTING_L2),
           "cuCtxGetLimit(PERSISTING_L2_CACHE_SIZE)")
    return value.value
