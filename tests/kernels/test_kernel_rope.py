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
