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


def check_slots(op: str, slots: torch.Tensor, rows: int, n_slots: int) -> None:
    """slots (rows,) int32 / int64: row b of the op reads (and writes) cache slot slots[b] of the
    cache's first dim, n_slots. Shape and dtype always; the values only where reading them costs
    no host sync (a CPU tensor: the references' engine, the interpreter), since a CUDA launch must
    stay capturable in a CUDA graph. There the caller owns the range."""
    check_shape(op, "slots", slots, (rows,))
    check_dtype(op, "slots", slots, (torch.int32, torch.int64))
    if slots.device.type == "cpu":
        check_slot_values(op, slots.tolist(), n_slots)


def check_slot_values(op: str, values: list, n_slots: int) -> None:
    """Every slot in [0, n_slots): a row must name a slot of the cache."""
    for b, s in enumerate(values):
        if not 0 <= s < n_slots:
            raise ValueError(f"{op}: slots[{b}] = {s} is outside [0, {n_slots}), the cache's "
                             f"first dim (one entry per cache slot)")


def cache_layout(slots) -> str:
    """A cache's layout, for check_rank's message: per row, or the whole layer with slots."""
    return "(B, Hkv, S, hd)" if slots is None else "(n_slots, Hkv, S, hd)"


def slots_arg(slots, stand_in: torch.Tensor) -> tuple:
    """(pointer, stride) of a kernel's slots argument: the tensor itself, or with slots None a
    stand-in pointer the kernel never reads (its SLOTS constexpr is off)."""
    return (stand_in, 0) if slots is None else (slots, slots.stride(0))


def by_slot(op: str, slots: torch.Tensor, rows: int, k_cache: torch.Tensor, row_fn):
    """A reference with slots: row_fn(b, s) is the slot-less reference of row b alone (b a
    one-row slice of the batch) on s = slots[b]'s one-row view of the caches, whose writes then
    land in the caller's cache; the rows' outputs concatenated in order. One host read of the
    slots (a reference may sync), checked as the launchers check them, values included."""
    check_shape(op, "slots", slots, (rows,))
    check_dtype(op, "slots", slots, (torch.int32, torch.int64))
    values = slots.tolist()
    check_slot_values(op, values, k_cache.shape[0])
    if not values:
        return row_fn(slice(0, 0), slice(0, 0))
    return torch.cat([row_fn(slice(b, b + 1), slice(s, s + 1)) for b, s in enumerate(values)])
