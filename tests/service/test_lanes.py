"""The worker actor's class itself (no Ray): streams queued behind one lane, cancelled while
they wait, while they decode and just as a lane is handed over, never leave a lane nobody holds;
the stream nobody cancelled gets exactly its standalone tokens."""
from __future__ import annotations

import asyncio

import pytest

from tinyloop.worker.serving import channel_pb2 as cpb
from tinyloop.worker.serving.actor import WorkerActor
from tinyloop.worker.serving.options import WorkerOptions

IDS = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def worker(model_path):
    w = WorkerActor(0, WorkerOptions(model_path=model_path, lanes=1, max_seq_len=64, device="cpu", dtype="float32"))
    yield w
    w._steps.stop()
    w.model.close()


async def _collect(agen) -> list[dict]:
    return [item async for item in agen]


def test_cancelled_streams_and_waiters_leave_no_lane_behind(worker, local_model):
    async def main():
        p = cpb.GenerateParams(prompt=cpb.Prompt(ids=cpb.TokenIds(ids=IDS)), loops=2, max_tokens=40)
        running = worker.generate("a", "alice", p)
        first = await running.__anext__()  # "a" holds the only lane
        waiting = [asyncio.ensure_future(_collect(worker.generate(k, "alice", p))) for k in "bcd"]
        await asyncio.sleep(0.01)
        assert (await worker.stats())["queued"] == 3
        assert await worker.cancel("b")   # while queued
        assert await worker.cancel("a")   # while decoding: "c" gets the lane
        await running.aclose()
        await asyncio.sleep(0)
        assert await worker.cancel("c")   # just as the lane is handed to it
        items = await asyncio.wait_for(waiting[2], 60)  # "d" runs to the end
        assert await waiting[0] == [] and await waiting[1] == []
        for _ in range(100):
            stats = await worker.stats()
            if stats["active_lanes"] == 0:
                break
            await asyncio.sleep(0.02)
        return first, items, stats

    first, items, stats = asyncio.run(main())
    assert first["ids"]
    assert [t for it in items for t in it.get("ids", [])] == local_model.generate(
        IDS, loops=2, max_tokens=40)[len(IDS):]
    assert items[-1]["complete"]["reason"] == "length"
    assert (stats["active_lanes"], stats["queued"], stats["running"], stats["streams"]) == (0, 0, 0, 0)
