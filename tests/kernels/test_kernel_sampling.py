import pytest
import torch
from kernel_tolerances import DEVICE

from tinyloop.kernels import (ARGMAX_KEY_NONE, argmax, argmax_key_ref, argmax_ref, greedy_feed, greedy_feed_ref,
                              sample_top_k, sample_top_k_ref)
from tinyloop.kernels.sampling import _selection_order


def make_logits(B, V, dtype, seed, ties):
    """Random logits; with ties, few distinct values so equal maxima span rows and chunks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (B, V), generator=g).float() if ties else 3 * torch.randn(B, V, generator=g)
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B, V", [(1, 1), (3, 17), (2, 131), (4, 5003)])
def test_argmax_matches_ref(B, V, dtype, ties):
    logits = make_logits(B, V, dtype, seed=V, ties=ties)
    assert torch.equal(argmax(logits), argmax_ref(logits))


def test_argmax_tie_across_chunks_takes_first():
    logits = torch.zeros(2, 9000, device=DEVICE)
    logits[0, [4500, 100, 8999]] = 1.0  # maxima in the 1st, 2nd and 3rd 4096-wide chunk
    logits[1, [8999, 4096]] = 2.0
    assert argmax(logits).tolist() == [100, 4096]


def feed_buffers(position, device):
    """A decode step's inputs (token, position) and a host ring, as greedy_feed takes them."""
    host = torch.full((2,), -1, dtype=torch.int64)
    if device == "cuda":
        host = host.pin_memory()
    return (torch.full((1, 1), 7, dtype=torch.int64, device=device),
            torch.full((1, 1), position, dtype=torch.int64, device=device), host)


def greedy_buffers(position, table):
    """greedy_feed's key (holding NONE), the feed buffers, and the x it embeds into."""
    key = torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.int64, device=table.device)
    x = torch.zeros(1, 1, table.shape[1], dtype=table.dtype, device=table.device)
    return key, *feed_buffers(position, table.device.type), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,D,position", [(17, 8, 4), (5003, 96, 9), (300, 5000, 0)])
def test_greedy_feed_matches_ref(V, D, position, dtype):
    """The token an argmax key names, fed forward: into the step's token input, its position
    one on, the host ring's slot of that position (the other slot untouched) and its embedding
    row into x (D = 5000: two BLOCK_D chunks); the key is set back to NONE."""
    g = torch.Generator().manual_seed(V + D)
    table = torch.randn(V, D, generator=g).to(DEVICE, dtype)
    logits = make_logits(1, V, torch.float32, seed=V, ties=True)
    got, want = greedy_buffers(position, table), greedy_buffers(position, table)
    for key in (got[0], want[0]):
        torch.maximum(key, argmax_key_ref(logits), out=key)
    out = greedy_feed(*got[:4], table, got[4])
    assert torch.equal(out, argmax_ref(logits))
    assert torch.equal(greedy_feed_ref(*want[:4], table, want[4]), out)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    key, tokens, positions, host, x = got
    assert int(key) == ARGMAX_KEY_NONE and tokens.item() == out.item() and positions.item() == position + 1
    slot = (position + 1) % 2
    assert host[slot].item() == out.item() and host[1 - slot].item() == -1
    assert torch.equal(x.view(D), table[out.item()])
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))


def test_greedy_feed_rejects_bad_inputs():
    table = torch.randn(11, 4, device=DEVICE)
    key, tokens, positions, host, x = greedy_buffers(3, table)
    with pytest.raises(ValueError, match=r"greedy_feed: key must have shape \(1,\)"):
        greedy_feed(key.repeat(2), tokens, positions, host, table, x)
    with pytest.raises(ValueError, match="key dtype must be one of"):
        greedy_feed(key.int(), tokens, positions, host, table, x)
    with pytest.raises(ValueError, match="positions dtype must be one of"):
        greedy_feed(key, tokens, positions.int(), host, table, x)
    with pytest.raises(ValueError, match=r"host must have shape \(2,\)"):
        greedy_feed(key, tokens, positions, host[:1], table, x)
    with pytest.raises(ValueError, match=r"x must have shape \(1, 1, 4\)"):
        greedy_feed(key, tokens, positions, host, table, x[..., :3])
    with pytest.raises(ValueError, match="x must be contiguous in the table's dtype"):
        greedy_feed(key, tokens, positions, host, table, x.double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_feed_gpu_writes_pinned_host_memory_and_rejects_pageable():
    table = torch.randn(151_936, 2048, device="cuda", dtype=torch.bfloat16)
    logits = make_logits(1, 151_936, torch.bfloat16, seed=1, ties=False)
    key, tokens, positions, host, x = greedy_buffers(10, table)
    key.copy_(argmax_key_ref(logits))
    out = greedy_feed(key, tokens, positions, host, table, x)
    torch.cuda.synchronize()
    assert host[1].item() == out.item() == argmax_ref(logits).item() and positions.item() == 11
    assert torch.equal(x.view(-1), table[out.item()]) and int(key) == ARGMAX_KEY_NONE
    with pytest.raises(ValueError, match="host must be pinned"):
        greedy_feed(key, tokens, positions, torch.zeros(2, dtype=torch.int64), table, x)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("B, V, top_k", [(3, 1, 5), (4, 17, 1), (4, 17, 1024), (5, 131, 7), (3, 2003, 50), (2, 1500, 1024)])
def test_sample_top_k_matches_ref(B, V, top_k, temperature, ties):
    logits = make_logits(B, V, torch.float32, seed=V + top_k, ties=ties)
    u = torch.rand(B, generator=torch.Generator().manual_seed(top_k)).to(DEVICE)
    assert torch.equal(sample_top_k(logits, top_k, temperature, u), sample_top_k_ref(logits, top_k, temperature, u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_selection_order_is_stable_descending_sort(dtype):
    """The kept tokens and their order, signed zeros and infinities included."""
    logits = make_logits(3, 300, dtype, seed=5, ties=True) - 2  # values -2 .. 1
    logits[0, [3, 7, 250]] = -0.0
    logits[1, [0, 299]] = float("inf")
    logits[2, :] = 0.0
    logits[2, ::3] = -0.0
    expected = logits.float().sort(dim=1, descending=True, stable=True).indices
    for k in (1, 7, 300):
        assert torch.equal(_selection_order(logits, k), expected[:, :k])


def test_sample_top_k_fp16_and_extreme_uniforms():
    logits = make_logits(4, 257, torch.float16, seed=1, ties=True)
    for u in (torch.zeros(4), torch.full((4,), 1.0 - 2 ** -24), torch.rand(4)):
        u = u.to(DEVICE)
        assert torch.equal(sample_top_k(logits, 40, 0.9, u), sample_top_k_ref(logits, 40, 0.9, u))


def test_sample_top_k_one_is_argmax():
    logits = make_logits(6, 333, torch.float32, seed=2, ties=True)
    assert torch.equal(sample_top_k(logits, 1, 1.0, torch.rand(6, device=DEVICE)), argmax_ref(logits))


def test_sample_top_k_ref_draws_the_softmax():
    """The spec itself: over a fine grid of u, each kept token is drawn with its softmax mass."""
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0, 1.0, -3.0]])
    n = 20000
    u = (torch.arange(n) + 0.5) / n
    tokens = sample_top_k_ref(logits.expand(n, -1), 4, 0.8, u)
    freq = torch.bincount(tokens, minlength=6).float() / n
    kept = torch.tensor([0, 2, 4, 1])  # descending logit, the tie 2 / 4 by index
    expected = torch.zeros(6)
    expected[kept] = torch.softmax(logits[0, kept] / 0.8, 0)
    torch.testing.assert_close(freq, expected, atol=1e-3, rtol=0)
    assert tokens[0] == 0 and tokens[-1] == 1  # inverse CDF walks the selection order


def test_sampling_rejects_bad_inputs():
    logits = torch.randn(2, 10, device=DEVICE)
    u = torch.rand(2, device=DEVICE)
    with pytest.raises(ValueError, match="top_k must be an int"):
        sample_top_k(logits, 0, 1.0, u)
    with pytest.raises(ValueError, match="top_k must be an int"):
        sample_top_k(logits, 1025, 1.0, u)
    with pytest.raises(ValueError, match="temperature must be"):
        sample_top_k(logits, 5, 0.0, u)
    with pytest.raises(ValueError, match="u must have shape"):
        sample_top_k(logits, 5, 1.0, u[:1])
    with pytest.raises(ValueError, match="logits must be 2-D"):
        argmax(logits[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ties", [False, True])
def test_sampling_gpu_bf16(ties):
    logits = make_logits(64, 151_936, torch.bfloat16, seed=0, ties=ties)
    assert torch.equal(argmax(logits), argmax_ref(logits))
    u = torch.rand(64, device="cuda")
    for top_k in (1, 50, 1024):
        assert torch.equal(sample_top_k(logits, top_k, 0.7, u), sample_top_k_ref(logits, top_k, 0.7, u))
