"""The shipped default model (worker/assets/default.tinyloop): measured properties.

The held-out sample is built from this machine's own stdlib (the training machine's Python
may differ): 32 windows of 256 bytes, evenly spaced over the held-out split. Deeper must be
strictly better there -- a property of any held-out Python text, not of one split.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ASSET = Path(__file__).resolve().parents[2] / "worker" / "assets" / "default.tinyloop"
pytestmark = pytest.mark.skipif(not ASSET.exists(),
                                reason=f"{ASSET} not present yet (added after the H200 training run)")


@pytest.fixture(scope="module")
def model():
    from tinyloop.worker.model import checkpoint
    m, _ = checkpoint.load(ASSET, "cpu", torch.float32)
    return m


def test_fits_budget_and_depths(model):
    assert ASSET.stat().st_size <= 8_000_000
    assert model.config.max_loops >= 16 and model.config.vocab_size == 256


@pytest.fixture(scope="module")
def heldout_loss(model):
    from tinyloop.train import corpus, evaluate
    win = evaluate.windows(corpus.heldout_bytes(), n_windows=32, seq_len=256)
    return {L: evaluate.mean_loss(model, win, L, batch_size=8) for L in (1, 4, 8)}


def test_heldout_loss_falls_from_one_iteration(heldout_loss):
    assert heldout_loss[1] > heldout_loss[4] and heldout_loss[1] > heldout_loss[8], heldout_loss


def test_heldout_loss_keeps_falling_to_L8(heldout_loss):
    assert heldout_loss[4] > heldout_loss[8], heldout_loss


@pytest.mark.parametrize("prompt", [
    "def fibonacci(n):\n",
    pytest.param("import os\n", marks=pytest.mark.xfail(
        strict=True, reason="measured on the shipped model: greedy output repeats 'from test.support import "
                            "os_helper' from the first line (docs/model-card.md); strict, so a model that "
                            "fixes it must drop this mark")),
])
def test_greedy_output_not_degenerate(prompt):
    from tinyloop.worker.api import Model
    with Model(str(ASSET), max_seq_len=256, device="cpu", dtype="float32") as m:
        ids = m.tokenizer.encode(prompt)
        out = list(m.generate(ids, max_tokens=96))[len(ids):]
    text = bytes(out).decode("utf-8", errors="replace")
    assert len(set(out)) > 1, f"one repeated byte: {text!r}"
    lines = [ln for ln in text.split("\n")[:-1] if ln.strip()]  # complete, non-blank lines
    assert len(lines) < 2 or len(set(lines)) > 1, f"one repeated line: {text!r}"
