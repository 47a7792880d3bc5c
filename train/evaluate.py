"""Held-out bits per byte at a list of depths L, on deterministic windows.

Windows are `n_windows` spans of `seq_len + 1` tokens, evenly spaced over the held-out array
(the same windows at every L, on every run). Loss is the mean next-token cross entropy over
every position of every window. Bits per byte = nats / ln 2 / bytes-per-token, where
bytes-per-token is 1 for the byte tokenizer and the held-out split's bytes / tokens for BPE.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def windows(tokens: np.ndarray, n_windows: int, seq_len: int) -> torch.Tensor:
    """-> (n_windows, seq_len + 1) long, evenly spaced over `tokens`."""
    if len(tokens) < seq_len + 1:
        raise ValueError(f"held-out split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_windows).round().astype(np.int64)
    idx = starts[:, None] + np.arange(seq_len + 1)
    return torch.from_numpy(tokens[idx].astype(np.int64))


@torch.no_grad()
def mean_loss(model, win: torch.Tensor, loops: int, batch_size: int = 32) -> float:
    """Mean cross entropy (nats per token) of `model` at depth `loops` on windows (N, T+1)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(win), batch_size):
        w = win[i:i + batch_size].to(device)
        logits = model(w[:, :-1], loops)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                               reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    return total / count


def bpb_table(model, win: torch.Tensor, loops_list: list[int], bytes_per_token: float = 1.0,
              batch_size: int = 32) -> dict[int, float]:
    return {L: mean_loss(model, win, L, batch_size) / math.log(2) / bytes_per_token for L in loops_list}


def heldout_for(meta: dict, heldout_bytes: np.ndarray, config) -> tuple[np.ndarray, float]:
    """The held-out split in the tokens of a checkpoint with metadata `meta` and config
    `config` -> (tokens, bytes per token). A tokenizer without the project's document token
    (a Hugging Face model's) joins documents with the model's end-of-text token (`bpe.separator`)."""
    tj = meta.get("tinyloop.tokenizer")
    if not tj:
        return heldout_bytes, 1.0
    from tinyloop.train import bpe
    ids = bpe.encode(tj, heldout_bytes, bpe.separator(config))
    return ids, heldout_bytes.size / ids.size


def eval_checkpoint(path: str, loops_list: list[int], n_windows: int = 256, seq_len: int = 512,
                    device: str = "cpu", max_bytes: int | None = None, batch_size: int = 32,
                    root: str | None = None, heldout_packages: list[str] | None = None, site: str | None = None,
                    package_max_bytes: int | None = None) -> dict:
    """Bits per byte of a `.tinyloop` file on the held-out split of the stdlib at `root` (default:
    this interpreter's), or on the held-out packages when given (the split of a package corpus),
    fp32 math."""
    from tinyloop.train import corpus
    from tinyloop.worker.model import checkpoint
    model, meta = checkpoint.load(path, device, torch.float32)
    for L in loops_list:
        if not 1 <= L <= model.config.max_loops:
            raise ValueError(f"loops {L} outside [1, max_loops={model.config.max_loops}]")
    if heldout_packages:
        held = corpus.heldout_package_bytes(heldout_packages, site, package_max_bytes or corpus.DEFAULT_MAX_BYTES)
    else:
        held = corpus.heldout_bytes(root, max_bytes=max_bytes or corpus.DEFAULT_MAX_BYTES)
    tokens, bpt = heldout_for(meta, held, model.config)
    win = windows(tokens, n_windows, seq_len)
    table = bpb_table(model, win, loops_list, bpt, batch_size)
    return {"bpb": {str(L): round(v, 4) for L, v in table.items()}, "n_windows": n_windows,
            "seq_len": seq_len, "heldout_bytes": int(held.size), "bytes_per_token": bpt}
