"""Every documented error path: the documented type, and a message that names the problem."""
import json
import os
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tinyloop.worker import Model
from tinyloop.worker.model import checkpoint
from tinyloop.worker.model.checkpoint import CheckpointError
from tinyloop.worker.model.config import PRESETS, LoopedConfig

P = [1, 2, 3]


@pytest.mark.parametrize("kwargs, match", [
    (dict(loops=0), "loops=0 out of range"),
    (dict(loops=33), "loops=33 out of range"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(seed=-3), "seed must be >= 0"),
    (dict(cache_window=-1), "cache_window must be >= 0"),
    (dict(l_warmup_tokens=-1), "l_warmup_tokens must be >= 0"),
    (dict(l_warmup_tokens=2), "l_warmup_L is required"),
    (dict(loops=4, l_warmup_tokens=2, l_warmup_L=8), "l_warmup_L=8 must be <= loops=4"),
    (dict(safety_check=True, safety_norm_threshold=0), "safety_norm_threshold must be > 0"),
    (dict(stop_token_ids=[999]), "stop_token_ids holds 999"),
])
def test_generate_value_errors(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_model.generate(P, **kwargs)


@pytest.mark.parametrize("prompt, match", [
    ([], "prompt is empty"),
    (np.array([], dtype=np.int32), "prompt is empty"),
    ([1, 256], "token id 256, outside the vocabulary"),
    ([-1], "token id -1, outside the vocabulary"),
    (np.zeros((2, 2), dtype=np.int32), "1-D"),
    (np.array([1.5]), "integer token ids"),
    ("hello", "1-D int32 numpy array or a list of ints"),
    ([1, "a"], "list of ints"),
])
def test_bad_prompts(tiny_model, prompt, match):
    with pytest.raises(ValueError, match=match):
        tiny_model.generate(prompt)


def test_prompt_that_cannot_fit_is_a_runtime_error(tiny_model):
    with pytest.raises(RuntimeError, match="exceeds max_seq_len 256"):
        tiny_model.generate([1] * 200, max_tokens=57)
    assert len(tiny_model.generate([1] * 200, max_tokens=56, loops=1)) == 256


def test_closed_model_is_a_runtime_error(tiny_path):
    m = Model(tiny_path, max_seq_len=64)
    h = m.build_resume_handle(P, L_used=1, max_loops=4)
    m.close()
    for call in (lambda: m.generate(P), lambda: m.build_resume_handle(P),
                 lambda: m.resume_generate(h, 2), lambda: m.score_trajectory(P, 2)):
        with pytest.raises(RuntimeError, match="model is closed"):
            call()
    m.close()  # idempotent


def test_numpy_int32_prompt_is_accepted(tiny_model):
    assert tiny_model.generate(np.array(P, dtype=np.int32), max_tokens=3)[:3] == P


# -- checkpoints --------------------------------------------------------------------------

@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.tinyloop"
    checkpoint.save(checkpoint.init_model(PRESETS["tiny"], 0), path)
    return path


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        Model(tmp_path / "nope.tinyloop")


@pytest.mark.parametrize("keep", [4, 100, -1000])
def test_truncated_file(good, keep):
    data = good.read_bytes()
    good.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(CheckpointError, match="truncated"):
        Model(good)


def test_not_a_safetensors_file(tmp_path):
    p = tmp_path / "junk.tinyloop"
    p.write_bytes(struct.pack("<Q", 5) + b"hello" + b"\0" * 32)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        Model(p)


def _rewrite(path, tensors=None, meta=None):
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = dict(f.metadata())
    t = tensors(t) if tensors else t
    m = meta(m) if meta else m
    save_file(t, str(path), metadata=m)


def test_unknown_version(good):
    _rewrite(good, meta=lambda m: {**m, "tinyloop.format_version": "99"})
    with pytest.raises(CheckpointError, match="unknown format version '99'"):
        Model(good)


def test_plain_safetensors_without_metadata(good):
    _rewrite(good, meta=lambda m: {})
    with pytest.raises(CheckpointError, match="not a .tinyloop checkpoint"):
        Model(good)


def test_missing_tensor(good):
    _rewrite(good, tensors=lambda t: {k: v for k, v in t.items() if k != "loop.0.ffn_norm.weight"})
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['loop.0.ffn_norm.weight'\]"):
        Model(good)


def test_shape_mismatch(good):
    _rewrite(good, tensors=lambda t: {**t, "norm.weight": torch.ones(3)})
    with pytest.raises(CheckpointError, match=r"shape mismatch for norm.weight: file has \(3,\)"):
        Model(good)


def test_inconsistent_config(good):
    bad = json.loads(PRESETS["tiny"].to_json()) | {"d_model": 66}
    _rewrite(good, meta=lambda m: {**m, "tinyloop.config": json.dumps(bad)})
    with pytest.raises(CheckpointError, match="invalid tinyloop.config: LoopedConfig: d_model"):
        Model(good)


def test_config_rejects_bad_options():
    with pytest.raises(ValueError, match="norm must be one of"):
        LoopedConfig(norm="post")
    with pytest.raises(ValueError, match="divisible by n_kv_heads"):
        LoopedConfig(n_heads=4, n_kv_heads=3)


def test_roundtrip_preserves_weights_and_config(good, tmp_path):
    m, meta = checkpoint.load(good)
    out = tmp_path / "again.tinyloop"
    checkpoint.save(m, out, dtype=torch.float16)
    m2, _ = checkpoint.load(out)
    assert m2.config == m.config == PRESETS["tiny"]
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert os.path.getsize(out) < 1_000_000
