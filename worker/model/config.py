"""`LoopedConfig`: the shape of a weight-shared looped transformer, and the presets."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

# pre: norm before each sublayer (Llama). sandwich: also a norm on each sublayer's output before
# the residual add (Ouro, Gemma 2). sandwich_sum: the second norm on the residual sum instead,
# x = norm(x + f(norm(x))) (Huginn's SandwichBlock).
NORM_PLACEMENTS = ("pre", "sandwich", "sandwich_sum")

# Fields added after format version 1: a config that leaves them all at their defaults is a
# version-1 model, and its checkpoint is written as version 1 (readable by older code).
V2_FIELDS = ("final_norm", "exit_norm", "inject", "adapter_bias", "embed_scale", "init_std", "qk_bias",
             "exit_gate")


@dataclass(frozen=True)
class LoopedConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    n_prelude: int = 1
    n_loop_layers: int = 1
    n_coda: int = 1
    norm: str = "pre"
    loop_final_norm: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    default_loops: int = 4
    max_loops: int = 16
    max_seq_len: int = 2048
    bos_id: int = -1
    eos_id: int = -1
    # final_norm: `norm` before the head. Ouro has none of its own: its last iteration's loop
    # norm is the state the head reads.
    final_norm: bool = True
    # exit_norm: `norm` (the same weight) also between the last iteration and the coda, as
    # Huginn applies ln_f to the recurrent state before its coda.
    exit_norm: bool = False
    # inject: Huginn's input injection. The loop carries a latent state s beside the prelude's
    # output e; each iteration starts with s = adapter(concat(s, e)). s starts as a truncated
    # normal of std init_std (times the runtime's init_scale) and times embed_scale.
    inject: bool = False
    adapter_bias: bool = False
    embed_scale: float = 1.0   # the embeddings are multiplied by it before the prelude
    init_std: float = 0.0
    qk_bias: bool = False      # a learned bias on q and k (before RoPE)
    exit_gate: bool = False    # Ouro's early-exit gate, Linear(d -> 1) with bias: the `gate` exit rule's

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"LoopedConfig: {msg}")

        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "d_ff", "n_loop_layers",
                     "max_loops", "max_seq_len", "default_loops"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_prelude", "n_coda"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.d_model % self.n_heads == 0,
             f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        need(self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be even for RoPE")
        need(self.norm in NORM_PLACEMENTS, f"norm must be one of {NORM_PLACEMENTS}, got {self.norm!r}")
        need(self.default_loops <= self.max_loops,
             f"default_loops ({self.default_loops}) exceeds max_loops ({self.max_loops})")
        for name in ("bos_id", "eos_id"):
            v = getattr(self, name)
            need(-1 <= v < self.vocab_size, f"{name} ({v}) outside the vocabulary")
        need(self.embed_scale > 0, f"embed_scale must be > 0, got {self.embed_scale}")
        need(self.init_std >= 0, f"init_std must be >= 0, got {self.init_std}")
        need(not (self.adapter_bias or self.init_std) or self.inject,
             "adapter_bias and init_std describe input injection: they need inject=True")
        need(not self.exit_norm or self.final_norm, "exit_norm reuses the final norm: it needs final_norm=True")

    @property
    def residual_width(self) -> int:
        """Width of the residual the loop carries between stages: d_model, or with input
        injection the latent state and the prelude's output side by side (2·d_model), so every
        stage that saves or hands on a residual (resume handles, speculative drafts, batches)
        carries both."""
        return 2 * self.d_model if self.inject else self.d_model

    @property
    def format_version(self) -> str:
        """"1" when no field added since version 1 leaves its default, else "2"."""
        default = LoopedConfig.__dataclass_fields__
        return "2" if any(getattr(self, f) != default[f].default for f in V2_FIELDS) else "1"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_cache_layers(self, max_loops: int | None = None) -> int:
        """Cache layers for prelude + `max_loops` iterations of the block + coda."""
        loops = self.max_loops if max_loops is None else max_loops
        return self.n_prelude + loops * self.n_loop_layers + self.n_coda

    def loop_layer_index(self, iteration: int, j: int) -> int:
        return self.n_prelude + iteration * self.n_loop_layers + j

    def coda_layer_index(self, j: int, max_loops: int | None = None) -> int:
        loops = self.max_loops if max_loops is None else max_loops
        return self.n_prelude + loops * self.n_loop_layers + j

    def layer_matmul_params(self) -> int:
        """The weights of one layer's projections: q, k, v, o and the SwiGLU MLP's three."""
        d, hd = self.d_model, self.head_dim
        return d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2 + 3 * d * self.d_ff

    def n_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        layer = self.layer_matmul_params() + (2 if self.norm == "pre" else 4) * d
        layer += (self.n_heads + self.n_kv_heads) * hd if self.qk_bias else 0
        n_layers = self.n_prelude + self.n_loop_layers + self.n_coda
        head = 0 if self.tie_embeddings else self.vocab_size * d
        extra = (d if self.loop_final_norm else 0) + (d if self.final_norm else 0)
        extra += (2 * d * d + (d if self.adapter_bias else 0)) if self.inject else 0
        extra += d + 1 if self.exit_gate else 0
        return self.vocab_size * d + n_layers * layer + extra + head

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "LoopedConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"LoopedConfig: unknown fields {unknown}")
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "LoopedConfig":
        return cls.from_dict(json.loads(s))


PRESETS: dict[str, LoopedConfig] = {
    # Fast enough for every CPU test; GQA, prelude and coda all present.
    "tiny": LoopedConfig(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, d_ff=160,
                         n_prelude=1, n_loop_layers=1, n_coda=1, default_loops=4, max_loops=32),
    "small": LoopedConfig(vocab_size=256, d_model=256, n_heads=8, n_kv_heads=4, d_ff=704,
                          n_prelude=1, n_loop_layers=2, n_coda=1, default_loops=8, max_loops=32),
    # The timing model of the GPU issue: d 2048, 16 heads of 128, SwiGLU 5632, vocab 32000,
    # 2 prelude layers and a 1-layer shared block (~285M parameters).
    "bench-285m": LoopedConfig(vocab_size=32000, d_model=2048, n_heads=16, n_kv_heads=16,
                               d_ff=5632, n_prelude=2, n_loop_layers=1, n_coda=0,
                               tie_embeddings=False, default_loops=8, max_loops=32,
                               max_seq_len=4096),
    # Ouro-1.4B shapes: a 24-layer block looped 4x, vocab 49152 (Ouro model card, ByteDance 2025).
    "ouro-1.4b": LoopedConfig(vocab_size=49152, d_model=2048, n_heads=16, n_kv_heads=16,
                              d_ff=5632, n_prelude=0, n_loop_layers=24, n_coda=0, norm="sandwich",
                              loop_final_norm=True, tie_embeddings=False, default_loops=4,
                              max_loops=4, max_seq_len=4096, rope_theta=1000000.0),
    # Ouro-2.6B (ByteDance/Ouro-2.6B's config.json: the 1.4B's layers doubled), with Ouro's own
    # norms (no final norm beyond the loop norm) and its early-exit gate, as the HF loader builds it.
    "ouro-2.6b": LoopedConfig(vocab_size=49152, d_model=2048, n_heads=16, n_kv_heads=16,
                              d_ff=5632, n_prelude=0, n_loop_layers=48, n_coda=0, norm="sandwich",
                              loop_final_norm=True, final_norm=False, exit_gate=True, norm_eps=1e-6,
                              tie_embeddings=False, default_loops=4, max_loops=8, max_seq_len=4096,
                              rope_theta=1000000.0),
    # Huginn-0125 (tomg-group-umd/huginn-0125's config.json): 2 prelude, a 4-layer recurrent
    # block with input injection, 2 coda layers, d 5280 in 55 heads of 96, as the HF loader builds it.
    "huginn-3.5b": LoopedConfig(vocab_size=65536, d_model=5280, n_heads=55, n_kv_heads=55, d_ff=17920,
                                n_prelude=2, n_loop_layers=4, n_coda=2, norm="sandwich_sum", exit_norm=True,
                                inject=True, embed_scale=5280 ** 0.5, init_std=(2 / (5 * 5280)) ** 0.5,
                                qk_bias=True, norm_eps=1e-6, tie_embeddings=True, default_loops=32,
                                max_loops=64, max_seq_len=4096, rope_theta=50000.0),
}
