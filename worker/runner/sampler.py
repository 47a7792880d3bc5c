"""Token sampling on the device: every row with its own parameters, from a counter-based
random stream.

Every random number is a pure function of (seed, absolute position, stream): a splitmix64
hash computed on the device. Any path that reaches the same position with the same logits
(fresh generate, resume, speculative verify, a batch lane) draws the same number, so seeded
sampling is path-independent. No generator state, no host synchronisation.

One call samples rows of any mix of parameters (`RowSampling`: each row's temperature, top-k,
top-p and repetition penalty as device tensors), so a batched step's streams sample together
whatever each asked for, and a row's token never depends on which rows ride with it: every op
is row-wise, and the one shape the rows share (the top-k width, the largest k among them)
changes no row's kept set. `SamplerGraphs` replays the same ops as a CUDA graph per row bucket,
so a sampled step costs a graph launch on the host, not the launches of some forty small ops
(the first call of a row bucket and parameter shape captures its graph: one host sync, once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.kernels import counter_hash
from tinyloop.kernels._checks import interpreting
from tinyloop.kernels.sample_rows import (MAX_VOCAB, STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TOKEN,
                                          accept_or_resample_ref, choose_rows, draw_rows, draw_rows_ref, probs_rows, probs_rows_ref,
                                          verdict_rows, verdict_rows_ref)
from tinyloop.worker.runner.stages import device_tensor

# (STREAM_TOKEN, STREAM_ACCEPT, STREAM_RESIDUAL: the independent random streams at one position,
# kernels/sample_rows.py's)


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int = STREAM_TOKEN) -> torch.Tensor:
    """seed, position (B,) int64 -> (B,) float64 uniforms in [0, 1) (kernels/counter_hash.py:
    one launch on CUDA, the same numbers as its torch reference elsewhere)."""
    if seed.is_cuda and seed.dim() == position.dim() == 1 and seed.dtype == position.dtype == torch.int64:
        return counter_hash.uniform(seed, position, stream)
    return counter_hash.uniform_ref(seed, position, stream)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters of one call, (B,) device tensors: temperature fp32 (0:
    greedy), top_k int64 (0 or >= V: no top-k), top_p fp32 (1: no top-p), penalty fp32 (1: no
    penalty); and what the host knows of them without reading the device: the largest top-k
    in force (0: none), whether any row keeps a top-p nucleus, has a penalty, or samples."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    penalty: torch.Tensor
    k_max: int
    top_p_any: bool
    penalty_any: bool
    sampled_any: bool

    @staticmethod
    def flags(params: list[SamplingParams], vocab: int) -> tuple[int, bool, bool, bool]:
        """(k_max, top_p_any, penalty_any, sampled_any) of rows `params` over a vocabulary of `vocab`."""
        sampled = [p for p in params if not p.greedy]
        k_max = max((p.top_k for p in sampled if 0 < p.top_k < vocab), default=0)
        # the top-k width rounded up to a power of two (at most the vocabulary): any width of at
        # least every row's k keeps the same sets, and few widths keep the sampler's graphs few
        k_max = min(1 << (k_max - 1).bit_length(), vocab) if k_max else 0
        return (k_max, any(p.top_p < 1.0 for p in sampled), any(p.repetition_penalty != 1.0 for p in params),
                bool(sampled))

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> "RowSampling":
        if all(p == params[0] for p in params):  # one sampler: fills, no copy from the host
            p, B = params[0], len(params)
            f32 = dict(dtype=torch.float32, device=device)
            return cls(torch.full((B,), p.temperature, **f32), torch.full((B,), p.top_k, dtype=torch.int64,
                                                                          device=device),
                       torch.full((B,), p.top_p, **f32), torch.full((B,), p.repetition_penalty, **f32),
                       *cls.flags(params, vocab))
        f = device_tensor([[p.temperature for p in params], [p.top_p for p in params],
                           [p.repetition_penalty for p in params]], device, torch.float32)
        k = device_tensor([p.top_k for p in params], device)
        return cls(f[0], k, f[1], f[2], *cls.flags(params, vocab))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor | None, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL-style penalty (Keskar et al. 2019): seen tokens' positive logits are divided by
    the row's penalty, negative ones multiplied. logits (B, V) fp32, seen (B, V) bool,
    penalty (B,) fp32 (a row with penalty 1 keeps its logits exactly)."""
    pen = penalty[:, None]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalised, logits)


def probs(logits: torch.Tensor, p: SamplingParams | RowSampling, fused: bool = False) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p, per row.
    (B, V) fp32. The logits are shifted by their maximum before the temperature divides them,
    so any temperature > 0 gives finite scores: the best token's is 0, and a tiny temperature
    sends the others to -inf (greedy in the limit) rather than overflowing to inf - inf = NaN.
    A greedy row (temperature 0) gets the distribution at temperature 1 (its token is the
    argmax all the same: `sample_rows`). fused (Settings.fused_sampler): one launch
    (kernels/sample_rows.py) where it applies (`_fits`), else the torch ops."""
    B, V = logits.shape
    if isinstance(p, SamplingParams):
        p = RowSampling.of([p] * B, V, logits.device)
    rows = probs_rows if _fits(fused, logits) else probs_rows_ref
    return rows(logits, p.temperature, p.top_k, p.top_p, p.k_max, p.top_p_any)


def draw(pr: torch.Tensor, u: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Inverse-CDF draw over tokens in descending-probability order, ties by index. pr (B, V),
    u (B,) float64 -> (B,). fused (Settings.fused_sampler): one launch (kernels/sample_rows.py)
    for a float32 pr where it applies (`_fits`), else the torch ops."""
    if pr.dtype == torch.float32 and _fits(fused, pr):
        return draw_rows(pr, u)
    return draw_rows_ref(pr, u)


def _fits(fused: bool, rows: torch.Tensor) -> bool:
    """Whether the fused launches take rows (B, V): asked for, a vocabulary one program holds,
    and a device Triton runs on (CUDA, or CPU tensors under the interpreter: the tests)."""
    return fused and rows.shape[-1] <= MAX_VOCAB and (rows.is_cuda or interpreting())


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                       u_accept: torch.Tensor, u_residual: torch.Tensor):
    """Speculative sampling's decision at one position, batched over rows
    (kernels/sample_rows.py's `accept_or_resample_ref`): (accepted (B,), token (B,)), the token
    distributed as p."""
    return accept_or_resample_ref(p, q, draft, u_accept, u_residual)


def chain_verdict(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, seed: torch.Tensor,
                  positions: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled chain round's decision, on the device. p (k + 1, V): the verifier's
    distributions over the chunk [t, d_1 .. d_k]; q (k, V) and drafts (k,): the drafts'
    distributions and tokens; seed (1,); positions (k + 1,): the token position each row of p
    decides. -> (n, targets (k + 1,)): n (a 0-d tensor) leading drafts accepted, each with
    probability min(1, p / q) (its STREAM_ACCEPT number); targets[i] the draft where accepted,
    else the STREAM_RESIDUAL draw from max(0, p_i - q_i); targets[k] the STREAM_TOKEN draw
    from p_k (the bonus after a whole chunk). The round emits targets[:n + 1]. fused
    (Settings.fused_sampler): one launch (kernels/sample_rows.py's `verdict_rows`) where it
    applies, else the torch ops (`verdict_rows_ref`, the uniforms in a launch each)."""
    if p.dtype == q.dtype == torch.float32 and _fits(fused, p):
        out = verdict_rows(p, q, drafts, seed, positions)
        return out[0], out[1:]
    return verdict_rows_ref(p, q, drafts, seed, positions, uniform)


def sample_rows(logits: torch.Tensor, seen: torch.Tensor | None, p: RowSampling, seed: torch.Tensor,
                position: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,) int64, row b for the token at absolute position[b]
    with seed[b] and its own parameters: the argmax of the penalised logits where the row is
    greedy, else the STREAM_TOKEN draw from `probs`. seen (B, V) bool: the tokens each row has
    seen (read only where p.penalty_any). fused (Settings.fused_sampler): the argmax or draw of
    every row in one launch (kernels/sample_rows.py's `choose_rows`) where it applies."""
    logits = logits.float()
    if p.penalty_any:
        logits = apply_repetition_penalty(logits, seen, p.penalty)
    if p.sampled_any and _fits(fused, logits):
        return choose_rows(logits, p.temperature, p.top_k, p.top_p, p.k_max, p.top_p_any, seed, position)
    best = logits.argmax(-1)
    if not p.sampled_any:
        return best
    return torch.where(p.temperature > 0, draw(probs(logits, p), uniform(seed, position)), best)


def sample(logits: torch.Tensor, seen: torch.Tensor | None, p: SamplingParams,
           seed: torch.Tensor, position: torch.Tensor | None) -> torch.Tensor:
    """sample_rows with every row on the parameters p (greedy reads no random number:
    position may be None)."""
    B, V = logits.shape
    if position is None:
        position = torch.zeros(B, dtype=torch.long, device=logits.device)
    return sample_rows(logits, seen, RowSampling.of([p] * B, V, logits.device), seed, position)


class SamplerGraphs:
    """sample_rows as CUDA graphs, one per (row bucket, the host flags of RowSampling), over
    static buffers a call fills: the logits, the seen masks, and the rows' float and integer
    parameters (one copy each). `capture` is the runner's graph capture (one shared
    pool: replays never overlap). fused: sample_rows' (Settings.fused_sampler)."""

    def __init__(self, vocab: int, buckets: list[int], device: torch.device, capture, fused: bool = False):
        self.vocab, self.buckets, self.device, self._capture = vocab, buckets, device, capture
        self.fused = fused
        self.logits = torch.zeros(buckets[-1], vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(buckets[-1], vocab, dtype=torch.bool, device=device)
        # per bucket: (3, bucket) temperature, top_p, penalty and (3, bucket) top_k, seed, position
        self.params = {b: (torch.ones(3, b, dtype=torch.float32, device=device),
                           torch.zeros(3, b, dtype=torch.int64, device=device)) for b in buckets}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # pinned host buffers the parameters go through (a copy from pageable memory would wait
        # for the queued work), a few in turn, each reused once the event behind its last copy
        # has passed (long before: the device runs at most a step or two behind the host)
        cuda = device.type == "cuda"
        self._ring = {b: [(torch.zeros(3, b, dtype=torch.float32, pin_memory=cuda),
                           torch.zeros(3, b, dtype=torch.int64, pin_memory=cuda),
                           torch.cuda.Event() if cuda else None) for _ in range(4)] for b in buckets}
        self._turn = {b: 0 for b in buckets}

    def drop(self) -> None:
        """Let go of the graphs now (Runner.close)."""
        self.graphs.clear()

    def covers(self, rows: int) -> bool:
        return rows <= self.buckets[-1]

    def sample(self, logits: torch.Tensor, seen: torch.Tensor | None, params: list[SamplingParams],
               seeds: list[int], positions: list[int]) -> torch.Tensor:
        """sample_rows of logits (B, V) on rows `params`, `seeds`, `positions` (host values)
        -> a fresh (B,) int64 device tensor (the graph's output buffer is copied out: the next
        call overwrites it)."""
        B = logits.shape[0]
        bucket = next(b for b in self.buckets if b >= B)
        flags = RowSampling.flags(params, self.vocab)
        pad = bucket - B  # rows past B: greedy, no penalty (their token is never read)
        f = torch.tensor([[p.temperature for p in params] + [0.0] * pad, [p.top_p for p in params] + [1.0] * pad,
                          [p.repetition_penalty for p in params] + [1.0] * pad], dtype=torch.float32)
        i = torch.tensor([[p.top_k for p in params] + [0] * pad, list(seeds) + [0] * pad,
                          list(positions) + [0] * pad], dtype=torch.int64)
        fparams, iparams = self.params[bucket]
        ring = self._ring[bucket]
        fhost, ihost, done = ring[self._turn[bucket]]
        self._turn[bucket] = (self._turn[bucket] + 1) % len(ring)
        if done is not None:
            done.synchronize()
        fhost.copy_(f)
        ihost.copy_(i)
        fparams.copy_(fhost, non_blocking=True)
        iparams.copy_(ihost, non_blocking=True)
        if done is not None:
            done.record()
        self.logits[:B].copy_(logits)
        if flags[2]:
            self.seen[:B].copy_(seen)
        key = (bucket, *flags)
        if key not in self.graphs:
            out = torch.empty(bucket, dtype=torch.long, device=self.device)
            rs = RowSampling(fparams[0], iparams[0], fparams[1], fparams[2], *flags)

            def run():
                out.copy_(sample_rows(self.logits[:bucket], self.seen[:bucket], rs, iparams[1], iparams[2],
                                      self.fused))
            self.graphs[key] = (self._capture(run), out)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:B].clone()
