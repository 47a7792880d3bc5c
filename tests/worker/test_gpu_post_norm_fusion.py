"""The CUDA decode step of a sandwich-norm model (Ouro's layers) with the post-norms in the
projections' prologues and the attention merged in its split kernel, against the step with the
norm launches and the merge kernel, both as a worker serves them (captured graphs): fp32 logits
within 1e-4 of each other and of the torch ops at every step, and the served step bitwise the
same when a stream is decoded twice (a fixed shape sums in a fixed order, whichever program of a
split merges), also with the L2 prefetch."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from model_zoo import TINY, write_checkpoint

from tinyloop.worker import Model
from tinyloop.worker.model.settings import Settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# Ouro-like: sandwich norms, a norm after every iteration, three loop layers, no prelude or coda;
# 128-wide heads so that the decode attention splits a 300-token context (LANE_SPLIT_LEN 128)
OURO_LIKE = dataclasses.replace(TINY, norm="sandwich", loop_final_norm=True, final_norm=False, n_prelude=0,
                                n_coda=0, n_loop_layers=3, d_model=256, n_heads=2, n_kv_heads=2, d_ff=704,
                                tie_embeddings=False, max_seq_len=512)
VARIANTS = {"fused": {}, "launched": {"fuse_post_norm": False, "attention_merge": "kernel"},
            "prefetch": {"l2_prefetch_mb": 0.25, "attention_prefetch": True}, "torch": {"backend": "torch"}}


def steps(path, variant: str, prompt: list[int], loops: int, n: int) -> torch.Tensor:
    """The prompt's logits, then n greedy decode steps' (the served path: graphs unless torch)."""
    fields = VARIANTS[variant]
    settings = dataclasses.replace(Settings(), **fields)
    with Model(path, device="cuda", dtype="float32", n_slots=1, max_seq_len=512, settings=settings,
               cuda_graphs=variant != "torch") as m:
        r = m.runner
        out = [r.prefill(0, prompt, loops).logits[0].clone()]
        toks = list(prompt) + [int(out[0].argmax())]
        for _ in range(n):
            out.append(r.decode([0], [toks[-1]], [len(toks) - 1], [loops]).logits[0].clone())
            toks.append(int(out[-1].argmax()))
        return torch.stack(out)


@pytest.mark.parametrize("loops", [1, 3])
def test_gpu_sandwich_decode_fused_equals_launched(tmp_path, loops):
    path = write_checkpoint(tmp_path / "ouro-like.tinyloop", OURO_LIKE, seed=11)
    prompt = torch.randint(0, OURO_LIKE.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    got = {v: steps(path, v, prompt, loops, 6) for v in VARIANTS}
    want = got["torch"]
    for v in ("fused", "launched", "prefetch"):
        err = ((got[v].cpu() - want.cpu()).norm(dim=-1) / want.cpu().norm(dim=-1)).max()
        assert err < 1e-4, (v, float(err))
    assert torch.equal(got["fused"], steps(path, "fused", prompt, loops, 6))
    assert torch.equal(got["prefetch"], got["fused"])  # the prefetch moves bytes, not values
