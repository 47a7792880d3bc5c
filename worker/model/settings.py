"""The engine's settings: one typed object, passed explicitly (`Model(settings=...)`), with the
environment read here and nowhere else in the worker (`Settings.from_env`)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping

EVICTION_POLICIES = ("evict_first", "evict_last", "")
# the KV cache modes (worker/model/cache.py; docs/kv-cache.md): K/V, or the normalized layer
# input h (model dtype, int8, int4) that K / V are rebuilt from, or h⁰ + int8 Δh per iteration
KV_MODES = ("kv", "h", "h-int8", "h-int4", "delta-int8")
# the rows kernels/gemv.py's batched projection takes in one call (its MAX_FUSED_ROWS; a copy, so that
# the gateway can import this module without torch: tests/kernels/test_kernel_gemv.py keeps them equal)
MAX_FUSED_ROWS = 64


@dataclass(frozen=True)
class Settings:
    """backend: "torch" (reference ops, any device) or "triton" (CUDA); None: triton on CUDA.
    cuda_graphs: capture the runner's graphs at load; None: on CUDA. prefill_graph_len: the
    longest prompt the prefill graphs cover (0: prefill stays eager). fused_rows: decode steps
    of up to this many lanes run the fused Triton projections (more lanes: cuBLAS and the
    unfused norms, SwiGLU and residual adds; on the H200 the fused projections beat those up
    to 32 rows and lose at 64: bench/results/rows-tiles-cuda.json). l2_keep_fraction: the
    share of the device's L2 that the shared block's largest projections may keep between
    iterations ("evict_last"); every other weight of a decode step loads with l2_stream, so that
    it passes through L2 without evicting them (a token reads the shared block L times and every
    other weight once).
    kv_mode: what the cache stores (KV_MODES); None: "kv".
    cancel_round / cross_iter_round: a quantized model's shared block alternates its rounding
    between even and odd iterations (the file's sign channel), or draws it per iteration
    (quant_checkpoint.use_rounding); neither: round to nearest at every iteration. dual_bit:
    iterations 0..dual_bit_switch run an INT2 copy of the quantized shared block made at load
    (None: as the file says, `tinyloop quantize --dual-bit`).
    batch_invariant (triton backend): every row of every pass is computed by the batch-1
    decode step's own kernels (the projection of one row, decode attention with splits fixed
    per cache shape), so a token's logits do not depend on the batch, the chunk or the graph
    bucket it ran in: a lane of a batched step equals its stream alone, a speculative verify
    equals plain decoding, a chunked prompt its unchunked prefill, bit for bit in bf16. It costs
    nothing at batch 1 and more the more rows a pass has (docs/performance.md); greedy
    speculative decoding replays a whole round as one graph only with it.
    device_rounds: speculative chains, greedy or sampled, run each round, drafts to acceptance, on the
    device with no host value inside (one graph per round with CUDA graphs), the host reading
    a round's tokens while the next runs; None: on with batch_invariant and CUDA graphs (without
    batch-invariant kernels a round's verify attends over the whole cache).
    sampler_graphs: with CUDA graphs, sampling (any temperature, top-k, top-p, penalty) replays
    one captured graph per row bucket; off, its ops launch one by one (the A/B of
    bench/sampling.py).
    fused_sampler: sampling's distribution (temperature, top-k, top-p) and its draw in one
    launch each, a row a program (kernels/sample_rows.py), where the vocabulary fits one
    (MAX_VOCAB), and a sampled chain round's verdict in one more; off, some thirty torch ops
    each; None: on with CUDA. The two round a distribution's last bits differently, so a draw
    can differ where its number lands within them of a boundary; every path of a process
    (plain, batched, speculative, device rounds) takes the same one.
    int4_tiles: a bench/int4_tiles.py result whose tiles the INT4 kernels take before the
    code's tables (kernels/int4_gemv.py TILES, MATMUL_TILES): a sweep tried on a model without
    editing the code (bench/quant_decode.py --tiles); None: the code's tables.
    interleave: a batched decode step whose streams run at different depths (or are midway
    through a token) runs its rows each at its own iteration, every pass over all of them
    (`Runner.interleave`, generation/batcher.py): a shallow stream decodes its next token while
    a deep one is still iterating, instead of every row waiting for the deepest. Off: each
    step runs every row's whole token, each iteration over the rows that still need it.
    gemv_tiles: a bf16 tiles JSON (kernels/gemv.py `load_tables`; bench/tiles.py writes one)
    whose tiles the fused projections (kernels/gemv.py) take before the code's tables (TILES,
    ROWS_TILES): a sweep tried on a model without editing the code; None: the code's tables.
    pdl: the Triton launches that can (the projections, decode attention, the sandwich
    post-norm, greedy_feed) use programmatic dependent launch where the hardware allows it
    (CUDA capability 9 and later; kernels/_launch.py); off, every launch waits for the kernel
    before it. autotune: a projection shape that no tile table holds runs the autotuner's tile
    (picked per process, so two workers may sum its rows in different orders) instead of the
    default tile."""
    backend: str | None = None
    cuda_graphs: bool | None = None
    prefill_graph_len: int = 2048
    fused_rows: int = 32
    l2_keep_fraction: float = 0.7
    l2_stream: str = "evict_first"
    kv_mode: str | None = None
    cancel_round: bool = False
    cross_iter_round: bool = False
    dual_bit: bool | None = None
    dual_bit_switch: int = 3
    batch_invariant: bool = False
    device_rounds: bool | None = None
    sampler_graphs: bool = True
    fused_sampler: bool | None = None
    int4_tiles: str | None = None
    interleave: bool = True
    gemv_tiles: str | None = None
    pdl: bool = True
    autotune: bool = False

    def __post_init__(self):
        if self.kv_mode is not None and self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, got {self.kv_mode!r}")
        if self.backend not in (None, "torch", "triton"):
            raise ValueError(f"backend must be 'torch' or 'triton', got {self.backend!r}")
        if self.prefill_graph_len < 0:
            raise ValueError(f"prefill_graph_len must be >= 0, got {self.prefill_graph_len}")
        if not 1 <= self.fused_rows <= MAX_FUSED_ROWS:
            raise ValueError(f"fused_rows must be in [1, {MAX_FUSED_ROWS}], got {self.fused_rows}")
        if not 0.0 <= self.l2_keep_fraction <= 1.0:
            raise ValueError(f"l2_keep_fraction must be in [0, 1], got {self.l2_keep_fraction}")
        if self.l2_stream not in EVICTION_POLICIES:
            raise ValueError(f"l2_stream must be one of {EVICTION_POLICIES}, got {self.l2_stream!r}")
        if self.cancel_round and self.cross_iter_round:
            raise ValueError("cancel_round and cross_iter_round are two roundings of one weight: pick one")
        if self.dual_bit_switch < 0:
            raise ValueError(f"dual_bit_switch must be >= 0, got {self.dual_bit_switch}")

    @property
    def launch_pdl(self) -> bool | None:
        """The `pdl=` every Triton launcher takes from these settings: None (on where the
        hardware allows it) or False."""
        return None if self.pdl else False

    @property
    def rounding(self) -> str:
        """The shared block's quantized rounding across iterations (quant_checkpoint.ROUNDINGS)."""
        return "cancel" if self.cancel_round else "stochastic" if self.cross_iter_round else "nearest"

    def replace(self, **changes) -> "Settings":
        """A copy with `changes`; None values keep the field as it is."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Defaults overridden by TINYLOOP_BACKEND, TINYLOOP_CUDA_GRAPHS (0/1),
        TINYLOOP_PREFILL_GRAPH_LEN, TINYLOOP_FUSED_ROWS, TINYLOOP_L2_KEEP_FRACTION,
        TINYLOOP_L2_STREAM, TINYLOOP_CANCEL_ROUND (0/1), TINYLOOP_CROSS_ITER_ROUND (0/1),
        TINYLOOP_DUAL_BIT (0/1), TINYLOOP_DUAL_BIT_SWITCH, TINYLOOP_BATCH_INVARIANT (0/1),
        TINYLOOP_DEVICE_ROUNDS (0/1), TINYLOOP_SAMPLER_GRAPHS (0/1), TINYLOOP_FUSED_SAMPLER (0/1),
        TINYLOOP_INT4_TILES (a path),
        TINYLOOP_INTERLEAVE (0/1), TINYLOOP_GEMV_TILES (a path), TINYLOOP_PDL (0/1) and
        TINYLOOP_AUTOTUNE (0/1); kv_mode by the reference runtime's switches
        (`kv_mode_from_env`). A 0/1 switch reads "0", "false", "no" and "" as off, anything
        else as on."""
        env = os.environ if environ is None else environ
        flag = lambda v: v not in ("0", "false", "no", "")  # noqa: E731
        kinds = {"backend": str, "cuda_graphs": flag,
                 "prefill_graph_len": int, "fused_rows": int, "l2_keep_fraction": float, "l2_stream": str,
                 "cancel_round": flag, "cross_iter_round": flag, "dual_bit": flag, "dual_bit_switch": int,
                 "batch_invariant": flag, "device_rounds": flag, "sampler_graphs": flag, "fused_sampler": flag,
                 "int4_tiles": str,
                 "interleave": flag, "gemv_tiles": str, "pdl": flag, "autotune": flag}
        values = {}
        for name, parse in kinds.items():
            raw = env.get(f"TINYLOOP_{name.upper()}")
            if raw is not None:
                try:
                    values[name] = parse(raw)
                except ValueError:
                    raise ValueError(f"TINYLOOP_{name.upper()}={raw!r} is not a valid {name}") from None
        return cls(**values, kv_mode=kv_mode_from_env(env))


def kv_mode_from_env(env: Mapping[str, str]) -> str | None:
    """The reference runtime's variables: TINYLOOP_KV_H_MODE=1 stores h (with TINYLOOP_KV_INT8=1
    or TINYLOOP_KV_INT4=1 quantized), TINYLOOP_KV_DELTA=1 stores h⁰ + int8 Δh; none set: None.
    A combination that names no mode is a ValueError naming the valid ones."""
    def on(name: str) -> bool:
        raw = env.get(f"TINYLOOP_KV_{name}", "0")
        if raw not in ("0", "1"):
            raise ValueError(f"TINYLOOP_KV_{name}={raw!r}: expected 0 or 1")
        return raw == "1"
    h, int8, int4, delta = on("H_MODE"), on("INT8"), on("INT4"), on("DELTA")
    valid = ("TINYLOOP_KV_H_MODE=1 [+ TINYLOOP_KV_INT8=1 | TINYLOOP_KV_INT4=1] or TINYLOOP_KV_DELTA=1 alone")
    if delta:
        if h or int8 or int4:
            raise ValueError(f"TINYLOOP_KV_DELTA=1 combines with no other TINYLOOP_KV_* switch; valid: {valid}")
        return "delta-int8"
    if int8 and int4:
        raise ValueError(f"TINYLOOP_KV_INT8=1 and TINYLOOP_KV_INT4=1 exclude each other; valid: {valid}")
    if (int8 or int4) and not h:
        raise ValueError(f"TINYLOOP_KV_INT{8 if int8 else 4}=1 needs TINYLOOP_KV_H_MODE=1; valid: {valid}")
    if not h:
        return None
    return "h-int8" if int8 else "h-int4" if int4 else "h"


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where the worker keeps files it makes itself (the seeded default model when no trained
    one ships): TINYLOOP_CACHE, else ~/.cache/tinyloop."""
    env = os.environ if environ is None else environ
    return env.get("TINYLOOP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tinyloop")
