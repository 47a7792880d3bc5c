"""A compressed KV cache mode end to end: real gRPC on loopback, a real local Ray worker."""
from __future__ import annotations

import grpc
import pytest

from tinyloop.client import TinyLoopClient, TinyLoopError

from service_helpers import running_service

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]
MODE = "delta-int8"


@pytest.fixture(scope="module")
def kv_service(ray_cluster, model_path):
    with running_service(model_path, "w-kv-mode", n=1, worker_kw={"kv_mode": MODE, "max_seq_len": 64}) as s:
        yield s


@pytest.fixture(scope="module")
def local(model_path):
    from tinyloop.worker.api import Model
    with Model(model_path, max_seq_len=64, kv_mode=MODE) as m:
        yield m


def test_a_compressed_mode_over_grpc(kv_service, local):
    _, gw = kv_service
    with TinyLoopClient(gw.address, caller="alice") as c:
        info = c.model_info()
        assert info["kv_mode"] == MODE
        assert info["kv_bytes_per_token_layer"] == pytest.approx(local.kv_bytes_per_token_layer)
        ids, _ = c.generate(PROMPT, loops=4, max_tokens=8, kv_mode=MODE).collect()
        assert ids == local.generate(PROMPT, loops=4, max_tokens=8)[len(PROMPT):]
        h = c.build_resume_handle(PROMPT, l_used=2, max_loops=6)
        assert h.nbytes == local.handle_nbytes(len(PROMPT), 6)
        ids, _ = c.resume(h.handle_id, 5, max_tokens=8).collect()
        assert ids == local.generate(PROMPT, loops=5, max_tokens=8)[len(PROMPT):]
        for call in (lambda: c.generate(PROMPT, max_tokens=2, kv_mode="h").collect(),
                     lambda: c.resume(h.handle_id, 5, max_tokens=2, kv_mode="kv").collect()):
            with pytest.raises(TinyLoopError) as e:
                call()
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert f"differs from this model's kv_mode '{MODE}'" in str(e.value)
        with pytest.raises(TinyLoopError) as e:
            c.generate(PROMPT, max_tokens=2, kv_mode="int3").collect()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "kv_mode must be one of" in str(e.value)
