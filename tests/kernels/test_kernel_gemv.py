import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels.gemv import gemv, gemv_ref

CASES = [  # (N, K): a row block and a K chunk that divide, and ones that do not
    (8, 64), (24, 192), (13, 100), (70, 33),
]


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", CASES)
@pytest.mark.parametrize("norm,swiglu,residual", [
    (False, False, False), (True, False, False), (False, False, True), (True, True, False),
])
def test_gemv_matches_ref(N, K, dtype, norm, swiglu, residual, pdl):
    g = torch.Generator().manual_seed(N * 1000 + K)
    x = (3 * torch.randn(1, 1, K, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(2 * N if swiglu else N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    kw = {}
    if norm:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
        kw["eps"] = 1e-5
    if residual:
        kw["residual"] = torch.randn(1, 1, N, generator=g).to(DEVICE, dtype)
    y = gemv(x, w, swiglu=swiglu, pdl=pdl, **kw)
    assert y.shape == (1, 1, N)
    assert_close(y, gemv_ref(x, w, swiglu=swiglu, **kw), "projection")


def test_gemv_equals_the_unfused_layer_ops():
    """norm + projection, and residual + projection, against the model's own unfused path."""
    from tinyloop.kernels.rmsnorm import rms_norm_ref
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 96, generator=g).to(DEVICE)
    w = torch.randn(40, 96, generator=g).to(DEVICE)
    nw = torch.rand(96, generator=g).to(DEVICE)
    r = torch.randn(1, 1, 40, generator=g).to(DEVICE)
    assert_close(gemv(x, w, norm_weight=nw, eps=1e-6), rms_norm_ref(x, nw, 1e-6) @ w.t(), "projection")
    assert_close(gemv(x, w, residual=r), r + x @ w.t(), "projection")


def test_gemv_rejects_bad_inputs():
    x = torch.randn(1, 16, device=DEVICE)
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="single row"):
        gemv(torch.randn(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="K = 16 columns"):
        gemv(x, torch.randn(8, 15, device=DEVICE))
    with pytest.raises(ValueError, match="weight dtype"):
        gemv(x, w.double())
    with pytest.raises(ValueError, match="unit stride"):
        gemv(x, torch.randn(16, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="even row count"):
        gemv(x, torch.randn(7, 16, device=DEVICE), swiglu=True)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        gemv(x, w, norm_weight=torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="residual must have shape"):
        gemv(x, w, residual=torch.ones(1, 9, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K,swiglu", [(6144, 2048, False), (2048, 2048, False), (11264, 2048, True),
                                        (2048, 5632, False), (32000, 2048, False)])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_gemv_gpu_bf16_shapes(N, K, swiglu, pdl):
    torch.manual_seed(0)
    x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    out_n = N // 2 if swiglu else N
    r = torch.randn(1, 1, out_n, device="cuda", dtype=torch.bfloat16)
    for kw in ({}, {"norm_weight": nw}, {"residual": r}, {"norm_weight": nw, "residual": r}):
        assert_close(gemv(x, w, swiglu=swiglu, pdl=pdl, **kw), gemv_ref(x, w, swiglu=swiglu, **kw), "projection")
