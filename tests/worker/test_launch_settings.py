"""How the Triton launches run is Settings' (pdl, autotune, gemv_tiles), read from the environment
by Settings.from_env alone and handed to every launcher as an explicit argument by the ops. The
Triton backend runs on a CPU under TRITON_INTERPRET=1 here (conftest), so these check the
arguments each launch receives; what PDL does on the GPU is the GPU tests'."""
import dataclasses
import importlib
import json

import pytest
import torch

from model_zoo import TINY, write_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.ops import Ops, select_ops
from tinyloop.worker.model.settings import Settings

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KEY = [448, 320, True, False, False, True]


def tiles_file(tmp_path) -> str:
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": [[KEY, [8, 64, 4, 1]]]}))
    return str(path)


def test_launch_settings_from_the_environment(tmp_path):
    """TINYLOOP_PDL, TINYLOOP_AUTOTUNE and TINYLOOP_GEMV_TILES reach Settings (the defaults:
    PDL where the hardware allows it, no autotuning, the code's tiles); launch_pdl is the `pdl=`
    a launcher takes from them."""
    default = Settings.from_env({})
    assert (default.pdl, default.autotune, default.gemv_tiles, default.launch_pdl) == (True, False, None, None)
    path = tiles_file(tmp_path)
    s = Settings.from_env({"TINYLOOP_PDL": "0", "TINYLOOP_AUTOTUNE": "1", "TINYLOOP_GEMV_TILES": path})
    assert (s.pdl, s.autotune, s.gemv_tiles, s.launch_pdl) == (False, True, path, False)
    assert Settings.from_env({"TINYLOOP_PDL": "1", "TINYLOOP_AUTOTUNE": "0"}) == default


def test_triton_ops_carry_the_launch_settings(tmp_path, monkeypatch):
    """select_ops hands pdl, autotune and the gemv tiles file to the Triton launchers: each
    launcher that can use PDL is bound to Settings' pdl (None: the hardware decides; False:
    off), the projection to the file's tables and autotune; the torch backend carries pdl for
    the runner's own greedy_feed. A tiles file that is none is refused when the ops are built."""
    gemv_mod = importlib.import_module("tinyloop.kernels.gemv")
    seen = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    path = tiles_file(tmp_path)
    ops = select_ops(DEV, "triton", gemv_tiles=path, pdl=False, autotune=True)
    assert (ops.pdl, ops.autotune) == (False, True)
    assert ops.gemv_tables == ({tuple(KEY): (8, 64, 4, 1)}, {})
    for launcher in (ops.rms_norm, ops.decode_attention, ops.rope_decode_attention, ops.rope_chunk_attention,
                     ops.rope_tree_attention, ops.int4[0]):
        assert launcher.keywords["pdl"] is False, launcher
    x, w = torch.randn(1, 1, 16, device=DEV), torch.randn(8, 16, device=DEV)
    torch.testing.assert_close(ops.gemv(x, w), x @ w.t())
    assert {k: seen[-1][k] for k in ("pdl", "tables", "autotune")} == {
        "pdl": False, "tables": ops.gemv_tables, "autotune": True}

    default = select_ops(DEV, "triton")
    assert (default.pdl, default.autotune, default.gemv_tables) == (None, False, None)
    assert all(f.keywords["pdl"] is None for f in (default.rms_norm, default.rope_decode_attention, default.int4[0]))
    default.gemv(x, w)
    assert {k: seen[-1][k] for k in ("pdl", "tables", "autotune")} == {"pdl": None, "tables": None, "autotune": False}
    assert select_ops(DEV, "torch", pdl=False).pdl is False and Ops().pdl is None

    (tmp_path / "bad.json").write_text('{"tiles": [[[1, 2], [8, 64, 4, 1]]]}')
    with pytest.raises(ValueError, match=r"gemv tiles .*bad.json.*a key is \[N, K, norm, swiglu, residual, pdl\]"):
        select_ops(DEV, "triton", gemv_tiles=str(tmp_path / "bad.json"))


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
def test_every_launch_of_the_engine_gets_settings_pdl(ckpt_dir, tmp_path, monkeypatch, pdl):
    """A Model on the Triton backend passes Settings.pdl to every launch that can use PDL: the
    projections, the decode attention ops (decode steps and chunks), the sandwich post-norm's
    rms_norm(skip=), and the greedy_feed of the captured decode step and of the device rounds,
    whichever path runs them (None while pdl is on: the hardware decides)."""
    want = None if pdl else False
    calls = []

    def spy(module, name):
        mod = importlib.import_module(module)
        real = getattr(mod, name)

        def launch(*args, **kw):
            calls.append((name, kw.get("pdl", "none given")))
            return real(*args, **kw)
        monkeypatch.setattr(mod, name, launch)

    for module, name in [("tinyloop.kernels.gemv", "gemv"), ("tinyloop.kernels.rmsnorm", "rms_norm"),
                         ("tinyloop.kernels.decode_attention", "rope_decode_attention"),
                         ("tinyloop.kernels.decode_attention", "rope_chunk_attention"),
                         ("tinyloop.worker.runner.graphs", "greedy_feed"),
                         ("tinyloop.worker.runner.rounds", "greedy_feed_ref")]:
        spy(module, name)
    cfg = dataclasses.replace(TINY, norm="sandwich", d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)
    path = write_checkpoint(ckpt_dir / "sandwich-launch.tinyloop", cfg, seed=3)
    with Model(path, max_seq_len=32, n_slots=2, dtype="float32", backend="triton", cuda_graphs=False,
               settings=Settings(pdl=pdl, batch_invariant=True, device_rounds=True)) as m:
        assert m.runner.ops.pdl is want
        m.generate([3, 17, 42], loops=2, max_tokens=2)
        m.generate_speculative([3, 17, 42], max_tokens=2, draft_loops=1, verify_loops=2, draft_ahead=1)
        from tinyloop.kernels.gemv import ARGMAX_KEY_NONE
        from tinyloop.worker.runner.graphs import decode_step
        e = m.runner.engine
        host = torch.zeros(2, dtype=torch.int64)
        decode_step(e, torch.tensor([0]), 2, torch.tensor([[5]]), torch.tensor([[3]]), host,
                    e.model.tok_embeddings.weight[5].view(1, 1, -1).clone(),
                    torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.int64))
    names = {name for name, _ in calls}
    assert {"gemv", "rms_norm", "rope_decode_attention", "rope_chunk_attention", "greedy_feed",
            "greedy_feed_ref"} <= names, names
    assert {value for _, value in calls} == {want}, sorted(set(calls))
