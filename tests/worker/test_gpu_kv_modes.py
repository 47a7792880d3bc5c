"""KV cache modes on the CUDA path (Triton ops + captured graphs) against the torch reference
path in the same mode, fp32 so that the comparison is of the paths, not of roundings.
Run on a GPU host: `pytest -m gpu tests/worker/test_gpu_kv_modes.py`."""
import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.model.settings import KV_MODES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]]


@pytest.fixture(scope="module", params=KV_MODES)
def pair(request, tiny_path):
    mode = request.param
    # max_loops 8: the graphs of eight depths per mode, not the checkpoint's 32
    fast = Model(tiny_path, max_seq_len=256, device="cuda", dtype="float32", n_slots=3, kv_mode=mode, max_loops=8)
    ref = Model(tiny_path, max_seq_len=256, device="cuda", dtype="float32", backend="torch", cuda_graphs=False,
                n_slots=3, kv_mode=mode, max_loops=8)
    yield fast, ref
    fast.close()
    ref.close()


def test_generate_resume_batch_speculative_equal_the_reference(pair):
    fast, ref = pair
    assert fast.runner.graphs is not None  # the captured decode, batch, verify and prefill stages
    for p in PROMPTS:
        assert fast.generate(p, loops=4, max_tokens=12) == ref.generate(p, loops=4, max_tokens=12)
    h_fast = fast.build_resume_handle(PROMPTS[1], L_used=2, max_loops=8)
    assert fast.resume_generate(h_fast, 6, max_tokens=10) == fast.generate(PROMPTS[1], loops=6, max_tokens=10)
    prompts, loops = [PROMPTS[1], PROMPTS[0], PROMPTS[0][:2]], [6, 2, 4]
    assert fast.generate_batch(prompts, per_lane_loops=loops, max_tokens=9) == \
        ref.generate_batch(prompts, per_lane_loops=loops, max_tokens=9)
    want = fast.generate(PROMPTS[0], loops=5, max_tokens=10)
    assert fast.generate_speculative(PROMPTS[0], max_tokens=10, draft_loops=2, verify_loops=5) == want
    assert fast.generate_tree_speculative(PROMPTS[0], max_tokens=10, draft_loops=2, verify_loops=5,
                                          K_branches=2) == want


def test_ring_window_equals_the_reference(pair):
    fast, ref = pair
    p = PROMPTS[1]
    assert fast.generate(p, loops=3, max_tokens=12, cache_window=4) == \
        ref.generate(p, loops=3, max_tokens=12, cache_window=4)
