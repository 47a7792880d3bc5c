"""Shared fixtures: small random checkpoints written once per session."""
from __future__ import annotations

import pytest

from model_zoo import CONFIGS, TINY, write_checkpoint


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="session")
def tiny_path(ckpt_dir):
    return write_checkpoint(ckpt_dir / "tiny.tinyloop", TINY, seed=1)


@pytest.fixture(scope="session", params=list(CONFIGS))
def config_path(request, ckpt_dir):
    return write_checkpoint(ckpt_dir / f"{request.param}.tinyloop", CONFIGS[request.param], seed=2)


@pytest.fixture
def tiny_model(tiny_path):
    from tinyloop.worker import Model
    with Model(tiny_path, max_seq_len=256, n_slots=4) as m:
        yield m
