"""Seeded sampling: reproducible, seed-dependent, and never outside top-k / top-p."""
import torch

from tinyloop.worker.generation.sampling import SamplingParams, probs, sample, uniform

PROMPT = [3, 17, 42, 99, 7]


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model):
    a = tiny_model.generate(PROMPT, loops=3, max_tokens=16, temperature=1.0, seed=7)
    assert a == tiny_model.generate(PROMPT, loops=3, max_tokens=16, temperature=1.0, seed=7)
    others = {tuple(tiny_model.generate(PROMPT, loops=3, max_tokens=16, temperature=1.0, seed=s)) for s in range(8, 12)}
    assert tuple(a) not in others and len(others) > 1


def test_uniform_stream_is_a_function_of_seed_and_position():
    seed = torch.tensor([1, 1, 2, 1])
    pos = torch.tensor([5, 6, 5, 5])
    u = uniform(seed, pos)
    assert u[0] == u[3] and u[0] != u[1] and u[0] != u[2]
    big = uniform(torch.zeros(100_000, dtype=torch.long), torch.arange(100_000))
    assert 0 <= big.min() and big.max() < 1 and abs(big.mean().item() - 0.5) < 0.01


def test_top_k_and_top_p_never_emit_excluded_tokens():
    torch.manual_seed(0)
    B, V = 4000, 50
    logits = torch.randn(1, V).expand(B, V) * 3
    seen = torch.zeros(B, V, dtype=torch.bool)
    seed, pos = torch.full((B,), 3), torch.arange(B)
    k_allowed = set(torch.topk(logits[0], 5).indices.tolist())
    toks = sample(logits, seen, SamplingParams(temperature=1.0, top_k=5), seed, pos)
    assert set(toks.tolist()) == k_allowed  # every allowed token shows up, nothing else does

    p = torch.softmax(logits[0], -1)
    order = torch.argsort(p, descending=True)
    cum = p[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.7).sum()) + 1].tolist())
    toks = sample(logits, seen, SamplingParams(temperature=1.0, top_k=0, top_p=0.7), seed, pos)
    assert set(toks.tolist()) == nucleus


def test_sampling_frequencies_follow_the_distribution():
    V, B = 6, 60_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(B, V)
    p = SamplingParams(temperature=0.7, top_k=0)
    toks = sample(logits, torch.zeros(B, V, dtype=torch.bool), p, torch.full((B,), 11), torch.arange(B))
    freq = torch.bincount(toks, minlength=V).double() / B
    assert torch.allclose(freq, probs(logits[:1], p)[0].double(), atol=0.01)


def test_repetition_penalty_lowers_seen_tokens(tiny_model):
    plain = tiny_model.generate(PROMPT, loops=3, max_tokens=24)
    penalised = tiny_model.generate(PROMPT, loops=3, max_tokens=24, repetition_penalty=5.0)
    gen = lambda out: out[len(PROMPT):]
    assert len(set(gen(penalised))) >= len(set(gen(plain)))
    assert penalised != plain
