"""The fused single-token layer step (Block.token_step on kernels/gemv.py, what CUDA decode
runs) and the fused prompt layer (the residual add in the norm kernel, kernels.swiglu) against
the unfused layer: same logits at every step, the prompt's included, same greedy tokens. On CPU
the Triton kernels run under the interpreter; on a GPU host, on the GPU (fp32, both models on
the torch reference ops but for the fused parts, no graphs)."""
import pytest
import torch

from tinyloop.kernels.gemv import gemv
from tinyloop.kernels.rmsnorm import rms_norm
from tinyloop.kernels.swiglu import swiglu
from tinyloop.worker import Model

PROMPT = [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def model(path, **kw) -> Model:
    return Model(path, max_seq_len=64, device=DEVICE, dtype="float32", backend="torch", cuda_graphs=False, **kw)


def decode_logits(m: Model, loops: int, toks: list[int], T0: int) -> torch.Tensor:
    """The prompt's last logits, then every decode step's, on lane 0 (the runner's stages, eager)."""
    r = m.runner
    steps = [r.prefill(0, toks[:T0], loops).logits[0]]
    for pos in range(T0, len(toks)):
        steps.append(r.decode([0], [toks[pos]], [pos], [loops]).logits[0].clone())
    return torch.stack(steps)


@pytest.mark.parametrize("config_path", ["gqa-prelude-coda", "sandwich", "untied-2-layer-block"], indirect=True)
def test_fused_token_step_matches_unfused(config_path, loops=2):
    with model(config_path) as ref, model(config_path) as fused:
        calls, acts = [], []
        fused._module.use_fast_path(rms_norm, gemv,
                                    swiglu=lambda g, u: acts.append(g.shape[-2]) or swiglu(g, u))
        for blk in fused._module.modules():
            if hasattr(blk, "token_step"):
                blk.gemv = lambda *a, _g=gemv, **k: calls.append(1) or _g(*a, **k)
        toks = PROMPT + ref.generate(PROMPT, loops=loops, max_tokens=4)[len(PROMPT):]
        want = decode_logits(ref, loops, toks, len(PROMPT))
        got = decode_logits(fused, loops, toks, len(PROMPT))
        assert calls, "the fused step never ran"
        assert len(PROMPT) in acts, "the prompt's feed-forward never ran the fused SwiGLU"
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-4
        assert fused.generate(PROMPT, loops=loops, max_tokens=4) == toks


@pytest.mark.parametrize("config_path", ["gqa-prelude-coda", "sandwich"], indirect=True)
def test_fused_batched_step_matches_unfused(config_path):
    """A batched decode step (the Batcher's waiting streams, on any lanes: a hole at 2, lane 0
    unused) through the fused projections of up to 16 rows: each stream's greedy tokens are its
    unfused stream's, and every step's logits agree to 1e-4, as streams finish and the step
    shrinks from 3 rows to 1."""
    from tinyloop.worker.generation.batcher import Batcher
    jobs = {1: (PROMPT, 2, 5), 3: (PROMPT[:4], 3, 4), 4: ([7, 7, 1], 1, 3)}
    with model(config_path, n_slots=5) as ref, model(config_path, n_slots=5) as fused:
        fused._module.use_fast_path(rms_norm, gemv, gemv_rows=16)
        rows = []
        for blk in fused._module.modules():
            if hasattr(blk, "token_step"):
                blk.gemv = lambda x, *a, _g=gemv, **k: rows.append(x.numel() // x.shape[-1]) or _g(x, *a, **k)
        out = {}
        for m in (ref, fused):
            b = Batcher(m.runner)
            got = {}
            for lane, (p, L, n) in jobs.items():
                ids, _ = b.join(m.start(m.make_request(p, loops=L, max_tokens=n, stop_token_ids=[]), lane))
                got[lane] = (list(ids), [])
            while b:
                for lane, (ids, _) in b.step().items():
                    got[lane][0].extend(ids)
                    got[lane][1].append(b.states[lane].logits.clone() if lane in b.states else None)
            out[m is fused] = got
        assert 3 in rows and 2 in rows, "the fused step never ran on the batch's 3, then 2 lanes"
        for lane in jobs:
            (want, wl), (have, hl) = out[False][lane], out[True][lane]
            assert have == want, lane
            for a, c in zip(wl, hl):
                if a is not None:
                    assert ((c - a).norm() / a.norm()) < 1e-4, lane


@pytest.mark.parametrize("config_path", ["gqa-prelude-coda", "untied-2-layer-block"], indirect=True)
def test_decode_step_feeds_its_greedy_token_embedded(config_path, loops=2):
    """graphs.decode_step, the step the decode graphs capture, fed by its own tail: the head's
    argmax key and greedy_feed (x: the token embedded) on the fused projections, and the same
    on the torch ops (the key from the logits), on the cache lane in its `slot` buffer (lane 2
    here: the graph of a depth serves every lane), give the greedy stream of generate() and the
    logits of the unfused step at every position, leave the key NONE between steps, keep
    host[p % 2] the token at p, and return the residual the coda and head start from."""
    from tinyloop.kernels.gemv import ARGMAX_KEY_NONE
    from tinyloop.worker.runner.graphs import decode_step
    with model(config_path) as ref, model(config_path) as fused:
        fused._module.use_fast_path(rms_norm, gemv)
        toks = ref.generate(PROMPT, loops=loops, max_tokens=5)
        want = decode_logits(ref, loops, toks, len(PROMPT))[1:]
        T0 = len(PROMPT)
        lane = 2
        for m in (fused, ref):
            e = m.runner.engine
            m.runner.prefill(lane, PROMPT, loops)
            slot = torch.tensor([lane], device=DEVICE)
            table = e.model.tok_embeddings.weight.detach()
            tokens = torch.tensor([[toks[T0]]], device=DEVICE)
            positions = torch.tensor([[T0]], device=DEVICE)
            host = torch.full((2,), -1, dtype=torch.int64)
            host = host.pin_memory() if DEVICE == "cuda" else host
            key = torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.int64, device=DEVICE)
            x = table[toks[T0]].view(1, 1, -1).clone()
            got = []
            for step in range(4):
                logits, greedy, h = decode_step(e, slot, loops, tokens, positions, host, x, key)
                got.append(logits[0].clone())
                p = T0 + 1 + step
                assert greedy.item() == toks[p] == tokens.item() == host[p % 2].item() and positions.item() == p
                assert int(key) == ARGMAX_KEY_NONE and torch.equal(x.view(-1), table[toks[p]])
                # h is the residual after the loop: the coda and head from it give the logits again
                at = e.make_pass(slot, torch.tensor([[p - 1]], device=DEVICE), e.cache.max_seq_len)
                assert torch.equal(e.logits(e.coda(h.clone(), at), at)[:, -1], logits)
            got = torch.stack(got)
            assert ((got - want[:4]).norm(dim=-1) / want[:4].norm(dim=-1)).max() < 1e-4
