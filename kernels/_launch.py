"""Launch options shared by the launchers.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start
while the previous kernel in the stream drains; it must call ``gdc_wait`` before it reads
anything that kernel writes. The decode step's GEMVs (kernels/gemv.py) load their first weight
chunk before the wait; the decode attention kernels (a split kernel, then the merge) let the
next kernel launch at once and read nothing before the wait, except rope_decode_attention's
kernels: its split kernel loads positions and its cos / sin rows first (and its programs
holding no slot of their lane exit there), its merge kernel the positions. On the H200 it took batch-1
decode at L = 8 from 0.539 to 0.510 ms (docs/performance.md).
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
