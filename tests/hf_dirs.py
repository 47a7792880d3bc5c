"""Tiny random Hugging Face model directories in the published layouts: Ouro
(ByteDance/Ouro-1.4B's config.json keys and tensor names) and Huginn (huginn-0125's), unsharded
or sharded with a model.safetensors.index.json, with a small byte-level BPE tokenizer.json."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

EOS = "<|endoftext|>"
CORPUS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
          "The loop runs the same block again and again, deeper each time.",
          "print('hello world')  # héllo wörld, ünïcode"]
VOCAB = 320


def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def ouro_config(n_kv_heads: int = 4, **over) -> dict:
    cfg = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": n_kv_heads, "hidden_act": "silu", "max_position_embeddings": 128,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
           "total_ut_steps": 4, "early_exit_threshold": 1.0, "use_sliding_window": False,
           "sliding_window": None, "max_window_layers": 2, "layer_types": ["full_attention"] * 2,
           "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
           "use_cache": True, "attention_dropout": 0.0, "initializer_range": 0.02}
    cfg.update(over)
    return cfg


def ouro_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, H = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    hd, kv = d // H, cfg["num_key_value_heads"] * (d // H)

    def rnd(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def norm_w(n):  # around 1, not 1: a norm read in the wrong place shows
        return 1 + rnd(n, std=0.2)
    w = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], d, std=0.5), "model.norm.weight": norm_w(d),
         "model.early_exit_gate.weight": rnd(1, d), "model.early_exit_gate.bias": rnd(1),
         "lm_head.weight": rnd(cfg["vocab_size"], d, std=0.3)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rnd(H * hd, d, std=0.3), p + "self_attn.k_proj.weight": rnd(kv, d, std=0.3),
              p + "self_attn.v_proj.weight": rnd(kv, d), p + "self_attn.o_proj.weight": rnd(d, H * hd),
              p + "mlp.gate_proj.weight": rnd(f, d), p + "mlp.up_proj.weight": rnd(f, d),
              p + "mlp.down_proj.weight": rnd(d, f)}
        for n in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            w[f"{p}{n}.weight"] = norm_w(d)
    return w


def huginn_config(**over) -> dict:
    d = 64
    cfg = {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven", "n_embd": d, "n_heads": 4,
           "n_layers": 4, "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 1,
           "num_key_value_heads": 4, "intermediate_size": 96, "block_size": 128, "vocab_size": VOCAB,
           "padded_vocab_size": VOCAB, "padding_multiple": 64, "tie_embeddings": True, "tie_word_embeddings": True,
           "bias": False, "qk_bias": True, "architecture_class_name": "RecurrentGPT",
           "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6,
           "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "init_strategy": "takase",
           "init_orthogonal": False, "state_init": "like-init", "injection_type": "linear",
           "mean_recurrence": 4, "mean_backprop_depth": 2, "sampling_scheme": "poisson-lognormal-filling",
           "rope_base": 50000, "activation_checkpoint_impl": "per-iteration",
           "init_values": {"std": math.sqrt(2 / (5 * d)), "out_proj": 0.01, "embedding": math.sqrt(2 / (5 * d)),
                           "embed_scale": math.sqrt(d)},
           "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "float32"}
    cfg.update(over)
    return cfg


def huginn_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, H = cfg["n_embd"], cfg["intermediate_size"], cfg["n_heads"]

    def rnd(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    w = {"transformer.wte.weight": rnd(cfg["vocab_size"], d, std=0.05),
         "transformer.adapter.weight": rnd(d, 2 * d, std=0.1), "transformer.ln_f.weight": 1 + rnd(d, std=0.2),
         "freqs_cis": torch.zeros(1, cfg["block_size"], 1, d // H // 2, 2)}  # a persistent buffer in the files
    if cfg.get("bias"):
        w["transformer.adapter.bias"] = rnd(d)
    stacks = (("prelude", cfg["n_layers_in_prelude"]), ("core_block", cfg["n_layers_in_recurrent_block"]),
              ("coda", cfg["n_layers_in_coda"]))
    for stack, n in stacks:
        for i in range(n):
            p = f"transformer.{stack}.{i}."
            w |= {p + "attn.Wqkv.weight": rnd(3 * d, d, std=0.3), p + "attn.qk_bias": rnd(2, 1, H, d // H, std=0.3),
                  p + "attn.proj.weight": rnd(d, d), p + "mlp.fc.weight": rnd(2 * f, d),
                  p + "mlp.proj.weight": rnd(d, f)}
            for j in range(1, 5):
                w[f"{p}norm_{j}.weight"] = 1 + rnd(d, std=0.2)
    return w


def write_dir(path: Path, cfg: dict, tensors: dict[str, torch.Tensor], shards: int = 1,
              tokenizer: bool = True) -> Path:
    """The directory as published: config.json, weights (one file or `shards` shards with an
    index), tokenizer.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer:
        (path / "tokenizer.json").write_text(tokenizer_json())
    names = list(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, path / "model.safetensors", metadata={"format": "pt"})
        return path
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n].contiguous() for n in part}, path / shard, metadata={"format": "pt"})
        weight_map |= {n: shard for n in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    return path
