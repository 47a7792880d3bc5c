"""Hugging Face model directories: Ouro (`model_type: "ouro"`) and Huginn (`"huginn_raven"`).

A directory holds `config.json`, the weights in `model.safetensors` or in shards named by
`model.safetensors.index.json`, and usually `tokenizer.json`. `inspect` reads only the config
and the safetensors headers (no torch: `tinyloop serve` checks a directory with it before it
starts a worker); `load` then reads the weights tensor by tensor from the memory-mapped files
into a `LoopedTransformer` built on the meta device, so no tensor is held twice beyond the
one being converted.

How each family maps onto `LoopedConfig` (the math is the published remote code's):

- Ouro: every decoder layer is the shared block (no prelude, no coda), applied total_ut_steps
  times; sandwich norms (input_layernorm / input_layernorm_2 around attention,
  post_attention_layernorm / post_attention_layernorm_2 around the MLP); model.norm after
  every iteration (the loop norm) and none of its own before the head; untied lm_head; the
  early-exit gate kept.
- Huginn: prelude, a recurrent core block with input injection (adapter of concat(state,
  prelude output)), coda; the norm on each residual sum (sandwich_sum); ln_f before the coda
  and again before the tied head; a q/k bias; embeddings scaled by embed_scale. Its RoPE
  rotates adjacent pairs; the engine rotates halves. Permuting each head's q and k rows
  (pair i = dims (2i, 2i+1) -> dims (i, i + hd/2)) turns one into the other exactly: the
  scores q·k are sums over the same products, and v is untouched.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable

from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.model.errors import CheckpointError
from tinyloop.worker.model.safetensors_header import read_header

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"

# a directory's default max_loops: this many times its default depth (deeper requests need
# the cache layers allocated up front; Model(max_loops=...) sets it)
MAX_LOOPS_FACTOR = 2

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass
class Source:
    """One tensor of the directory: its name, the shape config.json implies, and how it becomes
    the model's tensors (target name -> a function of the loaded tensor)."""
    name: str
    shape: tuple[int, ...]
    targets: dict[str, Callable] = field(default_factory=dict)


@dataclass
class Plan:
    """What `load` needs: the config, each source tensor and the file holding it."""
    path: str
    family: str
    config: LoopedConfig
    sources: list[Source]
    files: dict[str, str]              # tensor name -> file path
    dtypes: dict[str, str]             # tensor name -> safetensors dtype
    tokenizer_json: str | None


def is_hf_dir(path: str | os.PathLike) -> bool:
    return os.path.isdir(os.fspath(path))


# -- config.json ----------------------------------------------------------------------------
class _Keys:
    """config.json's values with errors that name the file and the key."""

    def __init__(self, path: str, values: dict):
        self.path, self.values = path, values

    def need(self, key: str, kind=int):
        if key not in self.values:
            raise CheckpointError(f"{self.path}: missing key {key!r}")
        return self._typed(key, self.values[key], kind)

    def get(self, key: str, default, kind=None):
        v = self.values.get(key)
        if v is None:
            return default
        return self._typed(key, v, kind or type(default))

    def _typed(self, key, v, kind):
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise CheckpointError(f"{self.path}: {key} must be an integer, got {v!r}")
        if kind is not None and not isinstance(v, kind):
            raise CheckpointError(f"{self.path}: {key} must be {kind.__name__}, got {v!r}")
        return v

    def require(self, key: str, allowed, default):
        v = self.values.get(key, default)
        if v not in allowed:
            raise CheckpointError(f"{self.path}: {key}={v!r} is not supported (supported: {allowed!r})")

    def token_id(self, key: str) -> int:
        v = self.values.get(key)
        if isinstance(v, list):  # several ids: the first is the model's own (the others stay stops the caller may add)
            v = v[0] if v else None
        return -1 if v is None else self._typed(key, v, int)


def _ouro_config(k: _Keys, max_loops: int | None) -> LoopedConfig:
    d, heads = k.need("hidden_size"), k.need("num_attention_heads")
    if k.values.get("head_dim") not in (None, d // heads):
        raise CheckpointError(f"{k.path}: head_dim={k.values['head_dim']} differs from hidden_size / "
                              f"num_attention_heads = {d // heads}, which this engine assumes")
    k.require("hidden_act", ("silu",), "silu")
    k.require("use_sliding_window", (False,), False)
    scaling = k.values.get("rope_scaling")
    if scaling not in (None, {}) and scaling.get("rope_type", scaling.get("type")) != "default":
        raise CheckpointError(f"{k.path}: rope_scaling {scaling!r} is not supported (plain RoPE only)")
    types = k.values.get("layer_types") or []
    if any(t != "full_attention" for t in types):
        raise CheckpointError(f"{k.path}: layer_types other than full_attention are not supported")
    loops = k.get("total_ut_steps", 4, int)
    return _config(k, max_loops, vocab_size=k.need("vocab_size"), d_model=d, n_heads=heads,
                   n_kv_heads=k.get("num_key_value_heads", heads, int), d_ff=k.need("intermediate_size"),
                   n_prelude=0, n_loop_layers=k.need("num_hidden_layers"), n_coda=0, norm="sandwich",
                   loop_final_norm=True, final_norm=False, exit_gate=True,
                   rope_theta=k.get("rope_theta", 10000.0, float), norm_eps=k.get("rms_norm_eps", 1e-6, float),
                   tie_embeddings=k.get("tie_word_embeddings", False, bool), default_loops=loops,
                   max_seq_len=k.get("max_position_embeddings", 32768, int),
                   bos_id=k.token_id("bos_token_id"), eos_id=k.token_id("eos_token_id"))


def _huginn_config(k: _Keys, max_loops: int | None) -> LoopedConfig:
    for key, supported in (("architecture_class_name", "RecurrentGPT"), ("block_class_name", "SandwichBlock"),
                           ("norm_class_name", "RMSNorm_llama"), ("mlp_class_name", "GatedMLP"),
                           ("nonlin_name", "SiLU"), ("injection_type", "linear"), ("state_init", "like-init")):
        k.require(key, (supported,), supported)
    if k.values.get("test_time_noise", 0):
        raise CheckpointError(f"{k.path}: test_time_noise={k.values['test_time_noise']!r} is not supported (0 only)")
    d, heads = k.need("n_embd"), k.need("n_heads")
    if k.get("num_key_value_heads", heads, int) != heads:
        # the reference's q/k bias is (2, 1, n_heads, head_dim): k carries n_heads heads
        raise CheckpointError(f"{k.path}: num_key_value_heads must equal n_heads ({heads}) in a Huginn model")
    prelude, core, coda = (k.need(n) for n in ("n_layers_in_prelude", "n_layers_in_recurrent_block",
                                               "n_layers_in_coda"))
    if "n_layers" in k.values and k.need("n_layers") != prelude + core + coda:
        raise CheckpointError(f"{k.path}: n_layers={k.values['n_layers']} is not n_layers_in_prelude + "
                              f"n_layers_in_recurrent_block + n_layers_in_coda = {prelude + core + coda}")
    init = k.values.get("init_values") or {}
    std = float(init.get("std", math.sqrt(2 / (5 * d))))
    scale = float(init.get("embed_scale", math.sqrt(d)))
    tied = k.get("tie_embeddings", k.get("tie_word_embeddings", True, bool), bool)
    return _config(k, max_loops, vocab_size=k.get("padded_vocab_size", k.need("vocab_size"), int), d_model=d,
                   n_heads=heads, n_kv_heads=heads, d_ff=k.need("intermediate_size"), n_prelude=prelude,
                   n_loop_layers=core, n_coda=coda, norm="sandwich_sum", exit_norm=True, inject=True,
                   adapter_bias=k.get("bias", False, bool), embed_scale=scale, init_std=std,
                   qk_bias=k.get("qk_bias", True, bool), rope_theta=k.get("rope_base", 50000.0, float),
                   norm_eps=k.get("norm_eps", 1e-6, float), tie_embeddings=tied,
                   default_loops=k.get("mean_recurrence", 32, int), max_seq_len=k.get("block_size", 4096, int),
                   bos_id=k.token_id("bos_token_id"), eos_id=k.token_id("eos_token_id"))


def _config(k: _Keys, max_loops: int | None, **fields) -> LoopedConfig:
    fields["max_loops"] = max_loops if max_loops is not None else MAX_LOOPS_FACTOR * fields["default_loops"]
    try:
        return LoopedConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"{k.path}: {e}") from None


FAMILIES = {"ouro": _ouro_config, "huginn_raven": _huginn_config}


def read_config(path: str | os.PathLike, max_loops: int | None = None) -> tuple[str, LoopedConfig]:
    """-> (model_type, LoopedConfig) of a directory's config.json."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, CONFIG)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such model directory")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no {CONFIG} (not a Hugging Face model directory)")
    try:
        with open(cfg_path) as f:
            values = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")
    family = values.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{cfg_path}: model_type {family!r} is not supported "
                              f"(supported: {', '.join(repr(f) for f in sorted(FAMILIES))})")
    return family, FAMILIES[family](_Keys(cfg_path, values), max_loops)


# -- the tensors each family has ---------------------------------------------------------------
def _keep(t):
    return t


def _rows(start: int, stop: int, fn=_keep):
    return lambda t: fn(t[start:stop])


def _halves_perm(n_heads: int, hd: int):
    """Row order that takes each head's adjacent pairs (2i, 2i+1) to halves (i, i + hd/2)."""
    import torch
    within = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    return (torch.arange(n_heads)[:, None] * hd + within).reshape(-1)


def _to_halves(n_heads: int, hd: int):
    """A (n_heads·hd, ...) tensor with its rows in rotate-half order."""
    return lambda t: t.index_select(0, _halves_perm(n_heads, hd))


def _ouro_sources(cfg: LoopedConfig) -> list[Source]:
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    out = [Source("model.embed_tokens.weight", (cfg.vocab_size, d), {"tok_embeddings.weight": _keep}),
           Source("model.norm.weight", (d,), {"loop_norm.weight": _keep}),
           Source("model.early_exit_gate.weight", (1, d), {"exit_gate.weight": _keep}),
           Source("model.early_exit_gate.bias", (1,), {"exit_gate.bias": _keep})]
    if not cfg.tie_embeddings:
        out.append(Source("lm_head.weight", (cfg.vocab_size, d), {"output.weight": _keep}))
    for i in range(cfg.n_loop_layers):
        hf, ours = f"model.layers.{i}.", f"loop.{i}."
        for name, shape, target in (
                ("self_attn.q_proj.weight", (q, d), "attention.wq.weight"),
                ("self_attn.k_proj.weight", (kv, d), "attention.wk.weight"),
                ("self_attn.v_proj.weight", (kv, d), "attention.wv.weight"),
                ("self_attn.o_proj.weight", (d, q), "attention.wo.weight"),
                ("mlp.gate_proj.weight", (f, d), "feed_forward.w1.weight"),
                ("mlp.up_proj.weight", (f, d), "feed_forward.w3.weight"),
                ("mlp.down_proj.weight", (d, f), "feed_forward.w2.weight"),
                ("input_layernorm.weight", (d,), "attention_norm.weight"),
                ("input_layernorm_2.weight", (d,), "post_attention_norm.weight"),
                ("post_attention_layernorm.weight", (d,), "ffn_norm.weight"),
                ("post_attention_layernorm_2.weight", (d,), "post_ffn_norm.weight")):
            out.append(Source(hf + name, shape, {ours + target: _keep}))
    return out


def _huginn_sources(cfg: LoopedConfig) -> list[Source]:
    d, f, hd, H = cfg.d_model, cfg.d_ff, cfg.head_dim, cfg.n_heads
    q, kv = H * hd, cfg.n_kv_heads * hd
    out = [Source("transformer.wte.weight", (cfg.vocab_size, d), {"tok_embeddings.weight": _keep}),
           Source("transformer.adapter.weight", (d, 2 * d), {"adapter.weight": _keep}),
           Source("transformer.ln_f.weight", (d,), {"norm.weight": _keep})]
    if cfg.adapter_bias:
        out.append(Source("transformer.adapter.bias", (d,), {"adapter.bias": _keep}))
    if not cfg.tie_embeddings:
        out.append(Source("lm_head.weight", (cfg.vocab_size, d), {"output.weight": _keep}))
    halves = _to_halves(H, hd)
    stacks = (("prelude", "prelude", cfg.n_prelude), ("core_block", "loop", cfg.n_loop_layers),
              ("coda", "coda", cfg.n_coda))
    for hf_stack, stack, n in stacks:
        for i in range(n):
            hf, ours = f"transformer.{hf_stack}.{i}.", f"{stack}.{i}."
            out += [Source(hf + "attn.Wqkv.weight", (q + 2 * kv, d),
                           {ours + "attention.wq.weight": _rows(0, q, halves),
                            ours + "attention.wk.weight": _rows(q, q + kv, _to_halves(cfg.n_kv_heads, hd)),
                            ours + "attention.wv.weight": _rows(q + kv, q + 2 * kv)}),
                    Source(hf + "attn.proj.weight", (d, q), {ours + "attention.wo.weight": _keep}),
                    Source(hf + "mlp.fc.weight", (2 * f, d), {ours + "feed_forward.w1.weight": _rows(0, f),
                                                              ours + "feed_forward.w3.weight": _rows(f, 2 * f)}),
                    Source(hf + "mlp.proj.weight", (d, f), {ours + "feed_forward.w2.weight": _keep})]
            if cfg.qk_bias:
                out.append(Source(hf + "attn.qk_bias", (2, 1, H, hd),
                                  {ours + "attention.q_bias": lambda t: halves(t[0].reshape(-1)),
                                   ours + "attention.k_bias": lambda t: halves(t[1].reshape(-1))}))
            for j, target in enumerate(("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm"), 1):
                out.append(Source(f"{hf}norm_{j}.weight", (d,), {f"{ours}{target}.weight": _keep}))
    return out


SOURCES = {"ouro": _ouro_sources, "huginn_raven": _huginn_sources}


def _ignored(family: str, name: str, cfg: LoopedConfig) -> bool:
    """Tensors a published directory may hold that are no weights of the model: RoPE tables
    (Huginn's freqs_cis, older rotary inv_freq buffers) and the tied head's copy."""
    if name == "freqs_cis" or name.endswith("rotary_emb.inv_freq"):
        return True
    return cfg.tie_embeddings and name == "lm_head.weight"


# -- safetensors headers -----------------------------------------------------------------------
def _header(path: str) -> dict:
    """A safetensors file's tensors: {name: {"dtype", "shape", "data_offsets"}} (no torch)."""
    header = read_header(path)
    header.pop("__metadata__", None)
    return header


def _weight_files(path: str) -> tuple[dict[str, str], dict[str, dict], str]:
    """-> (tensor name -> file, file -> header, the file that names the tensors)."""
    index = os.path.join(path, INDEX)
    single = os.path.join(path, WEIGHTS)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map: {e})") from None
        headers: dict[str, dict] = {}
        files = {}
        for name, shard in sorted(weight_map.items()):
            file = os.path.join(path, shard)
            if file not in headers:
                if not os.path.isfile(file):
                    raise CheckpointError(f"{index}: names {shard} for tensor {name!r}, and there is no such file")
                headers[file] = _header(file)
            if name not in headers[file]:
                raise CheckpointError(f"{file}: no tensor {name!r}, which {INDEX} places there")
            files[name] = file
        return files, headers, index
    if os.path.isfile(single):
        header = _header(single)
        return {name: single for name in header}, {single: header}, single
    raise CheckpointError(f"{path}: no {WEIGHTS} or {INDEX}")


def inspect(path: str | os.PathLike, max_loops: int | None = None) -> Plan:
    """Check a directory without reading its weights: config, every tensor's presence, name,
    shape and dtype. -> the Plan that `load` follows. Raises CheckpointError naming the file
    and the tensor."""
    path = os.fspath(path)
    family, cfg = read_config(path, max_loops)
    files, headers, listing = _weight_files(path)
    sources = SOURCES[family](cfg)
    wanted = {s.name for s in sources}
    unexpected = sorted(n for n in files if n not in wanted and not _ignored(family, n, cfg))
    for s in sources:
        if s.name not in files:
            hint = f"; it has {unexpected[0]!r}, which is no tensor of this model" if unexpected else ""
            raise CheckpointError(f"{listing}: missing tensor {s.name!r}{hint}")
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(f"{files[name]}: unexpected tensor {name!r} (no tensor of a {family} model "
                              f"with this {CONFIG})")
    dtypes = {}
    for s in sources:
        info = headers[files[s.name]][s.name]
        if tuple(info["shape"]) != s.shape:
            raise CheckpointError(f"{files[s.name]}: tensor {s.name!r} has shape {tuple(info['shape'])}, "
                                  f"{CONFIG} implies {s.shape}")
        if info["dtype"] not in FLOAT_DTYPES:
            raise CheckpointError(f"{files[s.name]}: tensor {s.name!r} has dtype {info['dtype']}, "
                                  f"expected a float type")
        dtypes[s.name] = info["dtype"]
    tok = os.path.join(path, TOKENIZER)
    tokenizer_json = None
    if os.path.isfile(tok):
        with open(tok, encoding="utf-8") as f:
            tokenizer_json = f.read()
    return Plan(path, family, cfg, sources, {s.name: files[s.name] for s in sources}, dtypes, tokenizer_json)


def storage_dtype(plan: Plan):
    """The torch dtype the directory stores its embedding in (what `convert` keeps by default)."""
    import torch
    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    return table[plan.dtypes[plan.sources[0].name]]


# -- loading -----------------------------------------------------------------------------------
def load(path: str | os.PathLike, device="cpu", dtype=None, max_loops: int | None = None,
         progress: Callable | None = None):
    """-> (LoopedTransformer in eval mode on `device` in `dtype`, metadata as a `.tinyloop`
    file's: config, format version and the tokenizer). dtype None: the directory's own.
    progress: wraps the iterable of source tensors (a progress bar)."""
    import torch
    from safetensors import SafetensorError, safe_open

    from tinyloop.worker.model.checkpoint import owned
    from tinyloop.worker.model.modules import LoopedTransformer

    plan = inspect(path, max_loops)
    dtype = storage_dtype(plan) if dtype is None else dtype
    with torch.device("meta"):
        model = LoopedTransformer(plan.config)
    by_file: dict[str, list[Source]] = {}
    for s in plan.sources:
        by_file.setdefault(plan.files[s.name], []).append(s)
    steps = [(file, s) for file, group in by_file.items() for s in group]
    handles = {}
    try:
        for file, s in (progress(steps) if progress else steps):
            if file not in handles:
                handles = {file: safe_open(file, framework="pt", device="cpu")}  # one file open at a time
            t = handles[file].get_tensor(s.name)
            if not torch.isfinite(t).all():
                raise CheckpointError(f"{file}: tensor {s.name!r} holds NaN or Inf")
            for target, fn in s.targets.items():
                _assign(model, target, owned(fn(t).to(device=device, dtype=dtype), t).contiguous())
            del t
    except SafetensorError as e:
        raise CheckpointError(f"{path}: corrupt safetensors data: {e}") from None
    finally:
        handles.clear()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:  # a family's table forgot a weight: a bug here, not in the directory
        raise RuntimeError(f"{path}: no source tensor for {left[:3]}")
    model.materialize_rope(device)
    return model.eval(), metadata(plan)


def metadata(plan: Plan) -> dict:
    """The directory's metadata as a `.tinyloop` file holds it: format version, config, where
    it came from and the tokenizer."""
    meta = {"tinyloop.format_version": plan.config.format_version, "tinyloop.config": plan.config.to_json(),
            "tinyloop.source": f"{plan.family}:{os.path.abspath(plan.path)}"}
    if plan.tokenizer_json is not None:
        meta["tinyloop.tokenizer"] = plan.tokenizer_json
    return meta


def _assign(model, name: str, tensor) -> None:
    import torch.nn as nn
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def check(path: str | os.PathLike, max_loops: int | None = None) -> None:
    """What a service checks before it starts a worker, without torch: a directory in full
    (`inspect`), a file's existence (its worker reads and checks the rest)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        inspect(path, max_loops)
    elif not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint file or model directory")
