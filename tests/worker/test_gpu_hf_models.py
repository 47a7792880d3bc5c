"""Ouro and Huginn directories on the GPU: the worker's CUDA path (Triton kernels, captured
graphs) against the independent fp32 reference (tests/hf_reference.py), on tiny random
directories in the published layouts."""
from __future__ import annotations

import pytest
import torch
from hf_dirs import huginn_config, huginn_tensors, ouro_config, ouro_tensors, write_dir
from hf_reference import huginn_logits, ouro_logits

from tinyloop.worker import Model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = [5, 17, 42, 99, 3, 250, 11]


@pytest.fixture(scope="module", params=["ouro", "huginn"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "ouro":
        cfg = ouro_config(n_kv_heads=2)
        tensors = ouro_tensors(cfg, seed=3)
    else:
        cfg = huginn_config()
        tensors = huginn_tensors(cfg, seed=5)
    return request.param, write_dir(root, cfg, tensors), cfg, tensors


@pytest.mark.parametrize("loops", [2, 4])
def test_gpu_prefill_and_decode_follow_the_reference(family, loops):
    """In fp32 on the GPU (its Triton kernels and captured graphs) the logits are the
    reference's up to summation order. fp32, because bf16 activations through a tiny random
    block drift by several percent from any fp32 reference, which would hide a wrong norm or
    position behind a loose bound."""
    name, path, cfg, w = family
    dtype, tol = "float32", 1e-4
    ref = ouro_logits if name == "ouro" else huginn_logits
    kw = {} if name == "ouro" else {"init_scale": 0.0}  # the zero latent state: the reference's at scale 0
    with Model(path, device="cuda", dtype=dtype, n_slots=2, max_seq_len=64, **kw) as m:
        assert m.runner.graphs is not None  # the captured path, as a worker serves
        toks = list(PROMPT)
        for step in range(6):
            want = (ref(w, cfg, toks, loops) if name == "ouro"
                    else ref(w, cfg, toks, loops, torch.zeros(len(toks), cfg["n_embd"])))[-1]
            if step == 0:
                got = m.runner.prefill(0, toks, loops).logits[0]
            else:
                got = m.runner.decode([0], [toks[-1]], [len(toks) - 1], [loops]).logits[0]
            err = float((got.float().cpu() - want.float()).norm() / want.float().norm())
            assert err < tol, (name, dtype, loops, step, err)
            toks.append(int(want.argmax()))
