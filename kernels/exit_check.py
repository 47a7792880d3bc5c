"""The early-exit check of a decode step's rows, in one launch.

After each loop iteration every row still iterating asks its exit rule whether to stop
(worker/runner/early_exit.py: the criteria gate, latent, kl, argmax, their thresholds, earliest
exits and patience). The reference, `exit_check_ref`, is a fixed handful of vectorized torch
ops over the rows, every criterion computed for every row; on a small model that is more
launches than the iteration itself. `exit_check` is the same math as one Triton program per
row, which computes its own row's criterion only.

Arguments (n rows of state, the step's m = states.shape[0] rows in buffer order):

    params      (n, 6) fp32   per row: criterion id (0 none, 1 gate, 2 latent, 3 kl, 4 argmax),
                              threshold, earliest exit, first iteration with logits, patience, depth
    d           (n,) fp32     iterations done (each check adds one, in place)
    remaining, cum  (n,) fp32 gate: ∏ (1 − λ_j) and Σ p_j so far
    prev_n      (n, D) fp32   latent: the last iteration's RMS-normalized state
    prev_logp   (n, V) fp32   kl: the last iteration's log-probabilities
    prev_arg, streak  (n,) int64  argmax: the last argmax and how long it has held
    order       (≥ m,) int64  buffer row k holds row order[k]
    states      (m, D)        the states after the iteration (a strided view of the residual)
    logits      (m, V) fp32 or None: the next-token logits of each row's state (kl, argmax)
    depth_row   (≥ m,) int64  the step's per-row depths: a row its rule stops now gets d here
    stop        (≥ m,) bool   out: the row has stopped (at its depth, by its rule now or before)
    gate_w (D,), gate_b (1,)  the exit gate's weights (a model with a gate), else None

A row's state buffers are indexed by its row (order[k]), its inputs and outputs by its buffer
position k. A buffer state the row's criterion does not use may differ between the two (the
reference updates every criterion's state for every row); no decision reads it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import check_device, interpreting

GATE, LATENT, KL, ARGMAX = 1, 2, 3, 4
CRITERION_IDS = {"gate": GATE, "latent": LATENT, "kl": KL, "argmax": ARGMAX}  # 0: a row with no rule


def exit_check_ref(params, d, remaining, cum, prev_n, prev_logp, prev_arg, streak, order, states, logits,
                   depth_row, stop, gate_w=None, gate_b=None, eps=1e-6, kinds=None):
    """kinds: the criteria the rows use (None: every one); the others' state is not updated."""
    m = states.shape[0]
    kinds = ("gate", "latent", "kl", "argmax") if kinds is None else kinds
    rows = order[:m]
    dr = d.index_select(0, rows) + 1
    d.index_copy_(0, rows, dr)
    crit, thr, earliest, first, patience, depth = params.index_select(0, rows).unbind(-1)
    hit = torch.zeros(m, dtype=torch.bool, device=states.device)
    if gate_w is not None and "gate" in kinds:
        gated = crit == GATE
        lam = torch.sigmoid((F.linear(states, gate_w.view(1, -1).to(states.dtype)) + gate_b.to(states.dtype))
                            .float()[..., 0])
        rem = remaining.index_select(0, rows)
        p = torch.where(dr >= depth, rem, lam * rem)  # the last iteration takes the mass left
        c = cum.index_select(0, rows) + p
        cum.index_copy_(0, rows, torch.where(gated, c, 0))
        remaining.index_copy_(0, rows, torch.where(gated, rem * (1 - lam), 1))
        hit |= gated & (c >= thr)
    if "latent" in kinds:
        s = states.float()
        cur = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
        rel = (cur - prev_n.index_select(0, rows)).norm(dim=-1) / cur.norm(dim=-1)
        prev_n.index_copy_(0, rows, cur)
        hit |= (crit == LATENT) & (dr >= 2) & (rel < thr)
    if logits is not None and "kl" in kinds:
        on = dr >= first  # the rows whose rule reads this iteration's distribution
        logp = torch.log_softmax(logits.float(), -1)
        prev = prev_logp.index_select(0, rows)
        kl = (logp.exp() * (logp - prev)).sum(-1)
        prev_logp.index_copy_(0, rows, torch.where(on[:, None], logp, prev))
        hit |= (crit == KL) & (dr > first) & (kl < thr)
    if logits is not None and "argmax" in kinds:
        on = dr >= first
        arg = logits.float().argmax(-1)
        pa = prev_arg.index_select(0, rows)
        old = streak.index_select(0, rows)
        st = torch.where(on, torch.where(arg == pa, old + 1, 0), old)
        streak.index_copy_(0, rows, st)
        prev_arg.index_copy_(0, rows, torch.where(on, arg, pa))
        hit |= (crit == ARGMAX) & (st >= patience)
    at = depth_row[:m].to(torch.float32)  # the rows' depths now (a frozen row's: where it stopped)
    now = hit & (dr >= earliest) & (at > dr)
    depth_row[:m].copy_(torch.where(now, dr.to(depth_row.dtype), depth_row[:m]))
    torch.logical_or(dr >= torch.minimum(at, depth), now, out=stop[:m])


@triton.jit
def _exit_check_kernel(params_ptr, d_ptr, rem_ptr, cum_ptr, prev_n_ptr, prev_logp_ptr, prev_arg_ptr, streak_ptr,
                       order_ptr, x_ptr, stride_x, logits_ptr, depth_ptr, stop_ptr, gw_ptr, gb_ptr, D, V, eps,
                       HAS_GATE: tl.constexpr, HAS_LOGITS: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    k = tl.program_id(0)
    r = tl.load(order_ptr + k)
    p = params_ptr + r * 6
    crit = tl.load(p).to(tl.int32)
    thr = tl.load(p + 1)
    earliest = tl.load(p + 2)
    first = tl.load(p + 3)
    patience = tl.load(p + 4)
    depth = tl.load(p + 5)
    d = tl.load(d_ptr + r) + 1.0
    tl.store(d_ptr + r, d)
    offs = tl.arange(0, BLOCK_D)
    dm = offs < D
    hit = d < 0.0  # False
    if HAS_GATE:
        if crit == 1:
            xs = tl.load(x_ptr + k * stride_x + offs, mask=dm, other=0.0)
            w = tl.load(gw_ptr + offs, mask=dm, other=0.0)
            # the gate's logit rounded to the state's dtype, as the reference's projection gives it
            z = (tl.sum(xs.to(tl.float32) * w.to(tl.float32), 0).to(xs.dtype).to(tl.float32)
                 + tl.load(gb_ptr).to(xs.dtype).to(tl.float32)).to(xs.dtype).to(tl.float32)
            lam = 1.0 / (1.0 + tl.exp(-z))
            rem = tl.load(rem_ptr + r)
            pr = tl.where(d >= depth, rem, lam * rem)
            c = tl.load(cum_ptr + r) + pr
            tl.store(cum_ptr + r, c)
            tl.store(rem_ptr + r, rem * (1.0 - lam))
            hit = c >= thr
    if crit == 2:
        s = tl.load(x_ptr + k * stride_x + offs, mask=dm, other=0.0).to(tl.float32)
        cur = s * (1.0 / tl.sqrt(tl.sum(s * s, 0) / D + eps))
        prev = tl.load(prev_n_ptr + r * D + offs, mask=dm, other=0.0)
        diff = cur - prev
        rel = tl.sqrt(tl.sum(diff * diff, 0)) / tl.sqrt(tl.sum(cur * cur, 0))
        tl.store(prev_n_ptr + r * D + offs, cur, mask=dm)
        hit = (d >= 2.0) & (rel < thr)
    if HAS_LOGITS:
        on = d >= first
        lrow = logits_ptr + k * V
        vs = tl.arange(0, BLOCK_V)
        if crit == 3:
            mx = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)
            se = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
            for v0 in range(0, V, BLOCK_V):
                z = tl.load(lrow + v0 + vs, mask=v0 + vs < V, other=float("-inf"))
                mn = tl.maximum(mx, tl.max(z, 0))
                se = se * tl.exp(mx - mn) + tl.sum(tl.exp(z - mn), 0)
                mx = mn
            lse = mx + tl.log(se)
            kl = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
            prow = prev_logp_ptr + r * V
            for v0 in range(0, V, BLOCK_V):
                vm = v0 + vs < V
                lp = tl.load(lrow + v0 + vs, mask=vm, other=0.0) - lse
                pv = tl.load(prow + v0 + vs, mask=vm, other=0.0)
                kl += tl.sum(tl.where(vm, tl.exp(lp) * (lp - pv), 0.0), 0)
                if on:
                    tl.store(prow + v0 + vs, lp, mask=vm)
            hit = (d > first) & (kl < thr)
        if crit == 4:
            best = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)
            arg = tl.sum(tl.zeros([BLOCK_V], tl.int64), 0)
            for v0 in range(0, V, BLOCK_V):
                z = tl.load(lrow + v0 + vs, mask=v0 + vs < V, other=float("-inf"))
                bm = tl.max(z, 0)
                bi = tl.argmax(z, 0).to(tl.int64) + v0
                arg = tl.where(bm > best, bi, arg)  # a tie keeps the earlier block: the first maximum
                best = tl.maximum(best, bm)
            pa = tl.load(prev_arg_ptr + r)
            old = tl.load(streak_ptr + r)
            st = tl.where(on, tl.where(arg == pa, old + 1, 0), old)
            tl.store(streak_ptr + r, st)
            tl.store(prev_arg_ptr + r, tl.where(on, arg, pa))
            hit = st.to(tl.float32) >= patience
    at = tl.load(depth_ptr + k).to(tl.float32)
    now = hit & (d >= earliest) & (at > d)
    if now:
        tl.store(depth_ptr + k, d.to(tl.int64))
    tl.store(stop_ptr + k, ((d >= tl.minimum(at, depth)) | now).to(tl.int8))


def exit_check(params, d, remaining, cum, prev_n, prev_logp, prev_arg, streak, order, states, logits,
               depth_row, stop, gate_w=None, gate_b=None, eps=1e-6, kinds=None):
    """exit_check_ref's decisions in one launch (module docstring); each row computes its own
    criterion, so `kinds` changes nothing here."""
    m, D = states.shape
    if m == 0:
        return
    check_device("exit_check", params=params, states=states, depth_row=depth_row, stop=stop)
    if states.stride(1) != 1:
        raise ValueError("exit_check: states must have unit stride along D")
    if logits is not None and (logits.dtype != torch.float32 or not logits.is_contiguous()):
        raise ValueError("exit_check: logits must be contiguous fp32")
    if depth_row.stride(0) != 1 or stop.dtype != torch.bool:
        raise ValueError("exit_check: depth_row must be a unit-stride row and stop a bool tensor")
    V = prev_logp.shape[-1]
    has_gate = gate_w is not None
    _exit_check_kernel[(m,)](
        params, d, remaining, cum, prev_n, prev_logp, prev_arg, streak, order, states, states.stride(0),
        states if logits is None else logits, depth_row, stop.view(torch.int8),
        gate_w if has_gate else states, gate_b if has_gate else states, D, V, float(eps),
        HAS_GATE=has_gate, HAS_LOGITS=logits is not None, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_V=min(4096 if not interpreting() else 1 << 16, triton.next_power_of_2(V)))
