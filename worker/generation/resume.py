"""Warm-start resume handles.

A handle is the prompt's cache for the prelude and the first L_used iterations, allocated
for max_loops iterations, plus the residual entering iteration L_used at every prompt
position. Resuming at new_L copies the populated layers into a working lane, restores the
residual, runs only iterations [L_used, new_L) over the prompt, runs the coda, and decodes.
Because iteration i reads the same weights at every depth, that state is exactly what a
fresh generate(loops=new_L) would have built.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tinyloop.worker.generation.decode import DecodeState, Prefill, Request, TokenStream, decode_steps
from tinyloop.worker.model.cache import CacheParts
from tinyloop.worker.runner.runner import Runner

_ids = itertools.count(1)


def handle_nbytes(cache: CacheParts, seq_len: int, max_loops: int, cache_window: int) -> int:
    """Bytes a handle holds: the cache's encoding (its kv_mode) of n_prelude +
    max_loops·n_loop_layers layers over seq_len positions (or the window), plus the
    (seq_len, residual_width) residual in the model dtype."""
    cfg = cache.config
    positions = min(seq_len, cache_window) if cache_window else seq_len
    layers = list(range(cfg.n_prelude + max_loops * cfg.n_loop_layers))
    return cache.bytes_for(layers, positions) + seq_len * cfg.residual_width * cache.dtype.itemsize


@dataclass(eq=False)
class ResumeHandle:
    owner: int                 # id of the runner that built it
    prompt: list[int]
    _loops_used: int
    _max_loops: int
    cache_window: int
    state: dict[str, torch.Tensor] | None  # the cache's parts (CacheParts.copy_out), in its kv_mode
    residual: torch.Tensor | None  # (1, T, D): enters iteration L_used
    kv_mode: str = "kv"
    id: int = 0

    def __post_init__(self):
        self.id = next(_ids)

    def seq_len(self) -> int:
        return len(self.prompt)

    def loops_used(self) -> int:
        return self._loops_used

    def max_loops(self) -> int:
        return self._max_loops

    def nbytes(self) -> int:
        if self.state is None:
            return 0
        return sum(t.nbytes for t in self.state.values()) + self.residual.nbytes

    @property
    def freed(self) -> bool:
        return self.state is None

    def free(self) -> None:
        self.state = self.residual = None


def build(runner: Runner, lane: int, prompt: list[int], L_used: int, max_loops: int,
          cache_window: int) -> ResumeHandle:
    """Prefill once at L_used through `lane` and keep what a deeper resume needs."""
    cfg, cache = runner.config, runner.cache
    T = len(prompt)
    positions = min(T, cache_window) if cache_window else T
    n_layers = cfg.n_prelude + max_loops * cfg.n_loop_layers
    used = cfg.n_prelude + L_used * cfg.n_loop_layers
    x = runner.build(lane, list(prompt), L_used, cache_window).residual
    state = cache.copy_out(lane, used, n_layers, positions)
    return ResumeHandle(id(runner), list(prompt), L_used, max_loops, cache_window, state, x, cache.mode)


def resume(runner: Runner, lane: int, handle: ResumeHandle, new_L: int, req: Request) -> TokenStream:
    """Clone the handle into `lane`, run iterations [L_used, new_L) over the prompt, decode."""
    return (yield from decode_steps(start(runner, lane, handle, new_L, req)))


def start(runner: Runner, lane: int, handle: ResumeHandle, new_L: int, req: Request) -> DecodeState:
    """Clone the handle into `lane` and run iterations [L_used, new_L) over the prompt: the
    state that decides the first token."""
    return Extension(runner, lane, handle, new_L, req).run(handle.seq_len())


class Extension(Prefill):
    """A resume's extension in chunks, which the worker's scheduler budgets as it does a
    prompt's prefill (a long handle then rides along with the running streams' decode steps
    instead of stalling them): the first `run` clones the handle into the lane, and `run(n)`
    runs iterations [L_used, new_L) and the coda over the next n prompt positions from the
    handle's residuals. Iteration i of a position reads the positions before it at iteration i
    only, which the earlier chunks wrote, so the chunks build the state one extension would.
    The chunk that ends the prompt returns the `DecodeState`; its stats count every chunk."""

    def __init__(self, runner: Runner, lane: int, handle: ResumeHandle, new_L: int, req: Request):
        super().__init__(runner, lane, req)
        self.new_L, self.loops_used = new_L, handle.loops_used()
        # held here: the handle may be freed (evicted, released) while its chunks run
        self._handle_state, self._residual = handle.state, handle.residual

    @property
    def joinable(self) -> bool:
        return False  # no fresh prompt: prefill_together cannot take it

    def _chunk(self, a: int, b: int):
        runner, req, lane = self.runner, self.req, self.lane
        if a == 0:
            cfg = runner.config
            runner.cache.copy_in(lane, self._handle_state, cfg.n_prelude + self.loops_used * cfg.n_loop_layers)
        return runner.extend(lane, self._residual[:, a:b], self.loops_used, self.new_L, a, req.window,
                             req.safety_threshold is not None)

    def _decode_state(self, out) -> DecodeState:
        self._handle_state = self._residual = None
        st = super()._decode_state(out)
        st.extra_stats["prompt_loop_iterations"] = self.work.loop_iterations
        return st
