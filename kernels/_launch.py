"""Launch options shared by the launchers.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start
while the previous kernel in the stream drains; it must call ``gdc_wait`` before it reads
anything that kernel writes. The decode step's GEMVs (kernels/gemv.py) load their first weight
chunk before the wait; the decode attention kernels (a split kernel, then the merge) let the
next kernel launch at once and read nothing before the wait, except rope_decode_attention's
kernels: its split kernel loads positions, its cos / sin rows and its lane's cache slot (with
`slots`) first (and its programs holding no slot of their lane exit there), its merge kernel the
positions. Batch-1 decode launches many short kernels back to back, so each one's launch and
ramp-up, hidden behind the previous kernel's tail, would otherwise be a visible part of the step.
"""
import functools
import os

import torch


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: on for Hopper and later unless TINYLOOP_PDL=0 (read once
    per process and device, not per launch)."""
    if device.type != "cuda":
        return False
    return _pdl_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _pdl_on(index: int) -> bool:
    return os.environ.get("TINYLOOP_PDL", "1") != "0" and torch.cuda.get_device_capability(index)[0] >= 9
