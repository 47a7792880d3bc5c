"""Helpers shared by the service tests (imported by name: tests/ is not a package)."""
from __future__ import annotations

import contextlib
import time

import ray

LANES = 2
MAX_SEQ_LEN = 2048
MAX_MESSAGE = 1 << 20


def start_service(model_path, prefix: str, n: int = 2, lanes: int = LANES, worker_kw: dict | None = None,
                  **gateway_kw):
    from tinyloop.gateway import workers
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    kw = dict(max_seq_len=MAX_SEQ_LEN, torch_threads=1, coalesce_s=0.005) | (worker_kw or {})
    actors = workers.spawn(n, workers.WorkerOptions(model_path=model_path, lanes=lanes, **kw), name_prefix=prefix)
    gw = GatewayThread(actors, GatewayOptions(port=0, max_message_bytes=MAX_MESSAGE, **gateway_kw))
    return actors, gw


@contextlib.contextmanager
def running_service(model_path, prefix: str, **kw):
    """start_service for the length of a with-block: (actors, gateway), both taken down after."""
    actors, gw = start_service(model_path, prefix, **kw)
    try:
        yield actors, gw
    finally:
        gw.stop(0.5)
        for a in actors:
            ray.kill(a, no_restart=True)


def worker_stats(actors) -> list[dict]:
    return ray.get([a.stats.remote() for a in actors])


def wait_idle(actors, timeout: float = 15.0, handles: bool = False) -> list[dict]:
    """Poll the worker-side counts until no lane (and, with handles, no handle) is in use."""
    deadline = time.monotonic() + timeout
    while True:
        stats = worker_stats(actors)
        idle = all(s["active_lanes"] == 0 and s["streams"] == 0 and s["queued"] == 0 and
                   (not handles or s["handles"] == 0) for s in stats)
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def wait_view(gateway, ready, what: str, timeout: float = 10.0) -> None:
    """Wait until ready(the gateway's workers) holds; fail with `what` and the gateway's view of
    each worker (in placement, its own in-flight count, the others' at the last poll)."""
    workers = gateway.gateway.servicer.workers
    deadline = time.monotonic() + timeout
    while not ready(workers):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: " + ", ".join(
                f"{w.label} healthy={w.healthy} inflight={w.inflight} others={w.others}" for w in workers))
        time.sleep(0.02)


def wait_placeable(gateway, timeout: float = 10.0) -> None:
    """Wait until the gateway sees every worker in placement with nothing on it (its own streams
    and handle builds ended, none of another gateway's at the last poll), so a placement test
    starts from equal workers."""
    wait_view(gateway, lambda workers: all(w.healthy and w.load_now() == 0 for w in workers),
              "the workers did not come to rest in the gateway's view", timeout)
