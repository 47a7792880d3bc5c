"""The fused single-token layer step (Block.token_step on kernels/gemv.py, what CUDA decode
runs) against the unfused layer: same logits at every decode step, same greedy tokens. On CPU
the Triton kernels run under the interpreter."""
import pytest
import torch

from tinyloop.kernels.gemv import gemv
from tinyloop.kernels.rmsnorm import rms_norm
from tinyloop.worker import Model
from tinyloop.worker.generate import prefill

PROMPT = [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]


def decode_logits(m: Model, loops: int, toks: list[int], T0: int) -> torch.Tensor:
    e = m.engine
    logits, _ = prefill(e, 0, toks[:T0], loops, 0)
    steps = [logits[0]]
    for pos in range(T0, len(toks)):
        p = e.make_pass(slice(0, 1), torch.tensor([[pos]]), pos + 1)
        steps.append(e.forward(torch.tensor([[toks[pos]]]), p, loops)[0, -1])
    return torch.stack(steps)


@pytest.mark.parametrize("config_path", ["gqa-prelude-coda", "sandwich", "untied-2-layer-block"], indirect=True)
def test_fused_token_step_matches_unfused(config_path, loops=2):
    with Model(config_path, max_seq_len=64) as ref, Model(config_path, max_seq_len=64) as fused:
        fused._module.use_fast_path(rms_norm, gemv)
        calls = []
        for blk in fused._module.modules():
            if hasattr(blk, "token_step"):
                blk.gemv = lambda *a, _g=gemv, **k: calls.append(1) or _g(*a, **k)
        toks = PROMPT + ref.generate(PROMPT, loops=loops, max_tokens=4)[len(PROMPT):]
        want = decode_logits(ref, loops, toks, len(PROMPT))
        got = decode_logits(fused, loops, toks, len(PROMPT))
        assert calls, "the fused step never ran"
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-4
        assert fused.generate(PROMPT, loops=loops, max_tokens=4) == toks
