import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels import apply_rope_ref, rope_cache_write, rope_cache_write_ref


def rope_tables(positions, hd, theta=10000.0):
    """positions (B, T) -> cos, sin (B, T, hd // 2) fp32, as the model builds them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=positions.device) / hd)
    ang = positions.float()[..., None] * inv_freq.float()
    return ang.cos(), ang.sin()


def make_inputs(B, T, H, Hkv, hd, S, dtype, seed):
    """q, k, v as views of one fused projection output and caches as views into a larger
    (B, S + 3, Hkv, hd) buffer, so every stride differs from the contiguous one."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * hd, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    q, k, v = q.view(B, T, H, hd), k.view(B, T, Hkv, hd), v.view(B, T, Hkv, hd)
    caches = [torch.randn(B, S + 3, Hkv, hd, generator=g).to(DEVICE, dtype)[:, 1:S + 1].permute(0, 2, 1, 3)
              for _ in range(2)]  # (B, Hkv, S, hd) views
    positions = torch.randint(0, 4096, (B, T), generator=g).to(DEVICE)
    cos, sin = rope_tables(positions, hd)
    # distinct slots per row; a few -1 (padding) and S (out of range) must be skipped
    write_idx = torch.stack([torch.randperm(S + 1, generator=g)[:T] for _ in range(B)])
    write_idx = torch.where(write_idx == S, -1, write_idx).to(DEVICE)
    return q, k, v, cos, sin, write_idx, caches[0], caches[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B, T, H, Hkv, hd, S", [
    (1, 1, 2, 2, 16, 1),
    (2, 3, 4, 2, 32, 7),
    (3, 8, 8, 2, 24, 33),
    (2, 5, 6, 3, 64, 130),
    (1, 7, 4, 1, 18, 11),
])
def test_rope_cache_write_matches_ref(B, T, H, Hkv, hd, S, dtype):
    q, k, v, cos, sin, idx, k_cache, v_cache = make_inputs(B, T, H, Hkv, hd, S, dtype, seed=B * 100 + T + hd)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_rot = rope_cache_write(q, k, v, cos, sin, idx, k_cache, v_cache)
    q_ref = rope_cache_write_ref(q, k, v, cos, sin, idx, k_ref, v_ref)
    assert q_rot.shape == (B, H, T, hd) and q_rot.is_contiguous()
    assert_close(q_rot, q_ref)
    assert_close(k_cache, k_ref)  # written slots match, untouched slots still equal
    assert torch.equal(v_cache, v_ref)  # v is copied, not computed


def test_rope_cache_write_mixed_cache_dtype():
    q, k, v, cos, sin, idx, k_cache, v_cache = make_inputs(2, 4, 4, 2, 32, 9, torch.float32, seed=3)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_rot = rope_cache_write(q, k, v, cos, sin, idx, k_cache, v_cache)
    assert_close(q_rot, rope_cache_write_ref(q, k, v, cos, sin, idx, k_ref, v_ref))
    assert_close(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_apply_rope_ref_is_relative():
    """The spec itself: q . k after RoPE depends only on the position difference."""
    torch.manual_seed(0)
    hd = 32
    q, k = torch.randn(1, 1, 1, hd, dtype=torch.float64), torch.randn(1, 1, 1, hd, dtype=torch.float64)
    dots = []
    for pq, pk in [(5, 2), (103, 100), (3, 0)]:
        cq, sq = rope_tables(torch.tensor([[pq]]), hd)
        ck, sk = rope_tables(torch.tensor([[pk]]), hd)
        dots.append((apply_rope_ref(q, cq.double(), sq.double()) * apply_rope_ref(k, ck.double(), sk.double())).sum())
    torch.testing.assert_close(dots[0], dots[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dots[0], dots[2], atol=1e-5, rtol=1e-5)


def test_rope_cache_write_rejects_bad_inputs():
    q, k, v, cos, sin, idx, k_cache, v_cache = make_inputs(1, 2, 2, 1, 16, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="cos must have shape"):
        rope_cache_write(q, k, v, cos[..., :-1], sin, idx, k_cache, v_cache)
    with pytest.raises(ValueError, match="write_idx dtype"):
        rope_cache_write(q, k, v, cos, sin, idx.int(), k_cache, v_cache)
    with pytest.raises(ValueError, match="head dim must be even"):
        rope_cache_write(q[..., :15], k[..., :15], v[..., :15], cos, sin, idx,
                         k_cache[..., :15], v_cache[..., :15])
    with pytest.raises(ValueError, match="v_cache must have shape"):
        rope_cache_write(q, k, v, cos, sin, idx, k_cache, v_cache[:, :, :3])


def make_slot_inputs(B, n_slots, T, H, Hkv, hd, S, dtype, seed):
    """make_inputs' for B rows over whole cache layers (n_slots, Hkv, S, hd); row 1 is idle
    (every write_idx -1 or S: it writes nothing)."""
    q, k, v, cos, sin, idx, k_cache, v_cache = make_inputs(n_slots, T, H, Hkv, hd, S, dtype, seed)
    idx = idx[:B].clone()
    idx[1] = torch.tensor([-1, S] * T)[:T]
    return q[:B], k[:B], v[:B], cos[:B], sin[:B], idx, k_cache, v_cache


@pytest.mark.parametrize("hd, dtype, slots_dtype", [(64, torch.float32, torch.int64), (18, torch.float16, torch.int32)])
def test_rope_cache_write_slots_matches_ref(hd, dtype, slots_dtype):
    """Rows on cache slots slots[b] of whole layers (n_slots = 5 > B = 3, GQA 2, odd S): the
    launcher equals the reference with slots, q_rot and caches; each row writes its own slot
    only (the idle row and the two unused slots untouched bitwise); the reference and the
    launcher equal their slot-less selves on the gathered rows k_cache[slots], writes included."""
    B, n_slots, T, H, Hkv, S = 3, 5, 4, 4, 2, 19
    slots = torch.tensor([4, 0, 2], dtype=slots_dtype, device=DEVICE)
    got, ref, orig = (make_slot_inputs(B, n_slots, T, H, Hkv, hd, S, dtype, seed=hd) for _ in range(3))
    q_rot = rope_cache_write(*got, slots=slots)
    q_ref = rope_cache_write_ref(*ref, slots=slots)
    assert q_rot.shape == (B, H, T, hd) and q_rot.is_contiguous() and q_ref.is_contiguous()
    assert_close(q_rot, q_ref)
    assert_close(got[6], ref[6])
    assert torch.equal(got[7], ref[7])
    for a in (got, ref):  # slot 0 (the idle row's) and the unused slots 1, 3: untouched
        for s in (0, 1, 3):
            assert torch.equal(a[6][s], orig[6][s]) and torch.equal(a[7][s], orig[7][s])
        for s in (4, 2):
            assert not torch.equal(a[6][s], orig[6][s])

    for op, out, a in ((rope_cache_write_ref, q_ref, ref), (rope_cache_write, q_rot, got)):
        gathered = orig[6][slots], orig[7][slots]  # (B, Hkv, S, hd) copies
        assert torch.equal(out, op(*orig[:6], *gathered))
        assert torch.equal(a[6][slots], gathered[0]) and torch.equal(a[7][slots], gathered[1])


@pytest.mark.parametrize("op", [rope_cache_write, rope_cache_write_ref])
def test_rope_cache_write_rejects_bad_slots(op):
    args = make_slot_inputs(2, 4, 2, 2, 1, 16, 4, torch.float32, seed=0)
    name = op.__name__
    with pytest.raises(ValueError, match=rf"{name}: slots\[1\] = 4 is outside \[0, 4\)"):
        op(*args, slots=torch.tensor([0, 4], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots\[0\] = -2 is outside"):
        op(*args, slots=torch.tensor([-2, 0], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots must have shape \(2,\), got \(3,\)"):
        op(*args, slots=torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots must have shape \(2,\), got \(\)"):
        op(*args, slots=torch.tensor(0, device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots dtype"):
        op(*args, slots=torch.tensor([0, 1], dtype=torch.uint8, device=DEVICE))
    if op is rope_cache_write:
        with pytest.raises(ValueError, match=r"v_cache must have shape \(4, 1, 4, 16\)"):
            op(*args[:7], args[7][:2], slots=torch.tensor([0, 1], device=DEVICE))

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B, T, H, Hkv, hd, S", [(8, 1, 32, 8, 128, 4099), (2, 257, 16, 4, 64, 1031)])
def test_rope_cache_write_gpu_bf16(B, T, H, Hkv, hd, S):
    q, k, v, cos, sin, idx, k_cache, v_cache = make_inputs(B, T, H, Hkv, hd, S, torch.bfloat16, seed=T)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_rot = rope_cache_write(q, k, v, cos, sin, idx, k_cache, v_cache)
    assert_close(q_rot, rope_cache_write_ref(q, k, v, cos, sin, idx, k_ref, v_ref))
    assert_close(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_cache_write_gpu_slots_bf16():
    """Rows on a permuted subset of 9 cache slots: the reference's q_rot and caches, and the
    slot-less launch on the gathered rows bitwise."""
    B, n_slots, T, H, Hkv, hd, S = 4, 9, 17, 32, 8, 128, 1031
    slots = torch.tensor([8, 0, 5, 2], device="cuda")
    got, ref, orig = (make_slot_inputs(B, n_slots, T, H, Hkv, hd, S, torch.bfloat16, seed=2) for _ in range(3))
    q_rot = rope_cache_write(*got, slots=slots)
    assert_close(q_rot, rope_cache_write_ref(*ref, slots=slots))
    assert_close(got[6], ref[6])
    assert torch.equal(got[7], ref[7])
    gathered = orig[6][slots], orig[7][slots]
    assert torch.equal(q_rot, rope_cache_write(*orig[:6], *gathered))
    assert torch.equal(got[6][slots], gathered[0]) and torch.equal(got[7][slots], gathered[1])
