"""The fused decode kernels' GPU-only paths (the interpreter runs none of them: the bulk L2
prefetches are inline PTX, the merge's atomics and its L1-bypassing loads are compiled code)
compile for sm_90 with Triton's own ptxas, on any host: hopper_compile.py in a process without
the interpreter, each variant's PTX holding the instructions it is built on."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_fused_kernels_compile_for_hopper():
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("no NVIDIA backend in this Triton")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, str(HERE / "hopper_compile.py")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout
    assert "gemv skip+norm+swiglu st.global" in text, text
    assert "gemv skip+norm one chunk st.global" in text, text
    assert "gemv l2_prefetch cp.async.bulk.prefetch.L2.global" in text, text
    assert "attention merge+prefetch_kv atom. cp.async.bulk.prefetch.L2.global ld.global.cg" in text, text
