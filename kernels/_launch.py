"""Launch options and device facts shared by the launchers.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start
while the previous kernel in the stream drains; it must call ``gdc_wait`` before it reads
anything that kernel writes. The decode step's GEMVs (kernels/gemv.py) load their first weight
chunk before the wait; the decode attention kernels (a split kernel, then the merge) let the
next kernel launch at once and read nothing before the wait, except rope_decode_attention's
kernels: its split kernel loads positions, its cos / sin rows and its lane's cache slot (with
`slots`) first (and its programs holding no slot of their lane exit there), its merge kernel the
positions. Batch-1 decode launches many short kernels back to back, so each one's launch and
ramp-up, hidden behind the previous kernel's tail, would otherwise be a visible part of the step.
Every launcher that can launch this way takes ``pdl=`` (`use_pdl`); the engine's ops pass
Settings.pdl (worker/model/settings.py, TINYLOOP_PDL) to each of them.
"""
import functools

import torch

from ._checks import interpreting


def use_pdl(device: torch.device, pdl: bool | None = None) -> bool:
    """Whether a launch on `device` uses programmatic dependent launch: `pdl` where the caller
    gives it (the engine's ops pass Settings.pdl: None while it is on, False when off); None:
    where the hardware allows it, a CUDA device of capability 9 or more, not under the
    interpreter. The launchers take it as an argument, so no launch reads the environment."""
    if pdl is not None:
        return bool(pdl)
    if device.type != "cuda" or interpreting():
        return False
    return _capable(device_index(device))


def device_index(device: torch.device) -> int:
    """A CUDA device's index (the current device's for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """A CUDA device's SM count (cached per device)."""
    return _sm_count(device_index(device))


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
