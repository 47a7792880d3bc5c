"""Worker loss: a killed actor's stream gets UNAVAILABLE, Ray restarts it with a new epoch,
its old handles answer HANDLE_LOST, and the other worker serves throughout."""
from __future__ import annotations

import logging
import time

import grpc
import pytest
import ray
from prometheus_client import REGISTRY

from tinyloop.client import TinyLoopClient, TinyLoopError

from service_helpers import running_service, wait_idle

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]
CAUSES = ("call_failed", "stream_failed", "poll_timeout", "poll_failed")


def times_left(worker: str) -> float:
    """The gateway's count of the times it took the worker out of placement, every cause."""
    return sum(REGISTRY.get_sample_value("tinyloop_worker_left_placement_total",
                                         {"worker": worker, "cause": c}) or 0.0 for c in CAUSES)


@pytest.fixture(scope="module")
def service(ray_cluster, model_path):
    with running_service(model_path, "w-fault") as service:
        yield service


def test_killed_worker_mid_stream(service, caplog):
    actors, gw = service
    caplog.set_level(logging.WARNING, logger="tinyloop.gateway")
    c = TinyLoopClient(gw.address, caller="alice")
    h = {}
    while len(h) < 2:
        built = c.build_resume_handle(PROMPT, l_used=2, max_loops=8)
        h.setdefault(built.worker_id, built)
    victim, survivor = h["worker-0"], h["worker-1"]

    stream = c.resume(victim.handle_id, 8, max_tokens=2000)
    it = iter(stream)
    assert next(it).ids
    # a stream on the other worker, in flight across the kill, is not disturbed by it
    bystander_stream = c.resume(survivor.handle_id, 8, max_tokens=2000)
    bystander = iter(bystander_stream)
    got = list(next(bystander).ids)
    assert got
    left_before = {w: times_left(w) for w in ("worker-0", "worker-1")}
    ray.kill(actors[0], no_restart=False)
    assert ray.get(actors[1].stats.remote())["streams"] >= 1, "the bystander stream ended before the kill"
    with pytest.raises(TinyLoopError) as e:
        list(it)
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.UNAVAILABLE, "WORKER_UNAVAILABLE")
    for chunk in bystander:
        got += chunk.ids
    assert len(got) == 2000, f"the stream on worker-1 ended after {len(got)} of 2000 tokens"
    assert bystander_stream.complete.worker_id == "worker-1"

    # The other worker keeps serving while worker-0 restarts: its handle and new work.
    ids, comp = c.resume(survivor.handle_id, 4, max_tokens=5).collect()
    assert len(ids) == 5 and comp.worker_id == "worker-1"
    for _ in range(3):
        ids, comp = c.generate(PROMPT, loops=3, max_tokens=4, timeout=30).collect()
        assert len(ids) == 4

    deadline = time.monotonic() + 90
    while True:
        try:
            c.resume(victim.handle_id, 4, max_tokens=2).collect()
            pytest.fail("a handle from before the restart must not resume")
        except TinyLoopError as err:
            if err.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "HANDLE_LOST"), err
            break
    assert c.free_handle(victim.handle_id) is False

    info = c.model_info()
    assert [w["epoch"] for w in info["workers"]] == [2, 1]
    while not all(w.healthy for w in gw.gateway.servicer.workers):
        time.sleep(0.1)
    # the loss and the return show in the metrics: worker-0 left placement once (by whichever of
    # the failed stream and the health poll saw it first) and is up again; worker-1 never left
    assert times_left("worker-0") - left_before["worker-0"] == 1
    assert times_left("worker-1") == left_before["worker-1"]
    assert [REGISTRY.get_sample_value("tinyloop_worker_up", {"worker": w}) for w in ("worker-0", "worker-1")] == [1, 1]
    # and the gateway's log says so, one line with the cause
    out = [r.getMessage() for r in caplog.records if "is out of placement" in r.getMessage()]
    assert len(out) == 1 and out[0].startswith("worker-0 is out of placement (") and "\n" not in out[0], out
    workers_seen = {c.generate(PROMPT, loops=2, max_tokens=30).collect()[1].worker_id for _ in range(4)}
    assert workers_seen == {"worker-0", "worker-1"}
    assert c.free_handle(survivor.handle_id) is True
    stats = wait_idle(actors, handles=True)
    assert all(s["handles"] == 0 and s["active_lanes"] == 0 for s in stats), stats
    c.close()
