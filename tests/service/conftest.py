"""Fixtures of the end-to-end service tests: a tiny random model, a real local Ray cluster,
real worker actors and a real grpc.aio gateway on loopback."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from service_helpers import MAX_SEQ_LEN, running_service


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    from tinyloop.worker.model import checkpoint
    from tinyloop.worker.model.config import PRESETS
    path = tmp_path_factory.mktemp("model") / "tiny.tinyloop"
    checkpoint.save(checkpoint.init_model(PRESETS["tiny"], 0, std=0.3), path, dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="session")
def local_model(model_path):
    from tinyloop.worker.api import Model
    with Model(model_path, max_seq_len=MAX_SEQ_LEN) as m:
        yield m


@pytest.fixture(scope="session")
def ray_cluster():
    ray.init(num_cpus=8, include_dashboard=False, namespace="tinyloop-tests", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def service(ray_cluster, model_path, request):
    prefix = f"w-{request.module.__name__.rsplit('.', 1)[-1]}"
    with running_service(model_path, prefix) as service:
        yield service


@pytest.fixture(scope="module")
def actors(service):
    return service[0]


@pytest.fixture(scope="module")
def gateway(service):
    return service[1]


@pytest.fixture()
def client(gateway):
    from tinyloop.client import TinyLoopClient
    with TinyLoopClient(gateway.address, caller="alice") as c:
        yield c
