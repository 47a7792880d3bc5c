"""End to end through real gRPC and a real local Ray cluster with two worker actors."""
from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time

import grpc
import pytest
import ray

from tinyloop.client import AsyncTinyLoopClient, TinyLoopClient, TinyLoopError
from tinyloop.gateway import handles

from service_helpers import MAX_MESSAGE, wait_idle, wait_placeable, worker_stats

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]


def expect(code, reason, fn, *args, **kwargs):
    with pytest.raises(TinyLoopError) as e:
        out = fn(*args, **kwargs)
        if hasattr(out, "collect"):
            out.collect()
    assert (e.value.code, e.value.reason) == (code, reason), e.value
    return e.value


def test_generate_token_ids_streams_chunks_then_one_complete(client, local_model):
    stream = client.generate(PROMPT, loops=4, max_tokens=24, request_id="req-1")
    chunks = list(stream)
    assert chunks and all(c.ids for c in chunks)
    assert len(chunks[0].ids) == 1, "the first token is sent on its own"
    ids = [t for c in chunks for t in c.ids]
    assert ids == local_model.generate(PROMPT, loops=4, max_tokens=24)[len(PROMPT):]
    c = stream.complete
    assert c.request_id == "req-1" and stream.request_id == "req-1"
    assert c.finish_reason == "length" and c.worker_id.startswith("worker-")
    assert c.usage["prompt_tokens"] == len(PROMPT) and c.usage["completion_tokens"] == 24
    assert c.usage["loop_iterations"] > 0 and c.handle_id == ""


def test_generate_text_in_incremental_text_out(client, local_model):
    tok = local_model.tokenizer
    prompt = "hello loops"
    stream = client.generate(prompt, loops=3, max_tokens=16, include_text=True)
    chunks = list(stream)
    ids = [t for c in chunks for t in c.ids]
    assert ids == local_model.generate(tok.encode(prompt), loops=3, max_tokens=16)[len(tok.encode(prompt)):]
    assert "".join(c.text for c in chunks) == tok.decode(ids)


def test_seeded_sampling_matches_in_process(client, local_model):
    ids, _ = client.generate(PROMPT, loops=3, max_tokens=12, temperature=0.9, top_k=20, seed=7).collect()
    assert ids == local_model.generate(PROMPT, loops=3, max_tokens=12, temperature=0.9, top_k=20, seed=7)[len(PROMPT):]


@pytest.mark.parametrize("l_used,new_L", [(2, 5), (4, 4), (1, 8)])
def test_resume_equals_in_process_generate(client, local_model, l_used, new_L):
    h = client.build_resume_handle(PROMPT, l_used=l_used, max_loops=8)
    assert (h.seq_len, h.loops_used, h.max_loops) == (len(PROMPT), l_used, 8) and h.nbytes > 0
    ids, complete = client.resume(h.handle_id, new_L, max_tokens=20).collect()
    assert ids == local_model.generate(PROMPT, loops=new_L, max_tokens=20)[len(PROMPT):]
    assert complete.worker_id == h.worker_id
    again, _ = client.resume(h.handle_id, new_L, max_tokens=20, temperature=0.8, seed=3).collect()
    assert again == local_model.generate(PROMPT, loops=new_L, max_tokens=20, temperature=0.8, seed=3)[len(PROMPT):]
    assert client.free_handle(h.handle_id) is True
    assert client.free_handle(h.handle_id) is False  # idempotent


def test_generate_can_return_a_handle(client, local_model):
    ids, c = client.generate(PROMPT, loops=3, max_tokens=6, return_handle=True, handle_max_loops=6).collect()
    assert c.handle_id and handles.decode(c.handle_id).worker == int(c.worker_id.split("-")[1])
    deeper, c2 = client.resume(c.handle_id, 6, max_tokens=8).collect()
    assert deeper == local_model.generate(PROMPT, loops=6, max_tokens=8)[len(PROMPT):]
    assert c2.worker_id == c.worker_id
    client.free_handle(c.handle_id)


def test_two_workers_handles_stay_new_work_spreads(client, actors, gateway):
    wait_placeable(gateway)
    built = []
    try:
        for _ in range(6):
            built.append(client.build_resume_handle(PROMPT, l_used=2, max_loops=6))
        assert {h.worker_id for h in built} == {"worker-0", "worker-1"}
        for h in built:
            assert handles.decode(h.handle_id).worker == int(h.worker_id.split("-")[1])
            _, c = client.resume(h.handle_id, 4, max_tokens=3).collect()
            assert c.worker_id == h.worker_id
        per_worker = [s["handles"] for s in worker_stats(actors)]
        assert per_worker == [sum(h.worker_id == f"worker-{i}" for h in built) for i in range(2)]
    finally:  # a failure here leaves no handle behind for the tests after it
        for h in built:
            client.free_handle(h.handle_id)
    # Concurrent streams go to the least-loaded worker: both take part.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda _: client.generate(PROMPT, loops=4, max_tokens=40).collect()[1].worker_id,
                             range(4)))
    assert set(done) == {"worker-0", "worker-1"}
    assert all(s["handles"] == 0 for s in wait_idle(actors))


def test_new_work_goes_to_the_less_loaded_worker(client, actors, gateway):
    """Placement is by load, not by turn: while one worker runs long streams, every new
    request goes to the other (a rotation would alternate). Two streams, because the idle
    worker's polled count may still hold a request that just finished (up to a poll interval
    old): one stream could tie with it, two cannot."""
    wait_placeable(gateway)
    h = client.build_resume_handle(PROMPT, l_used=2, max_loops=8)
    busy = h.worker_id
    streams = [client.resume(h.handle_id, 8, max_tokens=2000) for _ in range(2)]  # on the handle's worker
    its = [iter(s) for s in streams]
    assert all(next(it).ids for it in its)
    seen = [client.generate(PROMPT, loops=2, max_tokens=3).collect()[1].worker_id for _ in range(4)]
    still = worker_stats(actors)[int(busy.split("-")[1])]["streams"]
    for stream, it in zip(streams, its):
        stream.cancel()
        with pytest.raises(TinyLoopError):
            list(it)
    assert still >= 2, "the long streams ended before the new requests were placed"
    assert busy not in seen, f"new requests went to {seen} while {busy} ran two streams"
    assert client.free_handle(h.handle_id) is True
    assert all(s["handles"] == 0 for s in wait_idle(actors, handles=True))


def _running_stream(client, actors, **kw):
    stream = client.generate(PROMPT, loops=8, max_tokens=2000, **kw)
    it = iter(stream)
    first = next(it)
    assert first.ids
    assert sum(s["active_lanes"] for s in worker_stats(actors)) >= 1
    return stream, it


def test_cancel_mid_stream_frees_the_lane(client, actors):
    stream, it = _running_stream(client, actors)
    t0 = time.monotonic()
    stream.cancel()
    with pytest.raises(TinyLoopError) as e:
        list(it)
    assert e.value.code == grpc.StatusCode.CANCELLED
    stats = wait_idle(actors)
    freed_after = time.monotonic() - t0
    assert all(s["active_lanes"] == 0 and s["streams"] == 0 for s in stats), stats
    assert freed_after < 2.0
    ids, _ = client.generate(PROMPT, loops=2, max_tokens=3).collect()
    assert len(ids) == 3


def test_deadline_is_honoured_and_frees_the_lane(client, actors):
    t0 = time.monotonic()
    expect(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
           lambda: client.generate(PROMPT, loops=8, max_tokens=2000, timeout=0.4).collect())
    assert time.monotonic() - t0 < 2.0
    stats = wait_idle(actors)
    assert all(s["active_lanes"] == 0 for s in stats), stats


def _foreign_handle(gateway, client):
    h = client.build_resume_handle(PROMPT, l_used=2, max_loops=4)
    with TinyLoopClient(gateway.address, caller="mallory") as other:
        expect(grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER", other.resume, h.handle_id, 3)
        expect(grpc.StatusCode.PERMISSION_DENIED, "NOT_OWNER", other.free_handle, h.handle_id)
    ids, _ = client.resume(h.handle_id, 3, max_tokens=2).collect()  # the owner still can
    client.free_handle(h.handle_id)


def _freed_handle(client):
    h = client.build_resume_handle(PROMPT, l_used=2, max_loops=4)
    client.free_handle(h.handle_id)
    expect(grpc.StatusCode.NOT_FOUND, "HANDLE_NOT_FOUND", client.resume, h.handle_id, 3)


def _expired_handle(client, actors):
    ray.get([a.configure.remote(handle_ttl_s=0.2) for a in actors])
    try:
        h = client.build_resume_handle(PROMPT, l_used=2, max_loops=4)
        time.sleep(0.5)
        expect(grpc.StatusCode.NOT_FOUND, "HANDLE_EXPIRED", client.resume, h.handle_id, 3)
        assert client.free_handle(h.handle_id) is False
    finally:
        ray.get([a.configure.remote(handle_ttl_s=600.0) for a in actors])


def _evicted_handle(client, actors):
    first = client.build_resume_handle(PROMPT, l_used=2, max_loops=4)
    ray.get([a.configure.remote(handle_budget_bytes=first.nbytes + 1) for a in actors])
    try:
        second = [client.build_resume_handle(PROMPT, l_used=2, max_loops=4) for _ in range(2)]
        expect(grpc.StatusCode.NOT_FOUND, "HANDLE_EVICTED", client.resume, first.handle_id, 3)
        big = [9] * 200
        expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "HANDLE_BUDGET_EXHAUSTED",
               client.build_resume_handle, big, l_used=2, max_loops=8)
        for h in second:
            client.free_handle(h.handle_id)
    finally:
        ray.get([a.configure.remote(handle_budget_bytes=1 << 30) for a in actors])


def _busy_handle(client):
    h = client.build_resume_handle(PROMPT, l_used=2, max_loops=8)
    stream = client.resume(h.handle_id, 8, max_tokens=1500)
    it = iter(stream)
    next(it)
    expect(grpc.StatusCode.FAILED_PRECONDITION, "HANDLE_BUSY", client.free_handle, h.handle_id)
    stream.cancel()
    with pytest.raises(TinyLoopError):
        list(it)
    deadline = time.monotonic() + 15  # a loaded host can take seconds to stop the stream
    while True:
        try:
            assert client.free_handle(h.handle_id) is True
            break
        except TinyLoopError as e:
            assert e.reason == "HANDLE_BUSY" and time.monotonic() < deadline
            time.sleep(0.02)


def _unknown_handle(client, actors):
    epoch = worker_stats(actors)[0]["epoch"]
    expect(grpc.StatusCode.NOT_FOUND, "HANDLE_NOT_FOUND", client.resume, handles.encode(0, epoch, b"\1" * 16), 3)
    expect(grpc.StatusCode.NOT_FOUND, "HANDLE_NOT_FOUND", client.resume, handles.encode(9, epoch, b"\1" * 16), 3)
    assert client.free_handle(handles.encode(1, epoch, b"\2" * 16)) is False


INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_INPUTS = {
    "empty prompt ids": lambda c: c.generate([], max_tokens=3),
    "empty prompt text": lambda c: c.generate("", max_tokens=3),
    "id outside vocab": lambda c: c.generate([1, 256], max_tokens=3),
    "loops 0": lambda c: c.generate(PROMPT, loops=0, max_tokens=3),
    "loops above max": lambda c: c.generate(PROMPT, loops=10_000, max_tokens=3),
    "max_tokens 0": lambda c: c.generate(PROMPT, max_tokens=0),
    "negative temperature": lambda c: c.generate(PROMPT, temperature=-1.0, max_tokens=3),
    "top_p 0": lambda c: c.generate(PROMPT, top_p=0.0, max_tokens=3),
    "stop id outside vocab": lambda c: c.generate(PROMPT, stop_token_ids=[999], max_tokens=3),
    "too long for max_seq_len": lambda c: c.generate([1] * 2000, max_tokens=100),
    "build l_used > max_loops": lambda c: c.build_resume_handle(PROMPT, l_used=6, max_loops=4),
    "build empty prompt": lambda c: c.build_resume_handle([], l_used=2, max_loops=4),
    "uncertainty lo > hi": lambda c: c.score_uncertainty(PROMPT, 5, 2),
    "trajectory loops 0": lambda c: c.score_trajectory(PROMPT, 0),
}
REASONS = {"too long for max_seq_len": "TOO_LONG"}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_invalid_argument(client, case):
    e = expect(INVALID, REASONS.get(case, "INVALID_ARGUMENT"), BAD_INPUTS[case], client)
    assert e.message


def test_bad_handles_and_messages_get_their_status_and_the_server_keeps_serving(client, gateway, actors):
    expect(INVALID, "MALFORMED_HANDLE", client.resume, "not-a-handle", 3)
    expect(INVALID, "MALFORMED_HANDLE", client.free_handle, "A" * 31)
    h = client.build_resume_handle(PROMPT, l_used=4, max_loops=6)
    e = expect(INVALID, "INVALID_ARGUMENT", client.resume, h.handle_id, 2)   # new_L < loops_used
    assert "new_L" in e.message
    expect(INVALID, "INVALID_ARGUMENT", client.resume, h.handle_id, 7)       # new_L > handle's max_loops
    client.free_handle(h.handle_id)
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED", client.generate,
           [200] * (MAX_MESSAGE // 2 + 10), max_tokens=1)                     # oversized message
    _unknown_handle(client, actors)
    _foreign_handle(gateway, client)
    _freed_handle(client)
    _expired_handle(client, actors)
    _evicted_handle(client, actors)
    _busy_handle(client)
    ids, c = client.generate(PROMPT, loops=2, max_tokens=4).collect()
    assert len(ids) == 4 and c.finish_reason == "length"
    assert all(s["active_lanes"] == 0 and s["handles"] == 0 for s in wait_idle(actors, handles=True))


def test_scoring_and_info(client, local_model):
    s = client.score_consistency(PROMPT, 2, 6, max_tokens=8)
    ref = local_model.score_with_consistency(PROMPT, 2, 6, max_tokens=8)
    assert (s["agree"], s["answer_a"], s["answer_b"], s["first_divergence"]) == (
        ref["agree"], list(ref["answer_a"]), list(ref["answer_b"]), ref["first_divergence"])
    u = client.score_uncertainty(PROMPT, 2, 6)
    logits, kl = local_model.score_with_uncertainty(PROMPT, 2, 6)
    assert u["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    assert u["logits"].shape == logits.shape and abs(u["logits"] - logits).max() < 1e-4
    t = client.score_trajectory(PROMPT, 3)
    ref_t = local_model.score_trajectory(PROMPT, 3)
    assert t["labels"] == ref_t["labels"] and abs(t["hidden"] - ref_t["hidden"]).max() < 1e-4
    info = client.model_info()
    assert info["vocab_size"] == local_model.config.vocab_size
    assert info["max_loops"] == local_model.config.max_loops
    assert info["weight_format"] == "float32"
    assert [w["worker_id"] for w in info["workers"]] == ["worker-0", "worker-1"]
    assert all(w["alive"] for w in info["workers"])


@pytest.mark.parametrize("k_branches", [1, 2])
def test_speculative_through_the_service(client, local_model, k_branches):
    spec = {"draft_loops": 2, "verify_loops": 6, "draft_ahead": 3, "k_branches": k_branches}
    stream = client.generate(PROMPT, max_tokens=12, speculative=spec)
    ids, complete = stream.collect()
    assert ids == local_model.generate(PROMPT, loops=6, max_tokens=12)[len(PROMPT):]   # greedy: exact
    assert complete.usage["completion_tokens"] == 12
    assert complete.usage["accepted_per_verify"] > 0 and 0 <= complete.usage["acceptance_rate"] <= 1
    expect(INVALID, "INVALID_ARGUMENT", client.generate(PROMPT, max_tokens=4, speculative={
        "draft_loops": 6, "verify_loops": 2}).collect)


def test_health_and_reflection(gateway):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with grpc.insecure_channel(gateway.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="tinyloop.v1.TinyLoop"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        out = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in out.list_services_response.service}
        assert {"tinyloop.v1.TinyLoop", "grpc.health.v1.Health"} <= names


def test_bearer_auth(ray_cluster, actors):
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    gw = GatewayThread(actors, GatewayOptions(port=0, auth_tokens={"s3cret": "alice"}))
    try:
        with TinyLoopClient(gw.address) as anon:
            expect(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", anon.model_info)
        with TinyLoopClient(gw.address, token="wrong") as bad:
            expect(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", bad.model_info)
        with TinyLoopClient(gw.address, caller="bob", token="s3cret") as liar:
            expect(grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED", liar.model_info)
        with TinyLoopClient(gw.address, token="s3cret") as ok:
            assert len(ok.generate(PROMPT, loops=2, max_tokens=2).collect()[0]) == 2
    finally:
        gw.stop(0.5)


def test_the_client_retries_a_call_refused_unavailable_and_never_a_started_stream(gateway):
    """The clients' retry policy (client.channel_options): a call answered UNAVAILABLE before any
    response (a draining gateway) is tried max_attempts times in all, and succeeds once the
    gateway takes calls again; a stream cut after its first chunk is committed, never replayed."""
    from tinyloop.gateway import metrics
    servicer = gateway.gateway.servicer

    def count(method):
        return metrics.REQUESTS.labels(method)._value.get()
    servicer.draining = True
    try:
        for attempts in (1, 3):
            with TinyLoopClient(gateway.address, max_attempts=attempts) as c:
                before = count("ModelInfo")
                expect(grpc.StatusCode.UNAVAILABLE, "DRAINING", c.model_info)
                assert count("ModelInfo") - before == attempts
        with TinyLoopClient(gateway.address, max_attempts=5) as c:
            before = count("ModelInfo")
            reopen = threading.Timer(0.05, setattr, (servicer, "draining", False))
            reopen.start()
            assert c.model_info(timeout=30)["vocab_size"] > 0
            assert count("ModelInfo") - before >= 2  # refused at least once, then served
    finally:
        servicer.draining = False
    with pytest.raises(ValueError, match="max_attempts must be in"):
        TinyLoopClient(gateway.address, max_attempts=6)


def test_graceful_shutdown_drains(ray_cluster, actors):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    gw = GatewayThread(actors, GatewayOptions(port=0))
    c = TinyLoopClient(gw.address)
    stream = c.generate(PROMPT, loops=4, max_tokens=300)
    it = iter(stream)
    got = list(next(it).ids)
    stopper = threading.Thread(target=gw.stop, args=(10.0,))
    stopper.start()
    while not gw.gateway.servicer.draining:
        time.sleep(0.005)
    with grpc.insecure_channel(gw.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="")).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    expect(grpc.StatusCode.UNAVAILABLE, "DRAINING", c.model_info)
    got += [t for chunk in it for t in chunk.ids]   # the in-flight stream finishes
    assert len(got) == 300 and stream.complete.finish_reason == "length"
    stopper.join(15)
    c.close()


def test_async_client(gateway, local_model):
    async def main():
        async with AsyncTinyLoopClient(gateway.address, caller="carol") as c:
            streams = [c.generate(PROMPT, loops=L, max_tokens=10) for L in (2, 3, 4)]
            results = await asyncio.gather(*(s.collect() for s in streams))
            h = await c.build_resume_handle(PROMPT, l_used=2, max_loops=6)
            resumed, _ = await c.resume(h.handle_id, 5, max_tokens=10).collect()
            assert await c.free_handle(h.handle_id)
            info = await c.model_info()
            return results, resumed, info
    results, resumed, info = asyncio.run(main())
    for (ids, c), L in zip(results, (2, 3, 4)):
        assert ids == local_model.generate(PROMPT, loops=L, max_tokens=10)[len(PROMPT):]
        assert c.finish_reason == "length"
    assert resumed == local_model.generate(PROMPT, loops=5, max_tokens=10)[len(PROMPT):]
    assert info["vocab_size"] == 256


def test_200_mixed_requests_leave_nothing_behind(gateway, actors):
    rng = random.Random(0)
    errors: list[Exception] = []

    def one(i: int) -> None:
        r = random.Random(i)
        with TinyLoopClient(gateway.address, caller=f"user-{i % 5}") as c:
            kind = r.choice(["generate", "build-resume-free", "build-free", "cancel", "resume-cancel", "bad"])
            prompt = [r.randrange(256) for _ in range(r.randint(1, 12))]
            if kind == "generate":
                ids, comp = c.generate(prompt, loops=r.randint(1, 6), max_tokens=r.randint(1, 12)).collect()
                assert comp.usage["completion_tokens"] == len(ids)
            elif kind == "build-free":
                h = c.build_resume_handle(prompt, l_used=r.randint(0, 3), max_loops=6)
                assert c.free_handle(h.handle_id)
            elif kind == "build-resume-free":
                h = c.build_resume_handle(prompt, l_used=2, max_loops=6)
                c.resume(h.handle_id, r.randint(2, 6), max_tokens=r.randint(1, 8)).collect()
                assert c.free_handle(h.handle_id)
            elif kind == "cancel":
                s = c.generate(prompt, loops=4, max_tokens=500)
                it = iter(s)
                next(it)
                s.cancel()
                with pytest.raises(TinyLoopError):
                    list(it)
            elif kind == "resume-cancel":
                h = c.build_resume_handle(prompt, l_used=1, max_loops=6)
                try:
                    c.resume(h.handle_id, 6, max_tokens=500, timeout=r.uniform(0.01, 0.2)).collect()
                except TinyLoopError as e:
                    assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED
                deadline = time.monotonic() + 15
                while True:   # the resume may still be stopping: HANDLE_BUSY until it has
                    try:
                        c.free_handle(h.handle_id)
                        break
                    except TinyLoopError as e:
                        assert e.reason == "HANDLE_BUSY" and time.monotonic() < deadline
                        time.sleep(0.01)
            else:
                with pytest.raises(TinyLoopError):
                    c.generate(prompt, loops=0, max_tokens=3).collect()

    def guarded(i):
        try:
            one(i)
        except Exception as e:  # collected so one failure does not hide the rest
            errors.append(e)

    order = list(range(200))
    rng.shuffle(order)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(guarded, order))
    assert not errors, errors[:3]
    stats = wait_idle(actors, handles=True)
    assert all(s["active_lanes"] == 0 and s["streams"] == 0 and s["queued"] == 0 and s["handles"] == 0
               and s["handle_bytes"] == 0 for s in stats), stats
    assert gateway.gateway.servicer.inflight == 0


def test_cli_wire_commands(gateway):
    import json
    import subprocess
    import sys
    run = lambda *a: subprocess.run([sys.executable, "-m", "tinyloop.cli", *a], capture_output=True, text=True,
                                    timeout=120)
    info = run("info", "--server", gateway.address)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["vocab_size"] == 256
    gen = run("generate", "--server", gateway.address, "--prompt", "hi", "--loops", "2", "--max-tokens", "5")
    assert gen.returncode == 0 and "finish: length, 5 tokens" in gen.stderr, gen.stderr
    res = run("resume", "--server", gateway.address, "--prompt", "hi", "--l-used", "2", "--new-L", "3", "4",
              "--max-tokens", "4")
    assert res.returncode == 0 and res.stderr.count("finish: length, 4 tokens") == 2, res.stderr
    bad = run("generate", "--server", gateway.address, "--prompt", "hi", "--loops", "0")
    assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr


def test_prometheus_metrics_are_served_and_count(client):
    """The gateway's metrics over a real HTTP scrape, as `tinyloop serve --metrics-port` serves them."""
    import re
    import socket
    import urllib.request

    from prometheus_client import start_http_server

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    def value(text: str, name: str, labels: str) -> float:
        m = re.search(rf"^{name}\{{{labels}\}} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    wt = "tinyloop_worker_time_to_first_token_seconds"

    def worker_streams(before: str, after: str) -> float:
        return sum(value(after, f"{wt}_count", f'worker="{w}"') - value(before, f"{wt}_count", f'worker="{w}"')
                   for w in ("worker-0", "worker-1"))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1")
    try:
        before = scrape()
        ids, _ = client.generate(PROMPT, loops=2, max_tokens=7).collect()
        expect(INVALID, "INVALID_ARGUMENT", client.generate([], max_tokens=4).collect)
        # a health probe (every second) brings the workers' step histograms: wait for the one
        # that brings this stream's worker-side first token (a loaded host can delay it)
        deadline = time.monotonic() + 15
        while True:
            after = scrape()
            if worker_streams(before, after) >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        server.shutdown()
        thread.join()
    assert value(after, "tinyloop_requests_total", 'method="Generate"') - value(before, "tinyloop_requests_total", 'method="Generate"') == 2
    tokens = sum(value(after, "tinyloop_generated_tokens_total", f'worker="{w}"') - value(before, "tinyloop_generated_tokens_total", f'worker="{w}"')
                 for w in re.findall(r'tinyloop_generated_tokens_total\{worker="([^"]+)"\}', after))
    assert tokens == len(ids) == 7
    assert value(after, "tinyloop_errors_total", 'method="Generate",reason="INVALID_ARGUMENT"') >= 1
    assert "tinyloop_time_to_first_token_seconds_count" in after
    tpot = "tinyloop_time_per_output_token_seconds_count"
    assert re.search(rf"^{tpot} ([0-9.e+]+)$", after, re.M), after
    assert value(after, "tinyloop_requests_by_depth_total", 'loops="2",method="Generate"') - value(
        before, "tinyloop_requests_by_depth_total", 'loops="2",method="Generate"') == 1
    # the workers' own gauges and step histograms, from the gateway's probes
    for name in ("tinyloop_worker_queued_requests", "tinyloop_worker_running_lanes"):
        assert re.search(rf'^{name}\{{worker="worker-0"\}} 0.0$', after, re.M), name
    assert re.search(r'^tinyloop_worker_up\{worker="worker-0"\} 1.0$', after, re.M), after
    rows = re.findall(r'^tinyloop_worker_batch_rows_count\{worker="[^"]+"\} ([0-9.e+]+)$', after, re.M)
    prefill = re.findall(r'^tinyloop_worker_prefill_tokens_per_step_sum\{worker="[^"]+"\} ([0-9.e+]+)$',
                         after, re.M)
    assert rows and prefill and sum(map(float, prefill)) >= len(PROMPT), after
    for name in ("tinyloop_worker_prompts_prefilled_together_total", "tinyloop_worker_speculative_batched_total",
                 "tinyloop_worker_speculative_handed_to_batch_total", "tinyloop_worker_speculative_rounds_shared_total"):
        assert re.search(rf'^{name}\{{worker="worker-0"\}} [0-9.e+]+$', after, re.M), name
    # the worker-side time to first tokens: the stream above counted (with any of the test before
    # whose count the probe before `before` had not brought yet), within the gateway's (the
    # worker's clock starts after the gateway's and stops before the chunk reaches it)
    assert worker_streams(before, after) >= 1, after
    worker_s = sum(value(after, f"{wt}_sum", f'worker="{w}"') for w in ("worker-0", "worker-1"))
    gateway_s = float(re.search(r"^tinyloop_time_to_first_token_seconds_sum ([0-9.e+-]+)$", after, re.M).group(1))
    assert 0 < worker_s <= gateway_s, after
    # CPU time: a step thread's within its steps' wall time, its process's at least that
    stepped = [w for w in re.findall(r'tinyloop_worker_step_seconds_sum\{worker="([^"]+)"\}', after)
               if value(after, "tinyloop_worker_step_seconds_sum", f'worker="{w}"') > 0]
    assert stepped, after
    for w in stepped:
        label = f'worker="{w}"'
        step_cpu = value(after, "tinyloop_worker_step_cpu_seconds_total", label)
        assert 0 < step_cpu <= value(after, "tinyloop_worker_step_seconds_sum", label) + 1e-3, after
        assert value(after, "tinyloop_worker_process_cpu_seconds_total", label) >= step_cpu, after
    # each worker's start-up (Model.startup; on CPU the load alone: nothing is captured)
    loads = re.findall(r'^tinyloop_worker_startup_seconds\{part="load",worker="[^"]+"\} ([0-9.e+-]+)$', after, re.M)
    assert loads and all(float(v) > 0 for v in loads), after


def test_handle_defaults_are_the_models_and_nothing_is_clamped(client):
    """Unset l_used / max_loops are the model's default and deepest depth; a max_loops past the
    model's is refused with the Model's own message, as in-process (never silently clamped)."""
    info = client.model_info()
    h = client.build_resume_handle(PROMPT)
    assert (h.loops_used, h.max_loops) == (info["default_loops"], info["max_loops"])
    assert client.free_handle(h.handle_id)
    err = expect(INVALID, "INVALID_ARGUMENT", client.build_resume_handle, PROMPT, l_used=2,
                 max_loops=info["max_loops"] + 1)
    assert "exceeds the model's max_loops" in err.message
    err = expect(INVALID, "INVALID_ARGUMENT", client.build_resume_handle, PROMPT, l_used=5, max_loops=3)
    assert "L_used=5 exceeds max_loops=3" in err.message
