"""An independent reference of the two Hugging Face model families, in plain torch with no
cache: every call recomputes the whole sequence. It reads the published tensor names and
config.json keys directly, and follows the published remote code's math step by step
(Ouro: modeling_ouro.py; Huginn: recpre/raven_modeling_minimal.py), including the parts the
engine does differently (Huginn's adjacent-pair RoPE, its fused Wqkv and qk_bias layout, the
GatedMLP's fused fc). Nothing here imports the engine.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, H, T, hd), k / v (B, Hkv, T, hd): explicit softmax(q·k / sqrt(hd)) v, causal."""
    H, Hkv, T, hd = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), -1).to(q.dtype) @ v


# -- Ouro --------------------------------------------------------------------------------------
def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), -1)


def ouro_logits(w: dict[str, torch.Tensor], cfg: dict, tokens: list[int], ut_steps: int) -> torch.Tensor:
    """-> logits (T, V) of the tokens after `ut_steps` passes through all decoder layers."""
    d, H = cfg["hidden_size"], cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads", H)
    hd, eps = d // H, cfg["rms_norm_eps"]
    T = len(tokens)
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()                                   # (T, hd)
    x = w["model.embed_tokens.weight"][torch.tensor(tokens)][None]    # (1, T, d)
    for _ in range(ut_steps):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(1, T, H, hd).transpose(1, 2)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(1, T, Hkv, hd).transpose(1, 2)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(1, T, Hkv, hd).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            a = causal_attention(q, k, v).transpose(1, 2).reshape(1, T, H * hd) @ w[p + "self_attn.o_proj.weight"].T
            x = x + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
            m = (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
            x = x + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
        x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return (x @ head.T)[0]


# -- Huginn ------------------------------------------------------------------------------------
def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, hd), cos / sin (T, hd/2): rotate the adjacent pairs (2i, 2i+1) by angle i."""
    r = x.unflatten(-1, (-1, 2)).float()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack([r[..., 0] * c - r[..., 1] * s, r[..., 1] * c + r[..., 0] * s], -1)
    return out.flatten(3).type_as(x)


def _huginn_block(w, p: str, x, cfg, cos, sin):
    d, H = cfg["n_embd"], cfg["n_heads"]
    hd, eps, T = d // H, cfg.get("norm_eps", 1e-6), x.shape[1]
    h = rms_norm(x, w[p + "norm_1.weight"], eps)
    q, k, v = (h @ w[p + "attn.Wqkv.weight"].T).split([d, d, d], -1)
    q, k, v = q.view(1, T, H, hd), k.view(1, T, H, hd), v.view(1, T, H, hd)
    if cfg.get("qk_bias", True):
        qb, kb = w[p + "attn.qk_bias"].split(1, 0)
        q, k = q + qb, k + kb
    q, k = _rope_pairs(q, cos, sin), _rope_pairs(k, cos, sin)
    a = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    a = a.transpose(1, 2).reshape(1, T, d) @ w[p + "attn.proj.weight"].T
    x = rms_norm(a + x, w[p + "norm_2.weight"], eps)
    g, u = (rms_norm(x, w[p + "norm_3.weight"], eps) @ w[p + "mlp.fc.weight"].T).chunk(2, -1)
    return rms_norm((F.silu(g) * u) @ w[p + "mlp.proj.weight"].T + x, w[p + "norm_4.weight"], eps)


def huginn_logits(w: dict[str, torch.Tensor], cfg: dict, tokens: list[int], num_steps: int,
                  state: torch.Tensor) -> torch.Tensor:
    """-> logits (T, V) after `num_steps` recurrences from the initial latent state (T, d)."""
    d, H = cfg["n_embd"], cfg["n_heads"]
    hd, eps, T = d // H, cfg.get("norm_eps", 1e-6), len(tokens)
    init = cfg.get("init_values") or {}
    embed_scale = init.get("embed_scale", math.sqrt(d))
    inv_freq = 1.0 / (cfg.get("rope_base", 50000) ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    e = w["transformer.wte.weight"][torch.tensor(tokens)][None] * embed_scale
    for i in range(cfg["n_layers_in_prelude"]):
        e = _huginn_block(w, f"transformer.prelude.{i}.", e, cfg, cos, sin)
    x = state[None].to(e.dtype)
    for _ in range(num_steps):
        x = torch.cat([x, e], -1) @ w["transformer.adapter.weight"].T
        if "transformer.adapter.bias" in w:
            x = x + w["transformer.adapter.bias"]
        for i in range(cfg["n_layers_in_recurrent_block"]):
            x = _huginn_block(w, f"transformer.core_block.{i}.", x, cfg, cos, sin)
    x = rms_norm(x, w["transformer.ln_f.weight"], eps)
    for i in range(cfg["n_layers_in_coda"]):
        x = _huginn_block(w, f"transformer.coda.{i}.", x, cfg, cos, sin)
    x = rms_norm(x, w["transformer.ln_f.weight"], eps)
    return (x @ w["transformer.wte.weight"].T)[0]


def greedy(logits_of, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after the prompt, each from a full recompute: logits_of(tokens) (T, V)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(logits_of(tokens)[-1].argmax()))
    return tokens
