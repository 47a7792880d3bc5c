"""Sampling on the GPU (runner/sampler.py): the captured sampler graph draws exactly the tokens
of the same ops launched one by one, for every row count and parameter mix, and a batched
step's streams on samplers that differ per stream each get their stream alone's tokens
(batch-invariant kernels: the lanes' logits are their streams alone's, bit for bit); the
uniforms come from the one-launch kernel, the torch spec's numbers.
Run on a GPU host: `pytest -m gpu tests/worker/test_gpu_sampling.py`."""
import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.decode import decode_steps
from tinyloop.worker.model.settings import Settings
from tinyloop.kernels.counter_hash import uniform_ref
from tinyloop.worker.runner.sampler import RowSampling, SamplingParams, sample_rows, uniform

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROWS = [SamplingParams(), SamplingParams(repetition_penalty=1.4), SamplingParams(0.9, 40, 0.95, 1.3),
        SamplingParams(0.7, 5), SamplingParams(1.2, 0, 0.8), SamplingParams(0.5, 100, 0.9),
        SamplingParams(1.0, 12, 1.0, 1.1), SamplingParams(2.0, 1)]
SAMPLERS = [dict(temperature=0.8, top_k=50, top_p=0.95), dict(temperature=1.0, top_k=0),
            dict(temperature=0.6, top_k=20, repetition_penalty=1.2), dict(temperature=0.0),
            dict(temperature=1.3, top_k=100, top_p=0.8), dict(temperature=0.0, repetition_penalty=1.3)]


@pytest.fixture(scope="module")
def models():
    # batch-invariant kernels: a lane of a batched step computes its stream alone's logits, bit
    # for bit, so every stream's tokens must match whatever its sampler
    kw = dict(max_seq_len=256, device="cuda", n_slots=16)
    with Model(settings=Settings(batch_invariant=True), **kw) as graphed, \
            Model(settings=Settings(batch_invariant=True, sampler_graphs=False), **kw) as eager:
        yield graphed, eager


def test_sampler_graph_equals_the_ops(models):
    m = models[0]
    V = m.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    for B in (1, 3, 8, 16):
        rows = [ROWS[(b * 3) % len(ROWS)] for b in range(B)]
        logits = torch.randn(B, V, device="cuda", generator=g) * 4
        seen = torch.rand(B, V, device="cuda", generator=g) < 0.2
        seeds, pos = list(range(5, 5 + B)), list(range(40, 40 + B))
        for _ in range(3):  # replays reuse the buffers
            got = m.runner.sample(logits, seen, rows, seeds, pos)
            want = sample_rows(logits, seen, RowSampling.of(rows, V, logits.device),
                               torch.tensor(seeds, device="cuda"), torch.tensor(pos, device="cuda"))
            assert torch.equal(got, want), B


def _alone(m, prompt, s):
    st = m.start(m.make_request(prompt, loops=8, max_tokens=64, stop_token_ids=[], seed=9, **s), 0)
    return [t for chunk in decode_steps(st) for t in chunk]


def test_streams_on_their_own_samplers_batched_equal_alone(models):
    graphed, eager = models
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 30, 9, 12, 21)]
    alone = [_alone(graphed, p, s) for p, s in zip(prompts, SAMPLERS)]
    assert alone == [_alone(eager, p, s) for p, s in zip(prompts, SAMPLERS)]
    b = Batcher(graphed.runner)
    out = []
    for lane, (p, s) in enumerate(zip(prompts, SAMPLERS)):
        ids, _ = b.join(graphed.start(graphed.make_request(p, loops=8, max_tokens=64, stop_token_ids=[], seed=9,
                                                           **s), lane))
        out.append(list(ids))
    while b:
        for lane, (ids, _) in b.step().items():
            out[lane].extend(ids)
    assert out == alone


def test_the_uniforms_are_the_launch_and_the_spec_s_numbers():
    g = torch.Generator().manual_seed(3)
    seed, pos = (torch.randint(-(1 << 62), 1 << 62, (4096,), generator=g) for _ in range(2))
    for stream in (0, 1, 2):
        got = uniform(seed.cuda(), pos.cuda(), stream)
        assert got.is_cuda and torch.equal(got.cpu(), uniform_ref(seed, pos, stream))
