"""RoPE from the model's fp32 tables: the tables hold the per-position formula, survive the cast
to the serving dtype, feed every path that needs rows (a decode step on the full cache gathers
none: its attention op reads the tables), and positions past them are computed."""
import pytest
import torch

from model_zoo import CONFIGS
from tinyloop.worker import Model
from tinyloop.worker.model.cache import KVCache
from tinyloop.worker.model.modules import LoopedTransformer
from tinyloop.worker.model.ops import Ops
from tinyloop.worker.runner.engine import Engine
from tinyloop.worker.runner.stages import BatchStep, PaddedPrefill

# torch's CPU cos / sin may differ by an ulp between its vectorized and scalar loops, so the
# same angle computed in another tensor shape is only guaranteed within that
ULP = dict(rtol=0, atol=2.5e-7)


def formula(model, positions):
    """The angles of positions (B, T) as the engine computed them per step before the tables."""
    ang = positions.to(torch.float32)[..., None] * model.inv_freq
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tables_hold_the_formula(name):
    model = LoopedTransformer(CONFIGS[name])
    P = CONFIGS[name].max_seq_len
    assert model.rope_cos.shape == model.rope_sin.shape == (P, CONFIGS[name].head_dim // 2)
    cos, sin = formula(model, torch.arange(P)[:, None])  # one row per position, as a decode step
    torch.testing.assert_close(model.rope_cos, cos[:, 0], **ULP)
    torch.testing.assert_close(model.rope_sin, sin[:, 0], **ULP)
    positions = torch.tensor([[0, 5, P - 1], [7, 7, 1]])
    assert all(torch.equal(r, t[positions]) for r, t in
               zip(model.rope_rows(positions, P), (model.rope_cos, model.rope_sin)))


def test_rows_past_the_tables_are_computed():
    model = LoopedTransformer(CONFIGS["gqa-prelude-coda"])
    P = model.rope_cos.shape[0]
    positions = torch.tensor([[P - 1, P, P + 40]])
    for got, want in zip(model.rope_rows(positions, P + 41), formula(model, positions)):
        assert torch.equal(got, want)


def test_tables_stay_fp32_in_a_bf16_model(tiny_path):
    """Module.to(dtype) casts floating buffers: the tables (and inv_freq) are kept as int32 bits,
    so a bf16 model rotates by the same fp32 angles as the fp32 model, and no checkpoint
    carries them."""
    fresh = LoopedTransformer(CONFIGS["gqa-prelude-coda"])
    with Model(tiny_path, max_seq_len=64, dtype="bfloat16") as m:
        model = m._module
        assert model.tok_embeddings.weight.dtype == torch.bfloat16
        for name in ("inv_freq", "rope_cos", "rope_sin"):
            assert getattr(model, name).dtype == torch.float32
            assert torch.equal(getattr(model, name).cpu(), getattr(fresh, name)), name
        assert not [k for k in model.state_dict() if "rope" in k or "freq" in k]


def test_decode_steps_gather_no_rows(tiny_model):
    """A decode step on the full cache leaves its pass's rows ungathered (its attention op reads
    the tables), batched or not; a prefill pass gathers them once, from the tables; a padded
    prefill's stages (what the prefill graphs replay) gather theirs once at construction."""
    e = tiny_model.runner.engine
    prompt = torch.tensor([[3, 17, 42, 99, 7]])
    lane = torch.tensor([1])
    p = e.make_pass(lane, torch.arange(5)[None], 5)
    e.forward(prompt, p, 2)
    assert torch.equal(p.rows[0], e.model.rope_cos[:5][None]) and torch.equal(p.rows[1], e.model.rope_sin[:5][None])
    step = e.make_pass(lane, torch.tensor([[5]]), 6)
    e.forward(torch.tensor([[8]]), step, 2)
    assert step.rows is None
    batch = BatchStep(e, 2)
    batch.load([1], [1], [6], [2])  # a live lane and an idle one
    for stage in BatchStep.stages(2):
        batch.run(stage)
    assert batch.p.rope is None and batch.p.rows is None
    pre = PaddedPrefill(e, 16)
    rows = pre.p.rows
    assert torch.equal(rows[0], e.model.rope_cos[:16][None]) and torch.equal(rows[1], e.model.rope_sin[:16][None])
    pre.load_tokens(1, prompt[0].tolist())
    for stage in PaddedPrefill.stages(2):
        pre.run(stage)
    assert pre.p.rows is rows  # the same buffers: a replayed stage reads what construction gathered


def test_engine_needs_tables_as_long_as_its_cache():
    cfg = CONFIGS["gqa-prelude-coda"]
    model = LoopedTransformer(cfg)
    cache = KVCache(cfg, 1, cfg.max_seq_len + 1, 2, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="needs RoPE tables that long"):
        Engine(model, cache, Ops())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tables_stay_fp32_on_a_bf16_cuda_model(tiny_path):
    """On the GPU too: the tables the decode kernel gathers from are the fp32 ones built at init."""
    fresh = LoopedTransformer(CONFIGS["gqa-prelude-coda"])
    with Model(tiny_path, max_seq_len=64, device="cuda", dtype="bfloat16", cuda_graphs=False) as m:
        for name in ("inv_freq", "rope_cos", "rope_sin"):
            t = getattr(m._module, name)
            assert t.is_cuda and t.dtype == torch.float32
            assert torch.equal(t.cpu(), getattr(fresh, name)), name
