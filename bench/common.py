"""Shared benchmark plumbing: timing with device events, hardware facts, JSON out."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tinyloop.worker.model.settings import Settings

RESULTS = Path(__file__).parent / "results"


def hardware(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        import triton
        info["triton"] = triton.__version__
        # programmatic dependent launch as Settings.from_env() has it (kernels/_launch.py)
        info["TINYLOOP_PDL"] = "1" if Settings.from_env().pdl else "0"
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["cores"] = os.cpu_count()
        info["torch_threads"] = torch.get_num_threads()
    return info


def gemv_tuning(settings: Settings | None = None) -> dict:
    """kernels.gemv's tile arguments (tables, autotune) as a model built with `settings`
    (default: Settings.from_env(), which reads TINYLOOP_GEMV_TILES and TINYLOOP_AUTOTUNE) passes
    them: for benchmarks that launch the projection directly."""
    from tinyloop.kernels.gemv import load_tables
    s = Settings.from_env() if settings is None else settings
    return {"tables": load_tables(s.gemv_tiles) if s.gemv_tiles else None, "autotune": s.autotune}


def run_timed(fn, device: torch.device, repeat: int, warmup: int = 0):
    """(median seconds, last result) of fn(), synchronising the device around each call."""
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def warm_until_steady(fn, model, min_runs: int = 3, max_runs: int = 40) -> int:
    """Run fn() at least min_runs times and until a run captures no CUDA graph (at most
    max_runs): the runs timed after it replay what a worker that has served the workload a
    while replays, with no capture (10-15 ms each) inside them. -> the runs made."""
    runs = 0
    while runs < max_runs:
        before = model.graph_captures
        fn()
        runs += 1
        if runs >= min_runs and model.graph_captures == before:
            break
    return runs


def timed(fn, device: torch.device, warmup: int = 2, repeat: int = 5) -> float:
    """Median wall-clock milliseconds of fn()."""
    return run_timed(fn, device, repeat, warmup)[0] * 1e3


def provenance() -> dict:
    """The commit and UTC date a result is stamped with. TINYLOOP_COMMIT: the caller's commit,
    where the checkout has no .git or a stale copy of it (a GPU host)."""
    try:
        commit = os.environ.get("TINYLOOP_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        commit = None
    return {"commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def gpu_busy_ms(prof) -> float:
    """The GPU's busy time in a torch.profiler run, ms: the union of its kernels' and copies'
    intervals (overlapping ones, as PDL makes them, count once)."""
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def write(name: str, payload: dict, out_dir: str | None = None) -> Path:
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    payload = {"command": " ".join([Path(sys.executable).name, *sys.argv]), **provenance(), **payload}
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path
