"""The looped transformer: weights and the per-layer math.

    embed -> prelude[0..n_prelude) -> (loop block) x L -> coda[0..n_coda) -> norm -> head

A layer never owns its attention: it is handed an `attend(q, k, v)` callable. The training
path passes causal attention over the sequence; the engine passes one that writes the K/V
cache layer and reads it back. Same math, one definition.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinyloop.kernels.gemv import argmax_key_ref
from tinyloop.kernels.rope import apply_rope_ref
from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.model.latent import truncated_normal

def l2_keep(nbytes: dict[str, int], budget: float) -> frozenset[str]:
    """The loop block's projections kept in L2, given each one's weight bytes summed over the
    block's layers: the largest first, each one that still fits the budget."""
    keep, total = set(), 0
    for name, n in sorted(nbytes.items(), key=lambda item: -item[1]):
        if total + n <= budget:
            keep.add(name)
            total += n
    return frozenset(keep)


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    """The L2 cache's size on a CUDA device; 0 elsewhere (nothing to keep a weight in)."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0

# attend(q (B,T,H,hd), k (B,T,Hkv,hd), v (B,T,Hkv,hd)) -> (B,H,T,hd). It receives the raw
# projections and applies RoPE itself, so that the GPU path can fuse RoPE with the cache write.
# An attend with `needs_h` true (a store-h cache, runner/hattend.py) is called attend(q, k, v, h)
# with h (B,T,D), the normalized input the projections were computed from.
Attend = Callable[..., torch.Tensor]


def needs_h(attend: Attend) -> bool:
    return getattr(attend, "needs_h", False)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ weight.T; on CPU a batched decode step (x (B, 1, in), B > 1) runs row by row.

    CPU BLAS picks its kernel by the number of rows M, so the rows of one (B, in) GEMM differ
    in the last bits from the same rows run alone (M = 1). A bmm of B (1, in) x (in, out)
    products runs the M = 1 kernel for every lane, so a lane of a batched decode step is
    bitwise the step it would take alone (tests/worker/test_batcher.py checks the logits).
    Not on CUDA: there a row-wise bmm would read the weight once per lane, and a batched
    decode is bandwidth-bound on exactly those reads.

    A weight that is not a tensor (quant.QuantWeight, GPTQ's calibration recorder) computes
    the product itself."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x)
    if x.is_cpu and x.dim() == 3 and x.shape[0] > 1 and x.shape[1] == 1:
        return torch.bmm(x, weight.t().expand(x.shape[0], -1, -1))  # (B, 1, out)
    return F.linear(x, weight)


class RMSNorm(nn.Module):
    kernel = None  # a fused `rms_norm(x, weight, eps)` (Triton on CUDA); None: the torch ops below

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): with the kernel, one launch (the sum rounds as
        the unfused add does, so both are bitwise the ops below)."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual=residual)
        h = x + residual
        return self(h), h

    def added_to(self, skip: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """skip + norm(x), a sandwich-norm layer's post-norm and residual add: with the kernel,
        one launch (bitwise the kernel's norm, then the add)."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, skip=skip)
        return skip + self(x)


class Attention(nn.Module):
    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        hd = cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)
        if cfg.qk_bias:
            # Huginn's: added to q and k after the projection, before RoPE
            self.q_bias = nn.Parameter(torch.zeros(cfg.n_heads * hd))
            self.k_bias = nn.Parameter(torch.zeros(cfg.n_kv_heads * hd))

    def fuse(self) -> None:
        """One (q|k|v) projection for inference: a single larger GEMV per layer instead of
        three. wq/wk/wv become views into the fused weight, so nothing is stored twice."""
        if not isinstance(self.wq.weight, torch.Tensor):  # quantized: row blocks of the fused weight
            self.wqkv = type(self.wq.weight).cat([self.wq.weight, self.wk.weight, self.wv.weight])
            self.wq.weight, self.wk.weight, self.wv.weight = self.wqkv.split(self._sizes())
            return
        w = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight]).detach()
        self.wqkv = w
        self.wq.weight.data, self.wk.weight.data, self.wv.weight.data = w.split(self._sizes())
        if hasattr(self, "q_bias"):
            # the fused projection's bias: v has none (one add after the GEMV, no kernel of its own)
            self.qkv_bias = torch.cat([self.q_bias, self.k_bias, self.k_bias.new_zeros(self._sizes()[2])]).detach()

    def biased(self, qkv: torch.Tensor) -> torch.Tensor:
        """The fused projection (..., (H + 2·Hkv)·hd) plus the q/k bias, if the model has one."""
        return qkv + self.qkv_bias if hasattr(self, "qkv_bias") else qkv

    def _sizes(self) -> list[int]:
        return [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        if hasattr(self, "wqkv"):
            q, k, v = self.biased(linear(x, self.wqkv)).split(self._sizes(), -1)
        else:
            q, k, v = linear(x, self.wq.weight), linear(x, self.wk.weight), linear(x, self.wv.weight)
            if hasattr(self, "q_bias"):
                q, k = q + self.q_bias, k + self.k_bias
        return linear(self.attend(q, k, v, attend, x), self.wo.weight)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend,
               h: torch.Tensor | None = None) -> torch.Tensor:
        """Projected q (B, T, H·hd), k / v (B, T, Hkv·hd) of the normalized input h (B, T, D)
        -> attention output (B, T, H·hd)."""
        B, T, _ = q.shape
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        out = attend(q, k, v, h) if needs_h(attend) else attend(q, k, v)  # (B, H, T, hd)
        return out.transpose(1, 2).reshape(B, T, -1)


class FeedForward(nn.Module):
    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)  # up
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)  # down

    def fuse(self) -> None:
        """One (gate|up) projection for inference; w1/w3 become views into it."""
        if not isinstance(self.w1.weight, torch.Tensor):  # quantized, as Attention.fuse
            self.w13 = type(self.w1.weight).cat([self.w1.weight, self.w3.weight])
            self.w1.weight, self.w3.weight = self.w13.split([self.w1.weight.shape[0]] * 2)
            return
        w = torch.cat([self.w1.weight, self.w3.weight]).detach()
        self.w13 = w
        self.w1.weight.data, self.w3.weight.data = w.chunk(2)

    swiglu = None  # a fused `swiglu(gate, up)` (Triton on CUDA); None: F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "w13"):
            gate, up = linear(x, self.w13).chunk(2, -1)
        else:
            gate, up = linear(x, self.w1.weight), linear(x, self.w3.weight)
        act = F.silu(gate) * up if self.swiglu is None else self.swiglu(gate, up)
        return linear(act, self.w2.weight)


class Block(nn.Module):
    """Pre-norm (Llama), sandwich-norm (a norm before and after each sublayer, the second on
    its output: Ouro) or sandwich_sum (the second on the residual sum: Huginn) layer. The
    modules keep one set of names: attention_norm / ffn_norm before the sublayers,
    post_attention_norm / post_ffn_norm after them."""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.sandwich = cfg.norm == "sandwich"
        self.sum_norm = cfg.norm == "sandwich_sum"
        if cfg.norm != "pre":
            self.post_attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.post_ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    gemv = None  # the fused projection of up to gemv_rows rows (kernels/gemv.py) on CUDA; None: the ops below
    gemv_rows = 0
    invariant = False  # every pass through token_step, the batch-1 step's kernels (Settings.batch_invariant)
    loop_layers = 0  # in the shared block: its layer count (LoopedTransformer sets it); 0 elsewhere
    l2_keep_fraction = 0.0  # use_fast_path sets both (Settings); no fast path: nothing kept, nothing hinted
    l2_stream = ""
    _l2_kept: frozenset[str] | None = None  # l2_keep's pick

    def projections(self) -> dict[str, torch.Tensor]:
        """The decode step's four projection weights (after fuse()), by name."""
        att, ffn = self.attention, self.feed_forward
        return {"wqkv": att.wqkv, "wo": att.wo.weight, "w13": ffn.w13, "w2": ffn.w2.weight}

    def eviction(self, name: str) -> str:
        """The L2 eviction policy of projection `name`'s weight in a decode step: "evict_last"
        for the shared block's projections `l2_keep` picks within l2_keep_fraction of the
        device's L2, l2_stream for the rest. The pick is worked out once (an eager step asks
        four times a layer)."""
        if not self.loop_layers:
            return self.l2_stream
        if self._l2_kept is None:
            weights = self.projections()
            budget = self.l2_keep_fraction * l2_bytes(weights["wo"].device)
            nbytes = {n: w.nbytes * self.loop_layers for n, w in weights.items()}  # (quantized: packed bytes)
            self._l2_kept = l2_keep(nbytes, budget)
        return "evict_last" if name in self._l2_kept else self.l2_stream

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        if self.gemv is not None and (self.invariant or (x.shape[1] == 1 and x.shape[0] <= self.gemv_rows)):
            return self.token_step(x, attend)
        a = self.attention(self.attention_norm(x), attend)
        if self.sum_norm:
            x = self.post_attention_norm.add(a, x)[0]
            return self.post_ffn_norm.add(self.feed_forward(self.ffn_norm(x)), x)[0]
        if self.sandwich:
            a = self.post_attention_norm(a)
        h, x = self.ffn_norm.add(a, x)  # x + a and its norm
        f = self.feed_forward(h)
        if self.sandwich:
            return self.post_ffn_norm.added_to(x, f)
        return x + f

    def token_step(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        """forward() for one token per lane (x (B, 1, D), a decode step of one stream or a
        batched one; with `invariant`, any (B, T, D): every row as the batch-1 step computes it)
        in four fused projections, each reading its weight once for all lanes:
        the input norms ride in the
        (q|k|v) and (gate|up) projections, SiLU·up in the latter's epilogue, and the residual
        adds in the epilogues of wo and w2 (sandwich norm's post-norms need the whole projected
        row before the add: one launch each after the projection, the add fused in)."""
        att, ffn, gemv, ev = self.attention, self.feed_forward, self.gemv, self.eviction
        qkv = gemv(x, att.wqkv, norm_weight=self.attention_norm.weight, eps=self.attention_norm.eps,
                   eviction_policy=ev("wqkv"))
        # the projection norms its input itself; a store-h cache needs that input as a tensor
        h = self.attention_norm(x) if needs_h(attend) else None
        out = att.attend(*att.biased(qkv).split(att._sizes(), -1), attend, h)
        if self.sum_norm:
            # the post-norms read the residual sums: each one launch after its projection
            x = self.post_attention_norm.add(gemv(out, att.wo.weight, eviction_policy=ev("wo")), x)[0]
            h = gemv(x, ffn.w13, norm_weight=self.ffn_norm.weight, eps=self.ffn_norm.eps, swiglu=True,
                     eviction_policy=ev("w13"))
            return self.post_ffn_norm.add(gemv(h, ffn.w2.weight, eviction_policy=ev("w2")), x)[0]
        if self.sandwich:
            x = self.post_attention_norm.added_to(x, gemv(out, att.wo.weight, eviction_policy=ev("wo")))
        else:
            x = gemv(out, att.wo.weight, residual=x, eviction_policy=ev("wo"))
        h = gemv(x, ffn.w13, norm_weight=self.ffn_norm.weight, eps=self.ffn_norm.eps, swiglu=True,
                 eviction_policy=ev("w13"))
        if self.sandwich:
            return self.post_ffn_norm.added_to(x, gemv(h, ffn.w2.weight, eviction_policy=ev("w2")))
        return gemv(h, ffn.w2.weight, residual=x, eviction_policy=ev("w2"))


class LoopedTransformer(nn.Module):
    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude))
        self.loop = nn.ModuleList(Block(cfg) for _ in range(cfg.n_loop_layers))
        for layer in self.loop:
            layer.loop_layers = cfg.n_loop_layers
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        # weight variants of the shared block by iteration: iteration i runs loop_variants[i %
        # len] (quantized rounding that alternates across iterations, quant_checkpoint.py);
        # empty: every iteration runs `loop`. Runtime state, never in a checkpoint.
        self.loop_variants: list[nn.ModuleList] = []
        self.loop_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.loop_final_norm else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.final_norm else None
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # input injection: s = adapter(concat(s, e)) before each iteration (Huginn)
        self.adapter = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=cfg.adapter_bias) if cfg.inject else None
        # Ouro's early-exit gate: read by the `gate` exit rule (runner/early_exit.py), by no stage
        self.exit_gate = nn.Linear(cfg.d_model, 1) if cfg.exit_gate else None
        # a runtime option, not part of the checkpoint: the initial state's std is
        # config.init_std * init_scale (0: the zero state)
        self.init_scale = 1.0
        # fp32 RoPE, kept as int32 bit patterns: Module.to(dtype) casts floating buffers only, and
        # the checkpoint loader moves the model to the serving dtype (a bf16 inv_freq puts the
        # angle of position 1000 up to 1.2 rad off at hd 128). Not persistent: not in checkpoints.
        for name, t in self._rope_tables().items():
            self.register_buffer(f"{name}_bits", t.view(torch.int32), persistent=False)

    def _rope_tables(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        cfg = self.config
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64,
                                                          device=device) / cfg.head_dim))
        inv_freq = inv_freq.float()
        angles = torch.arange(cfg.max_seq_len, device=device).float()[:, None] * inv_freq  # (max_seq_len, hd/2)
        return {"inv_freq": inv_freq, "rope_cos": angles.cos(), "rope_sin": angles.sin()}

    def materialize_rope(self, device: torch.device | str) -> None:
        """The RoPE tables on `device`: a model built on the meta device (to be filled tensor
        by tensor from a file) has none yet. Computed on the CPU and copied, so that every
        device holds the same tables bit for bit (a GPU's cos / sin round differently)."""
        for name, t in self._rope_tables("cpu").items():
            setattr(self, f"{name}_bits", t.to(device).view(torch.int32))

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """GPT-2 style init: N(0, std), output projections scaled down by depth."""
        cfg = self.config
        depth = cfg.n_prelude + cfg.n_loop_layers * cfg.default_loops + cfg.n_coda
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
                continue
            s = std / (2 * depth) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=generator) * s)

    def use_fast_path(self, rms_norm, gemv=None, gemv_rows: int = 1, swiglu=None, l2_keep_fraction: float = 0.7,
                      l2_stream: str = "evict_first", invariant: bool = False) -> None:
        """Inference on CUDA: fused projections, a fused RMSNorm kernel (with the residual add
        before the feed-forward norm), a fused SwiGLU and, given `gemv`, decode steps of up to
        `gemv_rows` lanes in fused projections (fewer, larger launches: decode of a small model
        is bound by launches as much as by weight reads), their weight loads hinted for L2 as
        `Block.eviction` says (settings.Settings: l2_keep_fraction, l2_stream). invariant (with
        `gemv` in its batch-invariant form): every pass, of any batch and chunk size, runs the
        fused projections row by row as a batch-1 decode step does (Settings.batch_invariant)."""
        if invariant and gemv is None:
            raise ValueError("invariant runs every pass through the fused projection: give gemv")
        self.gemv, self.gemv_rows = gemv, gemv_rows if gemv is not None else 0
        self.invariant = invariant
        self.l2_stream = l2_stream
        for m in [*self.modules(), *(m for variant in self.loop_variants for m in variant.modules())]:
            if isinstance(m, (Attention, FeedForward)):
                m.fuse()
                if isinstance(m, FeedForward):
                    m.swiglu = swiglu
            elif isinstance(m, RMSNorm):
                m.kernel = rms_norm
            elif isinstance(m, Block):
                m.gemv, m.gemv_rows, m.invariant = self.gemv, self.gemv_rows, invariant
                m.l2_keep_fraction, m.l2_stream, m._l2_kept = l2_keep_fraction, l2_stream, None

    def use_gemv(self, gemv) -> None:
        """The fast path's fused projections (every block's and the head's) on another launcher,
        rows and options as they are: bench/tiles.py hands the model gemv bound to the tiles it
        tries (an explicit argument of each launch)."""
        if self.gemv is None:
            raise ValueError("use_gemv replaces the fast path's projection launcher: call use_fast_path first")
        self.gemv = gemv
        for m in [*self.modules(), *(m for variant in self.loop_variants for m in variant.modules())]:
            if isinstance(m, Block):
                m.gemv = gemv

    @property
    def inv_freq(self) -> torch.Tensor:
        """(hd/2,) fp32 rotation frequencies."""
        return self.inv_freq_bits.view(torch.float32)

    @property
    def rope_cos(self) -> torch.Tensor:
        """(max_seq_len, hd/2) fp32: row p is cos(p * inv_freq), computed once at init."""
        return self.rope_cos_bits.view(torch.float32)

    @property
    def rope_sin(self) -> torch.Tensor:
        """(max_seq_len, hd/2) fp32: row p is sin(p * inv_freq)."""
        return self.rope_sin_bits.view(torch.float32)

    def rope_rows(self, positions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int, every one in [0, bound) -> cos, sin (B, T, hd/2) fp32.

        Rows of the tables, so that every path (prefill, decode, the full forward) rotates by the
        same values: torch's CPU cos / sin can differ in the last bit between the vectorized and
        the scalar loop, so the same angle computed in two tensor shapes need not agree. Past the
        tables (bound > max_seq_len; no cache holds such positions) they are computed."""
        if bound <= self.rope_cos.shape[0]:
            return self.rope_cos[positions], self.rope_sin[positions]
        ang = positions.to(torch.float32)[..., None] * self.inv_freq
        return ang.cos(), ang.sin()

    def embedded(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding table -> the prelude's input (scaled, as Huginn's are)."""
        scale = self.config.embed_scale
        return x if scale == 1.0 else x * scale

    def initial_state(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The latent state entering the first iteration of an input-injection model: seeds
        (B,), positions (B, T) -> (B, T, D) in the weights' dtype. A truncated normal of std
        init_std · init_scale (then times embed_scale, as the reference scales it), drawn from
        the counter-based stream (latent.py); zeros when that std is 0."""
        cfg = self.config
        dtype = self.tok_embeddings.weight.dtype
        std = cfg.init_std * self.init_scale
        if std == 0:
            return torch.zeros(*positions.shape, cfg.d_model, dtype=dtype, device=positions.device)
        return (truncated_normal(seeds, positions, cfg.d_model) * (std * cfg.embed_scale)).to(dtype)

    def loop_input(self, e: torch.Tensor, seeds: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """The prelude's output e (B, T, D) -> the residual entering iteration 0: e itself, or
        with input injection (initial state | e) (B, T, 2D). seeds None: seed 0 for every row."""
        if not self.config.inject:
            return e
        if seeds is None:
            seeds = torch.zeros(e.shape[0], dtype=torch.long, device=e.device)
        return torch.cat([self.initial_state(seeds, positions), e], -1)

    def iteration(self, x: torch.Tensor, attends: list[Attend], index: int = 0) -> torch.Tensor:
        """Iteration `index` of the shared block (all its layers), plus the per-loop norm. With
        input injection x is (state | e): the adapter of that concatenation starts the
        iteration, and e rides along unchanged. The index picks the block's weight variant
        (loop_variants); a host int, so a captured stage of iteration i holds its variant."""
        e = None
        if self.adapter is not None:
            e = x[..., self.config.d_model:]
            # (invariant: the fused projection, row by row as a decode step runs it)
            x = self.gemv(x, self.adapter.weight) if self.invariant else linear(x, self.adapter.weight)
            if self.adapter.bias is not None:
                x = x + self.adapter.bias
        loop = self.loop_variants[index % len(self.loop_variants)] if self.loop_variants else self.loop
        for layer, attend in zip(loop, attends):
            x = layer(x, attend)
        if self.loop_norm is not None:
            x = self.loop_norm(x)
        return x if e is None else torch.cat([x, e], -1)

    def exit_loop(self, x: torch.Tensor) -> torch.Tensor:
        """The residual after the last iteration -> the coda's input: the latent state alone,
        normed where the model norms it before its coda (Huginn's ln_f)."""
        if self.config.inject:
            x = x[..., :self.config.d_model]
        return self.norm(x) if self.config.exit_norm else x

    def state(self, x: torch.Tensor) -> torch.Tensor:
        """The model-width part of a residual (what a trace or a norm check looks at)."""
        return x[..., :self.config.d_model]

    gemv = None  # see Block.gemv
    gemv_rows = 0
    invariant = False  # see Block.invariant
    l2_stream = ""

    def logits(self, x: torch.Tensor, dtype: torch.dtype | None = None,
               argmax_key: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and the head; dtype: the logits' (default x's), float32 written by the
        fused projection itself on the decode path (no conversion kernel). argmax_key (one
        token, x (1, 1, D)): a (1,) int64 tensor maxed with the key of the logits' argmax
        (kernels.gemv's `argmax_key`; in the fused projection's epilogue on the decode path)."""
        head = self.tok_embeddings.weight if self.output is None else self.output.weight
        norm = self.norm
        if self.gemv is not None and (self.invariant or (x.shape[1] == 1 and x.shape[0] <= self.gemv_rows)):
            return self.gemv(x, head, norm_weight=None if norm is None else norm.weight,
                             eps=1e-6 if norm is None else norm.eps, out_dtype=dtype,
                             argmax_key=argmax_key, eviction_policy=self.l2_stream)
        y = linear(x if norm is None else norm(x), head)
        if argmax_key is not None:
            if x.shape[:2] != (1, 1):
                raise ValueError(f"argmax_key takes the logits of one token, got x of shape {tuple(x.shape)}")
            torch.maximum(argmax_key, argmax_key_ref(y).view(1), out=argmax_key)
        return y if dtype is None else y.to(dtype)

    def forward(self, tokens: torch.Tensor, loops: int, window: int = 0,
                seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Full causal forward with no cache: training, and the recompute the tests compare to.
        window > 0: each position sees only the last `window` positions. seeds (B,): the
        initial latent state's seeds (input injection only; None: 0).

        tokens (B, T) -> logits (B, T, vocab)."""
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device)
        cos, sin = self.rope_rows(pos.expand(B, T), T)
        mask = None
        if window:
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # (T, T)

        def attend(q, k, v):
            q, k = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                  enable_gqa=k.shape[1] != q.shape[1])

        x = self.embedded(self.tok_embeddings(tokens))
        for layer in self.prelude:
            x = layer(x, attend)
        x = self.loop_input(x, seeds, pos.expand(B, T))
        for i in range(loops):
            x = self.iteration(x, [attend] * len(self.loop), i)
        x = self.exit_loop(x)
        for layer in self.coda:
            x = layer(x, attend)
        return self.logits(x)
