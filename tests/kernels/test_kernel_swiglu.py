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
    with pytest.raises(ValueError, match="unit stride along its last dim"):
        swiglu(g.t(), g.t().contiguous())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_gpu_bf16():
    torch.manual_seed(0)
    gate = 4 * torch.randn(33, 11008 + 3, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(gate)
    assert_close(swiglu(gate, up), swiglu_ref(gate, up))


# bf16 on the GPU only: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
def test_swiglu_halves_of_a_fused_projection(lead, dtype):
    """gate and up as the two halves of a (gate | up) output: strided rows, no copy."""
    torch.manual_seed(len(lead))
    F = 1031  # past one BLOCK, not a multiple of it
    gu = 4 * torch.randn(*lead, 2 * F, device=DEVICE, dtype=dtype)
    gate, up = gu.chunk(2, -1)
    out = swiglu(gate, up)
    assert out.shape == (*lead, F) and out.is_contiguous()
    assert_close(out, swiglu_ref(gate, up))


def test_swiglu_rounds_silu_like_the_unfused_ops():
    """silu(gate) is rounded to the dtype before the product, as F.silu then * does."""
    torch.manual_seed(0)
    gate = 4 * torch.randn(4096, device=DEVICE, dtype=HALF)
    up = torch.randn_like(gate)
    unfused = torch.nn.functional.silu(gate.float()).to(gate.dtype) * up
    assert torch.equal(swiglu_ref(gate, up), unfused)
    assert_close(swiglu(gate, up), unfused)


def test_swiglu_rejects_rows_that_do_not_collapse():
    g = torch.randn(4, 6, 8, device=DEVICE)[:, :3]  # (4, 3, 8): rows 8 apart within, 48 across
    with pytest.raises(ValueError, match="collapse to one row stride"):
        swiglu(g, g.contiguous())
