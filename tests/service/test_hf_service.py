"""The looped families people have, served: a Huginn directory (input injection, a seeded random
initial latent state) and an Ouro directory behind the gateway and a Ray worker, over real
gRPC. A seeded stream, and a handle built with the same seed resumed at a deeper depth, equal
the in-process `Model` runs with that seed."""
from __future__ import annotations

import pytest
from hf_dirs import huginn_config, huginn_tensors, ouro_config, ouro_tensors, write_dir

from tinyloop.client import TinyLoopClient
from tinyloop.worker import Model

from service_helpers import running_service, wait_idle

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 42, 99, 3, 250, 11]


@pytest.fixture(scope="module", params=["huginn", "ouro"])
def served(request, ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "huginn":
        cfg = huginn_config(eos_token_id=1)
        path = write_dir(root, cfg, huginn_tensors(cfg, seed=7))
    else:
        cfg = ouro_config(n_kv_heads=2, eos_token_id=1)
        path = write_dir(root, cfg, ouro_tensors(cfg, seed=2))
    with running_service(str(path), f"w-hf-{request.param}", n=1, lanes=2, worker_kw={"max_seq_len": 64}) as (
            actors, gw), Model(str(path), device="cpu", dtype="float32", max_seq_len=64, n_slots=2) as local:
        yield actors, gw, local


def test_seeded_generate_and_resume_equal_in_process(served):
    actors, gw, local = served
    with TinyLoopClient(gw.address) as c:
        ids, _ = c.generate(PROMPT, loops=3, max_tokens=8, seed=9).collect()
        assert ids == list(local.generate(PROMPT, loops=3, max_tokens=8, seed=9))[len(PROMPT):]
        h = c.build_resume_handle(PROMPT, l_used=2, max_loops=6, seed=9)
        deeper, _ = c.resume(h.handle_id, 5, max_tokens=8, seed=9).collect()
        assert deeper == list(local.generate(PROMPT, loops=5, max_tokens=8, seed=9))[len(PROMPT):]
        assert c.free_handle(h.handle_id)
        info = c.model_info()
    assert info["max_loops"] >= 6 and info["eos_id"] == 1
    stats = wait_idle(actors, handles=True)[0]
    assert (stats["active_lanes"], stats["handles"]) == (0, 0)
