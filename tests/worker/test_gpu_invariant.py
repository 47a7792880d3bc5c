"""Bit-exact in bf16 on the GPU with batch-invariant kernels (Settings.batch_invariant): greedy
speculative chains equal generate(loops=verify_loops), sampled chains' rounds on the device
decide as their host-driven rounds, every lane of a mixed-depth batch its
stream alone, greedy resume from every L_used a fresh generate, and a stream that joins or
leaves a running batch keeps its tokens, over 128 generated tokens, on the embedded default
model and on a random bench-285m (whose logits have many near ties).
Run on a GPU host: `pytest -m gpu tests/worker/test_gpu_invariant.py`."""
import dataclasses
import tempfile

import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.decode import start
from tinyloop.worker.model import checkpoint
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.model.settings import Settings

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
N = 128
INVARIANT = Settings(batch_invariant=True)


def _bench_285m() -> str:
    cfg = dataclasses.replace(PRESETS["bench-285m"], max_loops=8)
    path = f"{tempfile.gettempdir()}/bench-285m-invariant.tinyloop"
    checkpoint.save(checkpoint.init_model(cfg, 0), path, dtype=torch.bfloat16)
    return path


@pytest.fixture(scope="module", params=["default", "bench-285m"])
def model(request):
    path = None if request.param == "default" else _bench_285m()
    with Model(path, max_seq_len=512, device="cuda", dtype="bfloat16", n_slots=64, max_loops=8,
               settings=INVARIANT) as m:
        vocab = m.config.vocab_size
        gen = torch.Generator().manual_seed(1)
        m.prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 17, 40, 100)]
        yield m


def test_the_rounds_run_on_the_device(model):
    assert model.runner.settings.device_rounds and model.runner.ops.invariant


@pytest.mark.parametrize("draft_loops", [1, 2, 4])
def test_chain_speculative_equals_generate(model, draft_loops):
    for p in model.prompts:
        want = model.generate(p, loops=8, max_tokens=N)
        got = model.generate_speculative(p, max_tokens=N, draft_loops=draft_loops, verify_loops=8, draft_ahead=4)
        assert got == want
        assert got.stats["accepted_tokens"] > 0 or model.config.vocab_size > 256


@pytest.mark.parametrize("K", [1, 2, 4])
def test_tree_speculative_equals_generate(model, K):
    for p in model.prompts:
        assert model.generate_tree_speculative(p, max_tokens=N, draft_loops=2, verify_loops=8, draft_ahead=4,
                                               K_branches=K) == model.generate(p, loops=8, max_tokens=N)


def test_chain_speculative_on_the_host_path_equals_generate(model):
    """Without device rounds (the path sampled chains take) the verify is still exact."""
    r = model.runner
    r.settings = dataclasses.replace(r.settings, device_rounds=False)
    try:
        for p in model.prompts[:2]:
            assert model.generate_speculative(p, max_tokens=N, draft_loops=2, verify_loops=8) == \
                model.generate(p, loops=8, max_tokens=N)
    finally:
        r.settings = dataclasses.replace(r.settings, device_rounds=True)


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_k=50, top_p=0.95), dict(temperature=1.0, top_k=0)])
def test_sampled_rounds_on_the_device_decide_as_the_host_driven_rounds(model, sampling):
    """A sampled chain's round captured whole (drafts, acceptance and residual draws on the
    device) emits the host-driven rounds' tokens, bit for bit."""
    r = model.runner
    for i, p in enumerate(model.prompts[:2]):
        kw = dict(max_tokens=N, draft_loops=2, verify_loops=8, draft_ahead=4, seed=17 + i, **sampling)
        got = model.generate_speculative(p, **kw)
        r.settings = dataclasses.replace(r.settings, device_rounds=False)
        try:
            want = model.generate_speculative(p, **kw)
        finally:
            r.settings = dataclasses.replace(r.settings, device_rounds=True)
        assert got == want and got.stats["accepted_tokens"] == want.stats["accepted_tokens"]
    assert any(key[3] is not None for key in r._rounds)


@pytest.mark.parametrize("B", [2, 4, 8, 16, 64])
def test_every_lane_of_a_mixed_depth_batch_equals_its_stream_alone(model, B):
    prompts = [model.prompts[i % len(model.prompts)] for i in range(B)]
    depths = [1 + (i * 5) % 8 for i in range(B)]
    batch = model.generate_batch(prompts, per_lane_loops=depths, max_tokens=N)
    for p, L, got in zip(prompts, depths, batch):
        assert got == model.generate(p, loops=L, max_tokens=N)


@pytest.mark.parametrize("L_used", range(0, 8))
def test_greedy_resume_equals_a_fresh_generate(model, L_used):
    for p in model.prompts[:2]:
        h = model.build_resume_handle(p, L_used=L_used, max_loops=8)
        try:
            assert model.resume_generate(h, 8, max_tokens=N) == model.generate(p, loops=8, max_tokens=N)
        finally:
            model.free_resume_handle(h)


def test_a_stream_that_joins_or_leaves_a_running_batch_keeps_its_tokens(model):
    """Streams join a running batched decode at different steps and end at different lengths:
    each one's tokens equal its run alone."""
    r = model.runner
    lengths = [N, 40, N, 70]
    reqs = [model.make_request(p, loops=8, max_tokens=n) for p, n in zip(model.prompts, lengths)]
    joins = [0, 0, 25, 60]  # the step at which each stream joins
    b = Batcher(r)
    index, got = {}, [[] for _ in reqs]  # lane -> request
    step = 0
    try:
        while step == 0 or b:
            for i, at in enumerate(joins):
                if at == step:
                    lane = r.lanes.acquire()
                    index[lane] = i
                    new, _ = b.join(start(r, lane, reqs[i]))
                    got[i] += new
            for lane, update in b.step().items():
                new, _ = update
                got[index[lane]] += new
            step += 1
    finally:
        for lane in index:
            r.lanes.release(lane)
    for req, n, ids in zip(reqs, lengths, got):
        assert req.prompt + ids == model.generate(req.prompt, loops=8, max_tokens=n)
