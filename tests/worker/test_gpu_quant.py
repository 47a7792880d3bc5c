"""A quantized model on the CUDA path (INT4 Triton kernels, captured graphs, cancel rounding's
per-iteration variants) against the same file on the torch reference path, and the INT4
shared block kept in L2. Run on a GPU host: `pytest -m gpu tests/worker/test_gpu_quant.py`."""
import pytest
import torch

from tinyloop.cli import main
from tinyloop.worker import Model
from tinyloop.worker.model.settings import Settings

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]]


@pytest.fixture(scope="module")
def qpath(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpuq")
    assert main(["init-model", "--preset", "small", "--seed", "3", "--dtype", "float32",
                 "-o", str(d / "m.tinyloop")]) == 0
    assert main(["quantize", str(d / "m.tinyloop"), str(d / "q.tinyloop"), "--group-size", "64",
                 "--cancel-round"]) == 0
    return d / "q.tinyloop"


@pytest.mark.parametrize("cancel", [False, True], ids=["nearest", "cancel"])
def test_int4_graphs_match_the_torch_path(qpath, cancel):
    s = dict(cancel_round=cancel)
    with Model(qpath, max_seq_len=256, device="cuda", dtype="float32", n_slots=2,
               settings=Settings(**s)) as fast, \
         Model(qpath, max_seq_len=256, device="cuda", dtype="float32",
               settings=Settings(backend="torch", cuda_graphs=False, **s)) as ref:
        assert fast.runner.graphs is not None
        for p in PROMPTS:
            for L in (1, 3, 8):
                assert fast.generate(p, loops=L, max_tokens=12) == ref.generate(p, loops=L, max_tokens=12)
            lf, _ = fast.score_with_uncertainty(p, 2, 5)
            lr, _ = ref.score_with_uncertainty(p, 2, 5)
            assert abs(lf - lr).max() / abs(lr).max() < 1e-4
        assert fast.generate_batch(PROMPTS, per_lane_loops=[2, 6], max_tokens=8) == \
            ref.generate_batch(PROMPTS, per_lane_loops=[2, 6], max_tokens=8)
        assert fast.generate_speculative(PROMPTS[1], max_tokens=10, verify_loops=6) == \
            ref.generate(PROMPTS[1], loops=6, max_tokens=10)


def test_int4_block_is_kept_in_l2(qpath):
    """The shared block's INT4 projections fit the L2 budget whole: every one hinted evict_last."""
    with Model(qpath, max_seq_len=64, device="cuda", dtype="bfloat16", n_slots=1, cuda_graphs=False) as m:
        for block in m._module.loop:
            assert {block.eviction(n) for n in block.projections()} == {"evict_last"}
        assert m.weight_format == "int4-g64-rtn+cancel"
