"""The one tolerance table of the kernel tests, and the comparison every test uses.

Kernels compute in fp32 like their references, so the gap is reduction order plus one rounding
to the output dtype. Attention also rounds the softmax probabilities to the cache dtype before
the P @ V dot (as flash kernels do) while the reference keeps them in fp32, and uses exp2.
"""
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (atol, rtol) per kind of kernel and output dtype.
TOLERANCES = {
    "elementwise": {
        torch.float32: (1e-5, 1e-5),
        torch.float16: (1e-3, 1e-3),
        torch.bfloat16: (8e-3, 8e-3),
    },
    # a projection rounds its sum to the dtype before an epilogue (silu, the residual add)
    # rounds again: a different reduction order can move the result by two ulps
    "projection": {
        torch.float32: (1e-4, 1e-4),
        torch.float16: (2e-3, 2e-3),
        torch.bfloat16: (3.2e-2, 1.6e-2),
    },
    "attention": {
        torch.float32: (2e-5, 2e-5),
        torch.float16: (2e-3, 2e-3),
        torch.bfloat16: (1.6e-2, 1.6e-2),
    },
}


def assert_close(actual, expected, kind="elementwise"):
    """Every element written (no NaN left from the poisoned output) and within tolerance."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not torch.isnan(actual).any(), "kernel left unwritten (NaN-poisoned) elements"
    atol, rtol = TOLERANCES[kind][expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
