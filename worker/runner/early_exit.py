"""Early exit: per-token adaptive depth inside a decode step.

A request's `ExitRule` lets each of its decode tokens stop iterating the shared block before
the request's depth L, once a criterion says further iterations would change little. The
criteria, evaluated after iteration d (d iterations done) for each row still iterating:

    gate     Ouro's early-exit gate. λ_i = sigmoid(gate(h_i)) on the state after iteration i,
             p_i = λ_i · ∏_{j<i} (1 − λ_j) (the last iteration takes the remaining mass), and the
             token exits at the first d whose cumulative probability Σ_{i≤d} p_i ≥ threshold.
    kl       KL(p_d ‖ p_{d−1}) < threshold, p the next-token distribution that the coda and head
             give for the state after that iteration (one coda + head per checked iteration).
    latent   ‖n_d − n_{d−1}‖ / ‖n_d‖ < threshold, n the RMS-normalized state (no weight): the
             relative change of the normalized latent between successive iterations.
    argmax   the argmax of p has not changed for `patience` iterations (p_d … p_{d−patience}).

No exit before `min_loops` iterations; kl and latent compare two iterations' outputs, so their
earliest exit is after iteration 2, argmax's after 1 + patience. A token always stops at L.

The skipped iterations' cache layers still need the token's K/V: a later token at full depth
attends at every iteration (docs/early-exit.md). The `cache` policy fills them:

    recompute  (the default) the K/V projections of the exit state for every skipped layer:
               per block layer, W_k · norm(x_exit) and W_v · norm(x_exit) with RoPE, no
               attention and no MLP. The entries are what the first skipped iteration's first
               layer would have written; the block's weights are shared, so one projection per
               block layer serves every skipped iteration.
    copy       the exit iteration's own K/V, copied into each skipped iteration's layers.

Everything here is row-wise: a row's decision depends on its own values only, so a lane of a
batched step exits as it would alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.model.modules import LoopedTransformer, linear
from tinyloop.worker.runner.stages import device_tensor

CRITERIA = ("gate", "kl", "latent", "argmax")
CACHE_POLICIES = ("recompute", "copy")
# Thresholds when the request names none: gate, Ouro's remote code's own rule at a cumulative
# exit probability of one half; kl, Huginn's model card's 5e-4; latent, a relative change of
# 1 %; argmax takes none (its patience decides).
DEFAULT_THRESHOLD = {"gate": 0.5, "kl": 5e-4, "latent": 1e-2, "argmax": 1.0}
DEFAULT_PATIENCE = 2


@dataclass(frozen=True)
class ExitRule:
    criterion: str
    threshold: float
    min_loops: int = 1
    patience: int = DEFAULT_PATIENCE
    cache: str = "recompute"

    @property
    def needs_logits(self) -> bool:
        return self.criterion in ("kl", "argmax")

    def earliest(self) -> int:
        """The first iteration count after which this rule may stop a token."""
        first = {"gate": 1, "kl": 2, "latent": 2, "argmax": 1 + self.patience}[self.criterion]
        return max(first, self.min_loops)

    def first_logits(self) -> int:
        """The first iteration count whose logits the rule needs (kl / argmax): the ones its
        earliest decision compares with."""
        back = 1 if self.criterion == "kl" else self.patience
        return max(1, self.earliest() - back)


def check_rule(spec, cfg: LoopedConfig, name: str = "early_exit") -> ExitRule | None:
    """An ExitRule from a dict {criterion, threshold, min_loops, patience, cache} (or an
    ExitRule, or None: no exit). Missing criterion: the gate where the model has one, else
    latent; missing threshold: DEFAULT_THRESHOLD. A ValueError names the field that is wrong."""
    if spec is None:
        return None
    if isinstance(spec, ExitRule):
        spec = {"criterion": spec.criterion, "threshold": spec.threshold, "min_loops": spec.min_loops,
                "patience": spec.patience, "cache": spec.cache}
    if not isinstance(spec, dict):
        raise ValueError(f"{name} must be a dict or an ExitRule, got {type(spec).__name__}")
    unknown = set(spec) - {"criterion", "threshold", "min_loops", "patience", "cache"}
    if unknown:
        raise ValueError(f"{name} has unknown keys {sorted(unknown)}")
    criterion = spec.get("criterion") or ("gate" if cfg.exit_gate else "latent")
    if criterion not in CRITERIA:
        raise ValueError(f"{name}.criterion must be one of {', '.join(CRITERIA)}, got {criterion!r}")
    if criterion == "gate" and not cfg.exit_gate:
        raise ValueError(f"{name}.criterion 'gate' needs a model with an early-exit gate (Ouro's); this "
                         f"model has none: use kl, latent or argmax")
    threshold = spec.get("threshold")
    threshold = DEFAULT_THRESHOLD[criterion] if threshold is None else threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ValueError(f"{name}.threshold must be a number in (0, 1], got {threshold!r}")
    ints = {}
    for key, default in (("min_loops", 1), ("patience", DEFAULT_PATIENCE)):
        v = spec.get(key)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= cfg.max_loops:
            raise ValueError(f"{name}.{key} must be an int in [1, max_loops={cfg.max_loops}], got {v!r}")
        ints[key] = int(v)
    cache = spec.get("cache") or "recompute"
    if cache not in CACHE_POLICIES:
        raise ValueError(f"{name}.cache must be one of {', '.join(CACHE_POLICIES)}, got {cache!r}")
    return ExitRule(criterion, float(threshold), ints["min_loops"], ints["patience"], cache)


def normalized(state: torch.Tensor, eps: float) -> torch.Tensor:
    """(n, D) -> the RMS-normalized state in fp32 (the latent criterion's n)."""
    s = state.float()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


def gate_lambda(model: LoopedTransformer, state: torch.Tensor) -> torch.Tensor:
    """(n, D) states -> λ (n,) fp32: the gate's exit probability at that iteration."""
    g = model.exit_gate
    return torch.sigmoid((linear(state, g.weight) + g.bias).float()[..., 0])


class ExitState:
    """The criteria's per-row state over one decode step of B rows (original row order), and
    the decision after each iteration. Rows are named by their index in the step."""

    def __init__(self, model: LoopedTransformer, rules: list[ExitRule | None], depths: list[int],
                 device: torch.device):
        self.model, self.rules, self.depths = model, rules, depths
        B = len(rules)
        self.eps = model.config.norm_eps
        f32 = dict(dtype=torch.float32, device=device)
        self.remaining = torch.ones(B, **f32)     # gate: ∏ (1 − λ_j) so far
        self.cum = torch.zeros(B, **f32)          # gate: Σ p_j so far
        self.prev_n: torch.Tensor | None = None   # latent: (B, D) n of the last iteration
        self.prev_logp: torch.Tensor | None = None  # kl: (B, V) log p of the last iteration
        self.prev_arg = torch.full((B,), -1, dtype=torch.long, device=device)  # argmax
        self.streak = torch.zeros(B, dtype=torch.long, device=device)
        self.device = device

    def needs_logits(self, d: int, rows: list[int]) -> list[int]:
        """The rows (of `rows`, still iterating after iteration d) whose rule reads this
        iteration's next-token distribution."""
        out = []
        for r in rows:
            rule = self.rules[r]
            if rule is not None and rule.needs_logits and rule.first_logits() <= d < self.depths[r]:
                out.append(r)
        return out

    def decide(self, d: int, rows: list[int], states: torch.Tensor, logits: dict[int, torch.Tensor]) -> torch.Tensor:
        """After iteration d: rows (still iterating), their states (n, D) (the model-width part
        of the residual, in the order of `rows`), logits {row: (V,)} for needs_logits' rows ->
        (n,) bool on the device, True where the row stops now (at its depth, or its rule says so).
        The criteria's state is updated for every row whatever it decides."""
        n = len(rows)
        stop = device_tensor([d >= self.depths[r] for r in rows], self.device, torch.bool)
        by: dict[str, list[int]] = {}
        for k, r in enumerate(rows):
            rule = self.rules[r]
            if rule is not None:
                by.setdefault(rule.criterion, []).append(k)
        for criterion, ks in by.items():
            rs = [rows[k] for k in ks]
            kt, rt = self._index(ks), self._index(rs)
            thr = device_tensor([self.rules[r].threshold for r in rs], self.device, torch.float32)
            ok = device_tensor([d >= self.rules[r].earliest() for r in rs], self.device, torch.bool)
            if criterion == "gate":
                lam = gate_lambda(self.model, states.index_select(0, kt))
                last = device_tensor([d >= self.depths[r] for r in rs], self.device, torch.bool)
                rem = self.remaining.index_select(0, rt)
                p = torch.where(last, rem, lam * rem)  # the last iteration takes the mass left
                cum = self.cum.index_select(0, rt) + p
                self.cum.index_copy_(0, rt, cum)
                self.remaining.index_copy_(0, rt, rem * (1 - lam))
                hit = cum >= thr
            elif criterion == "latent":
                cur = normalized(states.index_select(0, kt), self.eps)
                if self.prev_n is None:
                    self.prev_n = torch.zeros(len(self.rules), cur.shape[-1], dtype=torch.float32,
                                              device=self.device)
                prev = self.prev_n.index_select(0, rt)
                rel = (cur - prev).norm(dim=-1) / cur.norm(dim=-1)
                self.prev_n.index_copy_(0, rt, cur)
                hit = rel < thr
            else:
                have = [k for k, r in zip(ks, rs) if r in logits]
                hit = torch.zeros(len(ks), dtype=torch.bool, device=self.device)
                if have:
                    at = self._index([ks.index(k) for k in have])
                    hr = self._index([rows[k] for k in have])
                    lg = torch.stack([logits[rows[k]] for k in have]).float()
                    if criterion == "kl":
                        logp = torch.log_softmax(lg, -1)
                        if self.prev_logp is None:
                            self.prev_logp = torch.zeros(len(self.rules), logp.shape[-1], dtype=torch.float32,
                                                         device=self.device)
                        prev = self.prev_logp.index_select(0, hr)
                        kl = (logp.exp() * (logp - prev)).sum(-1)
                        self.prev_logp.index_copy_(0, hr, logp)
                        hit.index_copy_(0, at, kl < thr.index_select(0, at))
                    else:
                        arg = lg.argmax(-1)
                        same = arg == self.prev_arg.index_select(0, hr)
                        streak = torch.where(same, self.streak.index_select(0, hr) + 1, 0)
                        self.streak.index_copy_(0, hr, streak)
                        self.prev_arg.index_copy_(0, hr, arg)
                        pat = device_tensor([self.rules[rows[k]].patience for k in have], self.device)
                        hit.index_copy_(0, at, streak >= pat)
            stop.index_copy_(0, kt, stop.index_select(0, kt) | (hit & ok))
        assert stop.shape[0] == n
        return stop

    def _index(self, values: list[int]) -> torch.Tensor:
        return device_tensor(values, self.device)


@torch.no_grad()
def fill_skipped(engine, exits: list[tuple[int, int, int, int, int, str]], x: torch.Tensor) -> None:
    """Fill the cache layers of the iterations a token skipped: exits [(row, slot, position,
    exit depth e, request depth L, policy)], x (B, 1, W) the residual after each row's last
    iteration (the exit state). Iterations [e, L) of every block layer get the token's K/V at
    its position; layers past L are never read at depth L (invariant 2), so none is written."""
    if not exits:
        return
    model, cache, cfg, ops = engine.model, engine.cache, engine.config, engine.ops
    nl = cfg.n_loop_layers
    for row, slot, pos, e, top, policy in exits:
        if e >= top:
            continue
        skipped = range(e, top)
        if policy == "copy":
            for j in range(nl):
                src = cfg.loop_layer_index(e - 1, j)
                dst = device_tensor([cfg.loop_layer_index(i, j) for i in skipped], cache.device)
                for t in (cache.k, cache.v):
                    t[dst, slot, :, pos] = t[src, slot, :, pos]
            continue
        xin = x[row:row + 1]  # (1, 1, W)
        if model.adapter is not None:  # an iteration starts with the adapter of (state | e)
            xin = linear(xin, model.adapter.weight)
            if model.adapter.bias is not None:
                xin = xin + model.adapter.bias
        pos_t = torch.full((1, 1), pos, dtype=torch.long, device=cache.device)
        cos, sin = model.rope_rows(pos_t, cache.max_seq_len)
        variants = model.loop_variants or [model.loop]
        for v_index, loop in enumerate(variants):
            its = [i for i in skipped if i % len(variants) == v_index]
            if not its:
                continue
            for j, layer in enumerate(loop):
                att = layer.attention
                h = layer.attention_norm(xin)
                k = linear(h, att.wk.weight)
                if hasattr(att, "k_bias"):
                    k = k + att.k_bias
                v = linear(h, att.wv.weight)
                k = ops.apply_rope(k.view(1, 1, att.n_kv_heads, att.head_dim), cos, sin)  # (1, 1, Hkv, hd)
                v = v.view(1, 1, att.n_kv_heads, att.head_dim)
                dst = device_tensor([cfg.loop_layer_index(i, j) for i in its], cache.device)
                cache.k[dst, slot, :, pos] = k[0, 0].to(cache.k.dtype)
                cache.v[dst, slot, :, pos] = v[0, 0].to(cache.v.dtype)


def histogram(depths: list[int], top: int) -> list[int]:
    """Counts of tokens by iterations run: entry d − 1 counts the tokens that ran d."""
    h = [0] * top
    for d in depths:
        h[d - 1] += 1
    return h
