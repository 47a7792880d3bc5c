"""Creating the worker actors: one per GPU (num_gpus=1), or CPU workers on CPU-only clusters.

`max_restarts` brings a dead worker back (with a new epoch: its handles are lost, and say
so); `max_task_retries` stays 0, because replaying a generation would duplicate tokens."""
from __future__ import annotations

import dataclasses

import ray

from tinyloop.worker.serving.actor import WorkerActor  # imports no torch at module level
from tinyloop.worker.serving.options import SchedulerOptions, WorkerOptions  # noqa: F401 (the spawner's options)

NAMESPACE = "tinyloop"


def cluster_gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def placement(n: int | None, gpus: int, device: str | None) -> tuple[int, bool]:
    """How many workers, and whether each takes a GPU (num_gpus=1), given the GPUs the cluster
    has now. `device="cuda"` always takes GPUs: on Kubernetes the gateway can start before the
    GPU worker pods have joined the Ray cluster, and Ray then holds each actor until a GPU is
    there, where counting the GPUs now would have made CPU workers. With no device given, GPUs
    are used when there is one for every worker."""
    if n is None:
        n = gpus or 1
    if device == "cuda":
        return n, True
    return n, device is None and gpus >= n


def spawn(n: int | None, opts: WorkerOptions, name_prefix: str = "tinyloop-worker",
          detached: bool = False) -> list:
    """Start n worker actors (default: one per GPU, else one CPU worker). Detached workers
    outlive the gateway that made them (get_if_exists: a restarted gateway re-attaches)."""
    n, use_gpu = placement(n, cluster_gpus(), opts.device)
    actor_cls = ray.remote(WorkerActor)
    actors = []
    for i in range(n):
        actors.append(actor_cls.options(
            name=f"{name_prefix}-{i}", namespace=NAMESPACE, lifetime="detached" if detached else None,
            get_if_exists=detached,
            num_gpus=1 if use_gpu else 0, num_cpus=opts.num_cpus,
            max_restarts=opts.max_restarts, max_task_retries=0, max_concurrency=1000,
        ).remote(i, dataclasses.replace(opts, device=opts.device or ("cuda" if use_gpu else "cpu"))))
    return actors


def attach(n: int, name_prefix: str = "tinyloop-worker", timeout_s: float = 300.0) -> list:
    """The n workers another gateway created (an extra gateway replica attaches by name)."""
    import time
    deadline = time.monotonic() + timeout_s
    actors = []
    for i in range(n):
        while True:
            try:
                actors.append(ray.get_actor(f"{name_prefix}-{i}", namespace=NAMESPACE))
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {name_prefix}-{i} not found in namespace {NAMESPACE}") from None
                time.sleep(1.0)
    return actors
