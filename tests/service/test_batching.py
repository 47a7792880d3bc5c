"""Continuous batching through the service: concurrent streams on one worker share decode
steps, and each still gets exactly the tokens it gets in process."""
from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
import ray

from tinyloop.client import TinyLoopClient, TinyLoopError

from service_helpers import start_service, wait_idle, worker_stats

pytestmark = pytest.mark.slow
LANES = 6


@pytest.fixture(scope="module")
def one_worker(ray_cluster, model_path):
    actors, gw = start_service(model_path, "w-batching", n=1, lanes=LANES)
    yield actors, gw
    gw.stop(0.5)
    for a in actors:
        ray.kill(a, no_restart=True)


def _collect(address, prompt, kw):
    with TinyLoopClient(address) as c:
        ids, complete = c.generate(prompt, **kw).collect()
        return ids, complete.finish_reason


def test_concurrent_streams_are_batched_and_equal_in_process(one_worker, local_model):
    actors, gw = one_worker
    before = worker_stats(actors)[0]
    jobs = [([5, 17, 99, 3, 42], dict(loops=2, max_tokens=40)),
            ([200, 1, 1, 5, 9, 31], dict(loops=8, max_tokens=33, temperature=0.9, top_k=30, seed=11)),
            ([9, 8, 7], dict(loops=5, max_tokens=25, repetition_penalty=1.2, temperature=0.7, seed=3)),
            ([5] * 10, dict(loops=3, max_tokens=40, stop_token_ids=[7, 8, 9])),
            ([77, 78], dict(loops=1, max_tokens=1)),
            ([1, 2, 3, 4], dict(loops=6, max_tokens=30, cache_window=4)),   # windowed: steps alone
            ([6, 6, 6], dict(loops=4, max_tokens=30, temperature=1.0, top_p=0.8, seed=5)),
            ([11, 12], dict(loops=7, max_tokens=20))]                        # waits for a lane
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _collect(gw.address, *j), jobs))
    for (prompt, kw), (ids, reason) in zip(jobs, got):
        want = local_model.generate(prompt, **kw)
        assert (ids, reason) == (want[len(prompt):], want.finish_reason), kw
    after = wait_idle(actors)[0]
    steps = after["batched_steps"] - before["batched_steps"]
    lane_steps = after["batched_lane_steps"] - before["batched_lane_steps"]
    assert steps > 0 and lane_steps / steps > 2, (steps, lane_steps)  # streams did share steps
    assert after["active_lanes"] == 0 and after["streams"] == 0


def test_cancel_mid_batch_frees_the_lane_and_the_others_go_on(one_worker, local_model):
    actors, gw = one_worker
    prompt, kw = [3, 1, 4, 1, 5], dict(loops=4, max_tokens=200)
    with TinyLoopClient(gw.address) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
        others = [pool.submit(_collect, gw.address, [9, i], kw) for i in range(2)]
        stream = c.generate(prompt, loops=8, max_tokens=1500)
        it = iter(stream)
        assert next(it).ids
        deadline = time.monotonic() + 5
        while worker_stats(actors)[0]["active_lanes"] < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        stream.cancel()
        with pytest.raises(TinyLoopError) as e:
            list(it)
        assert e.value.code == grpc.StatusCode.CANCELLED
        for i, f in enumerate(others):
            want = local_model.generate([9, i], **kw)
            assert f.result() == (want[2:], want.finish_reason)
    stats = wait_idle(actors)[0]
    assert stats["active_lanes"] == 0 and stats["streams"] == 0, stats
