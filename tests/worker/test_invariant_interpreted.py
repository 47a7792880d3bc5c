"""The batch-invariant engine path end to end on the real Triton kernels, run by the Triton
interpreter on the CPU (the GPU runs the same launches; tests/worker/test_gpu_invariant.py holds
the bf16 bitwise checks there): every pass goes through the batch-1 step's projection and
decode attention (chunks through `rope_chunk_attention`, trees through `rope_tree_attention`),
and greedy speculative chains (device rounds, eager here) and trees, a mixed-depth batch and a
resume give the tokens of plain generate on the same kernels, and of the torch reference
path. Tiny shapes and few tokens: the interpreter runs every program of every launch."""
import dataclasses

import pytest

from model_zoo import TINY, damped_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.settings import Settings

CFG = dataclasses.replace(TINY, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)
PROMPT = [3, 17, 42, 99, 7]
N = 4


@pytest.fixture(scope="module")
def pair(ckpt_dir):
    path = damped_checkpoint(ckpt_dir / "damped-interpreted.tinyloop", CFG, 5, 0.03)
    with Model(path, max_seq_len=48, n_slots=2, dtype="float32", backend="triton",
               settings=Settings(batch_invariant=True, device_rounds=True)) as fast, \
            Model(path, max_seq_len=48, n_slots=2, dtype="float32") as ref:
        yield fast, ref


def test_the_invariant_ops_run(pair):
    fast, ref = pair
    assert fast.runner.ops.name == "triton" and fast.runner.ops.invariant and fast.runner.settings.device_rounds
    assert ref.runner.ops.name == "torch"


def test_speculative_batch_and_resume_equal_generate(pair):
    fast, ref = pair
    want = fast.generate(PROMPT, loops=3, max_tokens=N)
    assert want == ref.generate(PROMPT, loops=3, max_tokens=N)
    assert fast.generate_speculative(PROMPT, max_tokens=N, draft_loops=1, verify_loops=3, draft_ahead=2) == want
    assert fast.generate_tree_speculative(PROMPT, max_tokens=N, draft_loops=1, verify_loops=3, draft_ahead=2,
                                          K_branches=2) == want
    other = [200, 1, 5]
    batch = fast.generate_batch([PROMPT, other], per_lane_loops=[3, 2], max_tokens=N)
    assert batch[0] == want and batch[1] == fast.generate(other, loops=2, max_tokens=N)
    h = fast.build_resume_handle(PROMPT, L_used=1, max_loops=3)
    try:
        assert fast.resume_generate(h, 3, max_tokens=N) == want
    finally:
        fast.free_resume_handle(h)


def test_sampled_speculation_on_the_kernels_decides_as_the_reference(pair):
    """A sampled chain's device round (drafts, acceptance and residual draws on the device, the
    uniforms from the counter-hash kernel's spec here) and a sampled tree's one-read round, on
    the interpreted kernels, decide as the torch reference path's host-driven rounds."""
    fast, ref = pair
    kw = dict(max_tokens=N + 2, draft_loops=1, verify_loops=3, draft_ahead=2, temperature=0.9, seed=5)
    got = fast.generate_speculative(PROMPT, **kw)
    assert got == ref.generate_speculative(PROMPT, **kw)
    assert any(key[3] is not None for key in fast.runner._rounds), "the sampled round must run on the device"
    plain = fast.generate(PROMPT, loops=3, max_tokens=N + 2, temperature=0.9, seed=5)
    assert fast.generate_tree_speculative(PROMPT, K_branches=2, **kw) == plain
