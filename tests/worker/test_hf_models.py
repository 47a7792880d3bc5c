"""Hugging Face directories of the two published looped families, Ouro and Huginn: logits and
greedy continuations against an independent plain-torch reference (tests/hf_reference.py),
the same through `tinyloop convert`, sharded files, the tokenizer, the loop features on these
models, and every bad directory named precisely."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_dirs import EOS, VOCAB, huginn_config, huginn_tensors, ouro_config, ouro_tensors, tokenizer_json, write_dir
from hf_reference import greedy, huginn_logits, ouro_logits
from safetensors.torch import load_file, save_file

from tinyloop.cli import main as cli_main
from tinyloop.worker import Model
from tinyloop.worker.model.checkpoint import CheckpointError, read_config

PROMPT = [5, 17, 42, 99, 3, 250, 11]
RTOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def open_model(path, **kw) -> Model:
    return Model(path, device="cpu", dtype="float32", n_slots=4, max_seq_len=128, cuda_graphs=False, **kw)


def next_logits(m: Model, ids: list[int], loops: int, seed: int = 0) -> torch.Tensor:
    """The engine's prefill logits of the next token (the lane seated with `seed`)."""
    m.runner.cache.seat(0, seed)
    return m.runner.prefill(0, ids, loops).logits[0]


def until_stop(tokens: list[int], n_prompt: int, eos: int) -> list[int]:
    """A reference greedy run cut where the engine stops: after the first EOS."""
    gen = tokens[n_prompt:]
    return tokens[:n_prompt] + (gen[:gen.index(eos) + 1] if eos in gen else gen)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, kv in (("ouro-mha", 4), ("ouro-gqa", 2)):
        cfg = ouro_config(n_kv_heads=kv, eos_token_id=1)
        out[name] = (write_dir(root / name, cfg, ouro_tensors(cfg, seed=kv)), cfg)
    cfg = huginn_config(eos_token_id=1)
    out["huginn"] = (write_dir(root / "huginn", cfg, huginn_tensors(cfg, seed=7)), cfg)
    cfg = huginn_config(eos_token_id=1, bias=True, n_layers_in_coda=2, n_layers=5)
    out["huginn-bias"] = (write_dir(root / "huginn-bias", cfg, huginn_tensors(cfg, seed=8)), cfg)
    return out


def weights(path) -> dict[str, torch.Tensor]:
    w = {}
    for f in sorted(path.glob("*.safetensors")):
        w |= load_file(f)
    return w


# -- parity ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ouro-mha", "ouro-gqa"])
def test_ouro_logits_match_the_reference(dirs, name):
    path, cfg = dirs[name]
    w = weights(path)
    with open_model(path) as m:
        assert (m.config.default_loops, m.config.max_loops, m.config.n_loop_layers) == (4, 8, 2)
        for L in (1, 2, 4, 7):  # up to the default total_ut_steps and deeper
            ref = ouro_logits(w, cfg, PROMPT, L)[-1]
            assert rel_err(next_logits(m, PROMPT, L), ref) < RTOL, L


@pytest.mark.parametrize("name", ["huginn", "huginn-bias"])
def test_huginn_logits_match_the_reference(dirs, name):
    path, cfg = dirs[name]
    w = weights(path)
    T = len(PROMPT)
    with open_model(path, init_scale=0.0) as m:
        for L in (1, 3, 4, 6):
            ref = huginn_logits(w, cfg, PROMPT, L, torch.zeros(T, cfg["n_embd"]))[-1]
            assert rel_err(next_logits(m, PROMPT, L), ref) < RTOL, L
    with open_model(path) as m:  # the random initial state, drawn from the seed
        pos = torch.arange(T)[None]
        for seed, L in ((3, 2), (11, 5)):
            state = m._module.initial_state(torch.tensor([seed]), pos)[0]
            assert state.abs().max() > 0
            ref = huginn_logits(w, cfg, PROMPT, L, state)[-1]
            assert rel_err(next_logits(m, PROMPT, L, seed), ref) < RTOL, (seed, L)


def _ref_greedy(name, dirs, L, n, state_of=None):
    path, cfg = dirs[name]
    w = weights(path)
    if name.startswith("ouro"):
        return greedy(lambda t: ouro_logits(w, cfg, t, L), PROMPT, n)
    return greedy(lambda t: huginn_logits(w, cfg, t, L, state_of(len(t))), PROMPT, n)


@pytest.mark.parametrize("name, L", [("ouro-gqa", 4), ("ouro-mha", 6)])
def test_ouro_greedy_matches_the_reference(dirs, name, L):
    ref = until_stop(_ref_greedy(name, dirs, L, 8), len(PROMPT), 1)
    with open_model(dirs[name][0]) as m:
        assert list(m.generate(PROMPT, loops=L, max_tokens=8)) == ref


def test_huginn_greedy_matches_the_reference(dirs, tmp_path):
    path, cfg = dirs["huginn"]
    with open_model(path) as m:
        def state_of(T):
            return m._module.initial_state(torch.tensor([21]), torch.arange(T)[None])[0]
        for L in (2, 4):
            ref = until_stop(_ref_greedy("huginn", dirs, L, 8, state_of), len(PROMPT), 1)
            assert list(m.generate(PROMPT, loops=L, max_tokens=8, seed=21)) == ref
        seeded = [list(m.generate(PROMPT, loops=4, max_tokens=8, seed=s)) for s in (21, 21, 22)]
        assert seeded[0] == seeded[1]  # a seeded request is reproducible


# -- convert, shards ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ouro-gqa", "huginn"])
def test_convert_gives_identical_logits(dirs, tmp_path, name, capsys):
    path, _ = dirs[name]
    out = tmp_path / f"{name}.tinyloop"
    assert cli_main(["convert", str(path), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    cfg, meta = read_config(out)
    assert meta["tinyloop.format_version"] == "2" and meta["tinyloop.source"].startswith(dirs[name][1]["model_type"])
    with open_model(path) as a, open_model(out) as b:
        assert a.config == b.config
        for L in (2, 4):
            assert torch.equal(next_logits(a, PROMPT, L, 5), next_logits(b, PROMPT, L, 5))
        assert list(a.generate(PROMPT, loops=3, max_tokens=6, seed=5)) == list(b.generate(PROMPT, loops=3,
                                                                                           max_tokens=6, seed=5))
        assert b.tokenizer.encode("def fibonacci(n):") == a.tokenizer.encode("def fibonacci(n):")


def test_sharded_equals_unsharded(dirs, tmp_path):
    for name, tensors in (("ouro-gqa", ouro_tensors), ("huginn", huginn_tensors)):
        path, cfg = dirs[name]
        sharded = write_dir(tmp_path / name, cfg, weights(path), shards=3)
        assert (sharded / "model.safetensors.index.json").exists() and not (sharded / "model.safetensors").exists()
        with open_model(path) as a, open_model(sharded) as b:
            assert torch.equal(next_logits(a, PROMPT, 3, 2), next_logits(b, PROMPT, 3, 2))


def test_bf16_directory_loads_in_its_dtype_and_converts(dirs, tmp_path):
    path, cfg = dirs["ouro-gqa"]
    bf = write_dir(tmp_path / "bf16", cfg, {k: v.to(torch.bfloat16) for k, v in weights(path).items()})
    out = tmp_path / "bf16.tinyloop"
    assert cli_main(["convert", str(bf), str(out)]) == 0
    kw = dict(device="cpu", n_slots=2, max_seq_len=64, cuda_graphs=False, dtype="bfloat16")
    with Model(bf, **kw) as a, Model(out, **kw) as b:
        assert a._module.tok_embeddings.weight.dtype == torch.bfloat16
        assert torch.equal(next_logits(a, PROMPT, 4), next_logits(b, PROMPT, 4))


@pytest.mark.parametrize("name", ["ouro-gqa", "huginn"])
def test_cache_modes_serve_the_published_families(dirs, name):
    """Every KV cache mode serves these models: store-h gives the K/V cache's tokens exactly, and
    in every mode a resume handle built at a shallower depth continues as a fresh generate in that
    mode and a batch's lanes equal their runs alone."""
    path, _ = dirs[name]
    with open_model(path) as kv:
        ref = list(kv.generate(PROMPT, loops=4, max_tokens=8, seed=3))
    for mode in ("h", "h-int8", "h-int4", "delta-int8"):
        with open_model(path, kv_mode=mode) as m:
            assert m.kv_mode == mode
            alone = list(m.generate(PROMPT, loops=4, max_tokens=8, seed=3))
            if mode == "h":
                assert alone == ref
            h = m.build_resume_handle(PROMPT, L_used=2, max_loops=8, seed=3)
            assert list(m.resume_generate(h, new_L=4, max_tokens=8, seed=3)) == alone, mode
            batch = m.generate_batch([PROMPT, PROMPT[:4]], per_lane_loops=[4, 2], max_tokens=8, seed=3)
            assert [list(g) for g in batch] == [alone, list(m.generate(PROMPT[:4], loops=2, max_tokens=8,
                                                                       seed=3))], mode


# -- quantized weights and held-out bits per byte --------------------------------------------
def small_stdlib(root):
    """A stdlib-shaped source tree for the corpus (train/corpus.py): tempfile.py is held out."""
    for rel in ("os.py", "tempfile.py", "json/__init__.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("".join(f"def f{i}(n):\n    return fibonacci(n - {i}) + {i}\n" for i in range(120)))
    return root


def test_documents_join_with_the_models_end_of_text_token():
    """A model's own tokenizer has no <|doc|> token: the corpus's documents are joined with the
    model's EOS (its BOS where it names no EOS), as such a model was pretrained; neither is an
    error, and a separator outside the vocabulary too."""
    import re

    import numpy as np
    from tokenizers import Tokenizer

    from tinyloop.train import bpe
    from tinyloop.worker.model.config import LoopedConfig
    tj = tokenizer_json()
    tok = Tokenizer.from_str(tj)
    data = np.frombuffer(b"def f(n):\x00print('x')\x00", dtype=np.uint8)
    ids = bpe.encode(tj, data, sep_id=7)
    assert ids.tolist() == tok.encode("def f(n):").ids + [7] + tok.encode("print('x')").ids + [7]
    assert bpe.separator(LoopedConfig(vocab_size=VOCAB, eos_id=3, bos_id=2)) == 3
    assert bpe.separator(LoopedConfig(vocab_size=VOCAB, bos_id=2)) == 2
    assert bpe.separator(LoopedConfig(vocab_size=VOCAB)) is None
    with pytest.raises(ValueError, match=re.escape("no <|doc|> token and the model names no EOS or BOS")):
        bpe.encode(tj, data)
    with pytest.raises(ValueError, match="outside the tokenizer's"):
        bpe.encode(tj, data, sep_id=10_000)


@pytest.mark.parametrize("name", ["ouro-gqa", "huginn"])
def test_a_directory_quantizes_and_evaluates_as_its_conversion(dirs, tmp_path, name, capsys):
    """`tinyloop quantize` and `tinyloop eval-bpb` take a Hugging Face directory: RTN and GPTQ
    (calibrated on corpus text in the model's own tokens) write the very file they write from
    the directory's `.tinyloop` conversion, and that file serves the tokens of the float model
    built from its dequantized weights; eval-bpb gives the conversion's figures."""
    from tinyloop.worker.model import checkpoint, quant_checkpoint
    path, _ = dirs[name]
    root = small_stdlib(tmp_path / "stdlib")
    conv = tmp_path / "conv.tinyloop"
    assert cli_main(["convert", str(path), str(conv)]) == 0
    for method in ("rtn", "gptq"):
        q_dir, q_conv = tmp_path / f"dir-{method}.tinyloop", tmp_path / f"conv-{method}.tinyloop"
        args = ["--group-size", "16", "--method", method, "--calib-tokens", "1024", "--corpus-root", str(root)]
        assert cli_main(["quantize", str(path), str(q_dir), *args]) == 0
        assert cli_main(["quantize", str(conv), str(q_conv), *args]) == 0
        a, b = load_file(q_dir), load_file(q_conv)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert f"int4-g16-{method}" in capsys.readouterr().out
    model, _ = checkpoint.load(q_dir)
    deq = tmp_path / "deq.tinyloop"
    checkpoint.save(quant_checkpoint.dequantized(model), deq, dtype=torch.float32)
    with open_model(q_dir) as q, open_model(deq) as f:
        assert q.weight_format.startswith("int4-g16") and f.weight_format == "float32"
        assert list(q.generate(PROMPT, loops=3, max_tokens=6, seed=5)) == list(f.generate(PROMPT, loops=3,
                                                                                           max_tokens=6, seed=5))
    tables = []
    for src in (path, conv):
        out = tmp_path / f"bpb-{len(tables)}.json"
        assert cli_main(["eval-bpb", "--model", str(src), "--loops", "1", "3", "--windows", "4", "--seq-len", "32",
                         "--corpus-root", str(root), "--device", "cpu", "--json", str(out)]) == 0
        tables.append(json.loads(out.read_text())["bpb"])
    assert tables[0] == tables[1] and set(tables[0]) == {"1", "3"}


# -- what the modules keep ---------------------------------------------------------------------
def test_ouro_keeps_the_early_exit_gate(dirs):
    path, _ = dirs["ouro-mha"]
    w = weights(path)
    with open_model(path) as m:
        gate = m._module.exit_gate
        assert torch.equal(gate.weight, w["model.early_exit_gate.weight"])
        assert torch.equal(gate.bias, w["model.early_exit_gate.bias"])
        assert m._module.norm is None and m._module.loop_norm is not None


def test_the_latent_state_is_a_seeded_truncated_normal(dirs):
    from tinyloop.worker.model.latent import truncated_normal
    pos = torch.arange(64)[None]
    a = truncated_normal(torch.tensor([1]), pos, 512)
    assert torch.equal(a, truncated_normal(torch.tensor([1]), pos, 512))
    assert torch.equal(a[:, 10:20], truncated_normal(torch.tensor([1]), pos[:, 10:20], 512))  # per position
    b = truncated_normal(torch.tensor([2]), pos, 512)
    assert not torch.equal(a, b) and a.abs().max() <= 3.0
    # a standard normal truncated at +-3: mean 0, std 0.9866
    assert abs(float(a.mean())) < 0.01 and abs(float(a.std()) - 0.9866) < 0.01
    path, cfg = dirs["huginn"]
    with open_model(path, init_scale=0.5) as m:
        s = m._module.initial_state(torch.tensor([1]), pos)
        std = cfg["init_values"]["std"] * 0.5 * cfg["init_values"]["embed_scale"]
        assert torch.allclose(s, a[..., :64] * std)


# -- tokenizer ---------------------------------------------------------------------------------
def test_the_tokenizer_json_serves_text(dirs):
    path, _ = dirs["ouro-gqa"]
    with open_model(path) as m:
        tok = m.tokenizer
        text = "def fibonacci(n): héllo"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        dec = tok.decoder()
        assert "".join(dec([i]) for i in ids) == text  # incremental, never a split character
        eos = tok._tok.token_to_id(EOS)
        assert EOS not in tok.decode(ids + [eos])  # special tokens stay out of the text


def test_eos_from_config_json_stops_generation(dirs, tmp_path):
    path, cfg = dirs["ouro-gqa"]
    with open_model(path) as m:
        free = list(m.generate(PROMPT, loops=4, max_tokens=8))
    stop = free[len(PROMPT) + 2]
    d = tmp_path / "eos"
    shutil.copytree(path, d)
    (d / "config.json").write_text(json.dumps(cfg | {"eos_token_id": [stop, 2]}))
    with open_model(d) as m:
        g = m.generate(PROMPT, loops=4, max_tokens=8)
        first = free.index(stop, len(PROMPT))
        assert list(g) == free[:first + 1] and g.finish_reason == "stop"


# -- the loop features on these models ---------------------------------------------------------
def test_ouro_resume_speculative_and_batch_equal_generate(dirs):
    path, _ = dirs["ouro-gqa"]
    p2 = [7, 8, 9, 10]
    with open_model(path) as m:
        alone = {L: list(m.generate(PROMPT, loops=L, max_tokens=6)) for L in (2, 4, 6)}
        h = m.build_resume_handle(PROMPT, L_used=2, max_loops=8)
        assert list(m.resume_generate(h, new_L=6, max_tokens=6)) == alone[6]
        assert list(m.generate_speculative(PROMPT, max_tokens=6, draft_loops=2, verify_loops=6)) == alone[6]
        assert list(m.generate_tree_speculative(PROMPT, max_tokens=6, draft_loops=1, verify_loops=4)) == alone[4]
        batch = m.generate_batch([PROMPT, p2, PROMPT], per_lane_loops=[2, 4, 6], max_tokens=6)
        assert [list(g) for g in batch] == [alone[2], list(m.generate(p2, loops=4, max_tokens=6)), alone[6]]


def test_huginn_resume_speculative_and_batch_equal_generate(dirs):
    path, _ = dirs["huginn"]
    with open_model(path) as m:
        alone = {L: list(m.generate(PROMPT, loops=L, max_tokens=6, seed=9)) for L in (2, 5)}
        h = m.build_resume_handle(PROMPT, L_used=2, max_loops=8, seed=9)
        assert list(m.resume_generate(h, new_L=5, max_tokens=6, seed=9)) == alone[5]
        assert list(m.generate_speculative(PROMPT, max_tokens=6, draft_loops=2, verify_loops=5, seed=9)) == alone[5]
        batch = m.generate_batch([PROMPT, PROMPT], per_lane_loops=[5, 2], max_tokens=6, seed=9)
        assert [list(g) for g in batch] == [alone[5], alone[2]]
        u = m.score_trajectory(PROMPT, n_loops=2)["hidden"]
        assert u.shape[1] == 64  # the state, not the state beside the prelude's output


def test_ouro_scores_match_the_reference(dirs):
    """Depth-consistency and uncertainty scoring on Ouro against the independent reference: the
    answers at two depths are the reference's greedy continuations at each, and the uncertainty
    score is the reference's next-token logits at L_hi with KL(p_hi || p_lo) of its two depths."""
    path, cfg = dirs["ouro-gqa"]
    w = weights(path)
    with open_model(path) as m:
        s = m.score_with_consistency(PROMPT, 2, 5, max_tokens=6)
        for L, answer in ((2, s["answer_a"]), (5, s["answer_b"])):
            assert answer == until_stop(_ref_greedy("ouro-gqa", dirs, L, 6), len(PROMPT), 1)[len(PROMPT):]
        logits, kl = m.score_with_uncertainty(PROMPT, 2, 5)
    lo, hi = (ouro_logits(w, cfg, PROMPT, L)[-1].double() for L in (2, 5))
    assert rel_err(torch.from_numpy(logits), hi) < RTOL
    ref_kl = float((hi.softmax(-1) * (hi.log_softmax(-1) - lo.log_softmax(-1))).sum())
    assert kl == pytest.approx(ref_kl, rel=1e-3, abs=1e-7)


# -- bad directories ---------------------------------------------------------------------------
def _broken(dirs, tmp_path, name="ouro-gqa", shards=1, cfg_over=None, drop=(), rename=None, reshape=None):
    path, cfg = dirs[name]
    w = weights(path)
    for n in drop:
        del w[n]
    if rename:
        w[rename[1]] = w.pop(rename[0])
    if reshape:
        w[reshape] = w[reshape][:-1]
    d = write_dir(tmp_path / "bad", cfg | (cfg_over or {}), w, shards=shards, tokenizer=False)
    return d


UP = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("case, match", [
    ("no_config", r"bad: no config.json \(not a Hugging Face model directory\)"),
    ("model_type", r"bad/config.json: model_type 'llama' is not supported \(supported: 'huginn_raven', 'ouro'\)"),
    ("missing", rf"bad/model.safetensors: missing tensor '{UP}'$"),
    ("misnamed", rf"bad/model.safetensors: missing tensor '{UP}'; it has 'model.layers.1.mlp.upp_proj.weight', "
                 "which is no tensor of this model"),
    ("extra", r"bad/model.safetensors: unexpected tensor 'model.layers.2.mlp.up_proj.weight'"),
    ("shape", rf"bad/model.safetensors: tensor '{UP}' has shape \(95, 64\), config.json implies \(96, 64\)"),
    ("config_shape", r"bad/model.safetensors: tensor 'model.embed_tokens.weight' has shape \(320, 64\), "
                     r"config.json implies \(321, 64\)"),
    ("shard_file", r"bad/model.safetensors.index.json: names model-00002-of-00002.safetensors for tensor '.*', "
                   "and there is no such file"),
    ("shard_missing", rf"bad/model.safetensors.index.json: missing tensor '{UP}'"),
    ("huginn", r"bad/model.safetensors: missing tensor 'transformer.core_block.1.attn.qk_bias'"),
    ("sliding", r"bad/config.json: use_sliding_window=True is not supported"),
    ("no_weights", r"bad: no model.safetensors or model.safetensors.index.json"),
])
def test_bad_directories_name_the_file_and_the_tensor(dirs, tmp_path, case, match, capsys):
    if case == "no_config":
        d = _broken(dirs, tmp_path)
        (d / "config.json").unlink()
    elif case == "model_type":
        d = _broken(dirs, tmp_path, cfg_over={"model_type": "llama"})
    elif case == "missing":
        d = _broken(dirs, tmp_path, drop=[UP])
    elif case == "misnamed":
        d = _broken(dirs, tmp_path, rename=(UP, "model.layers.1.mlp.upp_proj.weight"))
    elif case == "extra":
        d = _broken(dirs, tmp_path)
        w = load_file(d / "model.safetensors")
        w[UP.replace("1", "2")] = w[UP].clone()  # a layer config.json does not have
        save_file(w, d / "model.safetensors")
    elif case == "shape":
        d = _broken(dirs, tmp_path, reshape=UP)
    elif case == "config_shape":
        d = _broken(dirs, tmp_path, cfg_over={"vocab_size": 321})
    elif case in ("shard_file", "shard_missing"):
        d = _broken(dirs, tmp_path, shards=2, drop=[UP] if case == "shard_missing" else ())
        if case == "shard_file":
            (d / "model-00002-of-00002.safetensors").unlink()
    elif case == "huginn":
        d = _broken(dirs, tmp_path, name="huginn", drop=["transformer.core_block.1.attn.qk_bias"])
    elif case == "sliding":
        d = _broken(dirs, tmp_path, cfg_over={"use_sliding_window": True})
    else:
        d = _broken(dirs, tmp_path)
        (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=match) as e:
        open_model(d)
    assert isinstance(e.value, ValueError)
    # the service refuses to start, with the same message, before it starts anything
    assert cli_main(["serve", "--model", str(d), "--port", "0"]) == 2
    assert str(e.value) in capsys.readouterr().err


# -- the CUDA decode path's fused ops ----------------------------------------------------------
@pytest.mark.parametrize("name", ["ouro-gqa", "huginn-bias"])
def test_fused_decode_matches_the_torch_ops(dirs, name):
    """What CUDA decode runs on these models (Block.token_step's fused projections with the
    q/k bias after them, the sum norms in the residual-add kernel, the head with no norm of its
    own for Ouro), under the Triton interpreter on CPU: every step's logits within 1e-4 of the
    torch ops' and the same greedy tokens."""
    from tinyloop.kernels.gemv import gemv
    from tinyloop.kernels.rmsnorm import rms_norm
    from tinyloop.kernels.swiglu import swiglu
    path, _ = dirs[name]
    with open_model(path, backend="torch") as ref, open_model(path, backend="torch") as fused:
        calls = []
        fused._module.use_fast_path(rms_norm, gemv, swiglu=swiglu)
        for blk in fused._module.modules():
            if hasattr(blk, "token_step"):
                blk.gemv = lambda *a, _g=gemv, **k: calls.append(1) or _g(*a, **k)
        toks = list(ref.generate(PROMPT, loops=1, max_tokens=2, seed=4))
        steps = []
        for m in (ref, fused):
            m.runner.cache.seat(0, 4)
            out = [m.runner.prefill(0, PROMPT, 1).logits[0]]
            for pos in range(len(PROMPT), len(toks)):
                out.append(m.runner.decode([0], [toks[pos]], [pos], [1]).logits[0].clone())
            steps.append(torch.stack(out))
        assert calls, "the fused step never ran"
        want, got = steps
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-4
        assert list(fused.generate(PROMPT, loops=1, max_tokens=2, seed=4)) == toks


def test_the_full_size_presets_are_what_the_loader_builds(tmp_path):
    """`ouro-2.6b` and `huginn-3.5b` (random-weight shapes for benchmarks) are the configs the
    loader reads from the published config.json values."""
    import dataclasses

    from tinyloop.worker.model import hf
    from tinyloop.worker.model.config import PRESETS
    published = {
        "ouro-2.6b": ouro_config(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                                 intermediate_size=5632, num_hidden_layers=48, vocab_size=49152,
                                 max_position_embeddings=4096, rope_theta=1000000.0, layer_types=None),
        "huginn-3.5b": huginn_config(n_embd=5280, n_heads=55, num_key_value_heads=55, n_layers=8,
                                     n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
                                     intermediate_size=17920, vocab_size=65536, padded_vocab_size=65536,
                                     block_size=4096, mean_recurrence=32, init_values=None)}
    for name, cfg in published.items():
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        got = hf.read_config(tmp_path)[1]
        assert dataclasses.replace(got, bos_id=-1, eos_id=-1) == PRESETS[name], name
