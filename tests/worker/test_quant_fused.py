"""A quantized model on the Triton path (kernels/int4_gemv.py: the decode step's fused INT4
projections, the INT4 GEMM of prompts and batched steps), against the same model on the torch
reference: same greedy tokens, logits within 1e-4. On CPU the kernels run under the
interpreter (fp32, no graphs)."""
import pytest
import torch

from tinyloop.cli import main
from tinyloop.kernels.gemv import gemv
from tinyloop.kernels.int4_gemv import int4_gemv, int4_matmul
from tinyloop.kernels.rmsnorm import rms_norm
from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.model import quant_checkpoint
from tinyloop.worker.model.quant import route_gemv
from tinyloop.worker.model.settings import Settings

PROMPT = [200, 1, 5, 9, 31, 64]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def qpath(tmp_path_factory):
    d = tmp_path_factory.mktemp("qfused")
    assert main(["init-model", "--preset", "tiny", "--seed", "2", "--dtype", "float32", "-o", str(d / "m.tinyloop")]) == 0
    assert main(["quantize", str(d / "m.tinyloop"), str(d / "q.tinyloop"), "--group-size", "32",
                 "--cancel-round"]) == 0
    return d / "q.tinyloop"


def model(path, rows=1, **settings) -> Model:
    return Model(path, max_seq_len=64, device=DEVICE, dtype="float32", n_slots=4,
                 settings=Settings(backend="torch", cuda_graphs=False, **settings))


def fast(m: Model, rows: int) -> list[int]:
    """The model's Triton path (what Model sets up on CUDA), counting the INT4 GEMV's rows."""
    rows_seen = []
    m._module.use_fast_path(rms_norm, route_gemv(gemv), gemv_rows=rows)
    quant_checkpoint.use_kernels(m._module, (lambda x, *a, **k: rows_seen.append(x.numel() // x.shape[-1])
                                             or int4_gemv(x, *a, **k), int4_matmul), rows=rows)
    return rows_seen


def step_logits(m: Model, loops: int, toks: list[int], T0: int) -> torch.Tensor:
    r = m.runner
    steps = [r.prefill(0, toks[:T0], loops).logits[0]]
    for pos in range(T0, len(toks)):
        steps.append(r.decode([0], [toks[pos]], [pos], [loops]).logits[0].clone())
    return torch.stack(steps)


def test_int4_decode_step_matches_the_reference(qpath):
    """Cancel rounding and dual-bit up to iteration 0: iteration 0 runs the INT2 copy, 1 the
    odd INT4 variant, 2 the codes, each fused."""
    s = dict(cancel_round=True, dual_bit=True, dual_bit_switch=0)
    with model(qpath, **s) as ref, model(qpath, **s) as fused:
        rows = fast(fused, 1)
        toks = PROMPT + ref.generate(PROMPT, loops=3, max_tokens=3)[len(PROMPT):]
        want, got = step_logits(ref, 3, toks, len(PROMPT)), step_logits(fused, 3, toks, len(PROMPT))
        assert 1 in rows, "the fused INT4 step never ran"
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-4


def test_int4_batched_step_matches_the_reference(qpath):
    """Three streams batched through the fused INT4 projections of up to 16 rows (the GEMM
    kernel with the epilogues), as the step shrinks from 3 rows to 1."""
    jobs = {1: (PROMPT, 2, 4), 2: (PROMPT[:4], 1, 3), 3: ([7, 7, 1], 1, 2)}
    out = {}
    with model(qpath) as ref, model(qpath) as fused:
        rows = fast(fused, 16)
        for m in (ref, fused):
            b = Batcher(m.runner)
            got = {}
            for lane, (p, L, n) in jobs.items():
                ids, _ = b.join(m.start(m.make_request(p, loops=L, max_tokens=n, stop_token_ids=[]), lane))
                got[lane] = list(ids)
            while b:
                for lane, (ids, _) in b.step().items():
                    got[lane].extend(ids)
            out[m is fused] = got
    assert 3 in rows and 2 in rows
    assert out[True] == out[False]


def test_quantized_blocks_run_batched_rows_fused(qpath):
    """Model's set-up on the Triton path with Settings.fused_rows = 1 (cuBLAS for batched bf16 steps): the
    quantized blocks still take a batched decode step's rows through the INT4 launcher
    (use_kernels' rows), a block with float weights keeps fused_rows, and three lanes' step
    matches the reference."""
    with model(qpath) as ref, model(qpath) as fused:
        rows_seen = []
        fused._module.use_fast_path(rms_norm, route_gemv(gemv), gemv_rows=1)
        quant_checkpoint.use_kernels(fused._module, (lambda x, *a, **k: rows_seen.append(x.numel() // x.shape[-1])
                                                     or int4_gemv(x, *a, **k), int4_matmul), rows=16)
        blocks = [b for b in fused._module.modules() if hasattr(b, "gemv_rows") and hasattr(b, "projections")]
        quantized = [b for b in blocks if all(not isinstance(w, torch.Tensor) for w in b.projections().values())]
        assert quantized and all(b.gemv_rows == 16 for b in quantized)
        assert all(b.gemv_rows == 1 for b in blocks if b not in quantized)
        outs = []
        for m in (ref, fused):
            r = m.runner
            firsts = [int(r.prefill(lane, PROMPT[:4 + lane], 2).logits.argmax()) for lane in range(3)]
            outs.append(r.decode([0, 1, 2], firsts, [4, 5, 6], [2, 2, 2]).logits.clone())
        assert 3 in rows_seen, "the batched INT4 step did not take the fused rows"
        assert ((outs[1] - outs[0]).norm(dim=-1) / outs[0].norm(dim=-1)).max() < 1e-4
