import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels import swiglu, swiglu_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (17,), (3, 131), (2, 5, 64), (1031,)])
def test_swiglu_matches_ref(shape, dtype):
    torch.manual_seed(sum(shape))
    gate = 4 * torch.randn(shape, device=DEVICE, dtype=dtype)
    up = torch.randn(shape, device=DEVICE, dtype=dtype)
    assert_close(swiglu(gate, up), swiglu_ref(gate, up))


def test_swiglu_rejects_bad_inputs():
    g = torch.randn(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match="up shape"):
        swiglu(g, torch.randn(4, 5, device=DEVICE))
    with pytest.raises(ValueError, match="up dtype"):
        swiglu(g, g.half())
    with pytest.raises(ValueError, match="gate must be contiguous"):
        swiglu(g.t(), g.t().contiguous())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_gpu_bf16():
    torch.manual_seed(0)
    gate = 4 * torch.randn(33, 11008 + 3, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(gate)
    assert_close(swiglu(gate, up), swiglu_ref(gate, up))
