"""`tinyloop quantize`: a float `.tinyloop` file or a Hugging Face model directory (Ouro, Huginn)
-> a quantized `.tinyloop` file (quant_checkpoint.py's format), by round-to-nearest or GPTQ
calibrated on the training corpus."""
from __future__ import annotations

import os
from typing import Callable

import torch

from tinyloop.worker.model import checkpoint, gptq, quant, quant_checkpoint
from tinyloop.worker.model.errors import CheckpointError

CALIB_SEQ_LEN = 512


def calibration_windows(meta: dict, config, n_tokens: int, seq_len: int = CALIB_SEQ_LEN,
                        corpus_root: str | None = None, cache_dir: str | None = None) -> torch.Tensor:
    """(n, seq_len) token windows, n = ceil(n_tokens / seq_len), evenly spaced over the training
    split of the corpus (train/corpus.py), in the checkpoint's tokens (documents joined as
    `heldout_for` joins them for this model's `config`)."""
    from tinyloop.train import corpus
    from tinyloop.train.evaluate import heldout_for, windows
    data = corpus.build(cache_dir, root=corpus_root).train
    n = -(-n_tokens // seq_len)
    # encode only what the windows need (a BPE model's whole corpus would take minutes)
    span = min(len(data), max(8 * n * seq_len, 1 << 20))
    tokens, _ = heldout_for(meta, data[:span], config)
    return windows(tokens, n, seq_len - 1)


def quantize_file(src: str | os.PathLike, dst: str | os.PathLike, spec: quant.QuantSpec,
                  progress: Callable = lambda it, desc: it, calib_loops: int | None = None,
                  corpus_root: str | None = None, cache_dir: str | None = None) -> dict:
    """Quantize every projection of `src` (quant_checkpoint.PROJECTIONS) into `dst`. Every
    argument is checked before any work, and `dst` appears only once complete. calib_loops:
    GPTQ's calibration depth (default: the model's default_loops). -> a summary."""
    src, dst = os.fspath(src), os.fspath(dst)
    cfg, meta = checkpoint.read_config(src)
    if quant_checkpoint.spec_of(meta, src) is not None:
        raise CheckpointError(f"{src}: already quantized ({quant_checkpoint.spec_of(meta, src).describe()})")
    model, meta = checkpoint.load(src, "cpu", torch.float32)
    state = model.state_dict()
    prefixes = quant_checkpoint.projection_names(cfg)
    for p in prefixes:
        quant.check_shape(p, tuple(state[f"{p}.weight"].shape), spec.group_size)
    L = cfg.default_loops if calib_loops is None else calib_loops
    if not 1 <= L <= cfg.max_loops:
        raise ValueError(f"calib_loops={L} outside [1, max_loops={cfg.max_loops}]")
    H = {}
    if spec.method == "gptq":
        win = calibration_windows(meta, cfg, spec.calib_tokens, corpus_root=corpus_root, cache_dir=cache_dir)
        H = gptq.hessians(model, win, L, prefixes, lambda it: progress(it, "calibrating"))
    dtype, src_bytes = source_facts(src)
    tensors = {k: v.to(dtype) for k, v in state.items() if k.removesuffix(".weight") not in prefixes}
    for p in progress(prefixes, "quantizing"):
        cancel = spec.cancel_round and p.startswith("loop.")
        w = state[f"{p}.weight"]
        stored = gptq.quantize(w, H[p], spec.group_size, cancel) if H else quant.rtn(w, spec.group_size, cancel)
        tensors.update({f"{p}.{k}": v for k, v in stored.items()})
    extra = {k: v for k, v in meta.items() if k in ("tinyloop.tokenizer", "tinyloop.source")}
    quant_checkpoint.save(cfg, tensors, spec, dst, extra)
    return {"format": spec.describe(), "projections": len(prefixes), "bytes": os.path.getsize(dst),
            "source_bytes": src_bytes, "calib_loops": L if H else 0}


FILE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def source_facts(path: str) -> tuple[torch.dtype, int]:
    """(the float dtype of the source's embedding, which the quantized file keeps for its float
    tensors; the source's bytes) of a `.tinyloop` file, or of a Hugging Face directory (the dtype
    it stores its embedding in, its weight files' bytes: one look at its headers)."""
    if os.path.isdir(path):
        from tinyloop.worker.model import hf
        plan = hf.inspect(path)
        return hf.storage_dtype(plan), sum(os.path.getsize(f) for f in set(plan.files.values()))
    from tinyloop.worker.model.safetensors_header import read_header
    dtype = FILE_DTYPES.get(read_header(path)["tok_embeddings.weight"]["dtype"], torch.float32)
    return dtype, os.path.getsize(path)
