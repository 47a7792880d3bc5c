"""Kernel tests. Without CUDA the kernels run under the Triton interpreter on CPU tensors.

@triton.jit reads TRITON_INTERPRET when a module is imported (triton.language's own helpers
included), so it must be set before triton's first import: tests/conftest.py sets it, and so
does this file, so that a kernel test run from this folder alone needs nothing else.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def poison_new_tensors():
    """Outputs the launchers allocate with torch.empty come back filled with NaN (ints with
    their max value): deterministic mode fills uninitialized memory, so an element a kernel
    forgets to write fails the comparison instead of passing on stale memory."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
