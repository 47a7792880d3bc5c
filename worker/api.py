"""`tinyloop.worker.Model`: the in-process API (mirrors the reference runtime's Python API).

Argument checks live here, so every path (in-process, Ray actor, CLI) raises the same
`ValueError` / `RuntimeError` with the argument's name and the reason.
"""
from __future__ import annotations

import contextlib
import math
import os
import secrets
import threading
import time
from typing import Iterable

import numpy as np
import torch

from tinyloop.worker.generation import resume as resume_mod
from tinyloop.worker.generation import scoring
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.decode import (DecodeState, Finish, Generation, Prefill, Request,
                                              prefill_together, start, stream)
from tinyloop.worker.generation.resume import ResumeHandle
from tinyloop.worker.runner.sampler import SamplingParams
from tinyloop.worker.generation.speculative import SpecParams, stream_speculative
from tinyloop.worker.model import checkpoint, quant_checkpoint
from tinyloop.worker.model.cache import check_kv_mode, lane_bytes, make_cache
from tinyloop.worker.model.errors import HandleFreed, LanesBusy, ModelClosed, OutOfMemory, OutOfRange, TooLong
from tinyloop.worker.model.ops import select_ops
from tinyloop.worker.model.settings import KV_MODES, Settings
from tinyloop.worker.model.tokenizer import from_metadata
from tinyloop.worker.runner.early_exit import ExitRule, check_rule
from tinyloop.worker.runner.runner import Runner, RunnerSettings

DEFAULT_SAFETY_NORM_THRESHOLD = 1.0e4
MIN_TEMPERATURE = 1e-30  # the smallest that float32 scores can be divided by and stay finite


def _dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


# padded prompt tokens that generate_batch prefills in one pass (the scheduler's 2 x step_tokens)
BATCH_PREFILL_TOKENS = 2048
DEFAULT_LANES = {"cuda": 64, "cpu": 8}  # cache lanes when n_slots is not given, within the budget


def default_cache_budget(device: torch.device) -> int:
    """Bytes the cache may take when the caller sets no budget: half the free memory of a CUDA
    device (after the weights), 2 GiB on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return 2 << 30


class Model:
    """A looped transformer loaded from a `.tinyloop` file or a Hugging Face model directory
    (Ouro, Huginn: docs/models.md), with its own static cache.

    max_loops: the deepest depth a request may ask for (the cache holds that many iterations'
    layers); None: the checkpoint's (a directory: twice its default depth). init_scale: an
    input-injection model's (Huginn's) initial latent state is drawn with std init_std ·
    init_scale from each request's seed; 0 gives the zero state.

    n_slots: cache lanes (concurrent requests, batch lanes); None: 64 on CUDA, 8 on the CPU, as
    many as fit `cache_budget_bytes` (default: half the free device memory; 2 GiB on the CPU).
    cuda_graphs (default: on CUDA) captures at load every graph the runner replays: the decode
    step of every depth, the batched decode stages of every lane-count bucket, the verify
    stages and the prefill stages of prompts padded to length buckets of up to
    prefill_graph_len tokens (0: prefill stays eager). No graph depends on the lane count's
    lanes, only on the buckets. A call holds the model's lock, so one Model is safe to share
    between threads; the Ray actor instead runs requests on separate lanes, batching their
    decode steps (generation/batcher.py). `startup`: seconds spent loading and capturing, by
    part, the graph count and the graph pool's bytes.

    kv_mode: what the cache stores (docs/kv-cache.md): "kv" (K and V), "h" (the normalized
    layer input, K / V rebuilt from it at read), "h-int8" / "h-int4" (h quantized per head),
    "delta-int8" (h⁰ plus int8 Δh per later iteration); None: `settings.kv_mode` (the
    environment's TINYLOOP_KV_* switches), else "kv". Fixed for the Model's life: a call that
    names another mode is a ValueError. batch_invariant: `Settings.batch_invariant` (None: the
    settings'): every row computed by the batch-1 decode step's kernels, so batched,
    speculative and resumed streams equal their plain runs bit for bit on the GPU."""

    def __init__(self, path: str | os.PathLike | None = None, max_seq_len: int = 2048,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 n_slots: int | None = None, backend: str | None = None, cuda_graphs: bool | None = None,
                 prefill_graph_len: int | None = None, cache_budget_bytes: int | None = None,
                 settings: Settings | None = None, max_loops: int | None = None, init_scale: float = 1.0,
                 kv_mode: str | None = None, batch_invariant: bool | None = None):
        if path is None:
            from tinyloop.worker.model.default_model import default_model_path
            path = default_model_path()
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if n_slots is not None and n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if cache_budget_bytes is not None and cache_budget_bytes < 1:
            raise ValueError(f"cache_budget_bytes must be >= 1, got {cache_budget_bytes}")
        if max_loops is not None and (isinstance(max_loops, bool) or not isinstance(max_loops, int) or max_loops < 1):
            raise ValueError(f"max_loops must be an int >= 1, got {max_loops!r}")
        if not 0 <= init_scale < math.inf:
            raise ValueError(f"init_scale must be a finite number >= 0, got {init_scale}")
        # explicit arguments win over `settings`, which defaults to the environment's
        settings = (Settings.from_env() if settings is None else settings).replace(
            backend=backend, cuda_graphs=cuda_graphs, prefill_graph_len=prefill_graph_len, kv_mode=kv_mode,
            batch_invariant=batch_invariant)
        self.settings = settings
        self.prefill_graph_len = settings.prefill_graph_len
        t0 = time.perf_counter()
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _dtype(dtype, self.device)
        self.path = os.fspath(path)
        model, meta = checkpoint.load(self.path, self.device, self.dtype, max_loops)
        # the weights as stored ("float32", "bfloat16", ...) or their quantized format
        self.weight_format = quant_checkpoint.use_settings(model, meta, self.path, settings, self.dtype)
        model.init_scale = float(init_scale)
        self.init_scale = float(init_scale)
        self.config = model.config
        self.max_seq_len = min(max_seq_len, self.config.max_seq_len)
        self.kv_mode = check_kv_mode(settings.kv_mode or "kv", self.config, self.config.max_loops)
        if self.kv_mode != "kv" and quant_checkpoint.spec_of(meta, self.path) is not None:
            # the store-h read rebuilds K and V with float W_k / W_v; quantized weights have none
            raise ValueError(f"kv_mode {self.kv_mode!r} rebuilds K and V from float W_k / W_v, and {self.path} "
                             f"holds quantized weights ({self.weight_format}): use kv_mode 'kv'")
        self.tokenizer = from_metadata(meta)
        self._module = model
        if n_slots is None:
            n_slots = self._lanes_within(cache_budget_bytes)
        if settings.batch_invariant:
            if self.kv_mode != "kv":
                raise ValueError(f"batch_invariant runs the K/V cache's decode kernels; kv_mode {self.kv_mode!r} "
                                 f"has no batch-invariant read: use kv_mode 'kv'")
            if quant_checkpoint.spec_of(meta, self.path) is not None:
                raise ValueError(f"batch_invariant has no INT4 kernels; {self.path} holds quantized weights "
                                 f"({self.weight_format})")
        ops = select_ops(self.device, settings.backend, settings.batch_invariant, settings.int4_tiles,
                         settings.gemv_tiles, settings.pdl, settings.autotune)
        if ops.name == "triton":
            model.use_fast_path(ops.rms_norm, ops.gemv, settings.fused_rows, ops.swiglu,
                                settings.l2_keep_fraction, settings.l2_stream, ops.invariant)
            quant_checkpoint.use_kernels(model, ops.int4, ops.int4_rows)
        cuda_graphs = self.device.type == "cuda" if settings.cuda_graphs is None else settings.cuda_graphs
        cache = make_cache(self.kv_mode, self.config, n_slots, self.max_seq_len, self.config.max_loops,
                           self.device, self.dtype)
        fused_sampler = self.device.type == "cuda" if settings.fused_sampler is None else settings.fused_sampler
        device_rounds = (settings.batch_invariant and bool(cuda_graphs) if settings.device_rounds is None
                         else settings.device_rounds)
        self.runner = Runner(model, cache, ops, RunnerSettings(bool(cuda_graphs), settings.prefill_graph_len,
                                                               device_rounds=device_rounds,
                                                               sampler_graphs=settings.sampler_graphs,
                                                               fused_sampler=fused_sampler,
                                                               interleave=settings.interleave))
        self.n_slots = n_slots
        # seconds by part and graph count: what a worker's start-up cost (the actor logs it)
        self.startup = self.runner.startup
        self.startup["load_s"] = time.perf_counter() - t0
        self.startup["lanes"] = n_slots
        if cuda_graphs:
            self.capture_graphs(range(1, self.config.max_loops + 1))
        self._lock = threading.RLock()
        self._closed = False

    def _lanes_within(self, budget: int | None) -> int:
        cfg = self.config
        per_lane = lane_bytes(self.kv_mode, cfg, self.max_seq_len, cfg.max_loops, self.dtype)
        budget = default_cache_budget(self.device) if budget is None else budget
        fit = budget // per_lane
        if fit < 1:
            raise ValueError(f"one cache lane ({per_lane} bytes at max_seq_len {self.max_seq_len}) exceeds "
                             f"the cache budget of {budget} bytes")
        return int(min(DEFAULT_LANES.get(self.device.type, 8), fit))

    def capture_graphs(self, loops) -> None:
        """Capture the runner's graphs for the depths in `loops` (CUDA graphs on only). Done at
        start-up, before a worker reports healthy: capturing writes into lane 0's cache."""
        if self.runner.graphs is None:
            raise ValueError("this Model was built with cuda_graphs=False")
        self.runner.capture([self._loops(L) for L in loops])

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far, at start-up and while serving (0 without graphs): a
        workload that adds none is replaying what it has, as a worker does once it has served a while."""
        g = self.runner.graphs if self.runner is not None else None
        return 0 if g is None else g.captures

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if self.runner is not None:
                    self.runner.close()
                self.runner = None
                self._module = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosed("model is closed")

    @property
    def counters(self):
        return self.runner.counters

    @property
    def kv_bytes_per_token_layer(self) -> float:
        """The cache's bytes per token per cache layer in its kv_mode, measured from its tensors."""
        return self.runner.cache.bytes_per_token_layer()

    def handle_nbytes(self, seq_len: int, max_loops: int, cache_window: int = 0) -> int:
        """Bytes a resume handle of a seq_len-token prompt holds in this Model's kv_mode."""
        return resume_mod.handle_nbytes(self.runner.cache, seq_len, max_loops, cache_window)

    def check_kv_mode(self, kv_mode) -> None:
        """A call's kv_mode: None or this Model's; anything else is a ValueError."""
        if kv_mode is None or kv_mode == self.kv_mode:
            return
        if kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, got {kv_mode!r}")
        raise ValueError(f"kv_mode={kv_mode!r} differs from this model's kv_mode {self.kv_mode!r}: the cache's "
                         f"mode is fixed when the model is loaded (Model(kv_mode=...), tinyloop serve --kv-mode)")

    # -- argument checks ----------------------------------------------------------------
    def _prompt(self, prompt, name: str = "prompt") -> list[int]:
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1:
                raise ValueError(f"{name} must be a 1-D array of token ids, got shape {prompt.shape}")
            if not np.issubdtype(prompt.dtype, np.integer):
                raise ValueError(f"{name} must hold integer token ids, got dtype {prompt.dtype}")
            ids = prompt.astype(np.int64).tolist()
        elif isinstance(prompt, (list, tuple)):
            if all(type(t) is int for t in prompt):  # plain ints (not bools): the common case, checked fast
                ids = list(prompt)
            elif all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                ids = [int(t) for t in prompt]
            else:
                raise ValueError(f"{name} must be a list of ints")
        else:
            raise ValueError(f"{name} must be a 1-D int32 numpy array or a list of ints, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{name} is empty: at least one token is needed")
        V = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            bad = next(t for t in ids if not 0 <= t < V)
            raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {V})")
        return ids

    def _loops(self, loops, name: str = "loops") -> int:
        if loops is None:
            return self.config.default_loops
        if isinstance(loops, bool) or not isinstance(loops, (int, np.integer)):
            raise ValueError(f"{name} must be an int, got {type(loops).__name__}")
        if not 1 <= loops <= self.config.max_loops:
            raise ValueError(f"{name}={loops} out of range [1, max_loops={self.config.max_loops}]")
        return int(loops)

    def _sampling(self, temperature, top_k, top_p, repetition_penalty) -> SamplingParams:
        if not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature:g}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        return SamplingParams(float(temperature), int(top_k), float(top_p), float(repetition_penalty))

    def _fit(self, seq_len: int, max_tokens: int, what: str = "prompt") -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if seq_len + max_tokens > self.max_seq_len:
            raise TooLong(f"{what} of {seq_len} tokens + max_tokens {max_tokens} exceeds "
                               f"max_seq_len {self.max_seq_len}")

    def _window(self, cache_window: int) -> int:
        if isinstance(cache_window, bool) or not isinstance(cache_window, (int, np.integer)):
            raise ValueError(f"cache_window must be an int, got {type(cache_window).__name__}")
        if cache_window < 0:
            raise ValueError(f"cache_window must be >= 0 (0 = full cache), got {cache_window}")
        if cache_window > self.max_seq_len:
            raise ValueError(f"cache_window={cache_window} exceeds the cache's max_seq_len {self.max_seq_len} "
                             f"positions (0 = the full cache)")
        return int(cache_window)

    def _seed(self, seed) -> int:
        if seed is None:
            return secrets.randbits(62)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        return int(seed) & ((1 << 62) - 1)

    def _stop_ids(self, stop_token_ids: Iterable[int] | None) -> frozenset[int]:
        ids = set(stop_token_ids or ())
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary")
        if self.config.eos_id >= 0:
            ids.add(self.config.eos_id)
        return frozenset(ids)

    def make_request(self, prompt, loops=None, max_tokens=128, temperature=0.0, top_k=50, top_p=1.0,
                     repetition_penalty=1.0, seed=None, cache_window=0, l_warmup_tokens=0,
                     l_warmup_L=None, safety_check=False,
                     safety_norm_threshold=DEFAULT_SAFETY_NORM_THRESHOLD, stop_token_ids=None,
                     speculative=None, kv_mode=None, early_exit=None) -> Request:
        """Validate `generate`'s arguments into a Request (the Ray actor uses this too).

        speculative: None, or {draft_loops, verify_loops, draft_ahead, k_branches} for
        self-speculative decoding (verify_loops then is the request's depth)."""
        self._check_open()
        self.check_kv_mode(kv_mode)
        ids = self._prompt(prompt)
        L = self._loops(loops)
        self._fit(len(ids), max_tokens)
        if l_warmup_tokens < 0:
            raise ValueError(f"l_warmup_tokens must be >= 0, got {l_warmup_tokens}")
        warm_L = None
        if l_warmup_tokens:
            if l_warmup_L is None:
                raise ValueError("l_warmup_L is required when l_warmup_tokens > 0")
            warm_L = self._loops(l_warmup_L, "l_warmup_L")
            if warm_L > L:
                raise ValueError(f"l_warmup_L={warm_L} must be <= loops={L}")
        if safety_check and not safety_norm_threshold > 0:
            raise ValueError(f"safety_norm_threshold must be > 0, got {safety_norm_threshold}")
        req = Request(ids, L, int(max_tokens), self._sampling(temperature, top_k, top_p, repetition_penalty),
                      self._seed(seed), self._window(cache_window), int(l_warmup_tokens), warm_L,
                      float(safety_norm_threshold) if safety_check else None, self._stop_ids(stop_token_ids))
        if speculative is not None:
            self._speculative_request(req, speculative)
        req.early_exit = self._early_exit(early_exit, req)
        return req

    def _early_exit(self, early_exit, req: Request) -> ExitRule | None:
        """The request's exit rule (runner/early_exit.py's check_rule), or a ValueError naming
        the field, or the option it does not combine with."""
        rule = check_rule(early_exit, self.config)
        if rule is None:
            return None
        if rule.min_loops > req.loops:
            raise ValueError(f"early_exit.min_loops={rule.min_loops} exceeds loops={req.loops}")
        for bad, what in ((req.speculative is not None, "speculative decoding"),
                          (req.warmup_tokens > 0, "l_warmup_tokens"), (req.window > 0, "cache_window > 0"),
                          (req.safety_threshold is not None, "safety_check")):
            if bad:
                raise ValueError(f"early_exit does not combine with {what}")
        if self.kv_mode != "kv":
            raise ValueError(f"early_exit fills the skipped iterations' K/V, which needs kv_mode 'kv' "
                             f"(this model's is {self.kv_mode!r})")
        return rule

    # -- generation ---------------------------------------------------------------------
    def stream(self, request: Request, lane: int = 0):
        """An iterator of token-id lists for a validated request on one cache lane, which the
        caller holds (`runner.lanes`); its end's StopIteration.value is the `Finish`. Plain
        decoding's is a generator; a speculative request's a `SpeculativeStream`, which a greedy
        one can hand over to plain decoding between rounds (`handoff`)."""
        self._check_open()
        self._seat(lane, request.seed)
        if request.speculative is not None:
            return stream_speculative(self.runner, lane, request, self._spec_params(request.speculative))
        return stream(self.runner, lane, request)

    def start(self, request: Request, lane: int = 0) -> DecodeState:
        """Prefill a validated, non-speculative request into a cache lane: its `DecodeState`,
        to step alone (`generate.decode_steps`, what `stream` does) or with other streams in
        one step (generation/batcher.py, what the Ray actor does)."""
        self._check_open()
        if request.speculative is not None:
            raise ValueError("a speculative request streams through Model.stream")
        self._seat(lane, request.seed)
        return start(self.runner, lane, request)

    def start_chunked(self, request: Request, lane: int = 0) -> Prefill:
        """`start` in chunks: a `Prefill` whose `run(n)` prefills the next n prompt tokens and
        returns the `DecodeState` after the last (the worker's scheduler cuts long prompts so
        that they ride along with other streams' decode steps)."""
        self._check_open()
        if request.speculative is not None:
            raise ValueError("a speculative request streams through Model.stream")
        self._seat(lane, request.seed)
        return Prefill(self.runner, lane, request)

    def generate(self, prompt, loops=None, max_tokens=128, temperature=0.0, top_k=50, top_p=1.0,
                 repetition_penalty=1.0, seed=None, cache_window=0, l_warmup_tokens=0,
                 l_warmup_L=None, safety_check=False,
                 safety_norm_threshold=DEFAULT_SAFETY_NORM_THRESHOLD, stop_token_ids=None,
                 kv_mode=None, early_exit=None) -> Generation:
        """-> the full token stream (prompt + generated) as a `Generation` (a list of ints with
        `.finish_reason` and `.stats`). early_exit: None (every decode token runs `loops`), or a
        dict {criterion: gate | kl | latent | argmax, threshold in (0, 1], min_loops, patience,
        cache: copy | recompute} (or an ExitRule): each decode token stops iterating where the
        rule says (docs/early-exit.md); `.stats` then adds iterations_per_token and
        iterations_histogram."""
        req = self.make_request(prompt, loops, max_tokens, temperature, top_k, top_p, repetition_penalty,
                                seed, cache_window, l_warmup_tokens, l_warmup_L, safety_check,
                                safety_norm_threshold, stop_token_ids, kv_mode=kv_mode, early_exit=early_exit)
        with self._lock, self._lane() as lane:
            self._seat(lane, req.seed)
            return drain(req.prompt, stream(self.runner, lane, req))

    def generate_batch(self, prompts, per_lane_loops=None, max_tokens=128, temperature=0.0, top_k=50,
                       top_p=1.0, repetition_penalty=1.0, seed=None, cache_window=0,
                       stop_token_ids=None, kv_mode=None, early_exit=None) -> list[Generation]:
        """Lanes of different prompts and depths in one batched decode; lane i equals
        `generate(prompts[i], loops=per_lane_loops[i])`. seed: one int for all lanes or a list.
        early_exit: one rule for every lane or a list (None entries: no exit); an exited lane
        drops out of the step's remaining iterations."""
        self._check_open()
        self.check_kv_mode(kv_mode)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        ids = [self._prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        B = len(ids)
        loops = per_lane_loops if per_lane_loops is not None else [None] * B
        if len(loops) != B:
            raise ValueError(f"per_lane_loops has {len(loops)} entries for {B} prompts")
        loops = [self._loops(L, f"per_lane_loops[{i}]") for i, L in enumerate(loops)]
        for i, p in enumerate(ids):
            self._fit(len(p), max_tokens, f"prompts[{i}]")
        sp = self._sampling(temperature, top_k, top_p, repetition_penalty)
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * B
        if len(seeds) != B:
            raise ValueError(f"seed has {len(seeds)} entries for {B} prompts")
        seeds = [self._seed(s) for s in seeds]
        window, stops = self._window(cache_window), self._stop_ids(stop_token_ids)
        reqs = [Request(ids[i], loops[i], int(max_tokens), sp, seeds[i], window, stop_ids=stops) for i in range(B)]
        rules = list(early_exit) if isinstance(early_exit, (list, tuple)) else [early_exit] * B
        if len(rules) != B:
            raise ValueError(f"early_exit has {len(rules)} entries for {B} prompts")
        for i, req in enumerate(reqs):
            req.early_exit = self._early_exit(rules[i], req)
        with self._lock:
            self._check_open()
            finishes = self._batch(reqs)
        return [Generation(ids[i] + out, f.reason, f.stats) for i, (out, f) in enumerate(finishes)]

    def _batch(self, reqs: list[Request]) -> list[tuple[list[int], "Finish"]]:
        """Streams on as many free lanes as there are (in waves when there are more requests),
        their decode steps batched (generation/batcher.py; a windowed cache in the batcher's
        checked step). -> (generated ids, Finish) per request."""
        results: list = [None] * len(reqs)
        pending = list(range(len(reqs)))
        batcher = Batcher(self.runner)
        while pending:
            held = []
            try:
                while pending and (lane := self.runner.lanes.acquire()) is not None:
                    held.append((pending.pop(0), lane))
                if not held:
                    raise LanesBusy(f"all {self.n_slots} cache lanes are in use")
                lane_of = {}
                states = self._prefill_wave([(lane, reqs[i]) for i, lane in held])
                for (i, lane), (new, finish) in zip(held, batcher.join_many(states)):
                    results[i] = (new, finish)
                    lane_of[lane] = i
                while batcher:
                    for lane, update in batcher.step().items():
                        if isinstance(update, Exception):
                            raise update
                        new, finish = update
                        got = results[lane_of[lane]]
                        got[0].extend(new)
                        results[lane_of[lane]] = (got[0], finish)
            finally:
                for lane in batcher.lanes:
                    batcher.leave(lane)
                for _, lane in held:
                    self.runner.lanes.release(lane)
        return results

    def _prefill_wave(self, seats: list[tuple[int, Request]]) -> list[DecodeState]:
        """The prompts of a wave of `_batch` prefilled into their lanes: fresh prompts on the full
        cache together (`prefill_together`), in groups of at most BATCH_PREFILL_TOKENS padded
        tokens, the others (and a group of one) alone. -> their decode states, in order."""
        for lane, req in seats:
            self._seat(lane, req.seed)
        pres = [Prefill(self.runner, lane, req) for lane, req in seats]
        states: list[DecodeState | None] = [None] * len(pres)
        group: list[int] = []
        longest = 0  # the group's longest prompt

        def flush():
            if len(group) > 1:
                for j, st in zip(group, prefill_together([pres[j] for j in group])):
                    states[j] = st
            elif group:
                states[group[0]] = start(self.runner, pres[group[0]].lane, pres[group[0]].req)
            group.clear()
        for j, pre in enumerate(pres):
            if not pre.joinable:
                states[j] = start(self.runner, pre.lane, pre.req)
                continue
            if group and (len(group) + 1) * max(longest, pre.remaining) > BATCH_PREFILL_TOKENS:
                flush()
                longest = 0
            group.append(j)
            longest = max(longest, pre.remaining)
        flush()
        return states

    def _seat(self, lane: int, seed: int) -> None:
        """Key the lane's initial latent state to the request's seed (input injection only:
        every other model draws nothing in its prelude)."""
        if self.config.inject:
            self.runner.cache.seat(lane, seed)

    def _lane(self, lane: int | None = None):
        """The cache lane of one call: `lane`, which the caller holds, or a free lane held for
        the call (RuntimeError when every lane is in use)."""
        self._check_open()
        if lane is None:
            return self.runner.lanes.hold()
        if not 0 <= lane < self.n_slots:
            raise ValueError(f"lane {lane} outside [0, n_slots={self.n_slots})")
        return contextlib.nullcontext(lane)

    # -- warm-start resume --------------------------------------------------------------
    def build_resume_handle(self, prompt, L_used=8, max_loops=32, cache_window=0, lane=None,
                            seed=None, kv_mode=None) -> ResumeHandle:
        """Prefill once at L_used; the handle can then resume at any new_L in [L_used, max_loops].
        seed: the prompt's initial latent state's (input injection only; None: a random one)."""
        self._check_open()
        self.check_kv_mode(kv_mode)
        ids = self._prompt(prompt)
        if L_used < 0:
            raise ValueError(f"L_used must be >= 0, got {L_used}")
        if max_loops < 1:
            raise ValueError(f"max_loops must be >= 1, got {max_loops}")
        if L_used > max_loops:
            # the reference runtime's error for it: the arguments are valid alone, not together
            raise OutOfRange(f"L_used={L_used} exceeds max_loops={max_loops}")
        if max_loops > self.config.max_loops:
            raise ValueError(f"max_loops={max_loops} exceeds the model's max_loops={self.config.max_loops}")
        window = self._window(cache_window)
        if len(ids) > self.max_seq_len:
            raise TooLong(f"prompt of {len(ids)} tokens exceeds max_seq_len {self.max_seq_len}")
        with self._lock:
            self._check_open()
            try:
                with self._lane(lane) as lane:
                    self._seat(lane, self._seed(seed))
                    return resume_mod.build(self.runner, lane, ids, int(L_used), int(max_loops), window)
            except torch.OutOfMemoryError as e:
                raise OutOfMemory(f"out of memory allocating the resume handle: {e}") from None

    def make_resume_request(self, handle: ResumeHandle, new_L, max_tokens=128, temperature=0.0, top_k=50,
                            top_p=1.0, cache_window=0, repetition_penalty=1.0, seed=None,
                            stop_token_ids=None, kv_mode=None) -> tuple[ResumeHandle, int, Request]:
        """Validate `resume_generate`'s arguments (the Ray actor uses this too)."""
        self._check_open()
        self.check_kv_mode(kv_mode)
        if not isinstance(handle, ResumeHandle):
            raise ValueError(f"handle must be a ResumeHandle, got {type(handle).__name__}")
        if self.runner is None or handle.owner != id(self.runner):
            raise HandleFreed("handle belongs to a different (or closed) Model")
        if handle.freed:
            raise HandleFreed("handle has been freed")
        if isinstance(new_L, bool) or not isinstance(new_L, (int, np.integer)):
            raise ValueError(f"new_L must be an int, got {type(new_L).__name__}")
        if not handle.loops_used() <= new_L <= handle.max_loops():
            raise OutOfRange(f"new_L={new_L} outside [loops_used={handle.loops_used()}, "
                               f"max_loops={handle.max_loops()}]")
        window = self._window(cache_window) or handle.cache_window
        if window != handle.cache_window:
            raise ValueError(f"cache_window={window} differs from the handle's window "
                             f"{handle.cache_window}; rebuild the handle with that window")
        self._fit(handle.seq_len(), max_tokens)
        req = Request(handle.prompt, int(new_L), int(max_tokens),
                      self._sampling(temperature, top_k, top_p, repetition_penalty), self._seed(seed),
                      window, stop_ids=self._stop_ids(stop_token_ids))
        return handle, int(new_L), req

    def stream_resume(self, resume_request, lane: int = 0):
        """Generator protocol of `stream`, for a validated `make_resume_request` result."""
        return resume_mod.resume(self.runner, lane, *self._resume_on(resume_request, lane))

    def start_resume_chunked(self, resume_request, lane: int = 0) -> "resume_mod.Extension":
        """`start_chunked` for a validated `make_resume_request` result: an `Extension` whose
        `run(n)` clones the handle into the lane (first) and extends its next n prompt positions
        to new_L, returning the `DecodeState` after the last (the worker's scheduler budgets a
        resume's extension as it does a prompt's prefill)."""
        return resume_mod.Extension(self.runner, lane, *self._resume_on(resume_request, lane))

    def _resume_on(self, resume_request, lane: int) -> tuple[ResumeHandle, int, Request]:
        """A validated resume request seated on `lane`: (handle, new_L, request); HandleFreed
        when its handle was freed since."""
        self._check_open()
        handle, new_L, req = resume_request
        if handle.freed:
            raise HandleFreed("handle has been freed")
        self._seat(lane, req.seed)
        return handle, new_L, req

    def resume_generate(self, handle: ResumeHandle, new_L, max_tokens=128, temperature=0.0, top_k=50,
                        top_p=1.0, cache_window=0, repetition_penalty=1.0, seed=None,
                        stop_token_ids=None, lane=None, kv_mode=None) -> Generation:
        """Extend the handle to new_L (iterations [L_used, new_L) only) and decode. The handle is
        not modified; many resumes on one handle never disturb each other."""
        rr = self.make_resume_request(handle, new_L, max_tokens, temperature, top_k, top_p, cache_window,
                                      repetition_penalty, seed, stop_token_ids, kv_mode)
        with self._lock, self._lane(lane) as lane:
            return drain(handle.prompt, self.stream_resume(rr, lane))

    def free_resume_handle(self, handle: ResumeHandle) -> None:
        """Release the handle's memory now (idempotent)."""
        if not isinstance(handle, ResumeHandle):
            raise ValueError(f"handle must be a ResumeHandle, got {type(handle).__name__}")
        handle.free()

    # -- scoring ------------------------------------------------------------------------
    def score_with_consistency(self, prompt, loops_a, loops_b, max_tokens=32, lane=None) -> dict:
        """Greedy answers at two depths from one shared prefill of the shallower depth."""
        ids = self._prompt(prompt)
        La, Lb = self._loops(loops_a, "loops_a"), self._loops(loops_b, "loops_b")
        self._fit(len(ids), max_tokens)
        lo = min(La, Lb)
        # one seed for the three calls: both answers then see the same initial latent states,
        # and differ by their depth alone
        seed = self._seed(None)
        handle = self.build_resume_handle(ids, L_used=lo, max_loops=max(La, Lb), lane=lane, seed=seed)
        try:
            a = self.resume_generate(handle, La, max_tokens=max_tokens, lane=lane, seed=seed)[len(ids):]
            b = self.resume_generate(handle, Lb, max_tokens=max_tokens, lane=lane, seed=seed)[len(ids):]
        finally:
            self.free_resume_handle(handle)
        d = scoring.first_divergence(a, b)
        return {"agree": d == -1, "answer_a": a, "answer_b": b, "first_divergence": d}

    def score_with_uncertainty(self, prompt, L_lo, L_hi, lane=None):
        """-> (next-token logits at L_hi as float32 (V,), KL(p_hi || p_lo)), sharing the first
        L_lo iterations between the two depths."""
        self._check_open()
        ids = self._prompt(prompt)
        lo, hi = self._loops(L_lo, "L_lo"), self._loops(L_hi, "L_hi")
        if lo > hi:
            raise ValueError(f"L_lo={lo} must be <= L_hi={hi}")
        self._fit(len(ids), 1)
        with self._lock, self._lane(lane) as lane:
            self._seat(lane, 0)  # scores are deterministic: seed 0's latent state
            logits, kl = scoring.uncertainty(self.runner, lane, ids, lo, hi)
        return logits.cpu().numpy().astype(np.float32), kl

    def score_trajectory(self, tokens, n_loops, lane=None) -> dict:
        """-> {"labels": [...], "hidden": float32 (n_stages, d_model)} for the last position."""
        self._check_open()
        ids = self._prompt(tokens, "tokens")
        L = self._loops(n_loops, "n_loops")
        self._fit(len(ids), 1, "tokens")
        with self._lock, self._lane(lane) as lane:
            self._seat(lane, 0)
            labels, hidden = scoring.trajectory(self.runner, lane, ids, L)
        return {"labels": labels, "hidden": hidden.cpu().numpy().astype(np.float32)}

    # -- self-speculative decoding ------------------------------------------------------
    def generate_speculative(self, prompt, max_tokens=128, draft_loops=2, verify_loops=8, draft_ahead=4,
                             temperature=0.0, top_k=50, top_p=1.0, seed=None,
                             stop_token_ids=None) -> Generation:
        """Draft at draft_loops, verify at verify_loops (warm-started from the draft's residuals).
        Greedy output equals `generate(prompt, loops=verify_loops)` (in fp32; in bf16 up to near
        ties, which the verify's chunk kernels may round the other way); sampled output is
        distributed as it. `.stats` adds accepted_per_verify, acceptance_rate, verify_steps."""
        return self._generate_speculative(prompt, max_tokens, temperature, top_k, top_p, seed,
                                          stop_token_ids, dict(draft_loops=draft_loops, verify_loops=verify_loops,
                                                               draft_ahead=draft_ahead, k_branches=1, tree=False))

    def generate_tree_speculative(self, prompt, max_tokens=128, draft_loops=2, verify_loops=8, draft_ahead=4,
                                  K_branches=2, temperature=0.0, top_k=50, top_p=1.0, seed=None,
                                  stop_token_ids=None) -> Generation:
        """K_branches draft branches of draft_ahead tokens, verified in one tree pass
        (K_branches=1: a chain through the tree path). Same guarantees as `generate_speculative`."""
        return self._generate_speculative(prompt, max_tokens, temperature, top_k, top_p, seed,
                                          stop_token_ids, dict(draft_loops=draft_loops, verify_loops=verify_loops,
                                                               draft_ahead=draft_ahead, k_branches=K_branches,
                                                               tree=True))

    def _generate_speculative(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                              speculative: dict) -> Generation:
        req = self.make_request(prompt, None, max_tokens, temperature, top_k, top_p, seed=seed,
                                stop_token_ids=stop_token_ids, speculative=speculative)
        with self._lock, self._lane() as lane:
            return drain(req.prompt, self.stream(req, lane))

    def _spec_params(self, speculative: dict) -> SpecParams:
        s = speculative
        k = s.get("k_branches", 1)
        tree = s.get("tree", k != 1)
        return SpecParams(s.get("draft_loops", 2), s.get("verify_loops", 8), s.get("draft_ahead", 4), k, tree)

    def _speculative_request(self, req: Request, speculative) -> None:
        """Validate the speculative options into the request; verify_loops becomes its depth."""
        if not isinstance(speculative, dict):
            raise ValueError(f"speculative must be a dict, got {type(speculative).__name__}")
        unknown = set(speculative) - {"draft_loops", "verify_loops", "draft_ahead", "k_branches", "tree"}
        if unknown:
            raise ValueError(f"speculative has unknown keys {sorted(unknown)}")
        spec = {k: int(v) if isinstance(v, np.integer) else v for k, v in speculative.items()}
        params = self._spec_params(spec).check(self.config.max_loops)
        if req.window:
            raise ValueError("speculative decoding needs the full cache (cache_window=0)")
        if req.warmup_tokens or req.safety_threshold is not None:
            raise ValueError("speculative decoding does not combine with l_warmup_tokens or safety_check")
        if req.sampling.repetition_penalty != 1.0:
            raise ValueError("speculative decoding does not support repetition_penalty")
        req.loops = params.verify_loops
        req.speculative = dict(draft_loops=params.draft_loops, verify_loops=params.verify_loops,
                               draft_ahead=params.draft_ahead, k_branches=params.k_branches, tree=params.tree)


def drain(prompt: list[int], gen) -> Generation:
    tokens = list(prompt)
    try:
        while True:
            tokens.extend(next(gen))
    except StopIteration as stop:
        finish = stop.value
    return Generation(tokens, finish.reason, finish.stats)
