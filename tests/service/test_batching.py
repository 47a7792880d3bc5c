"""Continuous batching through the service: concurrent streams on one worker share decode
steps, and each still gets exactly the tokens it gets in process."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from tinyloop.client import TinyLoopClient, TinyLoopError
from tinyloop.worker.serving.actor import waits_for_first_tokens
from tinyloop.worker.serving.options import SchedulerOptions

from service_helpers import running_service, wait_idle, worker_stats

pytestmark = pytest.mark.slow
LANES = 6


@pytest.fixture(scope="module")
def one_worker(ray_cluster, model_path):
    with running_service(model_path, "w-batching", n=1, lanes=LANES) as service:
        yield service


def _collect(address, prompt, kw, together: threading.Barrier | None = None):
    """A stream's ids and finish reason; with `together`, its call starts once every caller of
    the barrier has its channel connected, so that the streams really arrive at once (a
    loaded host would otherwise spread their starts over the connections' set-up)."""
    with TinyLoopClient(address) as c:
        if together is not None:
            grpc.channel_ready_future(c.channel).result(timeout=30)
            together.wait(timeout=60)
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
            ([1, 2, 3, 4], dict(loops=6, max_tokens=30, cache_window=4)),   # windowed: the checked step
            ([6, 6, 6], dict(loops=4, max_tokens=30, temperature=1.0, top_p=0.8, seed=5)),
            ([11, 12], dict(loops=7, max_tokens=20))]                        # waits for a lane
    together = threading.Barrier(len(jobs))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _collect(gw.address, *j, together), jobs))
    for (prompt, kw), (ids, reason) in zip(jobs, got):
        want = local_model.generate(prompt, **kw)
        assert (ids, reason) == (want[len(prompt):], want.finish_reason), kw
    after = wait_idle(actors)[0]
    steps = after["batched_steps"] - before["batched_steps"]
    lane_steps = after["batched_lane_steps"] - before["batched_lane_steps"]
    assert steps > 0 and lane_steps / steps > 2, (steps, lane_steps)  # streams did share steps
    assert after["active_lanes"] == 0 and after["streams"] == 0


def test_speculative_streams_share_their_rounds_through_the_service(one_worker, local_model):
    """Chain speculative streams at once on an idle worker (greedy and sampled, other depths
    and draft counts) run their rounds together: each gets its in-process speculative tokens
    and finish reason over real gRPC, and the worker counts the shared rounds."""
    actors, gw = one_worker
    before = worker_stats(actors)[0]["steps"]["speculative_rows"]
    jobs = [([3, 1, 4, 1, 5], dict(max_tokens=24, speculative=dict(draft_loops=2, verify_loops=5))),
            ([2, 7, 1, 8], dict(max_tokens=20, temperature=0.9, seed=4,
                                speculative=dict(draft_loops=1, verify_loops=4, draft_ahead=3))),
            ([9, 9, 8], dict(max_tokens=22, temperature=0.7, seed=9,
                             speculative=dict(draft_loops=2, verify_loops=5, draft_ahead=2)))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _collect(gw.address, *j), jobs))
    for (prompt, kw), (ids, reason) in zip(jobs, got):
        local = dict(kw)
        want = local_model.generate_speculative(prompt, **local.pop("speculative"), **local)
        assert (ids, reason) == (want[len(prompt):], want.finish_reason), kw
    after = wait_idle(actors)[0]
    assert after["steps"]["speculative_rows"] - before >= 2  # rounds of two streams or more, together
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


@pytest.fixture(scope="module")
def chunking_worker(ray_cluster, model_path):
    """Prompts prefilled 8 tokens a step: every prompt longer than that is chunked. Its step
    thread waits for each stream's first tokens to leave before the next decode step
    (first_token_wait_s), so the streams below run that path too."""
    with running_service(model_path, "w-chunking", n=1, lanes=LANES,
                         worker_kw={"scheduler": SchedulerOptions(step_tokens=8), "first_token_wait_s": 0.002}) as service:
        yield service


def test_every_kind_of_stream_together_equals_its_standalone_run(chunking_worker, local_model):
    """Plain, mixed depths, sampled, L scheduling, the safety check (one stopped by it), a
    sliding window, self-speculative decoding (greedy, and two sampled chains that share their
    rounds), a resume and a long chunked prompt, all at once on one worker: each gets its
    in-process tokens and finish reason, over real gRPC."""
    actors, gw = chunking_worker
    long_prompt = [(7 * i + 3) % 256 for i in range(70)]
    jobs = [("plain", [5, 17, 99, 3, 42], dict(loops=2, max_tokens=30)),
            ("deep", [200, 1, 1, 5, 9, 31], dict(loops=8, max_tokens=20)),
            ("sampled", [9, 8, 7], dict(loops=5, max_tokens=25, temperature=0.8, top_k=30, seed=3)),
            ("warmup", [6, 6, 6, 1], dict(loops=6, max_tokens=20, l_warmup_tokens=5, l_warmup_loops=2)),
            ("safety", [1, 2, 3, 4], dict(loops=3, max_tokens=20, safety_check=True, safety_norm_threshold=1e9)),
            ("stopped", [1, 2, 3, 4], dict(loops=3, max_tokens=20, safety_check=True, safety_norm_threshold=1e-3)),
            ("window", [4] * 12, dict(loops=3, max_tokens=25, cache_window=5)),
            ("long", long_prompt, dict(loops=4, max_tokens=15)),
            ("speculative", [3, 1, 4, 1, 5], dict(max_tokens=18, speculative=dict(draft_loops=2, verify_loops=5))),
            # sampled chains always speculate: two of them share their rounds
            ("spec-sampled", [2, 7, 1, 8], dict(max_tokens=16, temperature=0.9, seed=4,
                                                speculative=dict(draft_loops=1, verify_loops=4, draft_ahead=3))),
            ("spec-sampled-2", [2, 7, 1, 8, 2], dict(max_tokens=14, temperature=0.7, seed=9,
                                                     speculative=dict(draft_loops=2, verify_loops=5, draft_ahead=2)))]

    def run(job):
        name, prompt, kw = job
        with TinyLoopClient(gw.address) as c:
            if name == "resume":
                h = c.build_resume_handle(prompt, l_used=2, max_loops=6)
                try:
                    ids, complete = c.resume(h.handle_id, 5, max_tokens=kw["max_tokens"]).collect()
                finally:
                    c.free_handle(h.handle_id)
            else:
                ids, complete = c.generate(prompt, timeout=120, **kw).collect()
        return ids, complete.finish_reason

    jobs.append(("resume", [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], dict(max_tokens=16)))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = dict(zip([j[0] for j in jobs], pool.map(run, jobs)))
    for name, prompt, kw in jobs:
        local = dict(kw)
        if name == "warmup":
            local["l_warmup_L"] = local.pop("l_warmup_loops")
        if name == "speculative":
            want = local_model.generate(prompt, loops=5, max_tokens=kw["max_tokens"])
        elif name.startswith("spec-sampled"):
            spec = local.pop("speculative")
            want = local_model.generate_speculative(prompt, **local, **spec)
        elif name == "resume":
            want = local_model.generate(prompt, loops=5, max_tokens=kw["max_tokens"])
        else:
            want = local_model.generate(prompt, **local)
        assert got[name] == (want[len(prompt):], want.finish_reason), name
    assert got["stopped"][1] == "safety"  # FINISH_REASON_SAFETY over the wire
    stats = wait_idle(actors, handles=True)[0]
    assert (stats["active_lanes"], stats["handles"], stats["streams"]) == (0, 0, 0)
    assert stats["steps"]["prefill_counts"][-1] == 0 and max(  # no step prefilled more than its budget
        b for b, n in zip(stats["steps"]["prefill_bounds"], stats["steps"]["prefill_counts"]) if n) <= 16


def test_warmup_and_safety_arguments_are_checked_on_the_wire(chunking_worker):
    _, gw = chunking_worker
    with TinyLoopClient(gw.address) as c:
        for kw, word in ((dict(l_warmup_tokens=3), "l_warmup_loops is required"),
                         (dict(l_warmup_tokens=3, l_warmup_loops=6, loops=2), "l_warmup_L=6 must be <= loops=2"),
                         (dict(safety_check=True, safety_norm_threshold=-1.0), "safety_norm_threshold must be > 0")):
            with pytest.raises(TinyLoopError) as e:
                c.generate([1, 2, 3], max_tokens=4, **kw).collect()
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and word in e.value.message, e.value


def test_the_step_thread_waits_for_first_tokens_of_a_lone_stream_or_a_burst_only():
    """The wait holds back the decode step of every running stream, so it is made for a lone
    stream or a burst of arrivals (a quarter of the running streams or more), never for one
    arrival among many, and never when it is off."""
    assert waits_for_first_tokens(1, 1, 0.002)
    assert waits_for_first_tokens(64, 64, 0.002)
    assert waits_for_first_tokens(2, 8, 0.002)
    assert not waits_for_first_tokens(1, 8, 0.002)
    assert not waits_for_first_tokens(1, 64, 0.002)
    assert not waits_for_first_tokens(1, 1, 0.0)
    assert not waits_for_first_tokens(0, 1, 0.002)
