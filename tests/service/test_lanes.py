"""The worker's lane table, on the actor class itself (no Ray): a lane handed to a waiter whose
request is cancelled at that moment goes to the next waiter or back to the free lanes, so a
worker under cancellations never ends with a lane nobody holds (the race behind a rare
'200 mixed requests' failure: one lane busy with no stream left)."""
from __future__ import annotations

import asyncio

import pytest

from tinyloop.worker.serving.actor import WorkerActor, _StreamState


@pytest.fixture(scope="module")
def worker(model_path):
    w = WorkerActor(0, model_path, lanes=1, max_seq_len=64, device="cpu", dtype="float32")
    yield w
    w._pool.shutdown()
    w.model.close()


def test_lane_handed_to_a_cancelled_waiter_is_not_lost(worker):
    async def main():
        held = await worker._acquire_lane(_StreamState())  # the only lane
        waiting = asyncio.ensure_future(worker._acquire_lane(_StreamState()))
        behind = asyncio.ensure_future(worker._acquire_lane(_StreamState()))
        await asyncio.sleep(0)  # both wait on their futures now, in order
        worker._release_lane(held)  # the first waiter's future gets the lane...
        waiting.cancel()  # ...and its task is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting
        lane = await asyncio.wait_for(behind, 5)  # the lane went on to the next waiter
        assert lane == held and (await worker.stats())["active_lanes"] == 1
        worker._release_lane(lane)
        again = asyncio.ensure_future(worker._acquire_lane(_StreamState()))
        await asyncio.sleep(0)  # took the free lane at once
        assert again.done() and again.result() == lane
        waiting = asyncio.ensure_future(worker._acquire_lane(_StreamState()))
        await asyncio.sleep(0)
        worker._release_lane(lane)
        waiting.cancel()  # no one behind it: the lane goes back to the free ones
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return await worker.stats()

    stats = asyncio.run(main())
    assert stats["active_lanes"] == 0 and stats["queued"] == 0
