"""Invariants 1 and 2: incremental decode equals a full recompute; layers past L are never read."""
import copy
import math

import pytest
import torch

from tinyloop.worker import Model

PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]]


def recompute_greedy(model: Model, prompt, loops, n, window=0):
    """Greedy tokens from a full no-cache forward over the whole sequence at every step."""
    toks = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model._module(torch.tensor([toks]), loops, window)[0, -1]
        toks.append(int(logits.argmax()))
    return toks


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_incremental_decode_equals_full_recompute(config_path, loops):
    with Model(config_path, max_seq_len=128) as m:
        produced = set()
        for prompt in PROMPTS:
            out = m.generate(prompt, loops=loops, max_tokens=10)
            assert out == recompute_greedy(m, prompt, loops, 10)
            produced |= set(out[len(prompt):])
        assert len(produced) > 2, "degenerate model: the test could not fail"


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_decode_logits_match_full_recompute(config_path, loops):
    """Last-position logits of every decode step against the no-cache forward in float64: the
    cached fp32 decode is as close to it as the fp32 no-cache forward is (both only round)."""
    with Model(config_path, max_seq_len=128) as m:
        r = m.runner
        toks = PROMPTS[1] + [5, 77, 140, 2]
        T0 = len(PROMPTS[1])
        with torch.no_grad():
            exact = copy.deepcopy(m._module).double()(torch.tensor([toks]), loops)[0].float()[T0 - 1:]
            full = m._module(torch.tensor([toks]), loops)[0][T0 - 1:]
        steps = [r.prefill(0, toks[:T0], loops).logits[0]]
        for pos in range(T0, len(toks)):
            steps.append(r.decode([0], [toks[pos]], [pos], [loops]).logits[0])
        got = torch.stack(steps)

        def err(x):
            return float(((x - exact).norm(dim=-1) / exact.norm(dim=-1)).max())
        # a wrong key, position or depth is an O(1) error; rounding grows through the
        # iterations of a random block alike in both fp32 paths
        assert err(got) < max(1e-4, 3 * err(full)), (err(got), err(full))


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_layers_past_L_are_never_read(config_path, loops):
    with Model(config_path, max_seq_len=128) as m:
        want = m.generate(PROMPTS[0], loops=loops, max_tokens=8)
        cfg, cache = m.config, m.runner.cache
        first_unused = cfg.n_prelude + loops * cfg.n_loop_layers
        coda0 = cache.coda_layer(0)
        cache.k[first_unused:coda0] = math.nan
        cache.v[first_unused:coda0] = math.nan
        assert m.generate(PROMPTS[0], loops=loops, max_tokens=8) == want
        assert torch.isnan(cache.k[first_unused:coda0]).all(), "a layer past L was written"


@pytest.mark.parametrize("W", [1, 4, 7])
def test_cache_window_equals_sliding_window_reference(tiny_path, W):
    with Model(tiny_path, max_seq_len=128) as m:
        prompt = PROMPTS[1]  # longer than every W: the ring wraps during prefill and decode
        want = recompute_greedy(m, prompt, 3, 9, window=W)
        assert m.generate(prompt, loops=3, max_tokens=9, cache_window=W) == want


def test_l_scheduling_catches_up_the_cache(tiny_model):
    """After the warm-up tokens (run at l_warmup_L) the cache is extended to full depth over
    them, so the rest equals a full-depth generate continuing the same stream."""
    m, p = tiny_model, PROMPTS[0]
    n_warm, L, Lw = 4, 6, 2
    before = m.counters.snapshot()
    out = m.generate(p, loops=L, max_tokens=12, l_warmup_tokens=n_warm, l_warmup_L=Lw)
    work = m.counters.since(before)
    head = out[:len(p) + 1 + n_warm]
    assert out == m.generate(head, loops=L, max_tokens=12 - 1 - n_warm)
    # prompt at L, n_warm steps at Lw, one catch-up of L-Lw iterations, the rest at L
    assert work.loop_iterations == L + n_warm * Lw + (L - Lw) + (12 - 1 - n_warm) * L
    assert out[:len(p) + 1] == m.generate(p, loops=L, max_tokens=1)


def test_safety_check_stops_and_says_why(tiny_model):
    out = tiny_model.generate(PROMPTS[0], loops=4, max_tokens=8, safety_check=True, safety_norm_threshold=1e-3)
    assert out.finish_reason == "safety" and out == PROMPTS[0]
    ok = tiny_model.generate(PROMPTS[0], loops=4, max_tokens=8, safety_check=True, safety_norm_threshold=1e6)
    assert ok.finish_reason == "length" and ok == tiny_model.generate(PROMPTS[0], loops=4, max_tokens=8)


def test_stop_token_ends_generation(tiny_model):
    full = tiny_model.generate(PROMPTS[0], loops=4, max_tokens=10)
    stop = full[len(PROMPTS[0]) + 3]
    out = tiny_model.generate(PROMPTS[0], loops=4, max_tokens=10, stop_token_ids=[stop])
    assert out.finish_reason == "stop"
    assert out == full[:full.index(stop, len(PROMPTS[0])) + 1]


def test_causal_attention_is_the_masked_attention_of_a_fresh_prompt():
    """The engine's fresh-prompt attention (is_causal, no mask) against the masked attention
    with every key's position, GQA included."""
    from tinyloop.worker.model.ops import causal_attention, masked_attention
    torch.manual_seed(0)
    T = 13
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8)
    pos = torch.arange(T)
    want = masked_attention(q, k, v, pos.expand(2, T), pos, 0, 0.3)
    torch.testing.assert_close(causal_attention(q, k, v, 0.3), want)
