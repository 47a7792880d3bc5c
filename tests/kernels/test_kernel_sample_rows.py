"""kernels/sample_rows.py: the fused distributions and draws against their torch spec (the ops
the runtime runs without them), on odd vocabularies, ties, every parameter's edge, and bad
input."""
import pytest
import torch
from kernel_tolerances import DEVICE

from tinyloop.kernels.counter_hash import uniform_ref
from tinyloop.kernels.sample_rows import (MAX_VOCAB, choose_rows, choose_rows_ref, draw_rows, draw_rows_ref, probs_rows,
                                          probs_rows_ref, verdict_rows, verdict_rows_ref)


def row_params(B, V, seed):
    """Per-row temperature (greedy, tiny, plain, hot), top-k (none, 1, small, V - 1, >= V) and
    top-p (none, tiny, two in between), cycled so every pair meets, and the host's k_max as RowSampling
    rounds it (a power of two, at most V)."""
    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 1e-3, 1.0, 0.7, 2.5])[torch.arange(B) % 5]
    ks = torch.tensor([0, 1, 3, max(V - 1, 1), V + 5, 50])[torch.randperm(B, generator=g) % 6]
    # (top-p values off the round fractions that tied probabilities sum to: a prefix whose mass
    # lands exactly on p is kept or not by the sums' last bit, which the two round differently)
    ps = torch.tensor([1.0, 1e-6, 0.537, 0.913])[torch.arange(B) % 4]
    in_force = [k for k in ks.tolist() if 0 < k < V]
    k_max = min(1 << (max(in_force) - 1).bit_length(), V) if in_force else 0
    return (temps.to(DEVICE), ks.to(DEVICE), ps.to(DEVICE), k_max)


def logits_of(B, V, dtype, seed, ties):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (B, V), generator=g).float() if ties else 4 * torch.randn(B, V, generator=g)
    return x.to(DEVICE, dtype)


# (the interpreter sorts a row slowly: vocabularies a few hundred wide at most here; the GPU
# run of these tests takes the default model's 256 among them)
@pytest.mark.parametrize("B, V, dtype, ties", [(5, 1, torch.float32, False), (12, 7, torch.bfloat16, True),
                                               (20, 64, torch.float32, True), (10, 256, torch.bfloat16, False),
                                               (10, 100, torch.float32, True)])
def test_probs_rows_is_its_spec(B, V, dtype, ties):
    """Close to the spec everywhere, and the same kept tokens (top-k's threshold and top-p's
    prefix are exact: only the softmax's and the sums' last bits differ)."""
    logits = logits_of(B, V, dtype, seed=B * V, ties=ties)
    temps, ks, ps, k_max = row_params(B, V, seed=V)
    for top_p_any in (False, True):
        got = probs_rows(logits, temps, ks, ps, k_max, top_p_any)
        want = probs_rows_ref(logits, temps, ks, ps, k_max, top_p_any)
        assert got.dtype == torch.float32 and got.shape == (B, V)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(got > 0, want > 0)


def test_rows_take_any_strides():
    """Parameters expanded from one value (stride 0, as a device round's lane gives its rows)
    and rows of a wider or transposed tensor give what contiguous copies give."""
    B, V = 6, 40
    logits = logits_of(V, B, torch.float32, seed=5, ties=False).t()           # (B, V), strides (1, B)
    temps, ks, ps, k_max = (torch.full((1,), 0.7, device=DEVICE).expand(B), torch.full((1,), 9, device=DEVICE).expand(B),
                            torch.full((1,), 0.9, device=DEVICE).expand(B), 16)
    got = probs_rows(logits, temps, ks, ps, k_max, True)
    assert torch.equal(got, probs_rows(logits.contiguous(), temps.contiguous(), ks.contiguous(), ps.contiguous(),
                                       k_max, True))
    u = torch.full((1,), 0.4, dtype=torch.float64, device=DEVICE).expand(B)
    wide = torch.zeros(B, 2 * V, device=DEVICE)
    wide[:, ::2] = got
    assert torch.equal(draw_rows(wide[:, ::2], u), draw_rows(got, u.contiguous()))


def test_probs_rows_keeps_top_k_and_top_p_as_asked():
    """A row keeps its k largest scores (ties at the k-th all stay), a top-p row the smallest
    prefix reaching p, and a greedy row the distribution at temperature 1."""
    logits = torch.tensor([[4.0, 1.0, 3.0, 3.0, 0.0, -1.0]] * 4, device=DEVICE)
    temps = torch.tensor([1.0, 1.0, 1.0, 0.0], device=DEVICE)
    ks = torch.tensor([2, 3, 0, 0], device=DEVICE)
    ps = torch.tensor([1.0, 1.0, 0.5, 1.0], device=DEVICE)
    got = probs_rows(logits, temps, ks, ps, 4, True)
    assert (got[0] > 0).tolist() == [True, False, True, True, False, False]  # 3.0 ties with the 2nd largest
    assert (got[1] > 0).tolist() == [True, False, True, True, False, False]
    assert (got[2] > 0).tolist() == [True, False, False, False, False, False]  # 4.0 holds over half the mass
    torch.testing.assert_close(got[3], torch.softmax(logits[3], -1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.sum(-1), torch.ones(4, device=DEVICE))


@pytest.mark.parametrize("V", [1, 9, 256])
def test_draw_rows_is_its_spec(V):
    """The same token as the spec for distributions with ties, zeros (a top-k's tail) and u at
    both ends of [0, 1)."""
    B = 24
    g = torch.Generator().manual_seed(V)
    pr = torch.randint(0, 5, (B, V), generator=g).float()
    pr[:, V // 2:] *= torch.rand(B, V - V // 2, generator=g) < 0.2
    pr[:, 0] += 1.0                                            # every row some mass
    pr = (pr / pr.sum(-1, keepdim=True)).to(DEVICE)
    u = torch.rand(B, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1e-15, 1 - 1e-15, 0.5], dtype=torch.float64)
    u = u.to(DEVICE)
    assert torch.equal(draw_rows(pr, u), draw_rows_ref(pr, u))
    temps, ks, ps, k_max = row_params(B, V, seed=1)
    pr = probs_rows_ref(logits_of(B, V, torch.float32, seed=2, ties=True), temps, ks, ps, k_max, True)
    assert torch.equal(draw_rows(pr, u), draw_rows_ref(pr, u))


@pytest.mark.parametrize("B, V, dtype, ties", [(10, 7, torch.bfloat16, True), (15, 100, torch.float32, False)])
def test_choose_rows_is_its_spec(B, V, dtype, ties):
    """A sampling step in one launch: each sampled row's draw (its own seed and position) and
    each greedy row's argmax, the first of ties, as the spec's torch ops choose them."""
    logits = logits_of(B, V, dtype, seed=B + V, ties=ties)
    temps, ks, ps, k_max = row_params(B, V, seed=B)
    seed = torch.arange(B, dtype=torch.int64, device=DEVICE) * 977
    position = torch.full((1,), 40, dtype=torch.int64, device=DEVICE).expand(B)  # a stride-0 row
    for top_p_any in (False, True):
        got = choose_rows(logits, temps, ks, ps, k_max, top_p_any, seed, position)
        assert got.dtype == torch.int64 and got.shape == (B,)
        assert torch.equal(got, choose_rows_ref(logits, temps, ks, ps, k_max, top_p_any, seed, position))


def test_choose_rows_argmax_takes_torchs_ties_and_nans():
    """A greedy row's token is torch.argmax's: the first of equal maxima (-0.0 equal to 0.0),
    the first NaN where there is one, a row of -inf its first token."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[-0.0, 0.0, -1.0], [1.0, nan, nan], [-inf, -inf, -inf], [-5.0, -2.0, -2.0]], device=DEVICE)
    zero, one = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    k = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    got = choose_rows(logits, zero, k, one, 0, False, k, k)
    assert got.tolist() == logits.argmax(-1).tolist() == [0, 1, 0, 1]


def test_draw_rows_never_draws_a_zero_and_takes_the_first_of_an_empty_row():
    """A zero-probability token is never drawn even at u near 1; a row with no positive mass
    (all zero, or NaN from a diverged model) takes token 0, as the spec."""
    pr = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0] * 4, [float("nan")] * 4, [0.25] * 4], device=DEVICE)
    u = torch.tensor([1 - 1e-16, 0.3, 0.3, 0.9999], dtype=torch.float64, device=DEVICE)
    got = draw_rows(pr, u)
    assert got.tolist() == draw_rows_ref(pr, u).tolist() == [2, 0, 0, 3]


def chunks(k, V, seed, trials):
    """Sampled chain chunks of k drafts: p (k + 1, V) and q (k, V) as near to each other as a
    trial's noise leaves them (from q = p, so every draft stays, to far apart), with ties among
    their probabilities, one q above p everywhere (a rejection with no residual mass: the spec
    draws from p), and the drafts drawn from q."""
    g = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        p = torch.softmax(torch.randint(-2, 3, (k + 1, V), generator=g).float() * (1 + trial % 2), -1)
        q = torch.softmax(p[:k].log() + torch.randn(k, V, generator=g) * (trial % 3) * 0.7, -1)
        if k and trial % 4 == 3:
            q[0] = 2 * p[0]
        seed_t, positions = torch.tensor([trial * 7919 + k]), torch.arange(50 + trial, 50 + trial + k + 1)
        drafts = draw_rows_ref(q, uniform_ref(seed_t.expand(k), positions[:k], 0))
        yield tuple(t.to(DEVICE) for t in (p, q, drafts, seed_t, positions))


@pytest.mark.parametrize("k, V", [(0, 9), (1, 5), (4, 33), (6, 100)])
def test_verdict_rows_is_its_spec(k, V):
    """The round's decision in one launch: the spec's count of accepted drafts and every row's
    target (accepted drafts, residual draws with ties among the residuals, the fall-back to p,
    the bonus draw), over chunks that stop at different drafts."""
    stops = set()
    for p, q, drafts, seed, positions in chunks(k, V, seed=V, trials=12):
        got = verdict_rows(p, q, drafts, seed, positions)
        n, targets = verdict_rows_ref(p, q, drafts, seed, positions)
        assert got.dtype == torch.int64 and got.shape == (k + 2,)
        assert int(got[0]) == int(n) and got[1:].tolist() == targets.tolist()
        stops.add(int(n))
    assert len(stops) > 1 or k == 0


def test_bad_input_is_refused():
    ok = torch.zeros(2, 8, device=DEVICE)
    f32 = torch.ones(2, device=DEVICE)
    k = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    u = torch.zeros(2, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="MAX_VOCAB"):
        probs_rows(torch.zeros(1, MAX_VOCAB + 1, device=DEVICE), f32[:1], k[:1], f32[:1], 0, False)
    with pytest.raises(ValueError, match="k_max"):
        probs_rows(ok, f32, k, f32, 9, False)
    with pytest.raises(ValueError, match="top_k"):
        probs_rows(ok, f32, k.float(), f32, 0, False)
    with pytest.raises(ValueError, match="temperature"):
        probs_rows(ok, f32[:1], k, f32, 0, False)
    with pytest.raises(ValueError, match="pr"):
        draw_rows(ok.double(), u)
    with pytest.raises(ValueError, match="u"):
        draw_rows(ok, u.float())
    with pytest.raises(ValueError, match="position"):
        choose_rows(ok, f32, k, f32, 0, False, k, k[:1])
    with pytest.raises(ValueError, match="seed"):
        choose_rows(ok, f32, k, f32, 0, False, k.float(), k)
    one, pos = torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.arange(2, device=DEVICE)
    with pytest.raises(ValueError, match="q"):
        verdict_rows(ok, ok, k[:1], one, pos)                     # q must be (k, V) = (1, 8)
    with pytest.raises(ValueError, match="drafts"):
        verdict_rows(ok, ok[:1], k[:1].float(), one, pos)
    with pytest.raises(ValueError, match="positions"):
        verdict_rows(ok, ok[:1], k[:1], one, pos[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("V", [256, 2048, MAX_VOCAB])
def test_sample_rows_on_the_gpu_are_their_spec(V):
    """The compiled kernels at the embedded model's vocabulary, a BPE model's and the largest
    (4, 8 and 16 warps): distributions close to the spec with the same kept tokens, the spec's
    draws, a whole sampling step's tokens, and the spec's chain verdicts."""
    B = 32
    logits = logits_of(B, V, torch.bfloat16, seed=V, ties=False).cuda()
    temps, ks, ps, k_max = (t.cuda() if isinstance(t, torch.Tensor) else t for t in row_params(B, V, seed=V))
    got = probs_rows(logits, temps, ks, ps, k_max, True)
    want = probs_rows_ref(logits, temps, ks, ps, k_max, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert torch.equal(got > 0, want > 0)
    u = torch.rand(B, dtype=torch.float64, device="cuda")
    assert torch.equal(draw_rows(want, u), draw_rows_ref(want, u))
    seed, position = torch.arange(B, device="cuda") * 31, torch.arange(B, device="cuda") + 7
    assert torch.equal(choose_rows(logits, temps, ks, ps, k_max, True, seed, position),
                       choose_rows_ref(logits, temps, ks, ps, k_max, True, seed, position))
    for p, q, drafts, seed, positions in chunks(4, V, seed=V, trials=8):
        p, q, drafts, seed, positions = (t.cuda() for t in (p, q, drafts, seed, positions))
        got = verdict_rows(p, q, drafts, seed, positions)
        n, targets = verdict_rows_ref(p, q, drafts, seed, positions)
        assert int(got[0]) == int(n) and got[1:].tolist() == targets.tolist()
