"""Quantized weights on the torch path: the format, RTN and the sign channel, `tinyloop
quantize` and its errors, and parity: a quantized model computes exactly what a float model
built from its dequantized weights computes, on every generation path."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tinyloop.cli import main
from tinyloop.worker import Model
from tinyloop.worker.model import checkpoint, quant, quant_checkpoint
from tinyloop.worker.model.checkpoint import CheckpointError
from tinyloop.worker.model.settings import Settings

P = [5, 17, 3, 99, 42, 7]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny float model, its RTN-4 file with the sign channel, and the float file of that
    file's dequantized weights."""
    d = tmp_path_factory.mktemp("quant")
    src, q, deq = d / "m.tinyloop", d / "q.tinyloop", d / "deq.tinyloop"
    assert main(["init-model", "--preset", "tiny", "--seed", "1", "--dtype", "float32", "-o", str(src)]) == 0
    assert main(["quantize", str(src), str(q), "--group-size", "32", "--cancel-round"]) == 0
    model, _ = checkpoint.load(q)
    checkpoint.save(quant_checkpoint.dequantized(model), deq, dtype=torch.float32)
    return src, q, deq


def test_pack_and_rtn_round_trip():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(quant.unpack4(quant.pack4(codes)), codes)
    d = torch.randint(-1, 2, (5, 64), generator=g).to(torch.int8)
    assert torch.equal(quant.unpack_sign(quant.pack_sign(d)), d)
    w = torch.randn(7, 96, generator=g)
    t = quant.rtn(w, 32, cancel_round=True)
    qw = quant.QuantWeight.from_tensors(t, 32)
    step = t["scales"].float().repeat_interleave(32, 1)
    err = qw.dequantize() - w
    assert (err.abs() <= step / 2 + 1e-6).all()
    # the pair of even and odd iterations lands within a quarter step of every weight whose
    # correction stays a code (not at the clamped ends of a group's range)
    pair = (qw.dequantize() + qw.odd().dequantize()) / 2 - w
    int2 = qw.int2()
    assert int2.qweight.shape == (7, 96 // 4) and int2.zeros.max() <= 3
    assert (int2.dequantize() - qw.dequantize()).abs().max() <= int2.scales.float().max() / 2 + 1e-6
    inner = (quant.unpack4(t["qweight"]) > 0) & (quant.unpack4(t["qweight"]) < quant.QMAX)
    assert (pair.abs() <= step / 4 + 1e-6)[inner].all()
    assert pair.pow(2).mean() < 0.5 * err.pow(2).mean()


def test_quantized_file_layout(files):
    _, q, _ = files
    with safe_open(q, "pt") as f:
        meta = f.metadata()
        names = set(f.keys())
        assert f.get_tensor("loop.0.attention.wq.qweight").dtype == torch.uint8
        assert f.get_tensor("coda.0.feed_forward.w2.scales").shape == (64, 160 // 32)
    assert meta["tinyloop.format_version"] == "3"
    assert json.loads(meta["tinyloop.quant"]) == {"version": "1", "bits": 4, "group_size": 32, "method": "rtn",
                                                  "cancel_round": True, "calib_tokens": 0, "dual_bit": False}
    assert "loop.0.feed_forward.w1.sign" in names and "prelude.0.feed_forward.w1.sign" not in names
    assert "tok_embeddings.weight" in names and "loop.0.attention.wq.weight" not in names


def test_quantized_model_equals_its_dequantized_float_model(files):
    """generate, batch, resume, both speculative paths and scoring: the same tokens, and the
    same logits (fp32 on the CPU: the dequantized weights are exact, the math is the same)."""
    _, q, deq = files
    with Model(q, n_slots=4) as mq, Model(deq, n_slots=4) as mf:
        assert mq.weight_format == "int4-g32-rtn+cancel" and mf.weight_format == "float32"
        for kw in ({"loops": 3}, {"loops": 6, "temperature": 0.8, "seed": 4}):
            assert mq.generate(P, max_tokens=12, **kw) == mf.generate(P, max_tokens=12, **kw)
        prompts = [P, P[:3], [9, 9, 9, 1]]
        assert mq.generate_batch(prompts, per_lane_loops=[2, 5, 3], max_tokens=8) == \
            mf.generate_batch(prompts, per_lane_loops=[2, 5, 3], max_tokens=8)
        hq, hf = mq.build_resume_handle(P, L_used=2, max_loops=8), mf.build_resume_handle(P, L_used=2, max_loops=8)
        assert mq.resume_generate(hq, 6, max_tokens=8) == mf.resume_generate(hf, 6, max_tokens=8) \
            == mq.generate(P, loops=6, max_tokens=8)
        assert mq.generate_speculative(P, max_tokens=10, verify_loops=5) == \
            mf.generate_speculative(P, max_tokens=10, verify_loops=5)
        assert mq.generate_tree_speculative(P, max_tokens=10, verify_loops=5) == \
            mf.generate_tree_speculative(P, max_tokens=10, verify_loops=5)
        lq, klq = mq.score_with_uncertainty(P, 2, 7)
        lf, klf = mf.score_with_uncertainty(P, 2, 7)
        torch.testing.assert_close(torch.from_numpy(lq), torch.from_numpy(lf), atol=1e-5, rtol=1e-5)
        assert klq == pytest.approx(klf, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("rounding,settings,described", [
    ("cancel", dict(cancel_round=True), "cancel rounding"),
    ("stochastic", dict(cross_iter_round=True), "stochastic rounding"),
    ("dual-bit", dict(dual_bit=True, dual_bit_switch=1), "int2 iterations 0-1"),
])
def test_rounding_across_iterations_equals_its_float_reference(files, rounding, settings, described):
    """Iteration i runs the block's variant i (even: the codes, odd: codes + sign channel; a
    draw per iteration; INT2 up to the switch, INT4 after) on every path: the engine's decode
    equals the full forward of the float model holding the same variants."""
    _, q, _ = files
    with Model(q, n_slots=2, settings=Settings(**settings)) as mq:
        assert mq.weight_format == f"int4-g32-rtn+cancel ({described})"
        out = mq.generate(P, loops=5, max_tokens=6)
        logits, _ = mq.score_with_uncertainty(P, 2, 5)  # iterations 0-1, then 2-4 resumed
        ref = quant_checkpoint.dequantized(mq._module)
        full = ref(torch.tensor([out[:-1]]), 5)[0]
    assert out[len(P):] == full[len(P) - 1:].argmax(-1).tolist()
    torch.testing.assert_close(torch.from_numpy(logits), full[len(P) - 1], atol=1e-5, rtol=1e-5)
    with Model(q, n_slots=2) as plain:
        assert (torch.from_numpy(plain.score_with_uncertainty(P, 2, 5)[0]) - full[len(P) - 1]).abs().max() > 1e-3


def test_quantize_errors_leave_no_file(files, tmp_path, capsys):
    src, _, _ = files
    out = tmp_path / "bad.tinyloop"
    for args, match in [
        (["--group-size", "48"], "group size 48 does not divide the input dimension 64"),
        (["--method", "awq"], "method must be one of ('rtn', 'gptq'), got 'awq'"),
        (["--bits", "8", "--dual-bit"], "--dual-bit makes its INT2 copy from INT4 weights: it needs --bits 4"),
        (["--bits", "3"], "bits must be one of (4,), got 3"),
        (["--group-size", "7"], "group_size must be an even number"),
    ]:
        assert main(["quantize", str(src), str(out), *args]) == 2
        assert match in capsys.readouterr().err
        assert not os.path.exists(out) and not os.path.exists(f"{out}.tmp")


def _rewrite(src, dst, meta_change):
    with safe_open(src, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, dst, metadata={**meta, **meta_change})


def test_unknown_versions_are_refused(files, tmp_path):
    _, q, _ = files
    spec = json.loads(safe_open(q, "pt").metadata()["tinyloop.quant"])
    _rewrite(q, tmp_path / "v2q.tinyloop", {"tinyloop.quant": json.dumps({**spec, "version": "2"})})
    with pytest.raises(CheckpointError, match=r"unknown quantization version '2' \(supported: \('1',\)\)"):
        Model(tmp_path / "v2q.tinyloop")
    _rewrite(q, tmp_path / "v4.tinyloop", {"tinyloop.format_version": "4"})
    with pytest.raises(CheckpointError, match=r"unknown format version '4' \(supported: \('1', '2', '3'\)\)"):
        Model(tmp_path / "v4.tinyloop")


def test_rounding_settings_need_the_sign_channel(files, tmp_path):
    src, _, _ = files
    with pytest.raises(ValueError, match="cancel rounding applies to quantized weights"):
        Model(src, settings=Settings(cancel_round=True))
    plain = tmp_path / "plain.tinyloop"
    assert main(["quantize", str(src), str(plain), "--group-size", "32"]) == 0
    with pytest.raises(ValueError, match=r"needs the shared block quantized with its sign channel"):
        Model(plain, settings=Settings(cross_iter_round=True))
    with pytest.raises(ValueError, match="dual-bit applies to quantized weights"):
        Model(src, settings=Settings(dual_bit=True))
    with pytest.raises(ValueError, match="pick one"):
        Settings(cancel_round=True, cross_iter_round=True)
    assert Settings.from_env({"TINYLOOP_CANCEL_ROUND": "1"}).rounding == "cancel"
    env = Settings.from_env({"TINYLOOP_DUAL_BIT": "1", "TINYLOOP_DUAL_BIT_SWITCH": "5"})
    assert (env.dual_bit, env.dual_bit_switch) == (True, 5)


def test_gptq_beats_rtn_on_its_calibration_inputs():
    """GPTQ's error feedback lowers the output error ||(W - Q) X|| on the inputs it saw."""
    from tinyloop.worker.model import gptq
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated inputs
    w = torch.randn(24, 64, generator=g)
    H = (x.t() @ x / len(x)).double()

    def out_err(t):
        return ((w - quant.QuantWeight.from_tensors(t, 32).dequantize()) @ x.t()).norm()
    assert out_err(gptq.quantize(w, H, 32)) < 0.8 * out_err(quant.rtn(w, 32))


def test_loop_hessian_sums_every_iteration(files):
    """The shared block's Hessian takes the inputs of every iteration of the calibration pass
    (a deeper pass changes it); the prelude's sees each token once at any depth."""
    from tinyloop.worker.model import gptq
    src, _, _ = files
    model, _ = checkpoint.load(src)
    win = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    names = ["prelude.0.attention.wq", "loop.0.feed_forward.w2"]
    h1, h3 = gptq.hessians(model, win, 1, names), gptq.hessians(model, win, 3, names)
    torch.testing.assert_close(h1[names[0]], h3[names[0]])
    assert (h1[names[1]] - h3[names[1]]).abs().max() > 1e-6
    assert isinstance(model.loop[0].feed_forward.w2.weight, torch.nn.Parameter)  # restored


def test_store_h_modes_refuse_quantized_weights(tmp_path):
    """The store-h read rebuilds K and V with float W_k / W_v: a quantized checkpoint cannot use
    those modes, and says so (kv stays available)."""
    from tinyloop.worker import Model
    from tinyloop.worker.model.default_model import default_model_path
    from tinyloop.worker.model.quant import QuantSpec
    from tinyloop.worker.model.quantize import quantize_file
    out = tmp_path / "q.tinyloop"
    quantize_file(default_model_path(), out, QuantSpec(group_size=64))
    for mode in ("h", "h-int4", "delta-int8"):
        with pytest.raises(ValueError, match=rf"kv_mode '{mode}' rebuilds K and V .* quantized weights"):
            Model(out, max_seq_len=64, kv_mode=mode)
    with Model(out, max_seq_len=64, kv_mode="kv") as m:
        assert m.kv_mode == "kv" and m.weight_format.startswith("int4")


def test_int4_tiles_setting_reaches_the_launchers(tmp_path):
    """Settings.int4_tiles (TINYLOOP_INT4_TILES): the Triton backend's INT4 launchers take the
    sweep's tables; a file that is no sweep is refused when the ops are built. (The tests run the
    Triton backend on a CPU under TRITON_INTERPRET=1: conftest.)"""
    from tinyloop.worker.model.ops import select_ops
    key = [2048, 2048, 128, 4, False, False, True, True]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": [[key, ["pairs", 64, 1, 4, 1, 2]]], "matmul_tiles": []}))
    assert Settings.from_env({"TINYLOOP_INT4_TILES": str(path)}).int4_tiles == str(path)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = select_ops(dev, "triton", int4_tiles=str(path))
    tables = ops.int4[0].keywords["tables"]
    assert tables[0] == {tuple(key): ("pairs", 64, 1, 4, 1, 2)} and ops.int4[1].keywords["tables"] == tables
    assert select_ops(dev, "triton").int4[0].keywords["tables"] is None
    path.write_text("{")
    with pytest.raises(ValueError, match="not a bench/int4_tiles.py result"):
        select_ops(dev, "triton", int4_tiles=str(path))
