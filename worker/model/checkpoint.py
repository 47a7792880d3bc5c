"""`.tinyloop` checkpoints: one safetensors file, the config as JSON in its metadata.

Metadata keys: `tinyloop.format_version` ("1", or "2" for a config that uses a field added
since: `LoopedConfig.format_version`; "3" for quantized weights, quant_checkpoint.py) and `tinyloop.config` (LoopedConfig as JSON);
optionally `tinyloop.tokenizer` (an HF `tokenizer.json` as a string) and `tinyloop.source`
(what a converted file was converted from). Tensor names follow Llama (see
docs/checkpoint.md). `load` also takes a Hugging Face model directory (hf.py).
"""
from __future__ import annotations

import dataclasses
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.model.errors import CheckpointError
from tinyloop.worker.model.modules import LoopedTransformer
from tinyloop.worker.model.safetensors_header import read_header

SUPPORTED_VERSIONS = ("1", "2", "3")


def save(model: LoopedTransformer, path: str | os.PathLike, dtype: torch.dtype = torch.float16,
         tokenizer_json: str | None = None, source: str | None = None) -> None:
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    meta = {"tinyloop.format_version": model.config.format_version, "tinyloop.config": model.config.to_json()}
    if tokenizer_json is not None:
        meta["tinyloop.tokenizer"] = tokenizer_json
    if source is not None:
        meta["tinyloop.source"] = source
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def read_config(path: str | os.PathLike) -> tuple[LoopedConfig, dict]:
    """-> (config, metadata) of a `.tinyloop` file, or of a Hugging Face model directory (its
    config, tensor names, shapes and dtypes checked, no weight read: hf.inspect), without loading
    the weights."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from tinyloop.worker.model import hf
        plan = hf.inspect(path)
        return plan.config, hf.metadata(plan)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    meta = read_header(path).get("__metadata__") or {}
    version = meta.get("tinyloop.format_version")
    if version is None:
        raise CheckpointError(f"{path}: not a .tinyloop checkpoint (no tinyloop.format_version in metadata)")
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(f"{path}: unknown format version {version!r} (supported: {SUPPORTED_VERSIONS})")
    try:
        cfg = LoopedConfig.from_json(meta["tinyloop.config"])
    except KeyError:
        raise CheckpointError(f"{path}: metadata has no tinyloop.config") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: invalid tinyloop.config: {e}") from None
    if version == "1" and cfg.format_version != "1":
        raise CheckpointError(f"{path}: format version 1 cannot hold this config (it uses fields of version 2)")
    return cfg, meta


def load(path: str | os.PathLike, device: torch.device | str = "cpu",
         dtype: torch.dtype = torch.float32, max_loops: int | None = None) -> tuple[LoopedTransformer, dict]:
    """-> (model in eval mode on `device` in `dtype`, safetensors metadata). `path` is a
    `.tinyloop` file or a Hugging Face model directory (Ouro, Huginn: hf.py). max_loops: the
    deepest depth the model will run at (the cache is sized for it); None: the checkpoint's
    (a directory: twice its default depth)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from tinyloop.worker.model import hf
        return hf.load(path, device, dtype, max_loops)
    from tinyloop.worker.model import quant_checkpoint
    cfg, meta = read_config(path)
    spec = quant_checkpoint.spec_of(meta, path)
    if max_loops is not None:
        cfg = with_max_loops(cfg, max_loops, path)
    with torch.device("meta"):
        model = LoopedTransformer(cfg)
    quantized = {} if spec is None else quant_checkpoint.file_names(cfg, spec)
    if spec is not None:
        # the projections' nn.Linear weights give way to the stored quantized tensors
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                    if k.removesuffix(".weight") not in quant_checkpoint.projection_names(cfg)}
    else:
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            names = set(f.keys())
            missing = sorted(set(quantized) - names)
            if missing:
                raise CheckpointError(f"{path}: missing quantized tensor(s) {missing[:5]}"
                                      + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
            if spec is not None:
                quant_checkpoint.install(model, quant_checkpoint.read_quantized(f, path, cfg, spec, device))
            names -= set(quantized)
            missing = sorted(set(expected) - names)
            if missing:
                raise CheckpointError(f"{path}: missing tensor(s) {missing[:5]}"
                                      + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
            unexpected = sorted(names - set(expected))
            if unexpected:
                raise CheckpointError(f"{path}: unexpected tensor(s) {unexpected[:5]} for this config")
            for name, shape in expected.items():
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"{path}: shape mismatch for {name}: file has "
                                          f"{tuple(t.shape)}, config needs {shape}")
                if not t.dtype.is_floating_point:
                    raise CheckpointError(f"{path}: {name} has dtype {t.dtype}, expected a float type")
                if not torch.isfinite(t).all():
                    raise CheckpointError(f"{path}: tensor {name} holds NaN or Inf")
                state[name] = owned(t.to(device=device, dtype=dtype), t)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: corrupt safetensors data: {e}") from None
    # the meta model takes the tensors as they are: no random init of its own, no second copy
    model.load_state_dict(state, assign=True)
    model.materialize_rope(device)
    return model.eval(), meta


def owned(v: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """v in memory of its own: a tensor that still views the file's mapped bytes (no cast, no
    move) is copied, into fresh (aligned) memory, since CPU BLAS rounds differently on
    operands at the odd offsets a safetensors header leaves."""
    if v.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return v.clone(memory_format=torch.contiguous_format)
    return v


def with_max_loops(cfg: LoopedConfig, max_loops: int, path: str) -> LoopedConfig:
    """cfg with another max_loops: the weights do not depend on it, only the cache does."""
    try:
        return dataclasses.replace(cfg, max_loops=max_loops)
    except ValueError as e:
        raise CheckpointError(f"{path}: max_loops={max_loops}: {e}") from None


def init_model(cfg: LoopedConfig, seed: int, std: float = 0.02) -> LoopedTransformer:
    model = LoopedTransformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed), std)
    return model.eval()
