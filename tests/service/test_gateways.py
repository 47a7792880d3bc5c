"""Several gateways in front of the same workers: a gateway keeps no state beyond what a
handle id carries, so a second gateway that attaches to the workers by name (what `tinyloop
serve --attach` does for an extra replica) resumes and frees handles the first one built."""
from __future__ import annotations

import pytest

from tinyloop.client import TinyLoopClient

from service_helpers import MAX_MESSAGE, running_service, wait_idle

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]
PREFIX = "w-gateways"


def test_a_handle_built_through_one_gateway_resumes_through_another(ray_cluster, model_path):
    from tinyloop.gateway import workers
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    with running_service(model_path, PREFIX) as (actors, first):
        second = GatewayThread(workers.attach(len(actors), name_prefix=PREFIX),
                               GatewayOptions(port=0, max_message_bytes=MAX_MESSAGE))
        try:
            with TinyLoopClient(first.address, caller="alice") as a, \
                 TinyLoopClient(second.address, caller="alice") as b:
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
        finally:
            second.stop(0.5)
