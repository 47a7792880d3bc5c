"""A plain PyTorch decoder of a looped transformer: the same-run baseline of the benchmarks.

In the style of gpt-fast, it shares the model's weights (no copy). Every layer run gets its
own static K/V cache: the prelude layers, one per (iteration, loop layer), then the coda.
The decode step has static shapes: it writes its K/V at `pos`, then attends over the whole
cache with a mask built from `pos`. So it compiles with fullgraph=True, and "reduce-overhead"
can capture it in CUDA graphs.

It shares no code with the engine (worker/runner/engine.py), only the weights and the RoPE formula
(kernels/rope.py `apply_rope_ref`).

    dec = PlainDecoder(model, max_seq_len=256, loops=8)
    logits = dec.prefill(tokens)                   # (1, T) -> (1, V), fp32
    logits = dec.step(token, pos)                  # (1, 1), (1,) device tensors -> (1, V)
    fast = dec.compiled("max-autotune-no-cudagraphs")   # same cache, compiled step
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tinyloop.kernels.rope import apply_rope_ref
from tinyloop.worker.model.modules import LoopedTransformer


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype) * norm.weight


class PlainDecoder:
    def __init__(self, model: LoopedTransformer, max_seq_len: int, loops: int):
        cfg = model.config
        self.model, self.config, self.loops, self.max_seq_len = model, cfg, loops, max_seq_len
        w = model.tok_embeddings.weight
        self.device = w.device
        n_layers = cfg.n_prelude + loops * cfg.n_loop_layers + cfg.n_coda
        shape = (1, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=w.device, dtype=w.dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=w.device, dtype=w.dtype) for _ in range(n_layers)]
        self.k_pos = torch.arange(max_seq_len, device=w.device)
        self.head = w if model.output is None else model.output.weight
        self.gqa = cfg.n_kv_heads != cfg.n_heads

    # -- the model ----------------------------------------------------------------------
    def _block(self, b, x, n: int, attend) -> torch.Tensor:
        a, f = b.attention, b.feed_forward
        B, T, _ = x.shape
        h = rms_norm(x, b.attention_norm)
        if hasattr(a, "wqkv"):  # the engine's fused projections, when it made them
            q, k, v = F.linear(h, a.wqkv).split(a._sizes(), -1)
        else:
            q, k, v = F.linear(h, a.wq.weight), F.linear(h, a.wk.weight), F.linear(h, a.wv.weight)
        q = q.view(B, T, a.n_heads, a.head_dim)
        k = k.view(B, T, a.n_kv_heads, a.head_dim)
        v = v.view(B, T, a.n_kv_heads, a.head_dim)
        o = F.linear(attend(n, q, k, v).transpose(1, 2).reshape(B, T, -1), a.wo.weight)
        if b.sandwich:
            o = rms_norm(o, b.post_attention_norm)
        x = x + o
        h = rms_norm(x, b.ffn_norm)
        if hasattr(f, "w13"):
            gate, up = F.linear(h, f.w13).chunk(2, -1)
        else:
            gate, up = F.linear(h, f.w1.weight), F.linear(h, f.w3.weight)
        o = F.linear(F.silu(gate) * up, f.w2.weight)
        if b.sandwich:
            o = rms_norm(o, b.post_ffn_norm)
        return x + o

    def _forward(self, tokens: torch.Tensor, attend) -> torch.Tensor:
        """tokens (1, T) -> logits of the last position (1, V) fp32; attend(n, q, k, v) is the
        attention of cache layer n."""
        m, n = self.model, 0
        x = m.tok_embeddings(tokens)
        for b in m.prelude:
            x, n = self._block(b, x, n, attend), n + 1
        for _ in range(self.loops):
            for b in m.loop:
                x, n = self._block(b, x, n, attend), n + 1
            if m.loop_norm is not None:
                x = rms_norm(x, m.loop_norm)
        for b in m.coda:
            x, n = self._block(b, x, n, attend), n + 1
        return F.linear(rms_norm(x[:, -1], m.norm), self.head).float()

    def _rope(self, positions: torch.Tensor):
        ang = positions.float()[None, :, None] * self.model.inv_freq  # (1, T, hd/2)
        return ang.cos(), ang.sin()

    # -- prefill and the decode step ------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (1, T) at positions [0, T): fill the cache, -> logits (1, V)."""
        T = tokens.shape[1]
        cos, sin = self._rope(torch.arange(T, device=tokens.device))

        def attend(n, q, k, v):
            q, k = apply_rope_ref(q, cos, sin).transpose(1, 2), apply_rope_ref(k, cos, sin).transpose(1, 2)
            v = v.transpose(1, 2)
            self.k[n][:, :, :T] = k
            self.v[n][:, :, :T] = v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)

        return self._forward(tokens, attend)

    def _step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self._rope(pos)
        mask = (self.k_pos <= pos).view(1, 1, 1, -1)  # static shape: the whole cache, masked

        def attend(n, q, k, v):
            q, k = apply_rope_ref(q, cos, sin).transpose(1, 2), apply_rope_ref(k, cos, sin).transpose(1, 2)
            self.k[n].index_copy_(2, pos, k)
            self.v[n].index_copy_(2, pos, v.transpose(1, 2))
            return F.scaled_dot_product_attention(q, self.k[n], self.v[n], attn_mask=mask, enable_gqa=self.gqa)

        return self._forward(token, attend)

    def step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """token (1, 1) int64 at position pos (1,) int64, both on the device -> logits (1, V)."""
        with torch.no_grad():
            return self._step(token, pos)

    def compiled(self, mode: str = "max-autotune-no-cudagraphs") -> "PlainDecoder":
        """The same decoder (same weights, same cache) with its step under torch.compile.
        Compiles at its first call; "reduce-overhead" also captures CUDA graphs."""
        # Fixed addresses, so CUDA graphs neither copy these in at each replay nor refuse the
        # in-place cache writes: the cache, and the fused projections (plain tensors, where
        # parameters are static already).
        static = self.k + self.v + [self.k_pos]
        for mod in self.model.modules():
            static += [getattr(mod, name) for name in ("wqkv", "w13") if hasattr(mod, name)]
        for t in static:
            torch._dynamo.mark_static_address(t)
        fn = torch.compile(self._step, mode=mode, fullgraph=True, dynamic=False)
        c = copy.copy(self)

        def step(token, pos):
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are done with
            return fn(token, pos)

        c._step = step
        return c


@torch.no_grad()
def greedy(dec: PlainDecoder, prompt: list[int], n: int, host_sync: bool = True) -> list[int]:
    """n greedy tokens after `prompt` (a prefill, then n - 1 steps). host_sync: read each token
    on the host as it comes (as a generator that streams tokens must); otherwise feed the
    token on the device and read them all at the end (gpt-fast's loop)."""
    dev = dec.device
    tok = dec.prefill(torch.tensor([prompt], device=dev)).argmax(-1, keepdim=True)  # (1, 1)
    pos = torch.tensor([len(prompt)], device=dev)
    out = [int(tok)] if host_sync else [tok]
    for _ in range(n - 1):
        tok = dec.step(tok, pos).argmax(-1, keepdim=True)
        pos += 1
        out.append(int(tok) if host_sync else tok)
    return out if host_sync else torch.cat(out, 1)[0].tolist()
