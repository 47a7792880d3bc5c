"""The worker's token channel (worker/serving/channel.py): Generate and Resume stream from the
worker as frames on a TCP connection, not through Ray, and give the same tokens as the Ray path
and the in-process Model; the channel refuses connections without its token, calls without
their parameters and bytes that are no frames, and serves on after them."""
from __future__ import annotations

import asyncio
import struct
import time

import grpc
import pytest

from tinyloop.client import TinyLoopClient, TinyLoopError
from tinyloop.gateway.server import GatewayOptions, GatewayThread
from tinyloop.worker.serving import channel, channel_pb2 as cpb

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
        assert w.channel is not None and w.channel_token == info["channel"]["token"]


def test_channel_and_ray_paths_give_the_same_tokens(gateway, ray_gateway, local_model, actors):
    assert all(w.channel is None for w in ray_gateway.gateway.servicer.workers)
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


def _info(actors) -> dict:
    import ray
    return ray.get(actors[0].info.remote())["channel"]


async def _events(link: channel.Link, call: cpb.StreamCall) -> list[dict]:
    return [channel.item(ev) async for ev in link.stream(call.key, call)]


async def _raw_first_frame(address: str, data: bytes) -> tuple[cpb.LinkFrame | None, bool]:
    """Send raw bytes as a new connection's start: (the worker's first frame back, whether the
    worker then closed the connection)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    first = await asyncio.wait_for(channel.read_frame(reader), 30)
    closed = first is None or await asyncio.wait_for(channel.read_frame(reader), 30) is None
    writer.close()
    return first, closed


def test_channel_refuses_connections_without_its_token_and_malformed_calls(client, actors, local_model):
    info = _info(actors)
    call = cpb.StreamCall(key="k-test", caller="anonymous", generate=_params(loops=2, max_tokens=3))
    hello = lambda token: channel.frame(cpb.LinkFrame(hello=cpb.LinkHello(token=token)))  # noqa: E731
    start = channel.frame(cpb.LinkFrame(key="k-test", start=call))
    for data in (hello("wrong") + start, start, hello("")):
        first, closed = asyncio.run(_raw_first_frame(info["address"], data))
        assert closed and first.event.error.code == "UNAUTHENTICATED", first
    # bytes that are no frame (a length past the limit; a body that does not parse): the
    # connection is closed, nothing is answered on it
    for junk in (struct.pack(">I", channel.MAX_FRAME_BYTES + 1), struct.pack(">I", 3) + b"\xff\xff\xff"):
        first, closed = asyncio.run(_raw_first_frame(info["address"], hello(info["token"]) + junk))
        assert first is None and closed

    async def with_token():
        link = await channel.Link.open(info["address"], info["token"])
        try:
            bad = await _events(link, cpb.StreamCall(key="k-bad"))
            # what the gateway would have refused, the worker's Model refuses too: the reason, no stream
            zero = await _events(link, cpb.StreamCall(key="k-zero", generate=_params(loops=2, max_tokens=0)))
            good = await _events(link, call)
            return bad, zero, good
        finally:
            await link.close()
    bad, zero, good = asyncio.run(with_token())
    assert len(bad) == 1 and bad[0]["error"]["code"] == "INVALID_ARGUMENT" and "Params" in bad[0]["error"]["message"]
    assert len(zero) == 1 and zero[0]["error"]["code"] == "INVALID_ARGUMENT", zero
    assert "max_tokens" in zero[0]["error"]["message"]
    # with the token, a call is a stream like the gateway's: chunks, then one Complete
    want = local_model.generate(PROMPT, loops=2, max_tokens=3)[len(PROMPT):]
    assert [t for ev in good[:-1] for t in ev["ids"]] == want
    assert good[-1]["complete"]["reason"] == "length" and good[-1]["complete"]["stats"]["completion_tokens"] == 3
    ids, _ = client.generate(PROMPT, loops=2, max_tokens=3).collect()
    assert ids == want
    assert all(s["streams"] == 0 for s in wait_idle(actors))


@pytest.mark.parametrize("how", ["cancel", "connection"])
def test_a_direct_caller_leaving_mid_stream_frees_the_lane(actors, how):
    # leaving: the stream closed early (a cancel frame), or the whole connection dropped
    info = _info(actors)
    call = cpb.StreamCall(key=f"k-leave-{how}", caller="anonymous", generate=_params(loops=8, max_tokens=2000))

    async def leave():
        link = await channel.Link.open(info["address"], info["token"])
        events = link.stream(call.key, call)
        first = await events.__anext__()
        if how == "cancel":
            await events.aclose()
            await asyncio.sleep(0.2)  # the cancel frame goes out before the connection closes
        await link.close()
        return first
    assert asyncio.run(leave()).chunk.ids
    t0 = time.monotonic()
    stats = wait_idle(actors)
    assert all(s["active_lanes"] == 0 and s["streams"] == 0 for s in stats), stats
    assert time.monotonic() - t0 < 2.0


def test_an_interrupted_stream_ends_at_its_next_wait_and_frees_the_lane(actors):
    # Link.interrupt (the gateway's drain): the stream's iterator raises Interrupted where it next
    # waits for an event, and the worker's stream is cancelled; a key with no stream: False
    info = _info(actors)
    call = cpb.StreamCall(key="k-interrupt", caller="anonymous", generate=_params(loops=8, max_tokens=2000))

    async def interrupted():
        link = await channel.Link.open(info["address"], info["token"])
        events = link.stream(call.key, call)
        first = await events.__anext__()
        assert link.interrupt(call.key) and not link.interrupt("no-such-stream")
        with pytest.raises(channel.Interrupted):
            while True:
                await events.__anext__()
        assert call.key not in link.queues
        await asyncio.sleep(0.2)  # the cancel frame goes out before the connection closes
        await link.close()
        return first
    assert asyncio.run(interrupted()).chunk.ids
    stats = wait_idle(actors)
    assert all(s["active_lanes"] == 0 and s["streams"] == 0 for s in stats), stats


def test_a_link_that_ended_is_opened_again_by_the_next_stream(gateway, local_model):
    """The connection to a live worker ends (a network cut, a proxy's idle timeout): the next
    stream opens a new one and streams there, and the worker stays in placement."""
    want = local_model.generate(PROMPT, loops=2, max_tokens=5)[len(PROMPT):]
    with TinyLoopClient(gateway.address) as client:
        assert client.generate(PROMPT, loops=2, max_tokens=5).collect()[0] == want  # every link open
        links = {}
        for w in gateway.gateway.servicer.workers:
            if w._link is not None:
                links[w.label] = w._link
                gateway.run(w._link.close())
        assert links and all(link.closed for link in links.values())
        # placement goes by the workers' polled load: ask until every worker whose link ended served
        served, deadline = set(), time.monotonic() + 60
        while not set(links) <= served:
            assert time.monotonic() < deadline, f"only {served} served after their links ended"
            ids, c = client.generate(PROMPT, loops=2, max_tokens=5).collect()
            assert ids == want
            served.add(c.worker_id)
    for w in gateway.gateway.servicer.workers:
        assert w.healthy
        if w.label in links:
            assert w._link is not links[w.label] and not w._link.closed


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
