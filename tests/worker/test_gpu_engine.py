"""The CUDA path (Triton ops + captured decode graphs) against the torch reference path.
Run on a GPU host: `pytest -m gpu tests/worker/test_gpu_engine.py`."""
import pytest
import torch

from tinyloop.worker import Model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]]


@pytest.fixture(scope="module")
def pair(tiny_path):
    fast = Model(tiny_path, max_seq_len=256, device="cuda", dtype="float32", n_slots=2)
    ref = Model(tiny_path, max_seq_len=256, device="cuda", dtype="float32", backend="torch", cuda_graphs=False)
    yield fast, ref
    fast.close()
    ref.close()


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_graphs_and_triton_equal_torch_reference(pair, loops):
    fast, ref = pair
    assert fast.engine.graphs.get(loops) is not None
    for p in PROMPTS:
        assert fast.generate(p, loops=loops, max_tokens=24) == ref.generate(p, loops=loops, max_tokens=24)


def test_graph_replay_counts_iterations(pair):
    fast, _ = pair
    before = fast.counters.snapshot()
    fast.generate(PROMPTS[0], loops=4, max_tokens=5)
    assert fast.counters.since(before).loop_iterations == 4 * 5  # prefill + 4 decode steps


def test_resume_and_sampling_on_gpu(pair):
    fast, ref = pair
    h = fast.build_resume_handle(PROMPTS[1], L_used=2, max_loops=16)
    assert fast.resume_generate(h, 6, max_tokens=16) == ref.generate(PROMPTS[1], loops=6, max_tokens=16)
    kw = dict(loops=5, max_tokens=16, temperature=0.9, seed=3)
    assert fast.generate(PROMPTS[0], **kw) == ref.generate(PROMPTS[0], **kw)


def test_every_lane_replays_its_own_graph(pair):
    from tinyloop.worker.api import drain
    fast, ref = pair
    assert fast.engine.graphs.get(4, 1) is not None
    req = fast.make_request(PROMPTS[1], loops=4, max_tokens=16)
    assert drain(req.prompt, fast.stream(req, lane=1)) == ref.generate(PROMPTS[1], loops=4, max_tokens=16)


def _decode(model, req, pipelined):
    from tinyloop.worker.api import drain
    from tinyloop.worker.generate import decode_steps
    st = model.start(req)
    return drain(req.prompt, decode_steps(st, pipelined)), st


def test_pipelined_decode_equals_plain_on_gpu(pair):
    """Graph steps launched ahead of the host (pinned copy + event), dropped on a stop token:
    the same tokens, finish, stats and final logits as the plain loop, bitwise."""
    fast, _ = pair
    n = len(PROMPTS[1])
    for kw in (dict(loops=4), dict(loops=5, temperature=0.9, seed=3, repetition_penalty=1.2),
               dict(loops=3, cache_window=8)):
        req = fast.make_request(PROMPTS[1], max_tokens=16, **kw)
        plain, _ = _decode(fast, req, False)
        stop = fast.make_request(PROMPTS[1], max_tokens=16, stop_token_ids=[plain[n + 5]], **kw)
        for r in (req, stop):
            (a, sa), (b, sb) = _decode(fast, r, True), _decode(fast, r, False)
            assert a == b and (a.finish_reason, a.stats) == (b.finish_reason, b.stats), kw
            assert torch.equal(sa.logits, sb.logits) and sa.pos == sb.pos, kw
        assert _decode(fast, stop, True)[0].finish_reason == "stop"
