"""Which decode-step weights stay in L2 (worker/model/modules.py: l2_keep, Block.eviction): the
shared block's largest projections that fit Settings.l2_keep_fraction of the L2, loaded
"evict_last"; every other weight Settings.l2_stream. Logits do not depend on it (tests/kernels/test_kernel_gemv.py)."""
import pytest
import torch

from tinyloop.kernels.gemv import gemv
from tinyloop.kernels.rmsnorm import rms_norm
from tinyloop.worker.model.config import PRESETS, LoopedConfig
from tinyloop.worker.model.modules import LoopedTransformer, l2_keep
from tinyloop.worker.model.settings import Settings

KEEP, STREAM = Settings().l2_keep_fraction, Settings().l2_stream

MIB = 2**20


def block_bytes(cfg: LoopedConfig, dtype_bytes: int = 2) -> dict[str, int]:
    """Each projection's weight bytes over the shared block's layers."""
    hd = cfg.d_model // cfg.n_heads
    per_layer = {"wqkv": (cfg.n_heads + 2 * cfg.n_kv_heads) * hd * cfg.d_model,
                 "wo": cfg.d_model * cfg.n_heads * hd, "w13": 2 * cfg.d_ff * cfg.d_model,
                 "w2": cfg.d_model * cfg.d_ff}
    return {n: v * dtype_bytes * cfg.n_loop_layers for n, v in per_layer.items()}


def test_l2_keep_takes_the_largest_that_fit():
    nbytes = {"a": 30, "b": 25, "c": 10, "d": 8}
    assert l2_keep(nbytes, 40) == {"a", "c"}  # b would overflow after a; d after a + c
    assert l2_keep(nbytes, 45) == {"a", "c"}
    assert l2_keep(nbytes, 48) == {"a", "c", "d"}
    assert l2_keep(nbytes, 9) == {"d"}
    assert l2_keep(nbytes, 0) == frozenset()


def test_l2_plan_of_the_timing_models_on_the_h200s_l2():
    """bench-285m's one-layer block keeps q|k|v and wo (33.6 MB: the best pair measured on the
    H200, whose L2 CUDA reports as 60 MiB); the Ouro-1.4B shapes' 24-layer block cannot keep
    even one projection."""
    budget = KEEP * 60 * MIB
    assert l2_keep(block_bytes(PRESETS["bench-285m"]), budget) == {"wqkv", "wo"}
    assert l2_keep(block_bytes(PRESETS["ouro-1.4b"]), budget) == frozenset()


def test_only_the_shared_block_keeps_and_not_off_cuda():
    cfg = LoopedConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1,
                       n_loop_layers=2, n_coda=1, max_seq_len=32)
    m = LoopedTransformer(cfg)
    m.use_fast_path(rms_norm, gemv)
    assert [b.loop_layers for b in m.prelude] == [0] and [b.loop_layers for b in m.loop] == [2, 2]
    assert [b.loop_layers for b in m.coda] == [0]
    # on CPU there is no L2 to keep a weight in: every weight streams
    for block in (*m.prelude, *m.loop, *m.coda):
        assert {block.eviction(n) for n in block.projections()} == {STREAM}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_l2_plan_on_the_gpu():
    """bench-285m on the GPU: the shared block's loads follow l2_keep for this device's L2 (on
    the H200: q|k|v and wo evict_last), the prelude's all stream."""
    with torch.device("cuda"):
        m = LoopedTransformer(PRESETS["bench-285m"]).to(torch.bfloat16)
    m.use_fast_path(rms_norm, gemv)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    kept = l2_keep(block_bytes(PRESETS["bench-285m"]), KEEP * l2)
    if torch.cuda.get_device_name(0) == "NVIDIA H200":
        assert kept == {"wqkv", "wo"}
    loop, = m.loop
    assert {n for n in loop.projections() if loop.eviction(n) == "evict_last"} == kept
    assert {n: loop.eviction(n) for n in loop.projections() if n not in kept} == \
        {n: STREAM for n in loop.projections() if n not in kept}
    for block in m.prelude:
        assert {block.eviction(n) for n in block.projections()} == {STREAM}
    # the pick follows the setting (bench/ab.py builds a model per variant)
    m.use_fast_path(rms_norm, gemv, l2_keep_fraction=0.0)
    assert {loop.eviction(n) for n in loop.projections()} == {STREAM}
    m.use_fast_path(rms_norm, gemv, l2_keep_fraction=KEEP)
    assert {n for n in loop.projections() if loop.eviction(n) == "evict_last"} == kept


def test_settings_from_the_environment_and_their_errors():
    s = Settings.from_env({"TINYLOOP_L2_KEEP_FRACTION": "0.5", "TINYLOOP_CUDA_GRAPHS": "0",
                           "TINYLOOP_FUSED_ROWS": "16", "TINYLOOP_L2_STREAM": ""})
    assert (s.l2_keep_fraction, s.cuda_graphs, s.fused_rows, s.l2_stream) == (0.5, False, 16, "")
    assert Settings.from_env({}) == Settings()
    with pytest.raises(ValueError, match="TINYLOOP_FUSED_ROWS='x'"):
        Settings.from_env({"TINYLOOP_FUSED_ROWS": "x"})
    with pytest.raises(ValueError, match="l2_keep_fraction must be in"):
        Settings(l2_keep_fraction=1.5)
    with pytest.raises(ValueError, match="backend must be"):
        Settings(backend="cuda")
    assert Settings().replace(backend=None, fused_rows=4) == Settings(fused_rows=4)
