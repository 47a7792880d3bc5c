"""Training code on CPU: the corpus split, a few steps that lower the loss, the CLI wiring."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyloop.train import corpus, evaluate, trainer
from tinyloop.train.card import render
from tinyloop.worker.model import checkpoint
from tinyloop.worker.model.config import PRESETS


def test_split_is_stable_and_disjoint():
    # sha1("os.py")[:4] and sha1("tempfile.py")[:4] as integers: pinned so the split never drifts.
    assert not corpus.is_heldout("os.py")
    assert corpus.is_heldout("tempfile.py")
    files = corpus.list_files(max_bytes=2_000_000)
    assert files == sorted(files) and files
    assert not any(part in corpus.SKIP_DIRS for f in files for part in f.split("/")[:-1])
    held = corpus.heldout_docs(max_bytes=2_000_000)
    assert {r for r, _ in held} <= {f for f in files if corpus.is_heldout(f)}
    assert all(bytes([corpus.DOC_SEP]) not in d for _, d in held)


def test_build_caches(tmp_path):
    a = corpus.build(tmp_path, max_bytes=1_000_000)
    b = corpus.build(tmp_path, max_bytes=1_000_000)
    assert a.info == b.info and np.array_equal(a.train, b.train) and a.train.dtype == np.uint8
    assert a.info["n_heldout_files"] + a.info["n_train_files"] == a.info["n_files"]
    assert a.train[-1] == corpus.DOC_SEP


def test_build_from_another_root(tmp_path):
    root = tmp_path / "stdlib"
    for rel in ("os.py", "tempfile.py", "test/test_os.py", "site-packages/x.py", "json/__init__.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\nimport sys\n" * 20)
    (root / "PYTHON_VERSION").write_text("3.11.7\n")
    corp = corpus.build(tmp_path / "cache", root=root, max_bytes=1_000_000)
    info = corp.info
    assert info["python"] == "3.11.7" and info["corpus_root"] == str(root) and info["stdlib"] == str(root)
    assert info["n_files"] == 4 and info["n_test_files"] == 1 and "tempfile.py" in info["heldout_files"]
    assert corpus.heldout_bytes(root).tobytes() == corp.heldout.tobytes()
    (root / "PYTHON_VERSION").unlink()
    assert corpus.source_python(root) == "unknown" and corpus.source_python() == sys.version.split()[0]
    assert corpus.build(tmp_path / "cache", max_bytes=100_000).info["corpus_root"] is None


def test_few_steps_lower_the_loss(tmp_path):
    corp = corpus.build(tmp_path, max_bytes=3_000_000)
    args = trainer.TrainArgs(steps=40, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5,
                             max_train_loops=3, eval_every=0, eval_windows=8, eval_loops=(1, 3),
                             log_every=5, progress=False)
    log = tmp_path / "log.jsonl"
    model, summary = trainer.train(PRESETS["tiny"], corp.train, corp.heldout, args, "cpu", str(log))
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    train_losses = [r["loss"] for r in recs if "loss" in r]
    assert summary["steps"] == 40 and summary["tokens"] == 40 * 8 * 64
    assert train_losses[-1] < train_losses[0] - 0.5, train_losses
    assert summary["final_eval_loss"]["1"] < 5.0  # ln 256 = 5.55 at init
    assert summary["best_step"] == 40 and summary["best_eval_loss"] == summary["final_eval_loss"]

    path = tmp_path / "m.tinyloop"
    checkpoint.save(model, path, torch.float16)
    loaded, _ = checkpoint.load(path)
    win = evaluate.windows(corp.heldout, 4, 64)
    table = evaluate.bpb_table(loaded, win, [1, 2])
    assert all(0 < v < 8 for v in table.values())


def test_returns_best_eval_snapshot(tmp_path):
    # 300 training bytes at a high lr: the model memorizes them and held-out loss rises after the
    # first evals, so the best eval is not the last and the returned weights must be restored.
    corp = corpus.build(tmp_path, max_bytes=3_000_000)
    args = trainer.TrainArgs(steps=60, batch_size=8, seq_len=64, lr=2e-2, warmup_steps=5,
                             max_train_loops=3, eval_every=10, eval_windows=8, eval_loops=(1, 3),
                             log_every=5, progress=False)
    log = tmp_path / "log.jsonl"
    model, summary = trainer.train(PRESETS["tiny"], corp.train[:300], corp.heldout, args, "cpu", str(log))
    evals = [r for r in map(json.loads, log.read_text().splitlines()) if "best" in r]
    assert [r["step"] for r in evals] == list(range(10, 61, 10))
    best = min(evals, key=lambda r: r["eval_loss"]["3"])
    assert summary["selected_by_loops"] == 3
    assert summary["best_step"] == best["step"] < summary["steps"] == 60, (summary, evals)
    assert summary["best_eval_loss"] == best["eval_loss"]
    assert summary["final_eval_loss"] == evals[-1]["eval_loss"]
    assert summary["final_eval_loss"]["3"] > summary["best_eval_loss"]["3"]
    win = evaluate.windows(corp.heldout, args.eval_windows, args.seq_len)
    for L in args.eval_loops:
        assert abs(evaluate.mean_loss(model, win, L) - summary["best_eval_loss"][str(L)]) < 1e-3
    assert not model.training


def test_lr_schedule():
    a = trainer.TrainArgs(steps=100, lr=1.0, warmup_steps=10, min_lr_frac=0.1)
    assert trainer.lr_at(a, 0, 0.0) == 0.1 and trainer.lr_at(a, 9, 0.09) == 1.0
    assert abs(trainer.lr_at(a, 50, 0.5) - 0.55) < 1e-9 and abs(trainer.lr_at(a, 99, 1.0) - 0.1) < 1e-9


def test_cli_registers_without_torch():
    code = ("import sys; from tinyloop.cli import build_parser; p = build_parser(); "
            "a = p.parse_args(['train', '--out', 'x.tinyloop', '--minutes', '1', '--corpus-root', 'd']); "
            "b = p.parse_args(['eval-bpb', '--model', 'x', '--loops', '1', '4']); "
            "assert a.preset == 'default' and b.loops == [1, 4]; "
            "assert a.corpus_root == 'd' and b.corpus_root is None; "
            "assert 'torch' not in sys.modules, 'tinyloop.train.cli imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_preset_fits_8mb():
    from tinyloop.train.presets import get_preset
    cfg = get_preset("default")
    assert cfg.n_params() * 2 < 8_000_000 and cfg.max_loops >= 16 and cfg.default_loops == 8


def test_card_renders():
    card = {"config": json.loads(PRESETS["tiny"].to_json()), "n_params": 1000, "checkpoint_bytes": 2000,
            "tokenizer": "byte", "command": "tinyloop train", "hardware": "cpu", "torch": "2",
            "total_wall_s": 1.0, "bpb": {"1": 3.0, "8": 2.0},
            "corpus": {"python": "3.12", "n_files": 2, "doc_sep": 0, "heldout_frac": 0.02,
                       "n_heldout_files": 1, "heldout_bytes": 10, "n_train_files": 1, "train_bytes": 10},
            "eval": {"windows": 4, "seq_len": 64},
            "train": {"train_wall_s": 1.0, "steps": 1, "tokens": 64, "tok_per_s": 64,
                      "args": vars(trainer.TrainArgs(steps=1))}}
    text = render(card)
    assert "| bits/byte | 3.000 | 2.000 |" in text
    assert "kept checkpoint" not in text
    card["train"].update(steps=3000, best_step=2000, best_eval_loss={"1": 0.9, "8": 0.8},
                         final_eval_loss={"1": 0.95, "8": 0.85}, selected_by_loops=8)
    card["corpus"].update(corpus_root="/tmp/stdlib-src", n_test_files=1)
    text = render(card)
    assert "| kept checkpoint | step 2,000 of 3,000" in text and "`--corpus-root /tmp/stdlib-src`" in text


def test_bpe_checkpoint_serves_text(tmp_path, capsys):
    """`tinyloop train --tokenizer bpe` (the benchmark-model path, docs/training.md) on a tiny
    preset: the checkpoint embeds its tokenizers-trained BPE, and the worker loads it and
    round-trips text through it."""
    from tinyloop.cli import main
    from tinyloop.worker import Model
    out = tmp_path / "bpe.tinyloop"
    rc = main(["train", "--preset", "tiny", "--tokenizer", "bpe", "--vocab-size", "320", "--steps", "2",
               "--corpus-mb", "2", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0",
               "--corpus-dir", str(tmp_path / "corpus"), "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    with Model(out, device="cpu", max_seq_len=128) as m:
        assert m.config.vocab_size == 320
        text = "def f(x):\n    return x\n"
        ids = m.tokenizer.encode(text)
        assert len(ids) < len(text.encode()) and m.tokenizer.decode(ids) == text
        assert len(m.generate(ids, max_tokens=4)) == len(ids) + 4


def test_too_small_corpus_is_a_clear_error(tmp_path, capsys):
    from tinyloop.cli import main
    rc = main(["train", "--preset", "tiny", "--steps", "1", "--corpus-mb", "0.05", "--corpus-dir",
               str(tmp_path / "c"), "--out", str(tmp_path / "m.tinyloop"), "--no-progress"])
    assert rc == 2 and "corpus too small" in capsys.readouterr().err
    assert not (tmp_path / "m.tinyloop").exists()


def _site(tmp_path):
    """A site-packages of three small packages, with a cache folder the corpus must skip."""
    site = tmp_path / "site"
    for pkg, files in {"alpha": ["__init__.py", "core.py", "sub/x.py"], "beta": ["__init__.py", "b.py"],
                       "gamma": ["__init__.py", "g.py"]}.items():
        for rel in files:
            path = site / pkg / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# {pkg}/{rel}\ndef f():\n    return {len(rel)}\n" * 10)
    (site / "alpha" / "__pycache__").mkdir()
    (site / "alpha" / "__pycache__" / "core.py").write_text("not source\n")
    return site


def test_package_corpus_holds_out_whole_packages(tmp_path):
    site = _site(tmp_path)
    corp = corpus.build_packages(["alpha", "beta"], ["gamma"], tmp_path / "cache", site=site,
                                 stdlib_max_bytes=200_000)
    info = corp.info
    assert info["split"] == "package" and info["heldout_files"] == ["gamma/__init__.py", "gamma/g.py"]
    assert info["packages"]["alpha"]["files"] == 3  # __pycache__ skipped
    held = corp.heldout.tobytes()
    assert b"# gamma/g.py" in held and b"# alpha/" not in held and b"# beta/" not in held
    train = corp.train.tobytes()
    assert b"# gamma/" not in train and b"# alpha/sub/x.py" in train and b"# beta/b.py" in train
    assert info["stdlib_files"] > 0 and info["n_train_files"] == info["stdlib_files"] + 5
    # cached under its signature; the held-out bytes alone read the same documents
    again = corpus.build_packages(["alpha", "beta"], ["gamma"], tmp_path / "cache", site=site,
                                  stdlib_max_bytes=200_000)
    assert again.info == info and np.array_equal(again.train, corp.train)
    assert corpus.heldout_package_bytes(["gamma"], site).tobytes() == held
    # a per-package cap keeps each package's first files
    capped = corpus.build_packages(["alpha"], ["gamma"], site=site, stdlib_max_bytes=0,
                                   package_max_bytes=len((site / "alpha/__init__.py").read_bytes()))
    assert capped.info["packages"]["alpha"]["files"] == 1 and capped.info["stdlib_files"] == 0


def test_package_corpus_refuses_what_cannot_split(tmp_path):
    site = _site(tmp_path)
    with pytest.raises(ValueError, match=r"both trained on and held out: \['beta'\]"):
        corpus.build_packages(["alpha", "beta"], ["beta"], site=site)
    with pytest.raises(ValueError, match="at least one is needed"):
        corpus.build_packages(["alpha"], [], site=site)
    with pytest.raises(ValueError, match="package 'delta' is not installed under"):
        corpus.build_packages(["alpha"], ["delta"], site=site)


def test_deep_depth_weighting_favours_deep_loops():
    import random
    assert trainer.depth_weights(4, "uniform") == [0.25] * 4
    assert trainer.depth_weights(4, "deep") == [0.1, 0.2, 0.3, 0.4]
    with pytest.raises(ValueError, match="depth_weighting must be one of"):
        trainer.depth_weights(4, "shallow")
    rng = random.Random(0)
    counts = [0] * 8
    for _ in range(20_000):
        counts[trainer.sample_depth(rng, 8, "deep") - 1] += 1
    expected = [20_000 * L / 36 for L in range(1, 9)]
    assert all(abs(c - e) < 0.1 * e for c, e in zip(counts, expected)), counts


def test_card_describes_a_package_corpus():
    card = json.loads((Path(__file__).parents[2] / "docs" / "model-card.json").read_text())
    card["train"]["args"]["depth_weighting"] = "deep"
    card["corpus"] = {"split": "package", "python": "3.12.3", "stdlib_files": 10, "stdlib_bytes": 1000,
                      "package_max_bytes": 40_000_000, "doc_sep": 0, "heldout_packages": ["sympy"],
                      "train_packages": ["torch"], "packages": {"torch": {"files": 5, "bytes": 500},
                                                                "sympy": {"files": 2, "bytes": 200}},
                      "n_heldout_files": 2, "heldout_bytes": 202, "n_train_files": 15, "train_bytes": 1510}
    text = render(card)
    assert "P(L) ∝ L over [1, " in text and "| `sympy` | held out | 2 | 200 |" in text
    assert "--heldout-packages sympy" in text and "never seen in training: `sympy`" in text


def test_train_and_eval_on_a_package_corpus_through_the_cli(tmp_path, capsys):
    """`tinyloop train --packages ... --heldout-packages ... --depth-weighting deep --card`, then
    `tinyloop eval-bpb --heldout-packages ...` on the saved file: the card's figures are the
    held-out packages' (the same windows, so the same numbers)."""
    from tinyloop.cli import main
    site, out, card = _site(tmp_path), tmp_path / "m.tinyloop", tmp_path / "card.json"
    common = ["--site-packages", str(site), "--heldout-packages", "gamma", "--corpus-mb", "0.2"]
    rc = main(["train", "--preset", "tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
               "--eval-every", "0", "--max-train-loops", "3", "--depth-weighting", "deep", "--packages", "alpha",
               "beta", *common, "--corpus-dir", str(tmp_path / "c"), "--out", str(out), "--card", str(card),
               "--card-loops", "1", "2", "--card-windows", "4", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    c = json.loads(card.read_text())
    assert c["corpus"]["heldout_packages"] == ["gamma"] and c["train"]["args"]["depth_weighting"] == "deep"
    js = tmp_path / "bpb.json"
    assert main(["eval-bpb", "--model", str(out), "--loops", "1", "2", "--windows", "4", "--seq-len", "32",
                 *common, "--json", str(js)]) == 0
    assert json.loads(js.read_text())["bpb"] == c["bpb"]


def test_train_continues_from_a_checkpoint(tmp_path, capsys):
    """`tinyloop train --init CKPT` starts from the file's weights, config and BPE tokenizer (at a
    zero learning rate the saved file holds exactly the start's weights); a dimension flag or a
    tokenizer that disagrees with the file is refused before any step."""
    from tinyloop.cli import main
    from tinyloop.worker.model import checkpoint
    base = ["--steps", "2", "--corpus-mb", "2", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0",
            "--corpus-dir", str(tmp_path / "corpus"), "--no-progress"]
    a, b = tmp_path / "a.tinyloop", tmp_path / "b.tinyloop"
    assert main(["train", "--preset", "tiny", "--tokenizer", "bpe", "--vocab-size", "320", *base,
                 "--out", str(a)]) == 0, capsys.readouterr().err
    assert main(["train", "--init", str(a), "--tokenizer", "bpe", *base, "--lr", "0", "--out", str(b)]) == 0
    ma, meta_a = checkpoint.load(a)
    mb, meta_b = checkpoint.load(b)
    assert meta_b["tinyloop.tokenizer"] == meta_a["tinyloop.tokenizer"] and mb.config == ma.config
    for (k, va), vb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(va, vb), k
    capsys.readouterr()
    assert main(["train", "--init", str(a), "--tokenizer", "bpe", *base, "--d-model", "96", "--out", str(b)]) == 2
    assert "its config disagrees with --d-model 96" in capsys.readouterr().err
    assert main(["train", "--init", str(a), *base, "--out", str(b)]) == 2
    assert "its tokenizer is BPE, not --tokenizer byte" in capsys.readouterr().err
