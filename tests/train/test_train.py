"""Training code on CPU: the corpus split, a few steps that lower the loss, the CLI wiring."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
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
