"""A sandwich-norm model's one-lane decode step with its post-norms in the next projections'
prologues (Block.token_step with fuse_post_norm: kernels.gemv's skip=), against the same fused
step with a norm launch per post-norm (fuse_post_norm=False) and against the torch ops: the same
logits at every step and the same greedy tokens, with one norm launch per iteration instead of
two per layer. An Ouro-like block (no prelude or coda, three layers, a norm at the end of every
iteration, untied head), so a layer's deferred post-MLP norm meets the next layer's q|k|v
projection, and the last layer's meets the iteration's end. On CPU the kernels run under the
Triton interpreter."""
import dataclasses

import pytest
import torch
from model_zoo import TINY, write_checkpoint

from tinyloop.kernels.gemv import gemv
from tinyloop.kernels.rmsnorm import rms_norm
from tinyloop.kernels.swiglu import swiglu
from tinyloop.worker import Model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [200, 1, 1, 5, 9, 31, 64, 128, 250, 11]
OURO_LIKE = dataclasses.replace(TINY, norm="sandwich", loop_final_norm=True, final_norm=False, n_prelude=0,
                                n_coda=0, n_loop_layers=3, n_kv_heads=4, tie_embeddings=False)


def model(path) -> Model:
    return Model(path, max_seq_len=64, device=DEVICE, dtype="float32", backend="torch", cuda_graphs=False)


def counted(m: Model, fuse_post_norm: bool) -> dict:
    """m on the fused projections, counting the projections with the prologue and the norm
    launches with a skip (the post-norms written by a launch of their own)."""
    n = {"prologue": 0, "post_norm_launch": 0, "projection": 0}

    def norm(x, w, eps, **kw):
        n["post_norm_launch"] += "skip" in kw
        return rms_norm(x, w, eps, **kw)

    def proj(*a, **kw):
        n["projection"] += 1
        n["prologue"] += "skip" in kw
        return gemv(*a, **kw)
    m._module.use_fast_path(norm, proj, swiglu=swiglu, fuse_post_norm=fuse_post_norm)
    return n


def decode_logits(m: Model, loops: int, toks: list[int], T0: int) -> torch.Tensor:
    r = m.runner
    steps = [r.prefill(0, toks[:T0], loops).logits[0]]
    for pos in range(T0, len(toks)):
        steps.append(r.decode([0], [toks[pos]], [pos], [loops]).logits[0].clone())
    return torch.stack(steps)


def test_post_norms_in_the_prologues_match_the_launches(tmp_path, loops=2):
    path = write_checkpoint(tmp_path / "ouro-like.tinyloop", OURO_LIKE, seed=3)
    with model(path) as ref, model(path) as fused, model(path) as launched:
        counts = {True: counted(fused, True), False: counted(launched, False)}
        toks = PROMPT + ref.generate(PROMPT, loops=loops, max_tokens=3)[len(PROMPT):]
        steps = len(toks) - len(PROMPT)
        want = decode_logits(ref, loops, toks, len(PROMPT))
        for m, fuse in ((fused, True), (launched, False)):
            before = dict(counts[fuse])
            got = decode_logits(m, loops, toks, len(PROMPT))
            n = {k: v - before[k] for k, v in counts[fuse].items()}
            layers = OURO_LIKE.n_loop_layers * loops * steps  # the decode steps' layers
            prompt_norms = OURO_LIKE.n_loop_layers * loops  # the prompt's post-MLP norm launches
            assert n["projection"] == 4 * layers + steps + 1, n  # and the head, the prompt's last token's too
            if fuse:
                # gate|up carries every post-attention norm, q|k|v every post-MLP norm but each
                # iteration's last, which the iteration's end writes with one launch
                assert n["prologue"] == 2 * layers - loops * steps, n
                assert n["post_norm_launch"] == loops * steps + prompt_norms, n
            else:
                assert n["prologue"] == 0 and n["post_norm_launch"] == 2 * layers + prompt_norms, n
            assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-4, fuse
            assert m.generate(PROMPT, loops=loops, max_tokens=3) == toks


def test_settings_of_the_decode_step_fusions():
    """fuse_post_norm, attention_merge, attention_split_len and l2_prefetch_mb: their defaults,
    their environment variables, and a ValueError naming a bad value."""
    from tinyloop.worker.model.settings import Settings
    s = Settings()
    assert (s.fuse_post_norm, s.attention_merge, s.attention_split_len, s.l2_prefetch_mb,
            s.attention_prefetch) == (True, "split", 128, 0.0, False)
    s = Settings.from_env({"TINYLOOP_FUSE_POST_NORM": "0", "TINYLOOP_ATTENTION_MERGE": "kernel",
                           "TINYLOOP_ATTENTION_SPLIT_LEN": "256", "TINYLOOP_L2_PREFETCH_MB": "12",
                           "TINYLOOP_ATTENTION_PREFETCH": "1"})
    assert (s.fuse_post_norm, s.attention_merge, s.attention_split_len, s.l2_prefetch_mb,
            s.attention_prefetch) == (False, "kernel", 256, 12.0, True)
    for bad, match in (({"attention_merge": "tree"}, "attention_merge must be one of"),
                       ({"attention_split_len": 0}, "attention_split_len must be >= 1"),
                       ({"l2_prefetch_mb": -1.0}, r"l2_prefetch_mb must be in \[0, 1024\)")):
        with pytest.raises(ValueError, match=match):
            Settings(**bad)
