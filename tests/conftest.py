"""Shared fixtures: small random checkpoints written once per session.

Without CUDA the Triton kernels run under the interpreter, which triton reads from
TRITON_INTERPRET at its first import: so it is set here, before anything imports triton."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from model_zoo import CONFIGS, TINY, write_checkpoint  # noqa: E402


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
