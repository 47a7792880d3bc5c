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

    copy       (the default) the exit iteration's own K/V, copied into each skipped
               iteration's layers: a gather and a scatter per block layer, no arithmetic.
    recompute  the K/V projections of the exit state for every skipped layer: per block layer,
               W_k · norm(x_exit) and W_v · norm(x_exit) with RoPE, no attention and no MLP.
               The entries are what the first skipped iteration's first layer would have
               written; the block's weights are shared, so one projection per block layer
               serves every skipped iteration.

copy is the default because it costs no projection and measured no worse: on the embedded
default model at L = 16 its held-out bits per byte are the lower of the two at six of the
seven rules of bench/results/early-exit-cpu.json (docs/early-exit.md).

Everything here is row-wise: a row's decision depends on its own values only, so a lane of a
batched step exits as it would alone.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from tinyloop.kernels.exit_check import CRITERION_IDS, exit_check_ref
from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.model.modules import LoopedTransformer, linear
from tinyloop.worker.runner.stages import device_tensor

CRITERIA = ("gate", "kl", "latent", "argmax")
CACHE_POLICIES = ("copy", "recompute")
# Thresholds when the request names none: gate, a cumulative exit probability of one half;
# kl, Huginn's model card's 5e-4; latent, a relative change of 5 % (on the embedded default
# model at L = 16 the one that keeps held-out bits per byte within 1 % of full depth,
# bench/results/early-exit-cpu.json); argmax takes none (its patience decides).
DEFAULT_THRESHOLD = {"gate": 0.5, "kl": 5e-4, "latent": 5e-2, "argmax": 1.0}
DEFAULT_PATIENCE = 2
# The rules an interleaved launch checks on the device (worker/runner/stages.py InterleavedStep):
# those that read no next-token distribution, with the copy fill. kl and argmax need the coda
# and head after every iteration, recompute a projection per skipped layer: whole-token steps.
INTERLEAVED_CRITERIA = ("gate", "latent")
NEVER = 1 << 30
IDLE_PARAMS = [0, 1.0, NEVER, NEVER, 1, 0]  # ExitState.params of a row with no rule and depth 0
RULE_ROWS_KEPT = 1024  # the (rule, depth) rows an ExitState keeps made (a request's threshold is any float)


@dataclass(frozen=True)
class ExitRule:
    criterion: str
    threshold: float
    min_loops: int = 1
    patience: int = DEFAULT_PATIENCE
    cache: str = "copy"

    @property
    def needs_logits(self) -> bool:
        return self.criterion in ("kl", "argmax")

    @property
    def interleaves(self) -> bool:
        """Whether an interleaved launch can check this rule (INTERLEAVED_CRITERIA, copy fill)."""
        return self.criterion in INTERLEAVED_CRITERIA and self.cache == "copy"

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
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 < threshold <= 1:
        raise ValueError(f"{name}.threshold must be a number in (0, 1], got {threshold!r}")
    ints = {}
    for key, default in (("min_loops", 1), ("patience", DEFAULT_PATIENCE)):
        v = spec.get(key)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v <= cfg.max_loops:
            raise ValueError(f"{name}.{key} must be an int in [1, max_loops={cfg.max_loops}], got {v!r}")
        ints[key] = int(v)
    cache = spec.get("cache") or "copy"
    if cache not in CACHE_POLICIES:
        raise ValueError(f"{name}.cache must be one of {', '.join(CACHE_POLICIES)}, got {cache!r}")
    return ExitRule(criterion, float(threshold), ints["min_loops"], ints["patience"], cache)


CRITERION_ID = CRITERION_IDS  # the exit check's ids (kernels/exit_check.py)


class ExitState:
    """The criteria's state over a decode step's rows, and the check after each iteration.

    Static buffers of n rows, allocated once per runner, so that a captured graph of the check
    serves every step: the rules' parameters (n, 6) (criterion id, threshold, earliest exit,
    first iteration with logits, patience, depth), each criterion's running state, `order`
    (buffer row k holds the step's row order[k]), each row's iteration count `d` (each check
    advances it) and the decisions `stop` (with two host slots, pinned on CUDA). `reset` loads
    a step's rules; `check` decides over the first rows of the buffers, each row by its own
    criterion, in one call of the ops' exit_check however the rules mix. `op`: that call
    (kernels/exit_check.py; the torch reference by default). The host keeps the parameters
    too, to know without reading the device which iterations need logits and at which a row
    may stop at all."""

    def __init__(self, model: LoopedTransformer, n: int, device: torch.device, op=exit_check_ref):
        self.model, self.n, self.device, self.op = model, n, device, op
        cfg = model.config
        self.eps = cfg.norm_eps
        f32 = dict(dtype=torch.float32, device=device)
        self.params = torch.zeros(n, 6, **f32)
        self.remaining = torch.ones(n, **f32)      # gate: ∏ (1 − λ_j) so far
        self.cum = torch.zeros(n, **f32)           # gate: Σ p_j so far
        self.prev_n = torch.zeros(n, cfg.d_model, **f32)         # latent: n of the last iteration
        self.prev_logp = torch.zeros(n, cfg.vocab_size, **f32)   # kl: log p of the last iteration
        self.prev_arg = torch.full((n,), -1, dtype=torch.long, device=device)  # argmax
        self.streak = torch.zeros(n, dtype=torch.long, device=device)
        self.d = torch.zeros(n, **f32)  # each row's iterations so far
        self.order = torch.arange(n, device=device)
        self.stop = torch.zeros(n, dtype=torch.bool, device=device)
        # two published decisions on the host (a check's, and the one before it, which the
        # host may still be about to read), pinned on CUDA, each with the event of its copy
        cuda = device.type == "cuda"
        self.ring = torch.zeros(2, n, dtype=torch.bool, pin_memory=cuda)
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        # every criterion this model can be asked for: what a captured check computes
        self.all_kinds = frozenset(["latent", "kl", "argmax"] + (["gate"] if cfg.exit_gate else []))
        self.kinds: frozenset[str] = frozenset()
        self._rows: dict[tuple, list[float]] = {}  # (rule, depth) -> its row of params (`_row`)
        self._last_load: tuple | None = None  # (rules, depths, rows) of the last `load_host`

    def reset(self, rules: list[ExitRule | None], depths: list[int]) -> None:
        """Load a step's rows: rules (None: a row that runs its depth) and depths; the rows
        past them are idle (depth 0: stopped from the start)."""
        params = self.load_host(rules, depths) + [IDLE_PARAMS] * (self.n - len(rules))  # (a new list)
        self.params.copy_(device_tensor(params, self.device, torch.float32), non_blocking=True)
        self.clear()
        self.set_order(list(range(self.n)))

    def load_host(self, rules: list[ExitRule | None], depths: list[int]) -> list[list[float]]:
        """The host's copy of the rows' rules (what needs_logits and can_stop read) -> the
        rows of `params` to load (a list the caller must not change)."""
        # a batch's launches load the same streams' rules again and again: the last load's
        # rows (the same list object, which InterleavedStep.load then need not copy again)
        last = self._last_load
        if last is not None and last[0] == rules and last[1] == depths:
            return last[2]
        rows = [self._row(r, d) for r, d in zip(rules, depths)]
        self.depths = list(depths)
        self.earliest = [row[2] for row in rows]
        self.first = [row[3] for row in rows]
        self.kinds = frozenset(r.criterion for r in rules if r is not None)
        self._last_load = (list(rules), list(depths), rows)
        return rows

    def _row(self, r: ExitRule | None, depth: int) -> list[float]:
        """A row of `params` (criterion id, threshold, earliest exit, first iteration with
        logits, patience, depth), made once per (rule, depth): a batch's streams keep theirs
        from step to step. A row with no rule: no exit, no logits before its depth."""
        key = (r, depth)
        row = self._rows.get(key)
        if row is None:
            if len(self._rows) >= RULE_ROWS_KEPT:
                self._rows.clear()
            never = NEVER
            row = self._rows[key] = [CRITERION_ID[r.criterion] if r else 0, r.threshold if r else 1.0,
                                     r.earliest() if r is not None else never,
                                     r.first_logits() if r is not None and r.needs_logits else never,
                                     r.patience if r else 1, depth]
        return row

    def clear(self) -> None:
        """Every row's running state as before its first check. prev_n and prev_logp need none:
        a criterion writes them at a check before any check reads them (latent decides from
        d = 2, kl after its first logits)."""
        self.remaining.fill_(1)
        self.cum.zero_()
        self.prev_arg.fill_(-1)
        self.streak.zero_()
        self.d.zero_()

    def set_order(self, order: list[int]) -> None:
        self.order.copy_(device_tensor(order + list(range(len(order), self.n)), self.device), non_blocking=True)

    def needs_logits(self, d: int, rows: list[int]) -> bool:
        """Whether a row of `rows` (still iterating after iteration d) reads this iteration's
        next-token distribution (kl, argmax)."""
        return any(self.first[r] <= d < self.depths[r] for r in rows)

    def can_stop(self, d: int, rows: list[int]) -> bool:
        """Whether a row of `rows` may stop after iteration d (its depth, or its earliest exit):
        when none may, the iteration's criteria are updated and nothing is read on the host."""
        return any(d >= self.depths[r] or d >= self.earliest[r] for r in rows)

    @torch.no_grad()
    def check(self, m: int, states: torch.Tensor, logits: torch.Tensor | None, depth_row: torch.Tensor,
              slot: int | None, kinds=None) -> None:
        """After the next iteration (each row's count in `d`: the check adds one): the first m
        buffer rows' states (m, D) (the model-width part of the residual) and, where
        needs_logits said so, their next-token logits (m, V) -> stop[:m] True where the row has
        stopped (at its depth, earlier by its rule, or at an earlier check), copied into host
        slot `slot` (`mark` it to read it). A row its rule stops now is frozen on the device:
        its entry of depth_row (m,), the step's per-row depths, becomes d, so every later
        iteration carries it through unchanged whether or not the host has read the decision
        yet. The math is the ops' `exit_check` (kernels/exit_check.py: the torch reference, or
        one Triton launch). kinds: the criteria to compute (default: the step's rules'). slot
        None: nothing published (a caller that reads the row's depth instead)."""
        kinds = self.kinds if kinds is None else kinds
        g = self.model.exit_gate if "gate" in kinds else None
        self.op(self.params, self.d, self.remaining, self.cum, self.prev_n, self.prev_logp, self.prev_arg,
                self.streak, self.order, states, logits, depth_row, self.stop,
                None if g is None else g.weight.view(-1), None if g is None else g.bias, self.eps, kinds)
        if slot is not None:
            self.ring[slot, :m].copy_(self.stop[:m], non_blocking=True)

    def mark(self, slot: int) -> None:
        """The host will read slot `slot`: on CUDA an event behind the check that fills it."""
        if self.events is not None:
            self.events[slot].record()

    def read(self, slot: int, m: int) -> list[bool]:
        """The decisions published into `slot`, once their copy is done (on CUDA an event
        wait: the work queued after it keeps running)."""
        if self.events is not None:
            self.events[slot].synchronize()
        return self.ring[slot, :m].tolist()


@torch.no_grad()
def fill_skipped(engine, exits: list[tuple[int, int, int, int, int, str]], x: torch.Tensor) -> None:
    """Fill the cache layers of the iterations tokens skipped: exits [(row, slot, position,
    exit depth e, request depth L, policy)], x (B, 1, W) the residual after each row's last
    iteration (the exit state). Iterations [e, L) of every block layer get the token's K/V at
    its position; layers past L are never read at depth L (invariant 2), so none is written.
    All the rows of a policy in one gather and one scatter per cache tensor (recompute: one
    projection per block layer and weight variant over all its rows)."""
    model, cache, cfg = engine.model, engine.cache, engine.config
    nl, dev = cfg.n_loop_layers, cache.device
    copies = [(cfg.loop_layer_index(i, j), slot, pos, cfg.loop_layer_index(e - 1, j))
              for _, slot, pos, e, top, policy in exits if policy == "copy"
              for i in range(e, top) for j in range(nl)]
    if copies:
        dst, slot, pos, src = device_tensor(list(zip(*copies)), dev).unbind(0)
        for t in (cache.k, cache.v):
            t[dst, slot, :, pos] = t[src, slot, :, pos]  # (n, Hkv, hd), gathered first
    todo = [ex for ex in exits if ex[5] == "recompute"]
    if not todo:
        return
    rows = device_tensor([ex[0] for ex in todo], dev)
    xin = x.index_select(0, rows)  # (R, 1, W): the exit states
    if model.adapter is not None:  # an iteration starts with the adapter of (state | e)
        xin = linear(xin, model.adapter.weight)
        if model.adapter.bias is not None:
            xin = xin + model.adapter.bias
    positions = device_tensor([[ex[2]] for ex in todo], dev)  # (R, 1)
    cos, sin = model.rope_rows(positions, cache.max_seq_len)
    variants = model.loop_variants or [model.loop]
    for v_index, loop in enumerate(variants):
        # (row in todo, iteration) pairs this variant's weights serve
        pairs = [(k, i) for k, (_, _, _, e, top, _) in enumerate(todo) for i in range(e, top)
                 if i % len(variants) == v_index]
        if not pairs:
            continue
        for j, layer in enumerate(loop):
            att = layer.attention
            h = layer.attention_norm(xin)
            k = linear(h, att.wk.weight)
            if hasattr(att, "k_bias"):
                k = k + att.k_bias
            v = linear(h, att.wv.weight).view(-1, 1, att.n_kv_heads, att.head_dim)
            k = engine.ops.apply_rope(k.view(-1, 1, att.n_kv_heads, att.head_dim), cos, sin)  # (R, 1, Hkv, hd)
            idx = device_tensor([[cfg.loop_layer_index(i, j), todo[r][1], todo[r][2], r] for r, i in pairs], dev)
            dst, slot, pos, r = idx.t().unbind(0)
            cache.k[dst, slot, :, pos] = k[r, 0].to(cache.k.dtype)
            cache.v[dst, slot, :, pos] = v[r, 0].to(cache.v.dtype)


def histogram(depths: list[int], top: int) -> list[int]:
    """Counts of tokens by iterations run: entry d − 1 counts the tokens that ran d."""
    h = [0] * top
    for d in depths:
        h[d - 1] += 1
    return h
