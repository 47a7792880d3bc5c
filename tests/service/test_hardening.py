"""One bad request never hurts another caller, over real gRPC: a poisoned sampling request fails
alone (or runs) while its batch-mates finish with their exact tokens; bytes that are no valid
message answer INVALID_ARGUMENT; a cache window past the cache, a handle that cannot fit and a
handle_max_loops below the depth are refused before any work; a handle id is only its issued
spelling; health says NOT_SERVING while no worker can take work."""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinyloop.client import TinyLoopClient, TinyLoopError
from tinyloop.client import tinyloop_pb2 as pb

from service_helpers import MAX_SEQ_LEN, running_service, start_service, wait_idle

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]
METHODS = {  # every RPC of the service, and whether it streams
    "Generate": True, "Resume": True, "BuildResumeHandle": False, "FreeHandle": False, "Score": False,
    "ScoreTrajectory": False, "ModelInfo": False,
}


@pytest.fixture(scope="module")
def service(ray_cluster, model_path):
    with running_service(model_path, "w-hard", n=1, lanes=4) as service:
        yield service


@pytest.fixture()
def client(service):
    with TinyLoopClient(service[1].address, caller="alice") as c:
        yield c


def _error(fn) -> TinyLoopError:
    with pytest.raises(TinyLoopError) as e:
        fn()
    return e.value


def test_a_poisoned_request_fails_alone_and_its_batch_mates_finish(service, client, local_model):
    """Temperature 5e-38 (whose scores overflow float32) is refused with the argument's name;
    1e-20, tiny but valid, runs: greedy in all but name. Three greedy streams decoding in the
    same batch meanwhile get exactly their tokens alone."""
    actors, _ = service
    prompts = [PROMPT, [9, 8, 7, 6], [1, 2, 3]]
    want = [local_model.generate(p, loops=3, max_tokens=40)[len(p):] for p in prompts]
    got: dict[int, list[int]] = {}

    def mate(i):
        got[i] = client.generate(prompts[i], loops=3, max_tokens=40, timeout=60).collect()[0]
    threads = [threading.Thread(target=mate, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    err = _error(lambda: client.generate(PROMPT, loops=3, max_tokens=40, temperature=5e-38, seed=7).collect())
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    assert "temperature" in err.message and "Traceback" not in err.message
    tiny, _ = client.generate(PROMPT, loops=3, max_tokens=40, temperature=1e-20, seed=7, timeout=60).collect()
    assert len(tiny) == 40 and tiny == local_model.generate(PROMPT, loops=3, max_tokens=40, temperature=1e-20,
                                                            seed=7)[len(PROMPT):]
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(3)] == want
    assert all(s["active_lanes"] == 0 for s in wait_idle(actors))


def _raw(channel, method: str):
    path = f"/tinyloop.v1.TinyLoop/{method}"
    return (channel.unary_stream if METHODS[method] else channel.unary_unary)(path)


def _field(message_cls, name: str, payload: bytes) -> bytes:
    """One length-delimited field of `message_cls` holding `payload`, in wire format."""
    number = message_cls.DESCRIPTOR.fields_by_name[name].number
    tag, n, length = (number << 3) | 2, len(payload), b""
    while True:
        length += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            break
    return bytes([tag]) + length + payload


def _call(stub, streams: bool, data: bytes):
    """-> (code, details) of one raw call (OK: (StatusCode.OK, ""))."""
    try:
        out = stub(data, timeout=10)
        if streams:
            list(out)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def test_bytes_that_are_no_message_are_invalid_argument(service):
    """Truncated or random bytes, and invalid UTF-8 in a string field, on every RPC: never
    UNKNOWN or INTERNAL, and no internals (traceback, path, exception class) in the details."""
    gw = service[1]
    rng = random.Random(1234)
    with grpc.insecure_channel(gw.address) as ch:
        valid = pb.GenerateRequest(request_id="r", prompt=pb.Prompt(ids=pb.TokenIds(ids=PROMPT)),
                                   max_tokens=2).SerializeToString()
        cases = [("Generate", valid[:-1]),  # truncated
                 ("Generate", _field(pb.GenerateRequest, "request_id", b"\xff\xfe")),
                 ("Generate", _field(pb.GenerateRequest, "prompt", _field(pb.Prompt, "text", b"def \xc3("))),
                 ("Resume", _field(pb.ResumeRequest, "handle_id", b"\x80abc")),
                 ("FreeHandle", _field(pb.FreeHandleRequest, "handle_id", b"\xed\xa0\x80"))]
        for method, data in cases:
            code, details = _call(_raw(ch, method), METHODS[method], data)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, data, code, details)
            assert "not a valid" in details and "Error" not in details, details
        seen = set()
        for method, streams in METHODS.items():
            stub = _raw(ch, method)
            for _ in range(12):
                data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
                code, details = _call(stub, streams, data)
                seen.add(code)
                assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method, data, details)
                assert not any(s in details for s in ("Traceback", "File \"", ".py", "pid=")), details
    assert grpc.StatusCode.INVALID_ARGUMENT in seen
    stats = wait_idle(service[0], handles=True)
    assert all(s["active_lanes"] == 0 and s["handles"] == 0 and s["handle_bytes"] == 0 for s in stats)


def test_checks_come_before_the_work(service, client):
    """A window past the cache and a handle_max_loops below the depth are refused at once,
    before a token; a handle larger than the whole byte budget before its prefill."""
    actors, _ = service
    for window in (1 << 24, (1 << 32) - 1, MAX_SEQ_LEN + 1):
        t0 = time.monotonic()
        err = _error(lambda: client.generate(PROMPT, loops=3, max_tokens=4, cache_window=window).collect())
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "cache_window" in err.message
        assert time.monotonic() - t0 < 2.0
    stream = client.generate(PROMPT, loops=4, max_tokens=4, return_handle=True, handle_max_loops=2)
    it = iter(stream)
    err = _error(lambda: next(it))  # the very first message is the error: no token streamed
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "handle_max_loops=2" in err.message
    ray.get(actors[0].configure.remote(handle_budget_bytes=1024))
    try:
        err = _error(lambda: client.build_resume_handle(PROMPT, l_used=2, max_loops=8))
        assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "HANDLE_BUDGET_EXHAUSTED")
        assert "exceeds" in err.message and "budget of 1024 bytes" in err.message
    finally:
        ray.get(actors[0].configure.remote(handle_budget_bytes=1 << 30))
    assert ray.get(actors[0].stats.remote())["handles"] == 0


def test_a_handle_id_is_only_its_issued_spelling(client):
    for _ in range(20):  # an id holding '-' or '_' (each of its 30 characters: 2 in 64)
        built = client.build_resume_handle(PROMPT, l_used=2, max_loops=4)
        if "-" in built.handle_id or "_" in built.handle_id:
            break
        client.free_handle(built.handle_id)
    else:
        pytest.skip("no handle id with '-' or '_' in 20 tries")
    respelled = built.handle_id.replace("-", "+").replace("_", "/")
    err = _error(lambda: client.resume(respelled, 3, max_tokens=2).collect())
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_HANDLE")
    assert len(client.resume(built.handle_id, 3, max_tokens=2).collect()[0]) == 2
    client.free_handle(built.handle_id)


def test_health_is_not_serving_while_no_worker_can_work(ray_cluster, model_path):
    actors, gw = start_service(model_path, "w-health", n=1, lanes=1, health_interval_s=0.2)
    try:
        with grpc.insecure_channel(gw.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status():
                return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            assert status() == health_pb2.HealthCheckResponse.SERVING
            ray.kill(actors[0], no_restart=True)
            deadline = time.monotonic() + 10
            while status() != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health still SERVING with its only worker dead"
                time.sleep(0.1)
    finally:
        gw.stop(0.5)


def test_a_handle_built_after_its_caller_left_is_freed(service, client):
    """BuildResumeHandle with deadlines too short for the build: every call answers
    DEADLINE_EXCEEDED, and no handle stays resident (none counts against the byte budget)."""
    from tinyloop.gateway import metrics
    actors, _ = service
    orphans = metrics.ERRORS.labels("BuildResumeHandle", "ORPHANED_HANDLE_FREED")
    before = orphans._value.get()
    kept = []
    long_prompt = [1 + i % 250 for i in range(1500)]  # a build of 1500 tokens outlasts these deadlines
    for i in range(8):
        try:
            kept.append(client.build_resume_handle(long_prompt, l_used=16, max_loops=16,
                                                   timeout=0.02 + 0.01 * (i % 4)))
        except TinyLoopError as e:
            assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED
    for h in kept:  # a build that beat its deadline belongs to the caller
        client.free_handle(h.handle_id)
    wait_idle(actors, timeout=30)  # every build has run (a build holds a lane)
    deadline = time.monotonic() + 10
    while ray.get(actors[0].stats.remote())["handles"]:
        assert time.monotonic() < deadline, "a handle outlived the caller that asked for it"
        time.sleep(0.05)
    assert ray.get(actors[0].stats.remote())["handle_bytes"] == 0
    assert orphans._value.get() > before, "no build outlived its caller: the test did not test it"


def test_a_stream_cut_by_the_drain_says_why(ray_cluster, model_path):
    from tinyloop.gateway import metrics
    actors, gw = start_service(model_path, "w-drain", n=1, lanes=1)
    try:
        c = TinyLoopClient(gw.address, caller="alice")
        before = metrics.REQUESTS.labels("Generate")._value.get()
        it = iter(c.generate(PROMPT, loops=8, max_tokens=2000, timeout=60))
        assert next(it).ids
        stopper = threading.Thread(target=gw.stop, args=(0.2,))
        stopper.start()
        err = _error(lambda: list(it))
        stopper.join(10)
        assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "DRAINING")
        # the stream had sent a chunk: the client's retry policy does not replay it
        assert metrics.REQUESTS.labels("Generate")._value.get() - before == 1
        c.close()
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def test_free_handle_on_a_forged_id_is_the_same_answer_for_every_worker(client):
    from tinyloop.gateway import handles
    for worker in (0, 7):  # the one worker, and one that does not exist
        assert client.free_handle(handles.encode(worker, 1, bytes(16))) is False
