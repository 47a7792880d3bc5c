"""The worker's token channel (worker/serving/channel.py): Generate and Resume stream from the
worker over gRPC, not Ray, and give the same tokens as the Ray path and the in-process Model;
the channel refuses callers without its token and calls without their parameters, and serves on
after them."""
from __future__ import annotations

import time

import grpc
import pytest

from tinyloop.client import TinyLoopClient, TinyLoopError
from tinyloop.gateway.server import GatewayOptions, GatewayThread
from tinyloop.worker.serving import channel, channel_pb2 as cpb, channel_pb2_grpc as cpb_grpc

from service_helpers import MAX_MESSAGE, wait_idle

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def ray_gateway(actors):
    """A second gateway in front of the same workers that streams through Ray."""
    gw = GatewayThread(actors, GatewayOptions(port=0, max_message_bytes=MAX_MESSAGE, worker_channel=False))
    yield gw
    gw.stop(0.5)


def test_streams_go_over_the_channel(gateway, actors):
    import ray
    infos = ray.get([a.info.remote() for a in actors])
    for w, info in zip(gateway.gateway.servicer.workers, infos):
        assert info["channel"]["address"].rsplit(":", 1)[1].isdigit() and len(info["channel"]["token"]) >= 24
        assert w.stub is not None and w.channel_token == info["channel"]["token"]


def test_channel_and_ray_paths_give_the_same_tokens(gateway, ray_gateway, local_model, actors):
    assert all(w.stub is None for w in ray_gateway.gateway.servicer.workers)
    want = local_model.generate(PROMPT, loops=4, max_tokens=24)[len(PROMPT):]
    with TinyLoopClient(gateway.address) as direct, TinyLoopClient(ray_gateway.address) as via_ray:
        ids_d, c_d = direct.generate(PROMPT, loops=4, max_tokens=24).collect()
        ids_r, c_r = via_ray.generate(PROMPT, loops=4, max_tokens=24).collect()
        assert ids_d == ids_r == want
        assert c_d.usage == c_r.usage and c_d.finish_reason == c_r.finish_reason == "length"
        # a handle built through one path resumes through the other
        _, c = direct.generate(PROMPT, loops=2, max_tokens=4, return_handle=True, handle_max_loops=6).collect()
        deeper, _ = via_ray.resume(c.handle_id, 6, max_tokens=8).collect()
        again, _ = direct.resume(c.handle_id, 6, max_tokens=8).collect()
        assert deeper == again == local_model.generate(PROMPT, loops=6, max_tokens=8)[len(PROMPT):]
        assert direct.free_handle(c.handle_id) is True
    assert all(s["handles"] == 0 for s in wait_idle(actors, handles=True))


def test_ray_path_cancel_mid_stream_frees_the_lane(ray_gateway, actors):
    with TinyLoopClient(ray_gateway.address) as client:
        stream = client.generate(PROMPT, loops=8, max_tokens=2000)
        it = iter(stream)
        assert next(it).ids
        stream.cancel()
        with pytest.raises(TinyLoopError) as e:
            list(it)
        assert e.value.code == grpc.StatusCode.CANCELLED
    assert all(s["active_lanes"] == 0 and s["streams"] == 0 for s in wait_idle(actors))


def _params(**kw) -> cpb.GenerateParams:
    return cpb.GenerateParams(prompt=cpb.Prompt(ids=cpb.TokenIds(ids=PROMPT)), **kw)


def _direct(actors):
    import ray
    info = ray.get(actors[0].info.remote())["channel"]
    return grpc.insecure_channel(info["address"]), info["token"]


def test_channel_refuses_calls_without_its_token_and_malformed_ones(client, actors, local_model):
    ch, token = _direct(actors)
    stub = cpb_grpc.WorkerChannelStub(ch)
    call = cpb.StreamCall(key="k-test", caller="anonymous", generate=_params(loops=2, max_tokens=3))
    for md in ((), ((channel.TOKEN_KEY, "wrong"),)):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(call, metadata=md, timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    md = ((channel.TOKEN_KEY, token),)
    for method, bad in ((stub.Generate, cpb.StreamCall(key="k-bad")),
                        (stub.Resume, cpb.StreamCall(key="k-bad", generate=_params(loops=2, max_tokens=3)))):
        with pytest.raises(grpc.RpcError) as e:
            list(method(bad, metadata=md, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Params" in e.value.details()
    # what the gateway would have refused, the worker's Model refuses too: the reason, no stream
    events = [channel.item(ev) for ev in stub.Generate(cpb.StreamCall(key="k-zero", generate=_params(
        loops=2, max_tokens=0)), metadata=md, timeout=30)]
    assert len(events) == 1 and events[0]["error"]["code"] == "INVALID_ARGUMENT", events
    assert "max_tokens" in events[0]["error"]["message"]
    # with the token, a call is a stream like the gateway's: chunks, then one Complete
    events = [channel.item(ev) for ev in stub.Generate(call, metadata=((channel.TOKEN_KEY, token),), timeout=30)]
    assert [t for ev in events[:-1] for t in ev["ids"]] == local_model.generate(PROMPT, loops=2, max_tokens=3)[len(PROMPT):]
    assert events[-1]["complete"]["reason"] == "length" and events[-1]["complete"]["stats"]["completion_tokens"] == 3
    ch.close()
    ids, _ = client.generate(PROMPT, loops=2, max_tokens=3).collect()
    assert len(ids) == 3
    assert all(s["streams"] == 0 for s in wait_idle(actors))


def test_a_direct_caller_leaving_mid_stream_frees_the_lane(actors):
    ch, token = _direct(actors)
    stub = cpb_grpc.WorkerChannelStub(ch)
    call = cpb.StreamCall(key="k-leave", caller="anonymous", generate=_params(loops=8, max_tokens=2000))
    stream = stub.Generate(call, metadata=((channel.TOKEN_KEY, token),), timeout=60)
    assert next(stream).chunk.ids
    t0 = time.monotonic()
    stream.cancel()
    stats = wait_idle(actors)
    assert all(s["active_lanes"] == 0 and s["streams"] == 0 for s in stats), stats
    assert time.monotonic() - t0 < 2.0
    ch.close()


def test_a_restarted_worker_streams_over_its_new_channel(gateway, actors, local_model):
    """Ray restarts a killed worker with a new channel address and token; the gateway takes
    them up (from its probe or its poll) and streams there again. Last in the module: it
    restarts worker-0."""
    import ray
    w0 = gateway.gateway.servicer.workers[0]
    old = w0.channel_token
    ray.kill(actors[0], no_restart=False)
    deadline = time.monotonic() + 120
    while not (w0.healthy and w0.channel_token not in ("", old)):
        assert time.monotonic() < deadline, "the gateway never took up the restarted worker's channel"
        time.sleep(0.2)
    assert ray.get(actors[0].info.remote())["channel"]["token"] == w0.channel_token
    want = local_model.generate(PROMPT, loops=3, max_tokens=6)[len(PROMPT):]
    with TinyLoopClient(gateway.address) as client:
        # placement goes by load, and worker-0's polled load may still be the one from before
        # the kill until the next poll: ask until it serves
        seen = set()
        while "worker-0" not in seen:
            assert time.monotonic() < deadline, f"worker-0 never served after its restart (served by {seen})"
            ids, c = client.generate(PROMPT, loops=3, max_tokens=6).collect()
            assert ids == want
            seen.add(c.worker_id)
