"""Invariant 3 (warm-start resume), scoring, trajectory, mixed-depth batches, handle memory."""
import dataclasses

import numpy as np
import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.generation.resume import handle_nbytes
from tinyloop.worker.model.cache import make_cache

PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]]


@pytest.mark.parametrize("k, L", [(0, 3), (2, 5), (3, 8), (5, 5)])
def test_greedy_resume_equals_fresh_generate(config_path, k, L):
    with Model(config_path, max_seq_len=128) as m:
        for p in PROMPTS:
            h = m.build_resume_handle(p, L_used=k, max_loops=16)
            assert m.resume_generate(h, L, max_tokens=10) == m.generate(p, loops=L, max_tokens=10)


def test_seeded_sampled_resume_equals_seeded_generate(tiny_model):
    p = PROMPTS[1]
    h = tiny_model.build_resume_handle(p, L_used=2, max_loops=16)
    for seed in (0, 1, 123):
        kw = dict(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=seed)
        assert tiny_model.resume_generate(h, 6, **kw) == tiny_model.generate(p, loops=6, **kw)


def test_resume_runs_only_the_missing_iterations(tiny_model):
    p = PROMPTS[1]
    h = tiny_model.build_resume_handle(p, L_used=3, max_loops=16)
    for new_L in (3, 4, 9):
        before = tiny_model.counters.snapshot()
        out = tiny_model.resume_generate(h, new_L, max_tokens=1)
        assert out.stats["prompt_loop_iterations"] == new_L - 3
        # one token needs no decode step: the prompt extension is all the loop work
        assert tiny_model.counters.since(before).loop_token_iterations == (new_L - 3) * len(p)


def test_many_resumes_on_one_handle_do_not_disturb_it(tiny_model):
    p = PROMPTS[0]
    h = tiny_model.build_resume_handle(p, L_used=2, max_loops=16)
    k0, r0 = h.state["k"].clone(), h.residual.clone()
    first = tiny_model.resume_generate(h, 4, max_tokens=8)
    tiny_model.resume_generate(h, 12, max_tokens=8)
    tiny_model.generate(PROMPTS[1], loops=7, max_tokens=8)
    assert tiny_model.resume_generate(h, 4, max_tokens=8) == first
    # bit for bit, as bytes: the layers past L_used are allocated but never written (as the
    # reference's handle), so they hold whatever the allocator left, NaN patterns included,
    # which torch.equal on floats would call unequal to themselves
    assert torch.equal(h.state["k"].view(torch.uint8), k0.view(torch.uint8))
    assert torch.equal(h.residual.view(torch.uint8), r0.view(torch.uint8))


def test_resume_with_window(tiny_model):
    p = PROMPTS[1]
    h = tiny_model.build_resume_handle(p, L_used=2, max_loops=8, cache_window=5)
    assert h.nbytes() == tiny_model.handle_nbytes(len(p), 8, 5)
    assert tiny_model.resume_generate(h, 6, max_tokens=8) == tiny_model.generate(p, loops=6, max_tokens=8, cache_window=5)


def _drain_extension(m, rr, chunk: int) -> tuple[list[int], object, int]:
    """A resume whose extension runs `chunk` prompt positions a call (the worker's scheduler
    cuts it so), then decodes alone: (tokens after the prompt, Finish, extension calls)."""
    from tinyloop.worker.generation.decode import decode_steps
    ext = m.start_resume_chunked(rr, 0)
    calls, st = 0, None
    while st is None:
        st = ext.run(chunk)
        calls += 1
    gen, ids = decode_steps(st), []
    while True:
        try:
            ids.extend(next(gen))
        except StopIteration as stop:
            return ids, stop.value, calls


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.9, top_k=40, seed=3), dict(cache_window=4),
                                dict(safety_check=True, safety_norm_threshold=1e9)],
                         ids=["greedy", "sampled", "window", "safety"])
def test_a_chunked_extension_equals_the_whole_resume(tiny_model, kw):
    """The extension cut into chunks of 1, 3 and 4 positions (a handle of 11): the same tokens
    and finish as the resume extended in one call and as a fresh generate; each chunk runs the
    missing iterations over its positions only."""
    m, p = tiny_model, PROMPTS[1]
    window = kw.pop("cache_window", 0)
    safety = {k: kw.pop(k) for k in ("safety_check", "safety_norm_threshold") if k in kw}
    h = m.build_resume_handle(p, L_used=2, max_loops=8, cache_window=window)
    want = m.resume_generate(h, 6, max_tokens=9, cache_window=window, **kw)
    assert want == m.generate(p, loops=6, max_tokens=9, cache_window=window, **safety, **kw)
    for chunk in (1, 3, 4, len(p)):
        rr = m.make_resume_request(h, 6, max_tokens=9, cache_window=window, **kw)
        if safety:  # the resume request carries no safety check of its own: set it as generate's
            rr = (rr[0], rr[1], dataclasses.replace(rr[2], safety_threshold=safety["safety_norm_threshold"]))
        before = m.counters.snapshot()
        ids, finish, calls = _drain_extension(m, rr, chunk)
        assert p + ids == want, chunk
        assert calls == -(-len(p) // chunk)
        assert finish.reason == want.finish_reason
        assert finish.stats["prompt_loop_iterations"] == calls * (6 - 2)
        # the token-iterations are the whole resume's: the chunks split the positions, not the work
        assert finish.stats["loop_token_iterations"] == want.stats["loop_token_iterations"]
        assert m.counters.since(before).loop_token_iterations == want.stats["loop_token_iterations"]
    assert h.nbytes() > 0  # the handle is untouched and alive


def test_a_freed_handle_keeps_an_extension_under_way(tiny_model):
    """A handle freed (evicted) after its extension started: the chunks still run from what
    the extension holds, and the resume ends as it would have."""
    m, p = tiny_model, PROMPTS[1]
    h = m.build_resume_handle(p, L_used=3, max_loops=8)
    want = m.resume_generate(h, 5, max_tokens=6)
    ext = m.start_resume_chunked(m.make_resume_request(h, 5, max_tokens=6), 0)
    assert ext.run(4) is None
    h.free()
    st = None
    while st is None:
        st = ext.run(4)
    from tinyloop.worker.generation.decode import decode_steps
    ids = [t for step in decode_steps(st) for t in step]
    assert p + ids == want


def test_handle_accessors_and_free(tiny_model):
    h = tiny_model.build_resume_handle(PROMPTS[0], L_used=4, max_loops=10)
    assert (h.seq_len(), h.loops_used(), h.max_loops()) == (5, 4, 10)
    assert h.nbytes() == tiny_model.handle_nbytes(5, 10) > 0
    tiny_model.free_resume_handle(h)
    tiny_model.free_resume_handle(h)
    assert h.nbytes() == 0
    with pytest.raises(RuntimeError, match="freed"):
        tiny_model.resume_generate(h, 5)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(L_used=-1), ValueError, "L_used must be >= 0"),
    (dict(max_loops=0), ValueError, "max_loops must be >= 1"),
    (dict(L_used=9, max_loops=8), RuntimeError, "L_used=9 exceeds max_loops=8"),  # as the reference runtime
    (dict(max_loops=64), ValueError, "exceeds the model's max_loops=32"),
    (dict(cache_window=-2), ValueError, "cache_window must be >= 0"),
])
def test_build_errors(tiny_model, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tiny_model.build_resume_handle(PROMPTS[0], **kwargs)


@pytest.mark.parametrize("new_L, kwargs, exc, match", [
    (2, {}, RuntimeError, r"new_L=2 outside \[loops_used=3, max_loops=8\]"),
    (9, {}, RuntimeError, r"new_L=9 outside"),
    (4, dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (4, dict(temperature=-1), ValueError, "temperature must be a finite number >= 0"),
    (4, dict(top_k=-5), ValueError, "top_k must be >= 0"),
    (4, dict(repetition_penalty=-1), ValueError, "repetition_penalty must be > 0"),
    (4, dict(max_tokens=500), RuntimeError, "exceeds max_seq_len"),
])
def test_resume_errors(tiny_model, new_L, kwargs, exc, match):
    h = tiny_model.build_resume_handle(PROMPTS[0], L_used=3, max_loops=8)
    with pytest.raises(exc, match=match):
        tiny_model.resume_generate(h, new_L, **kwargs)


def test_handle_of_another_model_is_refused(tiny_path):
    with Model(tiny_path, max_seq_len=64) as a, Model(tiny_path, max_seq_len=64) as b:
        h = a.build_resume_handle(PROMPTS[0], L_used=1, max_loops=4)
        with pytest.raises(RuntimeError, match="different"):
            b.resume_generate(h, 2)


# -- scoring -----------------------------------------------------------------------------

def test_consistency_matches_two_generates(tiny_model):
    p = PROMPTS[1]
    r = tiny_model.score_with_consistency(p, 3, 8, max_tokens=10)
    a = tiny_model.generate(p, loops=3, max_tokens=10)[len(p):]
    b = tiny_model.generate(p, loops=8, max_tokens=10)[len(p):]
    assert (r["answer_a"], r["answer_b"]) == (a, b)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)
    assert r["first_divergence"] == first and r["agree"] == (a == b)
    same = tiny_model.score_with_consistency(p, 5, 5, max_tokens=6)
    assert same["agree"] and same["first_divergence"] == -1


def test_uncertainty_shares_the_shallow_iterations(tiny_model):
    p = PROMPTS[1]
    before = tiny_model.counters.snapshot()
    logits, kl = tiny_model.score_with_uncertainty(p, 3, 7)
    assert tiny_model.counters.since(before).loop_iterations == 7  # not 3 + 7
    net = tiny_model._module
    with torch.no_grad():
        hi = net(torch.tensor([p]), 7)[0, -1].double()
        lo = net(torch.tensor([p]), 3)[0, -1].double()
    np.testing.assert_allclose(logits, hi.numpy(), rtol=1e-4, atol=1e-4)
    want = torch.sum(hi.softmax(-1) * (hi.log_softmax(-1) - lo.log_softmax(-1))).item()
    assert kl == pytest.approx(want, rel=1e-3, abs=1e-6) and kl > 0
    assert tiny_model.score_with_uncertainty(p, 4, 4)[1] == pytest.approx(0.0, abs=1e-6)


def test_trajectory_labels_and_final_state(tiny_model):
    p = PROMPTS[0]
    r = tiny_model.score_trajectory(p, 3)
    assert r["labels"] == ["embed", "pre.0", "loop.0", "loop.1", "loop.2", "coda.0", "final_ln"]
    assert r["hidden"].shape == (7, 64) and r["hidden"].dtype == np.float32
    net = tiny_model._module
    with torch.no_grad():
        logits = net.logits(torch.from_numpy(r["hidden"][-2])[None])  # head over coda output
    np.testing.assert_allclose(logits[0].numpy(), net(torch.tensor([p]), 3)[0, -1].detach().numpy(), rtol=1e-4, atol=1e-4)


# -- mixed-depth batches -----------------------------------------------------------------

def test_mixed_depth_batch_lanes_equal_standalone(tiny_model):
    prompts = [PROMPTS[0], [9, 8, 7], PROMPTS[1], [5] * 10]
    loops = [2, 8, 5, 8]
    before = tiny_model.counters.snapshot()
    out = tiny_model.generate_batch(prompts, per_lane_loops=loops, max_tokens=9)
    batched = tiny_model.counters.since(before)
    for p, L, o in zip(prompts, loops, out):
        assert o == tiny_model.generate(p, loops=L, max_tokens=9)
    # iteration i advanced only lanes deeper than i: 8 decode steps x sum of depths
    prefill_work = sum(L * len(p) for p, L in zip(prompts, loops))
    assert batched.loop_token_iterations == prefill_work + 8 * sum(loops)


def test_sampled_batch_lanes_equal_standalone(tiny_model):
    prompts, loops = [PROMPTS[0], PROMPTS[1]], [3, 6]
    out = tiny_model.generate_batch(prompts, per_lane_loops=loops, max_tokens=8, temperature=0.8, seed=[4, 5])
    for p, L, s, o in zip(prompts, loops, [4, 5], out):
        assert o == tiny_model.generate(p, loops=L, max_tokens=8, temperature=0.8, seed=s)


def test_batch_beyond_the_lanes_runs_in_waves(tiny_model):
    """More prompts than lanes (n_slots=4): waves of four, each lane still its run alone."""
    prompts = [[1 + i, 7, 3 * i + 2] for i in range(6)]
    loops = [2, 8, 5, 3, 8, 1]
    out = tiny_model.generate_batch(prompts, per_lane_loops=loops, max_tokens=5)
    assert [o.stats["completion_tokens"] for o in out] == [5] * 6
    for p, L, o in zip(prompts, loops, out):
        assert o == tiny_model.generate(p, loops=L, max_tokens=5)
    assert tiny_model.runner.lanes.free == 4  # every lane back


def test_batch_errors(tiny_model):
    with pytest.raises(ValueError, match="per_lane_loops has 1 entries for 2 prompts"):
        tiny_model.generate_batch([[1], [2]], per_lane_loops=[3])
    with pytest.raises(ValueError, match=r"per_lane_loops\[1\]=0 out of range"):
        tiny_model.generate_batch([[1], [2]], per_lane_loops=[3, 0])
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        tiny_model.generate_batch([[1], []])


# -- memory accounting -------------------------------------------------------------------

@pytest.mark.parametrize("seq, max_loops, mb", [(128, 32, 34), (512, 32, 136), (1024, 32, 272), (1024, 64, 528)])
def test_handle_bytes_follow_the_reference_table(seq, max_loops, mb):
    """The reference runtime's table (FP16 K/V, D=2048, 2 prelude layers, MiB); ours adds the
    (seq, D) residual the handle must keep, about 1.5 %."""
    cfg = LoopedConfig(vocab_size=32000, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=5632, n_prelude=2,
                       n_loop_layers=1, n_coda=0, max_loops=64, default_loops=8)
    cache = make_cache("kv", cfg, 1, 1, cfg.max_loops, torch.device("meta"), torch.float16)
    got = handle_nbytes(cache, seq, max_loops, 0) / 2**20
    assert mb <= got <= mb * 1.02
