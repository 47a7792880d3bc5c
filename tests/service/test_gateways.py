"""Several gateways in front of the same workers: a gateway keeps no state beyond what a
handle id carries, so a second gateway that attaches to the workers by name (what `tinyloop
serve --attach` does for an extra replica) resumes and frees handles the first one built, and
places new work by the load the other gateway put on each worker."""
from __future__ import annotations

import pytest

from tinyloop.client import TinyLoopClient

from service_helpers import MAX_MESSAGE, running_service, wait_idle, wait_view

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]
PREFIX = "w-gateways"


@pytest.fixture(scope="module")
def gateways(ray_cluster, model_path):
    """(actors, first gateway, second gateway attached by name; it polls the workers every 0.1 s)."""
    from tinyloop.gateway import workers
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    with running_service(model_path, PREFIX) as (actors, first):
        second = GatewayThread(workers.attach(len(actors), name_prefix=PREFIX),
                               GatewayOptions(port=0, max_message_bytes=MAX_MESSAGE, health_interval_s=0.1))
        try:
            yield actors, first, second
        finally:
            second.stop(0.5)


def test_a_handle_built_through_one_gateway_resumes_through_another(gateways):
    actors, first, second = gateways
    with TinyLoopClient(first.address, caller="alice") as a, TinyLoopClient(second.address, caller="alice") as b:
        built = {}
        while len(built) < len(actors):  # one handle on each worker
            h = a.build_resume_handle(PROMPT, l_used=2, max_loops=8)
            built.setdefault(h.worker_id, h)
        for worker_id, h in sorted(built.items()):
            via_first = a.resume(h.handle_id, 6, max_tokens=8).collect()
            via_second = b.resume(h.handle_id, 6, max_tokens=8).collect()
            assert via_second[1].worker_id == worker_id, \
                f"the second gateway sent {worker_id}'s handle to {via_second[1].worker_id}"
            assert via_second[0] == via_first[0], \
                f"{worker_id}: the same handle resumed to other tokens through the second gateway"
            # the handle lives on its worker, not in a gateway: freed through one, gone for both
            assert b.free_handle(h.handle_id) is True
            assert a.free_handle(h.handle_id) is False
    stats = wait_idle(actors, handles=True)
    assert all(s["handles"] == 0 and s["active_lanes"] == 0 for s in stats), stats


def test_placement_sees_the_load_another_gateway_put_on_a_worker(gateways):
    """While a stream from the first gateway runs on one worker, the second gateway, which has
    nothing in flight anywhere, sends its new requests to the other worker (by its own counts
    alone, a rotation, it would alternate): the workers' polled counts less its own streams,
    plus its own counted live."""
    actors, first, second = gateways
    with TinyLoopClient(first.address) as a, TinyLoopClient(second.address) as b:
        h = a.build_resume_handle(PROMPT, l_used=2, max_loops=8)
        stream = a.resume(h.handle_id, 8, max_tokens=2000)  # runs on the handle's worker
        it = iter(stream)
        assert next(it).ids
        # the second gateway's polls have seen the stream, and both workers are in its placement
        busy = next(w for w in second.gateway.servicer.workers if w.label == h.worker_id)
        wait_view(second, lambda workers: busy.others >= 1 and all(w.healthy for w in workers),
                  "the second gateway's polls did not see the stream")
        seen = []
        for _ in range(4):
            # back to back: a poll in flight while the one before ran counts it as the second
            # gateway's own (`own_streams`), which placement takes from its live count instead
            seen.append(b.generate(PROMPT, loops=2, max_tokens=2).collect()[1].worker_id)
        stream.cancel()
        assert h.worker_id not in seen, \
            f"the second gateway sent new work to {seen} while {h.worker_id} ran the first's stream"
        assert a.free_handle(h.handle_id) is True
    assert all(s["handles"] == 0 for s in wait_idle(actors, handles=True))
