"""Input checks shared by the launchers: every failure is a ValueError naming the argument.

The launchers run on CUDA tensors; under ``TRITON_INTERPRET=1`` (the CPU test path) the
interpreter runs the same kernels on CPU tensors, so CPU is accepted only then.
"""
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(op: str, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and that device can run Triton here."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"{op}: tensors must share one device, got {devices}")
    if first.type != "cuda" and not (interpreting() and first.type == "cpu"):
        raise ValueError(f"{op}: tensors must be on CUDA (CPU only under TRITON_INTERPRET=1), "
                         f"got {first}")
    return first


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} dtype must be one of {allowed}, got {t.dtype}")


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{op}: {name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_rank(op: str, name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{op}: {name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
