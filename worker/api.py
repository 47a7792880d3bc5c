"""`tinyloop.worker.Model`: the in-process API (mirrors the reference runtime's Python API).

Argument checks live here, so every path (in-process, Ray actor, CLI) raises the same
`ValueError` / `RuntimeError` with the argument's name and the reason.
"""
from __future__ import annotations

import os
import secrets
import threading
from typing import Iterable

import numpy as np
import torch

from tinyloop.worker import checkpoint
from tinyloop.worker.cache import KVCache
from tinyloop.worker.engine import Engine
from tinyloop.worker.generate import Generation, Request, batch, stream
from tinyloop.worker.ops import select_ops
from tinyloop.worker.sampling import SamplingParams
from tinyloop.worker.tokenizer import from_metadata

DEFAULT_SAFETY_NORM_THRESHOLD = 1.0e4


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


class Model:
    """A looped transformer loaded from a `.tinyloop` file, with its own static cache.

    n_slots: cache lanes (concurrent requests, batch lanes). A call holds the model's lock,
    so one Model is safe to share between threads; the Ray actor interleaves requests step
    by step on separate lanes instead."""

    def __init__(self, path: str | os.PathLike | None = None, max_seq_len: int = 2048,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 n_slots: int = 1, backend: str | None = None):
        if path is None:
            from tinyloop.worker.default_model import default_model_path
            path = default_model_path()
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _dtype(dtype, self.device)
        self.path = os.fspath(path)
        model, meta = checkpoint.load(self.path, self.device, self.dtype)
        self.config = model.config
        self.max_seq_len = min(max_seq_len, self.config.max_seq_len)
        self.tokenizer = from_metadata(meta)
        self._module = model
        self.engine = Engine(model, KVCache(self.config, n_slots, self.max_seq_len, self.config.max_loops,
                                            self.device, self.dtype), select_ops(self.device, backend))
        self._lock = threading.RLock()
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.engine = None
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
            raise RuntimeError("model is closed")

    @property
    def counters(self):
        return self.engine.counters

    # -- argument checks ----------------------------------------------------------------
    def _prompt(self, prompt, name: str = "prompt") -> list[int]:
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1:
                raise ValueError(f"{name} must be a 1-D array of token ids, got shape {prompt.shape}")
            if not np.issubdtype(prompt.dtype, np.integer):
                raise ValueError(f"{name} must hold integer token ids, got dtype {prompt.dtype}")
            ids = prompt.astype(np.int64).tolist()
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                raise ValueError(f"{name} must be a list of ints")
            ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"{name} must be a 1-D int32 numpy array or a list of ints, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{name} is empty: at least one token is needed")
        V = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
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
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
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
            raise RuntimeError(f"{what} of {seq_len} tokens + max_tokens {max_tokens} exceeds "
                               f"max_seq_len {self.max_seq_len}")

    @staticmethod
    def _window(cache_window: int) -> int:
        if cache_window < 0:
            raise ValueError(f"cache_window must be >= 0 (0 = full cache), got {cache_window}")
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
                     safety_norm_threshold=DEFAULT_SAFETY_NORM_THRESHOLD, stop_token_ids=None) -> Request:
        """Validate `generate`'s arguments into a Request (the Ray actor uses this too)."""
        self._check_open()
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
        return Request(ids, L, int(max_tokens), self._sampling(temperature, top_k, top_p, repetition_penalty),
                       self._seed(seed), self._window(cache_window), int(l_warmup_tokens), warm_L,
                       float(safety_norm_threshold) if safety_check else None, self._stop_ids(stop_token_ids))

    # -- generation ---------------------------------------------------------------------
    def stream(self, request: Request, lane: int = 0):
        """A generator of token-id lists for a validated request on one cache lane; its
        return value (StopIteration.value) is the `Finish`."""
        self._check_open()
        return stream(self.engine, lane, request)

    def generate(self, prompt, loops=None, max_tokens=128, temperature=0.0, top_k=50, top_p=1.0,
                 repetition_penalty=1.0, seed=None, cache_window=0, l_warmup_tokens=0,
                 l_warmup_L=None, safety_check=False,
                 safety_norm_threshold=DEFAULT_SAFETY_NORM_THRESHOLD, stop_token_ids=None) -> Generation:
        """-> the full token stream (prompt + generated) as a `Generation` (a list of ints with
        `.finish_reason` and `.stats`)."""
        req = self.make_request(prompt, loops, max_tokens, temperature, top_k, top_p, repetition_penalty,
                                seed, cache_window, l_warmup_tokens, l_warmup_L, safety_check,
                                safety_norm_threshold, stop_token_ids)
        with self._lock:
            self._check_open()
            return drain(req.prompt, stream(self.engine, 0, req))

    def generate_batch(self, prompts, per_lane_loops=None, max_tokens=128, temperature=0.0, top_k=50,
                       top_p=1.0, repetition_penalty=1.0, seed=None, cache_window=0,
                       stop_token_ids=None) -> list[Generation]:
        """Lanes of different prompts and depths in one batched decode; lane i equals
        `generate(prompts[i], loops=per_lane_loops[i])`. seed: one int for all lanes or a list."""
        self._check_open()
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        ids = [self._prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        B = len(ids)
        if B > self.engine.cache.n_slots:
            raise ValueError(f"{B} lanes exceed the model's n_slots={self.engine.cache.n_slots}")
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
        order = sorted(range(B), key=lambda i: -loops[i])  # deepest lanes first
        with self._lock:
            self._check_open()
            out, reasons = batch(self.engine, [ids[i] for i in order], [loops[i] for i in order],
                                 int(max_tokens), sp, [seeds[i] for i in order], window, stops)
        result: list[Generation | None] = [None] * B
        for slot, i in enumerate(order):
            result[i] = Generation(ids[i] + out[slot], reasons[slot],
                                   {"prompt_tokens": len(ids[i]), "completion_tokens": len(out[slot])})
        return result


def drain(prompt: list[int], gen) -> Generation:
    tokens = list(prompt)
    try:
        while True:
            tokens.extend(next(gen))
    except StopIteration as stop:
        finish = stop.value
    return Generation(tokens, finish.reason, finish.stats)
