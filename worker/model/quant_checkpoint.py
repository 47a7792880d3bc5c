"""Quantized `.tinyloop` files (format version 3): which weights are quantized, writing them,
reading them into a model, and the shared block's per-iteration weight variants.

Every projection of every layer (prelude, shared block, coda: attention wq wk wv wo, feed
forward w1 w2 w3) is stored quantized (quant.py's layout, suffixes `.qweight`, `.scales`,
`.zeros`, and `.sign` for the shared block's when the file was written with --cancel-round);
the embeddings, the head, the norms, biases and an input-injection adapter stay in the file's
float dtype. The metadata key `tinyloop.quant` holds `QuantSpec.to_meta()` as JSON.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Callable, Iterable

import torch
import torch.nn as nn
from safetensors.torch import save_file

from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.model.errors import CheckpointError
from tinyloop.worker.model.modules import Block, LoopedTransformer
from tinyloop.worker.model.quant import SUFFIXES, QuantSpec, QuantWeight, check_shape

FORMAT_VERSION = "3"
META_KEY = "tinyloop.quant"
PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


class QuantLinear(nn.Module):
    """An nn.Linear's place in a loaded quantized model: `.weight` is a QuantWeight (which
    modules.linear and the fused projections take where they take a weight tensor)."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.weight = weight


def projection_names(cfg: LoopedConfig) -> list[str]:
    """The quantized weights' prefixes ("loop.0.attention.wq"), layer by layer."""
    parts = [("prelude", cfg.n_prelude), ("loop", cfg.n_loop_layers), ("coda", cfg.n_coda)]
    return [f"{part}.{i}.{p}" for part, n in parts for i in range(n) for p in PROJECTIONS]


def spec_of(meta: dict, path: str) -> QuantSpec | None:
    """The file's QuantSpec (format version 3), None for an unquantized file."""
    if meta.get("tinyloop.format_version") != FORMAT_VERSION:
        return None
    raw = meta.get(META_KEY)
    if raw is None:
        raise CheckpointError(f"{path}: format version 3 without {META_KEY} metadata")
    try:
        return QuantSpec.from_meta(json.loads(raw), path)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: {META_KEY} is not JSON: {e}") from None


def file_names(cfg: LoopedConfig, spec: QuantSpec) -> dict[str, str]:
    """{stored tensor name: the projection prefix it belongs to} of a quantized file."""
    out = {}
    for prefix in projection_names(cfg):
        for suffix in SUFFIXES:
            if suffix == "sign" and not (spec.cancel_round and prefix.startswith("loop.")):
                continue
            out[f"{prefix}.{suffix}"] = prefix
    return out


def save(cfg: LoopedConfig, tensors: dict[str, torch.Tensor], spec: QuantSpec, path: str | os.PathLike,
         meta: dict[str, str]) -> None:
    """Write the file: tensors holds the float tensors and the quantized ones by stored name.
    Written to a temporary file and renamed, so a failure leaves no partial file at `path`."""
    meta = {**meta, "tinyloop.format_version": FORMAT_VERSION, "tinyloop.config": cfg.to_json(),
            META_KEY: json.dumps(spec.to_meta(), sort_keys=True)}
    tmp = f"{os.fspath(path)}.tmp"
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_quantized(f, path: str, cfg: LoopedConfig, spec: QuantSpec, device) -> dict[str, QuantWeight]:
    """The quantized weights of an open safetensors file, by prefix, checked against the config."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LoopedTransformer(cfg).state_dict().items()}
    stored = file_names(cfg, spec)
    out = {}
    for prefix in projection_names(cfg):
        N, K = shapes[f"{prefix}.weight"]
        try:
            check_shape(prefix, (N, K), spec.group_size)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        want = {"qweight": ((N, K // 2), torch.uint8), "scales": ((N, K // spec.group_size), torch.float16),
                "zeros": ((N, K // spec.group_size), torch.uint8), "sign": ((N, K // 4), torch.uint8)}
        t = {}
        for suffix, (shape, dtype) in want.items():
            name = f"{prefix}.{suffix}"
            if name not in stored:
                continue
            v = f.get_tensor(name)
            if tuple(v.shape) != shape or v.dtype != dtype:
                raise CheckpointError(f"{path}: {name} is {v.dtype} {tuple(v.shape)}, the format needs "
                                      f"{dtype} {shape}")
            if suffix == "scales" and not torch.isfinite(v).all():
                raise CheckpointError(f"{path}: tensor {name} holds NaN or Inf")
            t[suffix] = v.to(device).clone()
        out[prefix] = QuantWeight.from_tensors(t, spec.group_size)
    return out


def install(model: LoopedTransformer, weights: dict[str, QuantWeight]) -> None:
    """Put each quantized weight in its nn.Linear's place (a QuantLinear)."""
    for prefix, w in weights.items():
        parent, name = prefix.rsplit(".", 1)
        setattr(model.get_submodule(parent), name, QuantLinear(w))


def block_variant(layer: Block, weight_of: Callable[[QuantWeight], QuantWeight]) -> Block:
    """A copy of a shared-block layer with each quantized weight w replaced by weight_of(w),
    sharing everything else (norms, biases) with the layer."""
    v = copy.copy(layer)
    v._modules = dict(layer._modules)
    for sub in ("attention", "feed_forward"):
        m = copy.copy(getattr(layer, sub))
        m._modules = {k: QuantLinear(weight_of(q.weight)) if isinstance(q, QuantLinear) else q
                      for k, q in m._modules.items()}
        v._modules[sub] = m
    return v


ROUNDINGS = ("nearest", "cancel", "stochastic")


def use_rounding(model: LoopedTransformer, rounding: str, seed: int = 0, dual_bit_switch: int | None = None) -> None:
    """The shared block's weights by iteration (model.loop_variants): "nearest" the file's codes
    every iteration; "cancel" the codes at even iterations and q + d (the sign channel) at odd
    ones; "stochastic" an independent draw per iteration (QuantWeight.stochastic), one weight
    set per iteration up to max_loops (memory grows with max_loops). dual_bit_switch s:
    iterations 0..s run an INT2 copy of the block made now from its INT4 codes
    (QuantWeight.int2), the later ones as `rounding` says. Call before use_fast_path."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    loop = list(model.loop)
    weights = [m.weight for layer in loop for m in layer.modules() if isinstance(m, QuantLinear)]
    if rounding != "nearest" and (not weights or any(w.sign is None for w in weights)):
        raise ValueError(f"{rounding} rounding needs the shared block quantized with its sign channel "
                         f"(`tinyloop quantize --cancel-round`)")
    if rounding == "nearest":
        variants = [model.loop]
    elif rounding == "cancel":
        variants = [model.loop, nn.ModuleList(block_variant(layer, QuantWeight.odd) for layer in loop)]
    else:
        g = torch.Generator().manual_seed(seed)
        variants = [nn.ModuleList(block_variant(layer, lambda w: w.stochastic(g)) for layer in loop)
                    for _ in range(model.config.max_loops)]
    if dual_bit_switch is not None:
        if not weights:
            raise ValueError("dual-bit needs a quantized shared block (`tinyloop quantize`)")
        if dual_bit_switch < 0:
            raise ValueError(f"dual_bit_switch must be >= 0, got {dual_bit_switch}")
        int2 = nn.ModuleList(block_variant(layer, QuantWeight.int2) for layer in loop)
        L = model.config.max_loops
        variants = [int2 if i <= dual_bit_switch else variants[i % len(variants)] for i in range(L)]
    model.loop_variants = [] if variants == [model.loop] else variants


def use_kernels(model: LoopedTransformer, kernels: tuple[Callable, Callable], rows: int) -> None:
    """Every quantized weight of the model (fused ones included) on the Triton launchers, after
    model.use_fast_path; a block whose projections are quantized runs decode passes of up to
    `rows` rows (the INT4 launcher's limit) through its fused projections, whatever
    Settings.fused_rows says for bf16 weights (a block of both kinds: no more than `rows`): the
    INT4 launcher runs M > 1 rows row by row (each read from L2) or as its fused GEMM, where the unfused path would launch the GEMM and
    the norms, SwiGLU and residual adds apart. With several weight sets of the shared block
    (loop_variants), the L2 budget that Block.eviction gives the block is shared among them in
    proportion to their bytes, since they are all read by one token."""
    for m in _all_modules(model):
        for w in vars(m).values():
            if isinstance(w, QuantWeight):
                w.kernels = kernels
        if isinstance(m, Block) and m.gemv is not None and not m.invariant:
            quantized = [isinstance(w, QuantWeight) for w in m.projections().values()]
            if all(quantized):
                m.gemv_rows = rows
            elif any(quantized):  # the fused path's rows may not exceed what the INT4 launcher takes
                m.gemv_rows = min(m.gemv_rows, rows)
    distinct = list({id(v): v for v in model.loop_variants}.values())
    if len(distinct) > 1:
        nbytes = [sum(w.nbytes for layer in v for w in layer.projections().values()) for v in distinct]
        for v, n in zip(distinct, nbytes):
            for layer in v:
                layer.l2_keep_fraction *= n / sum(nbytes)
                layer._l2_kept = None


def _all_modules(model: LoopedTransformer) -> Iterable[nn.Module]:
    yield from model.modules()
    for variant in model.loop_variants:
        yield from variant.modules()


def use_settings(model: LoopedTransformer, meta: dict, path: str, settings, dtype: torch.dtype) -> str:
    """A loaded model's shared block by iteration as `settings` say (Settings.rounding,
    dual_bit) -> the weight format, as ModelInfo reports it."""
    spec = spec_of(meta, path)
    if spec is None:
        if settings.rounding != "nearest" or settings.dual_bit:
            what = "dual-bit" if settings.dual_bit else f"{settings.rounding} rounding"
            raise ValueError(f"{what} applies to quantized weights; {path} holds float weights "
                             f"(`tinyloop quantize` writes them)")
        return str(dtype).removeprefix("torch.")
    dual = spec.dual_bit if settings.dual_bit is None else settings.dual_bit
    use_rounding(model, settings.rounding, dual_bit_switch=settings.dual_bit_switch if dual else None)
    extra = [] if settings.rounding == "nearest" else [f"{settings.rounding} rounding"]
    if dual:
        extra.append(f"int2 iterations 0-{settings.dual_bit_switch}")
    return spec.describe() + (f" ({', '.join(extra)})" if extra else "")


def dequantized(model: LoopedTransformer, dtype: torch.dtype = torch.float32) -> LoopedTransformer:
    """The model with every quantized weight (its iteration variants' included) replaced, in
    place, by an nn.Linear holding `dequantize(dtype)`: the float model a quantized one must
    compute exactly (the parity tests' and the error benchmarks' reference)."""
    for m in list(_all_modules(model)):
        for name, q in list(m._modules.items()):
            if isinstance(q, QuantLinear):
                w = q.weight.dequantize(dtype)
                lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                lin.weight = nn.Parameter(w, requires_grad=False)
                m._modules[name] = lin
    return model
