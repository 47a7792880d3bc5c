"""A greedy speculative chain round over static buffers: drafts, verify and acceptance with no
host value inside, so one CUDA graph replays the whole round (`Graphs.capture_round`) and the
host reads one small result per round, after the next round has been launched.

A round of `ChainRound(engine, Ld, Lv, k)` on the lane in `slot` reads its lane's state, the
decided token t and its position p, from `state[lane]` (device memory), and then:

- feeds t at p, d_1 at p + 1, ..., d_k at p + k, one batch-1 decode step each at depth Ld,
  each the computation of the plain decode step (`graphs.decode_step`): the same kernels in the
  same order, the head's argmax key and `greedy_feed` giving the next draft. The last step runs
  no coda (only its residual is needed). Every step keeps its residual after Ld iterations.
- verifies the chunk [t, d_1 .. d_k] at positions p .. p + k: iterations [Ld, Lv) from the
  saved residuals, the coda and the head over the k + 1 rows (the speculative module's
  warm-start verification).
- accepts on the device: n = the number of leading drafts equal to the verifier's argmax;
  the round decides targets[0 .. n] (the verifier's tokens at p + 1 .. p + n + 1), and leaves
  state[lane] = (targets[n], p + n + 1) for the next round.
- writes [n, targets[0], ..., targets[k]] into `out`, which the runner copies to the host.

Because the state lives in device memory per lane, a round of one lane may be launched while
rounds of other lanes run or wait, and a lane's next round may be launched before the host
has read this one: it starts where this one leaves the state.

A sampled round (`sampling`: the host flags of the lane's parameters, `RowSampling.flags`)
runs the same passes and decides as the host-driven sampled chain does (Leviathan et al. 2023,
Chen et al. 2023), every random number its position's counter-based draw (runner/sampler.py):
draft i is the STREAM_TOKEN draw from q_i = probs(draft logits) at p + i + 1; the verify's
distributions p_i accept draft i with probability min(1, p_i / q_i) (STREAM_ACCEPT), the first
rejection emits a STREAM_RESIDUAL draw from max(0, p_i - q_i), and a fully accepted chunk the
STREAM_TOKEN draw from p_k. The lane's temperature, top-k, top-p and seed are read from
`params[lane]` (device memory, written when its stream starts rounds), so one graph serves
every stream whose parameters share the flags. A repetition penalty, which depends on the
tokens emitted so far, is refused (as speculative requests refuse it).

With batch-invariant kernels (Settings.batch_invariant) every row of the verify is computed as
the plain decode step computes it, so the tokens equal generate(loops=Lv)'s bit for bit;
without them they do in fp32 (the CPU tests) and up to near ties in bf16. Only `runner.Runner`
builds and runs rounds.
"""
from __future__ import annotations

import functools

import torch

from tinyloop.kernels.chain_state import chain_leave, chain_leave_ref, chain_load, chain_load_ref
from tinyloop.kernels.gemv import ARGMAX_KEY_NONE
from tinyloop.kernels.sampling import greedy_feed, greedy_feed_ref
from tinyloop.worker.runner.engine import Engine
from tinyloop.worker.runner.sampler import STREAM_TOKEN, RowSampling, chain_verdict, draw, probs, uniform


class ChainRound:
    """The static buffers and the eager run of one (Ld, Lv, k) round (what a graph captures)."""

    def __init__(self, engine: Engine, state: torch.Tensor, draft_loops: int, verify_loops: int, k: int,
                 sampling: tuple[int, bool] | None = None, params: tuple[torch.Tensor, torch.Tensor] | None = None,
                 fused: bool = False):
        """sampling: None (greedy) or the (k_max, top_p_any) flags of the lanes it serves;
        params: then the per-lane tables (lanes, 2) fp32 [temperature, top_p] and (lanes, 2)
        int64 [top_k, seed]; fused: the sampled round's distributions and draws in a launch
        each (Settings.fused_sampler, as the host-driven rounds and plain sampling take them)."""
        if not 1 <= draft_loops < verify_loops:
            raise ValueError(f"a round drafts at 1 <= draft_loops < verify_loops, got {draft_loops}, {verify_loops}")
        if k < 1:
            raise ValueError(f"a round drafts k >= 1 tokens, got {k}")
        self.engine, self.state = engine, state
        self.Ld, self.Lv, self.k = draft_loops, verify_loops, k
        cfg, dev = engine.config, engine.cache.device
        table = engine.model.tok_embeddings.weight.detach()
        self.table = table
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.x = table.new_zeros(1, 1, table.shape[1])
        self.key = torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.long, device=dev)
        # greedy_feed's host ring (the plain step's): written, never read here
        self.ring = torch.zeros(2, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.residuals = torch.zeros(1, k + 1, cfg.residual_width, dtype=table.dtype, device=dev)
        self.drafts = torch.zeros(k, dtype=torch.long, device=dev)
        self.chunk_positions = torch.zeros(1, k + 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(k + 2, dtype=torch.long, device=dev)
        self.sampling, self.params, self.fused = sampling, params, fused
        if sampling is not None:
            if params is None:
                raise ValueError("a sampled round reads its lane's parameters: pass the params tables")
            self.qs = torch.zeros(k, cfg.vocab_size, dtype=torch.float32, device=dev)  # the drafts' q
        # (pdl: Settings.pdl, which the engine's ops carry on either backend)
        self._feed = functools.partial(greedy_feed if dev.type == "cuda" else greedy_feed_ref, pdl=engine.ops.pdl)
        # the lane state's loads and stores: one launch each with the Triton ops (interpreted on
        # the CPU too), the torch spec's few small kernels else
        triton_ops = engine.ops.name == "triton"
        self._chain_load = chain_load if triton_ops else chain_load_ref
        self._chain_leave = chain_leave if triton_ops else chain_leave_ref

    @property
    def work(self) -> tuple[int, int]:
        """(loop iterations, token iterations) one round runs: every chunk token Lv in all."""
        return (self.k + 1) * self.Ld + (self.Lv - self.Ld), (self.k + 1) * self.Lv

    def _load(self) -> None:
        """The lane's token and position (state[lane]) into the round's inputs."""
        self._chain_load(self.state, self.slot, self.table, self.tokens, self.positions, self.chunk_positions,
                         self.x)

    def _leave(self, targets: torch.Tensor, n: torch.Tensor | None = None) -> None:
        """The round's result: [n, targets] into `out`, and the lane's next (token, position);
        n: the sampled verdict's, else (greedy) the leading drafts equal to their targets."""
        decided = {"drafts": self.drafts} if n is None else {"n": n.view(1)}
        self._chain_leave(targets, self.state, self.slot, self.chunk_positions, self.out, **decided)

    @torch.no_grad()
    def run(self) -> None:
        if self.sampling is not None:
            return self._run_sampled()
        e, k, S = self.engine, self.k, self.engine.cache.max_seq_len
        self._load()
        for i in range(k + 1):
            p = e.make_pass(self.slot, self.positions, S)
            h = e.run_loops(e.prelude(self.x, p), p, 0, self.Ld)
            self.residuals[:, i].copy_(h[:, 0])
            if i < k:
                e.logits(e.coda(h, p), p, argmax_key=self.key)
                self.drafts[i:i + 1].copy_(self._feed(self.key, self.tokens, self.positions, self.ring,
                                                      self.table, self.x))
        pc = e.make_pass(self.slot, self.chunk_positions, S)
        h = e.run_loops(self.residuals, pc, self.Ld, self.Lv)
        targets = e.logits(e.coda(h, pc))[0].argmax(-1)             # (k + 1,): tokens at p + 1 .. p + k + 1
        self._leave(targets)

    def _lane_sampling(self, rows: int) -> tuple[RowSampling, torch.Tensor]:
        """The lane's parameters as `rows` rows of RowSampling, and its seed (rows,)."""
        f = self.params[0].index_select(0, self.slot)[0]   # temperature, top_p
        i = self.params[1].index_select(0, self.slot)[0]   # top_k, seed
        k_max, top_p_any = self.sampling
        rs = RowSampling(f[0].expand(rows), i[0].expand(rows), f[1].expand(rows),
                         torch.ones(rows, dtype=torch.float32, device=f.device), k_max, top_p_any, False, True)
        return rs, i[1].expand(rows)

    def _run_sampled(self) -> None:
        """run() of a sampled round: the host-driven sampled chain's decisions (module docstring)."""
        e, k, S = self.engine, self.k, self.engine.cache.max_seq_len
        V = self.qs.shape[1]
        self._load()
        one, seed = self._lane_sampling(1)
        for i in range(k + 1):
            p = e.make_pass(self.slot, self.positions, S)
            h = e.run_loops(e.prelude(self.x, p), p, 0, self.Ld)
            self.residuals[:, i].copy_(h[:, 0])
            if i < k:
                q = probs(e.logits(e.coda(h, p), p).view(1, V), one, self.fused)
                self.qs[i].copy_(q[0])
                self.positions += 1
                d = draw(q, uniform(seed, self.positions.view(1), STREAM_TOKEN), self.fused)
                self.drafts[i:i + 1].copy_(d)
                self.tokens.copy_(d.view(1, 1))
                torch.index_select(self.table, 0, d, out=self.x.view(1, -1))
        pc = e.make_pass(self.slot, self.chunk_positions, S)
        h = e.run_loops(self.residuals, pc, self.Ld, self.Lv)
        rows, _ = self._lane_sampling(k + 1)
        pv = probs(e.logits(e.coda(h, pc))[0], rows, self.fused)     # (k + 1, V): p at p + 1 .. p + k + 1
        n, targets = chain_verdict(pv, self.qs, self.drafts, seed, self.chunk_positions[0] + 1, self.fused)
        self._leave(targets, n)
