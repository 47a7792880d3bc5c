"""gemv's post-norm prologue (skip=, skip_norm_weight=): the projection of h = skip + rmsnorm(x),
a sandwich-norm layer's post-norm and residual add on the previous projection's output, and h
itself, written by the kernel. Against the reference (the rms_norm skip path, then the
projection), and against the projection of the h it returns: every program's input is the
stored h, bit for bit."""
import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels.gemv import gemv, gemv_ref
from tinyloop.kernels.rmsnorm import rms_norm

# (N, K): K past the interpreter's 64-wide chunk (the loop, a ragged last chunk) and within it
# (the one-chunk path); N a row block's multiple and not
CASES = [(13, 100), (24, 192), (70, 33)]
OPTIONS = {"plain": {}, "norm": {"norm": True}, "norm+swiglu": {"norm": True, "swiglu": True},
           "residual": {"residual": True}}


def _inputs(N, K, dtype, norm=False, swiglu=False, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed + N * 1000 + K)
    x = (2 * torch.randn(1, 1, K, generator=g)).to(DEVICE, dtype)       # the previous projection's output
    skip = (3 * torch.randn(1, 1, K, generator=g)).to(DEVICE, dtype)    # the residual stream
    pw = (1 + 0.2 * torch.randn(K, generator=g)).to(DEVICE, dtype)      # the post-norm weight
    w = (torch.randn(2 * N if swiglu else N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    kw = {"swiglu": swiglu}
    if norm:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
        kw["eps"] = 1e-5
    if residual:
        kw["residual"] = torch.randn(1, 1, N, generator=g).to(DEVICE, dtype)
    return x, skip, pw, w, kw


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("N,K", CASES)
def test_gemv_skip_matches_ref(N, K, option, dtype, pdl):
    x, skip, pw, w, kw = _inputs(N, K, dtype, **OPTIONS[option])
    y, h = gemv(x, w, skip=skip, skip_norm_weight=pw, skip_eps=1e-6, pdl=pdl, **kw)
    want_y, want_h = gemv_ref(x, w, skip=skip, skip_norm_weight=pw, skip_eps=1e-6, **kw)
    assert h.shape == x.shape and y.shape == (1, 1, N)
    # h rounds twice (the normalized x, then the sum) like a projection's epilogue: a scale off by
    # the norm's reduction order can move the first rounding by an ulp of the larger operand
    assert_close(h, want_h, "projection")
    assert_close(y, want_y, "projection")
    # each program's input is the stored h: the projection of h alone is y, bit for bit (the
    # same tile, so the same sums)
    assert torch.equal(y, gemv(h, w, pdl=pdl, **kw))


def test_gemv_skip_h_is_the_norm_kernel_skip():
    """h against the unfused path's residual (kernels.rmsnorm's skip= launch): fp32, to the
    reduction order of the norm's sum of squares."""
    x, skip, pw, w, kw = _inputs(24, 192, torch.float32, norm=True)
    _, h = gemv(x, w, skip=skip, skip_norm_weight=pw, **kw)
    torch.testing.assert_close(h, rms_norm(x, pw, 1e-6, skip=skip), atol=1e-5, rtol=1e-5)


def test_gemv_skip_fp32_norm_weight_on_bf16():
    """A post-norm weight of another float dtype than x (a checkpoint's fp32 norms on bf16)."""
    x, skip, pw, w, kw = _inputs(13, 100, torch.bfloat16, norm=True)
    pw = pw.float() * 1.01
    y, h = gemv(x, w, skip=skip, skip_norm_weight=pw, **kw)
    want_y, want_h = gemv_ref(x, w, skip=skip, skip_norm_weight=pw, **kw)
    assert_close(h, want_h, "projection")
    assert_close(y, want_y, "projection")


def test_gemv_skip_rejects_bad_inputs():
    x, skip, pw, w, _ = _inputs(8, 16, torch.float32)
    with pytest.raises(ValueError, match="skip and skip_norm_weight come together"):
        gemv(x, w, skip=skip)
    with pytest.raises(ValueError, match="skip and skip_norm_weight come together"):
        gemv(x, w, skip_norm_weight=pw)
    with pytest.raises(ValueError, match=r"skip takes one row of x \(M = 1\), got M = 2"):
        gemv(x.expand(2, 1, 16).contiguous(), w, skip=skip.expand(2, 1, 16).contiguous(), skip_norm_weight=pw)
    with pytest.raises(ValueError, match=r"skip must have shape \(1, 1, 16\)"):
        gemv(x, w, skip=skip.view(1, 16), skip_norm_weight=pw)
    with pytest.raises(ValueError, match="skip dtype"):
        gemv(x, w, skip=skip.double(), skip_norm_weight=pw)
    with pytest.raises(ValueError, match=r"skip_norm_weight must have shape \(16,\)"):
        gemv(x, w, skip=skip, skip_norm_weight=pw[:8])
    with pytest.raises(ValueError, match="skip_norm_weight dtype"):
        gemv(x, w, skip=skip, skip_norm_weight=pw.to(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K,swiglu", [(6144, 2048, False), (11264, 2048, True)])
def test_gemv_skip_gpu_bf16_in_a_graph(N, K, swiglu):
    """The Ouro-1.4B shapes the prologue runs at (q|k|v, gate|up, both normed), bf16 with PDL,
    captured in a CUDA graph and replayed on new inputs: the reference's values, and bitwise
    the same y and h at every replay of the same inputs."""
    x, skip, pw, w, kw = _inputs(N // 2 if swiglu else N, K, torch.bfloat16, norm=True, swiglu=swiglu)
    xs, ss = x.clone(), skip.clone()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemv(xs, w, skip=ss, skip_norm_weight=pw, **kw)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, h = gemv(xs, w, skip=ss, skip_norm_weight=pw, **kw)
    runs = []
    for seed in (1, 2, 1):
        x2, s2, *_ = _inputs(N // 2 if swiglu else N, K, torch.bfloat16, seed=seed)
        xs.copy_(x2)
        ss.copy_(s2)
        g.replay()
        torch.cuda.synchronize()
        want_y, want_h = gemv_ref(x2, w, skip=s2, skip_norm_weight=pw, **kw)
        assert_close(h, want_h, "projection")
        assert_close(y, want_y, "projection")
        runs.append((y.clone(), h.clone()))
    assert torch.equal(runs[0][0], runs[2][0]) and torch.equal(runs[0][1], runs[2][1])


def test_gemv_l2_prefetch_leaves_y_unchanged():
    """l2_prefetch (the bytes of a later projection asked of L2 before the PDL wait) changes
    what the memory holds, never what is computed: y bitwise the call's without it (under the
    interpreter nothing is prefetched; tests/kernels' GPU test runs the prefetch)."""
    x, skip, pw, w, kw = _inputs(24, 192, torch.bfloat16, norm=True)
    later = torch.randn(64, 96, device=DEVICE).to(torch.bfloat16)
    want = gemv(x, w, **kw)
    assert torch.equal(gemv(x, w, l2_prefetch=(later[:8], later[32:40]), **kw), want)
    y, h = gemv(x, w, skip=skip, skip_norm_weight=pw, l2_prefetch=(later[:8], later[32:40]), **kw)
    assert torch.equal((y, h)[0], gemv(x, w, skip=skip, skip_norm_weight=pw, **kw)[0])


def test_gemv_l2_prefetch_rejects_bad_inputs():
    x, _, _, w, _ = _inputs(8, 16, torch.float32)
    t = torch.zeros(64, device=DEVICE)
    with pytest.raises(ValueError, match="l2_prefetch must be two tensors"):
        gemv(x, w, l2_prefetch=(t,))
    with pytest.raises(ValueError, match=r"l2_prefetch takes one row of x \(M = 1\), got M = 2"):
        gemv(x.expand(2, 1, 16).contiguous(), w, l2_prefetch=(t, t))
    with pytest.raises(ValueError, match=r"l2_prefetch\[1\] must be contiguous and 16-byte aligned"):
        gemv(x, w, l2_prefetch=(t, t.view(8, 8).t()))
    with pytest.raises(ValueError, match=r"l2_prefetch\[0\] must be contiguous and 16-byte aligned"):
        gemv(x, w, l2_prefetch=(t[1:], t))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_l2_prefetch_gpu_in_a_graph():
    """The Ouro-1.4B wo projection prefetching gate|up's first rows (both halves, 6 MiB each)
    with PDL, in a CUDA graph behind another kernel: y bitwise the plain call's at every replay."""
    x, _, _, w, _ = _inputs(2048, 2048, torch.bfloat16)
    w13 = (torch.randn(2 * 5632, 2048, device="cuda") / 45).to(torch.bfloat16)
    rows = 6 * 2**20 // (2048 * 2)
    pf = (w13[:rows], w13[5632:5632 + rows])
    want = gemv(x, w)
    xs = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemv(xs * 1, w, l2_prefetch=pf)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = gemv(xs * 1, w, l2_prefetch=pf)  # behind the multiply's kernel, as behind the attention
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want)
