"""The eager stages of the model against the static cache, on a pluggable ops backend.

The stages every generation path composes (through `runner.Runner`):

    embed_prelude -> run_loops(start, stop) -> coda -> logits

A `Pass` says where a chunk of tokens sits: its cache slots (a device tensor, so a captured
stage serves any lane), its absolute positions and the sliding window. Nothing in a stage
reads a device value on the host, so a stage can be captured in a CUDA graph. This module
counts nothing and knows nothing of graphs: the runner does both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tinyloop.worker.model.cache import CacheParts
from tinyloop.worker.model.modules import Attend, LoopedTransformer
from tinyloop.worker.model.ops import Ops, causal_attention, masked_attention
from tinyloop.worker.runner.hattend import HAttend


@dataclass
class Tree:
    """Tree mode for a pass: the chunk's tokens are nodes of a draft tree laid out in cache
    slots after a shared prefix, and each attends to the prefix plus its own ancestors only.

    The mask stays compact: one int64 bitmask row per node (bit u: node u is the node itself
    or an ancestor), never a dense (B, H, q, k) tensor."""
    slots: torch.Tensor          # (B, T) int64 cache slot of each query token (prefix_lens + node)
    prefix_lens: torch.Tensor    # (B,) int64 slots [0, prefix_len) are the shared prefix
    ancestors: torch.Tensor      # (B, N) int64 bitmask over the N nodes written so far
    query_nodes: torch.Tensor | None = None  # (T,) node index of each query; None: all N nodes
    # batch-invariant reads (Ops.invariant): each node's depth (B, N) and the cache slots of its
    # ancestors by depth (B, N, D), so that it attends as a decode step of its branch would
    depth: torch.Tensor | None = None
    ancestor_slots: torch.Tensor | None = None


RopeRows = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # LoopedTransformer.rope_rows


@dataclass
class Pass:
    """Where a chunk sits. Its RoPE rows, cos and sin (B, T, hd/2) at the positions, are gathered
    from the model's tables when an attention first asks (`rope_rows`) and kept for the other
    layers: a decode step on the full cache never asks, its attention op gathers one row per
    lane itself. A pass whose stages are captured as separate graphs must gather them before
    the first capture (PaddedPrefill does), or a replay of a later stage would read rows that
    only the first stage's replay writes."""
    slots: torch.Tensor          # (B,) int64 on the device: the cache slot (lane) of each row
    positions: torch.Tensor      # (B, T) int64 absolute positions; outside tree mode, T > 1
                                 # are consecutive and end at kv_len - 1 (a prompt, a chunk)
    kv_len: int                  # host-side bound: every position in the pass is < kv_len
    window: int = 0              # 0: full cache; W > 0: ring of W positions per lane
    rope: RopeRows | None = None           # None: no attention of the pass asks for rows
    norm_max: torch.Tensor | None = None   # (B,) max residual L2 norm seen per lane, if tracked
    trace: list | None = None              # (label, (B, D) last-position residual) per stage
    tree: Tree | None = None               # tree mode (speculative verify); None: causal chunk
    seq_lens: torch.Tensor | None = None   # (B,) positions[:, -1] + 1: what a ring decode step attends to
    rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # rope_rows, once asked

    def rope_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, T, hd/2) fp32 at the positions."""
        if self.rows is None:
            self.rows = self.rope(self.positions, self.kv_len)
        return self.rows

    def narrow(self, n: int) -> "Pass":
        """The first n rows (mixed-depth passes keep the deepest lanes first)."""
        return Pass(self.slots[:n], self.positions[:n], self.kv_len, self.window, self.rope,
                    None if self.norm_max is None else self.norm_max[:n], None,
                    seq_lens=None if self.seq_lens is None else self.seq_lens[:n],
                    rows=None if self.rows is None else (self.rows[0][:n], self.rows[1][:n]))


@dataclass
class Counters:
    """Instrumentation: how much loop-block work actually ran."""
    loop_iterations: int = 0        # shared-block applications (one per iteration per pass)
    loop_token_iterations: int = 0  # the same, weighted by tokens x lanes

    def snapshot(self) -> "Counters":
        return Counters(self.loop_iterations, self.loop_token_iterations)

    def since(self, before: "Counters") -> "Counters":
        return Counters(self.loop_iterations - before.loop_iterations,
                        self.loop_token_iterations - before.loop_token_iterations)

    def plus(self, other: "Counters") -> "Counters":
        return Counters(self.loop_iterations + other.loop_iterations,
                        self.loop_token_iterations + other.loop_token_iterations)

    def add(self, iterations: int, token_iterations: int) -> "Counters":
        """Count in place; returns what was added, as a Counters (a stage's own work)."""
        self.loop_iterations += iterations
        self.loop_token_iterations += token_iterations
        return Counters(iterations, token_iterations)


@dataclass
class Engine:
    model: LoopedTransformer
    cache: CacheParts
    ops: Ops

    def __post_init__(self):
        self.config = self.model.config
        self.scale = self.config.head_dim ** -0.5
        if self.cache.max_seq_len > self.model.rope_cos.shape[0]:
            raise ValueError(f"a cache of {self.cache.max_seq_len} positions needs RoPE tables that long, "
                             f"the model has {self.model.rope_cos.shape[0]} (its max_seq_len)")

    # -- passes --------------------------------------------------------------------------
    def make_pass(self, slots: torch.Tensor, positions: torch.Tensor, kv_len: int, window: int = 0,
                  track_norm: bool = False, trace: list | None = None) -> Pass:
        B = positions.shape[0]
        norm_max = torch.zeros(B, device=positions.device) if track_norm else None
        # a ring-window decode step reads p.seq_lens in every layer: computed once per pass
        seq_lens = positions[:, -1] + 1 if positions.shape[1] == 1 and window else None
        return Pass(slots, positions, kv_len, window, self.model.rope_rows, norm_max, trace, seq_lens=seq_lens)

    # -- stages --------------------------------------------------------------------------
    @torch.no_grad()
    def embed_prelude(self, tokens: torch.Tensor, p: Pass) -> torch.Tensor:
        """tokens (B, T) -> residual (B, T, D) after the prelude."""
        return self.prelude(self.model.tok_embeddings(tokens), p)

    @torch.no_grad()
    def prelude(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        """The embedded tokens (B, T, D) -> the residual entering iteration 0 (B, T,
        residual_width) (x is read, not written). With input injection that is the initial
        latent state beside the prelude's output, the state drawn from each row's lane seed
        (cache.seeds) at the rows' positions."""
        self._trace(p, "embed", x)
        x = self.model.embedded(x)
        for j, layer in enumerate(self.model.prelude):
            x = layer(x, self._attend(j, p, layer.attention))
            self._trace(p, f"pre.{j}", x)
        seeds = self.cache.seeds.index_select(0, p.slots) if self.config.inject else None
        return self.model.loop_input(x, seeds, p.positions)

    @torch.no_grad()
    def run_loops(self, x: torch.Tensor, p: Pass, start: int, stop: int,
                  lane_loops: list[int] | None = None, depth: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Apply iterations [start, stop) of the shared block to the residual x.

        out: a buffer of x's shape (x itself allowed) that the last iteration writes its
        result into, and which is returned: a stage set's static residual takes the result
        with no copy of its own (with depth, the kept rows are selected straight into it).

        Two forms of per-lane depth (mixed-depth batches):
        - lane_loops, sorted in descending order: iteration i advances only the lanes with
          depth > i, a prefix of the batch.
        - depth (B,) int64 on the device, lanes in any order: iteration i runs on every lane
          and keeps the result where depth > i (a lane past its depth carries its residual
          through unchanged). A lane past its depth still writes its K/V into iteration i's
          cache layers at its positions. That is harmless: a request at depth L never reads a
          layer past n_prelude + L·n_loop_layers (invariant 2), and a request that does read
          layer l at position q has written (l, q) itself first (its prefill or resume writes
          its prompt positions in every layer it uses, and each decode step writes its
          position before attending to it). tests/worker/test_batcher.py poisons those layers."""
        cfg = self.config
        for i in range(start, stop):
            n = x.shape[0] if lane_loops is None else sum(d > i for d in lane_loops)
            q = p if n == x.shape[0] else p.narrow(n)
            attends = [self._attend(cfg.loop_layer_index(i, j), q, self.model.loop[j].attention)
                       for j in range(cfg.n_loop_layers)]
            y = self.model.iteration(x[:n], attends, i)
            if depth is not None:
                y = torch.where((depth > i)[:, None, None], y, x, out=out if i == stop - 1 else None)
            x = y if n == x.shape[0] else torch.cat([y, x[n:]], 0)
            if p.norm_max is not None:
                # per-iteration safety check: the residual norm of every token, kept on device
                p.norm_max[:n] = torch.maximum(p.norm_max[:n], self.model.state(y).float().norm(dim=-1).amax(-1))
            self._trace(p, f"loop.{i}", x)
        if out is not None and x is not out:
            x = out.copy_(x)
        return x

    @property
    def interleaves(self) -> bool:
        """Whether rows at different iterations can share one pass (`iteration_rows`): the
        K/V cache (one tensor over every layer and lane) and one weight set for every iteration."""
        return self.cache.mode == "kv" and not self.model.loop_variants

    @torch.no_grad()
    def iteration_rows(self, x: torch.Tensor, p: Pass, rows: torch.Tensor) -> torch.Tensor:
        """One iteration of the shared block over decode rows (T = 1, full cache) that each sit
        at their own iteration: rows (n_loop_layers, B), row b's loop layer j's row of the
        layer-flattened cache (cache layer · n_slots + lane; kernels/interleave.py), so that it
        writes and reads the cache layer of its own iteration. The weights are the same at
        every iteration (`interleaves`), so only the cache rows tell the iterations apart."""
        if not self.interleaves:
            raise ValueError("rows at different iterations share a pass only over the K/V cache with one "
                             "weight set for every iteration")
        kc, vc = self.cache.k.flatten(0, 1), self.cache.v.flatten(0, 1)  # (layers · n_slots, Hkv, S, hd)
        ops, scale, model, pos = self.ops, self.scale, self.model, p.positions[:, 0]

        def attend_at(r: torch.Tensor) -> Attend:
            return lambda q, k, v: ops.rope_decode_attention(q, k, v, model.rope_cos, model.rope_sin, pos, kc, vc,
                                                             scale, slots=r)[:, :, None]
        return model.iteration(x, [attend_at(rows[j]) for j in range(self.config.n_loop_layers)])

    @torch.no_grad()
    def coda(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        """The residual after the last iteration -> the coda's output (B, T, D)."""
        x = self.model.exit_loop(x)
        for j, layer in enumerate(self.model.coda):
            x = layer(x, self._attend(self.cache.coda_layer(j), p, layer.attention))
            self._trace(p, f"coda.{j}", x)
        return x

    @torch.no_grad()
    def logits(self, x: torch.Tensor, p: Pass | None = None, argmax_key: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of x; argmax_key: see LoopedTransformer.logits."""
        if p is not None and p.trace is not None:
            norm = self.model.norm
            p.trace.append(("final_ln", (x[:, -1] if norm is None else norm(x[:, -1])).float()))
        return self.model.logits(x, torch.float32, argmax_key)

    def forward(self, tokens: torch.Tensor, p: Pass, loops: int, lane_loops: list[int] | None = None,
                last_only: bool = True, depth: torch.Tensor | None = None) -> torch.Tensor:
        """The whole model over a chunk: logits (B, T or 1, V). lane_loops / depth: per-lane
        depths (see run_loops), with `loops` their maximum."""
        x = self.embed_prelude(tokens, p)
        x = self.run_loops(x, p, 0, loops, lane_loops, depth)
        x = self.coda(x, p)
        return self.logits(x[:, -1:] if last_only else x, p)

    # -- attention against the cache -----------------------------------------------------
    def _attend(self, layer: int, p: Pass, attention) -> Attend:
        """The attend of cache layer `layer` for `attention` (whose W_k / W_v a store-h cache
        rebuilds K / V with)."""
        if self.cache.mode != "kv":
            return HAttend(self, layer, p, attention)
        kc = self.cache.k[layer]  # (n_slots, Hkv, S, hd): rows pick their slot (p.slots)
        vc = self.cache.v[layer]
        ops, scale, W, model, slots = self.ops, self.scale, p.window, self.model, p.slots

        def attend(q, k, v):
            T = q.shape[1]
            if p.tree is not None:
                return self._attend_tree(q, k, v, p, kc, vc)
            if W == 0 and T == 1:
                # a decode step: RoPE (rows of the model's tables, gathered by the op), the
                # cache write and attention in one op; a position outside the cache (an idle
                # lane of a batched step) writes and reads nothing
                return ops.rope_decode_attention(q, k, v, model.rope_cos, model.rope_sin, p.positions[:, 0],
                                                 kc, vc, scale, slots=slots)[:, :, None]
            if W == 0 and ops.invariant:
                # batch-invariant: a chunk's K / V written first, then each of its tokens attends
                # through the decode step's own kernel at its position (as if decoded one by one)
                return ops.rope_chunk_attention(q, k, v, model.rope_cos, model.rope_sin, p.positions, kc, vc,
                                                scale, slots=slots)
            if W == 0 or T == 1:
                # write first, then read: a single new token cannot evict a key it needs
                write_idx = p.positions if W == 0 else p.positions % W
                qr = ops.rope_cache_write(q, k, v, *p.rope_rows(), write_idx, kc, vc, slots=slots)  # (B, H, T, hd)
                if T == 1:
                    return ops.decode_attention(qr[:, :, 0], kc[:, :, :W], vc[:, :, :W],
                                                p.seq_lens, scale, slots=slots)[:, :, None]
                keys, vals = _rows(kc, slots, p.kv_len), _rows(vc, slots, p.kv_len)
                if T == p.kv_len:
                    # a fresh prompt (positions 0..T-1, see Pass): plain causal attention, no
                    # mask to build, the fused SDPA kernels
                    return causal_attention(qr, keys, vals, scale)
                k_pos = torch.arange(p.kv_len, device=q.device)
                return masked_attention(qr, keys, vals, p.positions, k_pos, 0, scale)
            return self._attend_ring_chunk(q, k, v, p, kc, vc)

        return attend

    def _attend_ring_chunk(self, q, k, v, p: Pass, kc, vc):
        """A chunk of T > 1 tokens with a window of W: writing the chunk first could evict
        keys its own earlier queries still need, so attend to (ring as it stands + chunk),
        then write the chunk's last W tokens."""
        W = p.window
        T = q.shape[1]
        cos, sin = p.rope_rows()
        qr = self.ops.apply_rope(q, cos, sin).transpose(1, 2)  # (B, H, T, hd)
        kr = self.ops.apply_rope(k, cos, sin).transpose(1, 2)  # (B, Hkv, T, hd)
        vt = v.transpose(1, 2)
        last = p.positions[:, :1] - 1                              # (B, 1) newest position in the ring
        slot = torch.arange(W, device=q.device)
        ring_pos = last - (last - slot).remainder(W)               # (B, W); < 0 means empty
        keys = torch.cat([_rows(kc, p.slots, W).to(kr.dtype), kr], 2)
        vals = torch.cat([_rows(vc, p.slots, W).to(vt.dtype), vt], 2)
        out = masked_attention(qr, keys, vals, p.positions, torch.cat([ring_pos, p.positions], 1),
                               W, self.scale)
        tail = slice(max(0, T - W), T)
        idx = (p.positions[:, tail] % W)[:, None, :]               # (B, 1, t)
        lane = p.slots[:, None, None]                              # (B, 1, 1)
        head = torch.arange(kr.shape[1], device=q.device)[None, :, None]  # (1, Hkv, 1)
        kc.index_put_((lane, head, idx), kr[:, :, tail].to(kc.dtype))
        vc.index_put_((lane, head, idx), vt[:, :, tail].to(vc.dtype))
        return out

    def _attend_tree(self, q, k, v, p: Pass, kc, vc):
        """Write the nodes' K / V at their slots, then attend with the ancestor bitmask. Keys
        past kv_len (nodes not written yet, stale entries) are never part of the read."""
        t = p.tree
        if self.ops.invariant:
            return self._attend_tree_invariant(q, k, v, p, kc, vc)
        qr = self.ops.rope_cache_write(q, k, v, *p.rope_rows(), t.slots, kc, vc, slots=p.slots)  # (B, H, T, hd)
        if t.query_nodes is not None:
            # a subset of the nodes asks (one depth of a tree being drafted): the op's query
            # t is node t, so place the queries at their nodes and read those rows back
            B, H, _, hd = qr.shape
            full = qr.new_zeros(B, H, t.ancestors.shape[1], hd)  # (B, H, N, hd)
            qr = full.index_copy(2, t.query_nodes, qr)
        out = self.ops.tree_attention(qr, kc[:, :, :p.kv_len], vc[:, :, :p.kv_len], t.prefix_lens,
                                      t.ancestors, self.scale, slots=p.slots)
        return out if t.query_nodes is None else out.index_select(2, t.query_nodes)

    def _attend_tree_invariant(self, q, k, v, p: Pass, kc, vc):
        """The tree pass with batch-invariant kernels: each node attends as the decode step of
        its own branch would at its position (its ancestors read from their node slots in depth
        order), through the decode step's kernel, so a tree verify equals plain decoding."""
        t, model = p.tree, self.model
        if t.depth is None or t.ancestor_slots is None:
            raise ValueError("a batch-invariant tree pass needs each node's depth and ancestor slots")
        slots, depth, anc, positions = t.slots, t.depth, t.ancestor_slots, p.positions
        if t.query_nodes is not None:
            slots, depth = slots.index_select(1, t.query_nodes), depth.index_select(1, t.query_nodes)
            anc = anc.index_select(1, t.query_nodes)
        return self.ops.rope_tree_attention(q, k, v, model.rope_cos, model.rope_sin, positions, slots, depth, anc,
                                            t.prefix_lens, kc, vc, self.scale, slots=p.slots)

    def _trace(self, p: Pass, label: str, x: torch.Tensor) -> None:
        if p.trace is not None:
            p.trace.append((label, self.model.state(x[:, -1]).float().clone()))



def _rows(cache: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """The first n positions of the slots' lanes of one cache layer (B, Hkv, n, hd): a gather
    of what the read needs, never of the whole lane."""
    return cache[:, :, :n].index_select(0, slots)
