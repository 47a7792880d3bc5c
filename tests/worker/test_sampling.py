"""Seeded sampling: reproducible, seed-dependent, and never outside top-k / top-p."""
import torch

from tinyloop.worker import Model
from tinyloop.worker.runner.sampler import RowSampling, SamplingParams, draw, probs, sample, sample_rows, uniform

from stage_graphs import with_stage_graphs

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


def test_a_float32_draw_is_the_draw_of_its_widened_distribution():
    """draw sorts a float32 distribution as float32 and widens the sorted values: the tokens are
    those of sorting the float64 widening (the order and the ties survive widening), on rows
    with many exact ties, zeros (a top-k's tail) and u near the CDF's ends."""
    torch.manual_seed(0)
    B, V = 512, 64
    pr = torch.randint(0, 6, (B, V)).float() / 8           # coarse values: ties everywhere
    pr[:, V // 2:] *= (torch.rand(B, V // 2) < 0.3)        # zeros, as a top-k leaves
    pr[0] = 0.0                                           # a row with no mass takes its first token
    pr = pr / pr.sum(-1, keepdim=True).clamp_min(1e-30)
    u = torch.cat([torch.rand(B - 4, dtype=torch.float64),
                   torch.tensor([0.0, 1e-12, 1 - 1e-12, 0.5], dtype=torch.float64)])
    got = draw(pr, u)
    assert pr.dtype == torch.float32 and torch.equal(got, draw(pr.double(), u))
    assert int(got[0]) == 0


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


# one row each: greedy, greedy with a penalty, and samplers of every shape (top-k of several
# widths, none, top-p, penalties), so one call mixes them all
ROWS = [SamplingParams(), SamplingParams(repetition_penalty=1.4), SamplingParams(0.9, 40, 0.95, 1.3),
        SamplingParams(0.7, 5), SamplingParams(1.2, 0, 0.8), SamplingParams(0.5, 100, 0.9),
        SamplingParams(1.0, 12, 1.0, 1.1), SamplingParams(2.0, 1), SamplingParams(0.05, 0)]


def _rows_case(B, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    seen = torch.rand(B, V, generator=g) < 0.2
    return logits, seen, torch.arange(B) * 7 + 1, torch.arange(B) + 30


def test_each_row_samples_as_it_would_alone():
    """sample_rows over rows of different parameters: row b's token is, exactly, the token of
    `sample` on row b alone with its own parameters (and so the same whichever rows ride with
    it), over many draws."""
    params = ROWS * 40
    logits, seen, seed, pos = _rows_case(len(params))
    got = sample_rows(logits, seen, RowSampling.of(params, logits.shape[1], logits.device), seed, pos)
    alone = torch.cat([sample(logits[b:b + 1], seen[b:b + 1], p, seed[b:b + 1], pos[b:b + 1])
                       for b, p in enumerate(params)])
    assert torch.equal(got, alone)
    for b, p in enumerate(params):  # and each kept inside its own top-k
        if not p.greedy and 0 < p.top_k < logits.shape[1]:
            assert int(got[b]) in torch.topk(logits[b], p.top_k).indices.tolist()


def test_probs_rows_are_the_one_row_distributions():
    params = ROWS[2:]
    logits, _, _, _ = _rows_case(len(params), seed=1)
    rows = probs(logits, RowSampling.of(params, logits.shape[1], logits.device))
    for b, p in enumerate(params):
        assert torch.equal(rows[b:b + 1], probs(logits[b:b + 1], p))


def test_runner_sampler_graphs_equal_the_eager_ops(tiny_path):
    """Runner.sample through its sampler "graphs" (the buffers, buckets and copies the GPU
    replays; here run eagerly) equals sample_rows on the same rows, for row counts that pad
    their bucket and for every parameter mix."""
    with Model(tiny_path, max_seq_len=64, n_slots=8) as m:
        graphs = with_stage_graphs(m, [2])
        V = m.runner.config.vocab_size
        for B, rows in ((1, ROWS[2:3]), (1, ROWS[:1]), (3, ROWS[1:4]), (8, ROWS[:8]), (5, ROWS[4:])):
            logits, seen, seed, pos = _rows_case(B, V, seed=B)
            got = m.runner.sample(logits, seen, rows, seed.tolist(), pos.tolist())
            assert torch.equal(got, sample_rows(logits, seen, RowSampling.of(rows, V, logits.device), seed, pos))
        assert any(kind == "call" for kind, _, _ in graphs.log)
        kw = dict(loops=2, max_tokens=12, temperature=0.8, top_k=20, seed=4)
        graphed = m.generate([3, 17, 42], **kw)
    with Model(tiny_path, max_seq_len=64, n_slots=8) as eager:
        assert graphed == eager.generate([3, 17, 42], **kw)


def test_a_row_without_finite_logits_takes_its_first_token():
    logits, seen, seed, pos = _rows_case(3)
    logits[1] = float("nan")
    got = sample_rows(logits, seen, RowSampling.of([ROWS[2]] * 3, logits.shape[1], logits.device), seed, pos)
    assert 0 <= int(got[1]) < logits.shape[1]


def test_fused_sampling_draws_the_torch_tokens():
    """sample_rows with the fused launches (kernels/sample_rows.py, under the interpreter here)
    draws the torch ops' token in every row of a mix of every parameter shape: the two differ
    only in sums' last bits, which no draw here lands within."""
    params = ROWS * 4
    logits, seen, seed, pos = _rows_case(len(params), seed=3)
    rs = RowSampling.of(params, logits.shape[1], logits.device)
    assert torch.equal(sample_rows(logits, seen, rs, seed, pos, fused=True), sample_rows(logits, seen, rs, seed, pos))
    torch.testing.assert_close(probs(logits, rs, fused=True), probs(logits, rs), rtol=1e-5, atol=1e-7)


def test_fused_sampler_setting_reaches_every_sampling_path(tiny_path, monkeypatch):
    """Settings.fused_sampler: a sampled generate's steps, a sampled speculative generate's drafts
    and its verdicts run the fused launches (counted on the real functions), and draw what the torch ops
    draw; without it they never run; unset, it is on with CUDA alone."""
    from tinyloop.worker.model.settings import Settings
    from tinyloop.worker.runner import sampler as sampler_mod
    calls = {"choose": 0, "probs": 0, "draw": 0, "verdict": 0}

    def counted(name, fn):
        def run(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return run
    monkeypatch.setattr(sampler_mod, "choose_rows", counted("choose", sampler_mod.choose_rows))
    monkeypatch.setattr(sampler_mod, "probs_rows", counted("probs", sampler_mod.probs_rows))
    monkeypatch.setattr(sampler_mod, "draw_rows", counted("draw", sampler_mod.draw_rows))
    monkeypatch.setattr(sampler_mod, "verdict_rows", counted("verdict", sampler_mod.verdict_rows))
    kw = dict(max_tokens=6, temperature=0.8, top_k=20, seed=5)
    with Model(tiny_path, max_seq_len=64, n_slots=2, settings=Settings()) as m:  # the default: on with CUDA
        assert m.runner.settings.fused_sampler is (m.device.type == "cuda")
    out = {}
    for fused in (False, True):
        settings = Settings.from_env({"TINYLOOP_FUSED_SAMPLER": str(int(fused))})
        assert settings.fused_sampler is fused and Settings.from_env({}).fused_sampler is None
        with Model(tiny_path, max_seq_len=64, n_slots=2, settings=settings) as m:
            assert m.runner.settings.fused_sampler is fused
            out[fused] = (m.generate(PROMPT, loops=3, **kw),
                          m.generate_speculative(PROMPT, draft_loops=1, verify_loops=3, draft_ahead=2, **kw))
        if not fused:
            assert calls == {"choose": 0, "probs": 0, "draw": 0, "verdict": 0}
    # the plain stream's steps choose in one launch; the drafts keep their distributions
    assert calls["choose"] >= 5 and calls["probs"] > 2 and calls["draw"] > 2 and calls["verdict"] > 0
    assert out[True] == out[False]
