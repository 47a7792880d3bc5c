import pytest
import torch
import torch.nn.functional as F
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels import ancestors_from_parents, tree_attention, tree_attention_ref

F32, F16 = torch.float32, torch.float16


def random_parents(B, T, g):
    """(B, T) int64, parents[b, t] uniform in [-1, t): forests of any shape, chains included."""
    return torch.stack([torch.tensor([int(torch.randint(-1, t, (1,), generator=g)) if t else -1
                                      for t in range(T)]) for _ in range(B)])


def make_inputs(B, H, Hkv, hd, T, S, dtype, seed):
    """q (B, H, T, hd) as a transposed view; caches (B, Hkv, S, hd) views of a (B, S, Hkv, hd) buffer."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, H, hd, generator=g).to(DEVICE, dtype).transpose(1, 2)
    caches = [torch.randn(B, S, Hkv, hd, generator=g).to(DEVICE, dtype).permute(0, 2, 1, 3) for _ in range(2)]
    prefix_lens = torch.randint(0, S - T + 1, (B,), generator=g)
    prefix_lens[0] = S - T  # a tree that ends exactly at the last slot
    return q, caches[0], caches[1], prefix_lens.to(DEVICE), random_parents(B, T, g).to(DEVICE)


@pytest.mark.parametrize("T, S, hd, H, Hkv, dtype", [
    (1, 1, 16, 2, 2, F32), (1, 33, 24, 4, 2, F16),
    (3, 7, 24, 8, 2, F32), (3, 130, 16, 2, 2, F16),
    (8, 33, 32, 4, 1, F32), (8, 130, 24, 8, 2, F32), (8, 8, 32, 4, 2, F16),
    (20, 57, 16, 8, 2, F32),  # G * T = 80 rows: two row tiles
])
def test_tree_attention_matches_ref(T, S, hd, H, Hkv, dtype):
    q, k_cache, v_cache, prefix_lens, parents = make_inputs(3, H, Hkv, hd, T, S, dtype, seed=T * 1000 + S)
    anc = ancestors_from_parents(parents)
    scale = hd ** -0.5
    assert_close(tree_attention(q, k_cache, v_cache, prefix_lens, anc, scale),
                 tree_attention_ref(q, k_cache, v_cache, prefix_lens, anc, scale), "attention")


@pytest.mark.parametrize("T, P", [(1, 0), (3, 17), (8, 40)])
def test_chain_tree_is_causal_attention(T, P):
    """parents = [-1, 0, 1, ...] must equal causal attention of the chunk over prefix + chunk."""
    B, H, Hkv, hd = 2, 4, 2, 24
    q, k_cache, v_cache, _, _ = make_inputs(B, H, Hkv, hd, T, P + T + 5, F32, seed=T + P)
    prefix_lens = torch.full((B,), P, device=DEVICE)
    parents = torch.arange(-1, T - 1, device=DEVICE).expand(B, T)
    out = tree_attention(q, k_cache, v_cache, prefix_lens, ancestors_from_parents(parents), hd ** -0.5)
    keys = torch.arange(P + T, device=DEVICE)
    causal = keys[None, :] <= P + torch.arange(T, device=DEVICE)[:, None]  # (T, P + T)
    expected = F.scaled_dot_product_attention(
        q, k_cache[:, :, :P + T].repeat_interleave(H // Hkv, 1), v_cache[:, :, :P + T].repeat_interleave(H // Hkv, 1),
        attn_mask=causal, scale=hd ** -0.5)
    assert_close(out, expected, "attention")


def test_ancestors_from_parents():
    g = torch.Generator().manual_seed(0)
    parents = random_parents(4, 30, g)
    expected = torch.zeros_like(parents)
    for b in range(4):
        for t in range(30):
            u = t
            while u >= 0:
                expected[b, t] |= 1 << u
                u = int(parents[b, u])
    assert torch.equal(ancestors_from_parents(parents), expected)
    wide = ancestors_from_parents(torch.arange(-1, 62).expand(1, 63))  # the top bit fits too
    assert wide[0, 62] == (1 << 63) - 1


def test_tree_attention_rejects_bad_inputs():
    q, k_cache, v_cache, prefix_lens, parents = make_inputs(2, 4, 2, 16, 3, 9, F32, seed=0)
    anc = ancestors_from_parents(parents)
    with pytest.raises(ValueError, match="ancestors dtype"):
        tree_attention(q, k_cache, v_cache, prefix_lens, anc.int(), 1.0)
    with pytest.raises(ValueError, match="ancestors must have shape"):
        tree_attention(q, k_cache, v_cache, prefix_lens, anc[:, :2], 1.0)
    with pytest.raises(ValueError, match="at most 63"):
        ancestors_from_parents(torch.full((1, 64), -1))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        tree_attention(q[:, :3], k_cache, v_cache, prefix_lens, anc, 1.0)


def make_slot_inputs(B, n_slots, H, Hkv, hd, T, S, dtype, seed):
    """make_inputs' for B rows over whole cache layers (n_slots, Hkv, S, hd)."""
    q, k_cache, v_cache, prefix_lens, parents = make_inputs(n_slots, H, Hkv, hd, T, S, dtype, seed)
    return q[:B], k_cache, v_cache, prefix_lens[:B], parents[:B]


# slots: a permuted subset of 5 cache slots (int64 / int32), or two rows sharing one (read only)
@pytest.mark.parametrize("T, hd, dtype, slots, slots_dtype", [
    (5, 64, F32, [4, 0, 2], torch.int64), (3, 24, F16, [4, 0, 2], torch.int32), (8, 24, F32, [1, 3, 1], torch.int64),
])
def test_tree_attention_slots_matches_ref(T, hd, dtype, slots, slots_dtype):
    """Rows on cache slots slots[b] of a whole layer (n_slots = 5 > B = 3, GQA 2, odd S): the
    launcher equals the reference; the reference equals the slot-less one on the gathered rows
    k_cache[slots] bitwise, and so does the launcher."""
    B, H, Hkv, S = 3, 4, 2, 19
    q, k_cache, v_cache, prefix_lens, parents = make_slot_inputs(B, 5, H, Hkv, hd, T, S, dtype, seed=T + hd)
    anc = ancestors_from_parents(parents)
    slots = torch.tensor(slots, dtype=slots_dtype, device=DEVICE)
    scale = hd ** -0.5
    out = tree_attention(q, k_cache, v_cache, prefix_lens, anc, scale, slots=slots)
    ref = tree_attention_ref(q, k_cache, v_cache, prefix_lens, anc, scale, slots=slots)
    assert_close(out, ref, "attention")
    k_rows, v_rows = k_cache[slots], v_cache[slots]  # (B, Hkv, S, hd) copies
    assert torch.equal(ref, tree_attention_ref(q, k_rows, v_rows, prefix_lens, anc, scale))
    assert torch.equal(out, tree_attention(q, k_rows, v_rows, prefix_lens, anc, scale))


@pytest.mark.parametrize("op", [tree_attention, tree_attention_ref])
def test_tree_attention_rejects_bad_slots(op):
    q, k_cache, v_cache, prefix_lens, parents = make_slot_inputs(2, 4, 4, 2, 16, 3, 9, F32, seed=0)
    args = (q, k_cache, v_cache, prefix_lens, ancestors_from_parents(parents), 1.0)
    name = op.__name__
    with pytest.raises(ValueError, match=rf"{name}: slots\[1\] = 4 is outside \[0, 4\)"):
        op(*args, slots=torch.tensor([0, 4], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots\[0\] = -1 is outside"):
        op(*args, slots=torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots must have shape \(2,\), got \(1, 2\)"):
        op(*args, slots=torch.tensor([[0, 1]], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots dtype"):
        op(*args, slots=torch.tensor([0., 1.], device=DEVICE))
    if op is tree_attention:
        with pytest.raises(ValueError, match=r"v_cache must have shape \(4, 2, 9, 16\)"):
            op(q, k_cache, v_cache[:2], *args[3:], slots=torch.tensor([0, 1], device=DEVICE))

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B, H, Hkv, hd, T, S", [(4, 32, 8, 128, 31, 4099), (2, 16, 16, 64, 63, 1031)])
def test_tree_attention_gpu_bf16(B, H, Hkv, hd, T, S):
    q, k_cache, v_cache, prefix_lens, parents = make_inputs(B, H, Hkv, hd, T, S, torch.bfloat16, seed=T)
    anc = ancestors_from_parents(parents)
    assert_close(tree_attention(q, k_cache, v_cache, prefix_lens, anc, hd ** -0.5),
                 tree_attention_ref(q, k_cache, v_cache, prefix_lens, anc, hd ** -0.5), "attention")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_attention_gpu_slots_bf16():
    """Rows on a permuted subset of 7 cache slots (two sharing one): the reference, and the
    slot-less launch on the gathered rows bitwise."""
    B, n_slots, H, Hkv, hd, T, S = 4, 7, 32, 8, 128, 31, 4099
    q, k_cache, v_cache, prefix_lens, parents = make_slot_inputs(B, n_slots, H, Hkv, hd, T, S, torch.bfloat16, 4)
    anc = ancestors_from_parents(parents)
    slots = torch.tensor([6, 0, 3, 3], device="cuda")
    out = tree_attention(q, k_cache, v_cache, prefix_lens, anc, hd ** -0.5, slots=slots)
    assert_close(out, tree_attention_ref(q, k_cache, v_cache, prefix_lens, anc, hd ** -0.5, slots=slots), "attention")
    assert torch.equal(out, tree_attention(q, k_cache[slots], v_cache[slots], prefix_lens, anc, hd ** -0.5))
