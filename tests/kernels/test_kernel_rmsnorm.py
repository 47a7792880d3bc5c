import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels import rms_norm, rms_norm_ref


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
@pytest.mark.parametrize("D", [17, 64, 131])
def test_rms_norm_matches_ref(D, lead, dtype, residual):
    torch.manual_seed(D * 7 + len(lead))
    x = torch.randn(*lead, D, device=DEVICE, dtype=dtype)
    w = torch.randn(D, device=DEVICE, dtype=dtype)
    r = torch.randn_like(x) if residual else None
    out, ref = rms_norm(x, w, 1e-6, r), rms_norm_ref(x, w, 1e-6, r)
    if residual:
        assert_close(out[0], ref[0])
        assert_close(out[1], ref[1])
    else:
        assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
@pytest.mark.parametrize("D", [17, 131])
def test_rms_norm_skip_is_the_add_after_the_norm(D, lead, dtype):
    """skip= (a sandwich layer's post-norm, then its residual add), one launch, is bitwise the
    two-launch form skip + rms_norm(x) (the norm rounded to x.dtype, then the sum) and close to
    the reference; a strided skip reads by its row stride."""
    torch.manual_seed(D * 11 + len(lead))
    x = torch.randn(*lead, D, device=DEVICE, dtype=dtype)
    w = torch.randn(D, device=DEVICE, dtype=dtype)
    skip = torch.randn(*lead, 2 * D, device=DEVICE, dtype=dtype)[..., :D]
    y = rms_norm(x, w, 1e-6, skip=skip)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, skip + rms_norm(x, w, 1e-6))
    assert_close(y, rms_norm_ref(x, w, 1e-6, skip=skip))


def test_rms_norm_strided_rows_and_fp32_weight():
    torch.manual_seed(1)
    x = torch.randn(4, 3, 2 * 37, device=DEVICE, dtype=torch.float16)[..., :37]  # row stride 74
    w = torch.randn(37, device=DEVICE, dtype=torch.float32)
    assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("bad, match", [
    (lambda x, w: (x, w[:-1]), "weight must have shape"),
    (lambda x, w: (x.int(), w), "x dtype"),
    (lambda x, w: (x, w.double()), "weight dtype"),
])
def test_rms_norm_rejects_bad_inputs(bad, match):
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        rms_norm(*bad(x, w), 1e-6)
    with pytest.raises(ValueError, match="residual must have shape"):
        rms_norm(x, w, 1e-6, torch.randn(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="skip must have shape"):
        rms_norm(x, w, 1e-6, skip=torch.randn(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="skip dtype torch.float16 must equal x dtype torch.float32"):
        rms_norm(x, w, 1e-6, skip=torch.randn(2, 8, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual .* or skip .*, not both"):
        rms_norm(x, w, 1e-6, x, skip=x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("D", [131, 2048, 4096])
def test_rms_norm_gpu_bf16(D):
    torch.manual_seed(D)
    x = torch.randn(7, 257, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    y, h = rms_norm(x, w, 1e-6, r)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert_close(y, y_ref)
    assert_close(h, h_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_gpu_skip_with_pdl_in_a_graph():
    """The skip= launch (PDL on Hopper) after a PDL-launched projection, captured in a graph the
    way a sandwich decode step is, then replayed on new inputs: bitwise skip + rms_norm(x) of
    that projection's output."""
    from tinyloop.kernels.gemv import gemv
    torch.manual_seed(3)
    D = 2048
    a = torch.randn(1, 1, D, device="cuda", dtype=torch.bfloat16)
    wo = (torch.randn(D, D, device="cuda") / D ** 0.5).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(D, device="cuda")).to(torch.bfloat16)
    skip = torch.randn(1, 1, D, device="cuda", dtype=torch.bfloat16)
    rms_norm(gemv(a, wo), w, 1e-6, skip=skip)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = rms_norm(gemv(a, wo), w, 1e-6, skip=skip)
    for seed in range(3):
        torch.manual_seed(10 + seed)
        a.copy_(torch.randn_like(a))
        skip.copy_(torch.randn_like(skip))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, skip + rms_norm(gemv(a, wo), w, 1e-6))
