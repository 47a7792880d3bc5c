"""A sampling step's distributions and draws, and a sampled speculative round's verdict, one
program per row, for vocabularies of up to MAX_VOCAB tokens: what the runtime's torch ops do
(worker/runner/sampler.py) in a launch each instead of some thirty.

``probs_rows``: logits (B, V) -> (B, V) fp32, each row's distribution: the logits shifted by
their maximum and divided by the row's temperature (1 where it is 0: a greedy row), then the
row's top-k (top_k[b] in 1..V - 1 keeps the scores at least its k-th largest; 0 or >= V keeps
all), the softmax, then the row's top-p (top_p[b] < 1 keeps the smallest prefix, in descending
order with ties by index, whose mass reaches top_p: the first token always stays) renormalized.
k_max and top_p_any are the host's flags of the call (`RowSampling`): k_max (at most V) 0 skips
the top-k, top_p_any False the top-p; a row's top-k in force must not exceed k_max.

``choose_rows``: a whole sampling step in one launch, logits (B, V) -> (B,) int64: each row's
draw from its ``probs_rows`` distribution with its own counter-based STREAM_TOKEN uniform
(kernels/counter_hash.py, of the row's seed and position), or its logits' argmax where its
temperature is 0.

``draw_rows``: pr (B, V) fp32, u (B,) fp64 in [0, 1) -> (B,) int64: the inverse-CDF draw over
the tokens in descending-probability order, ties by index: the first token whose float64
cumulative probability exceeds u times the row's total, never a token of zero probability (a
row with none, NaN logits among them, takes the first token in that order).

``verdict_rows``: a sampled chain round's decision (speculative sampling, Leviathan et al. 2023
and Chen et al. 2023) in one launch, one program a position, each drawing its own counter-based
uniforms (kernels/counter_hash.py): draft i stays with probability min(1, p_i / q_i), a rejected
one's position takes the draw from max(0, p_i - q_i) (float64 masses: their values sorted, ties
by index), the last the bonus draw from p_k; program 0 counts the drafts kept before the first
rejection.

The order is one sort of int64 keys, kernels/sampling.py's `order_key` (the probability's
order-preserving bits, then V - 1 - index): no two keys are equal. The kernels
compute what ``probs_rows_ref`` / ``draw_rows_ref`` compute (the torch ops the runtime runs where
the kernels do not apply) up to the order in which sums are taken: the temperature, the top-k
threshold and the orders are exact, the softmax and the cumulative sums round differently in
their last bits, so a draw can differ only where u lands within those bits of a boundary.
"""
import torch
import triton
import triton.language as tl

from ._checks import check_device, check_dtype, check_rank, check_shape
from .counter_hash import uniform_of, uniform_ref
from .sampling import order_key

MAX_VOCAB = 8192  # one program holds a row (and sorts it) in its registers

# The counter-based random streams at one position (kernels/counter_hash.py's `stream`), and
# the same as the kernels' constexprs (a jitted function reads no other globals)
STREAM_TOKEN = 0     # the token drawn at a position
STREAM_ACCEPT = 1    # speculative sampling's accept test
STREAM_RESIDUAL = 2  # speculative sampling's draw from the residual distribution
_TOKEN, _ACCEPT, _RESIDUAL = tl.constexpr(STREAM_TOKEN), tl.constexpr(STREAM_ACCEPT), tl.constexpr(STREAM_RESIDUAL)


@triton.jit
def _order_keys(p, offs, valid, V, invalid=-1):
    """kernels/sampling.py's `order_key` of each value (descending keys: descending values,
    ties by ascending index), an invalid lane `invalid` (-1: below the key of every probability,
    which is >= 0). A NaN (a diverged row's) becomes the positive quiet NaN, above every number,
    as torch.sort and torch.argmax place NaNs."""
    return tl.where(valid, order_key(tl.where(p != p, float("nan"), p), offs, V), invalid)


@triton.jit
def _key_prob(key):
    """The probability a key holds (0 for an invalid lane's -1): a probability is >= 0, so its
    key's high word is its bits unchanged."""
    return tl.where(key >= 0, (key >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _row_probs(x, offs, valid, V, t, k, top_p, K_MAX, TOP_K: tl.constexpr, TOP_P: tl.constexpr):
    """One row's distribution (`probs_rows`) from its fp32 logits x (padding -inf), temperature
    t, top-k k and top-p top_p."""
    t = tl.where(t > 0, t, 1.0)
    s = (x - tl.max(x, axis=0)) / t
    if TOP_K:
        has_k = (k > 0) & (k < V)
        rank = tl.minimum(tl.maximum(k, 1), K_MAX) - 1
        ordered = tl.sort(s, descending=True)  # the padding's -inf last
        kth = tl.max(tl.where(offs == rank, ordered, float("-inf")), axis=0)
        s = tl.where(has_k & (s < kth), float("-inf"), s)
    e = tl.where(valid, tl.exp(s - tl.max(s, axis=0)), 0.0)
    p = e / tl.sum(e, axis=0)
    if TOP_P:
        key = _order_keys(p, offs, valid, V)
        ordered = tl.sort(key, descending=True)
        sp = _key_prob(ordered)
        # keep the prefix whose mass before each token is below top_p: its last key is the
        # smallest kept one
        kept = tl.sum(tl.where((tl.cumsum(sp, axis=0) - sp < top_p) & (ordered >= 0), 1, 0), axis=0)
        last = tl.max(tl.where(offs == kept - 1, ordered, -1), axis=0)
        q = tl.where(key >= last, p, 0.0)
        p = tl.where(top_p < 1.0, q / tl.sum(q, axis=0), p)
    return p


@triton.jit
def _probs_rows_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, out_ptr, stride_l, stride_lv, stride_t,
                       stride_k, stride_p, stride_o, V, K_MAX,
                       TOP_K: tl.constexpr, TOP_P: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    x = tl.load(logits_ptr + b * stride_l + offs * stride_lv, mask=valid, other=float("-inf")).to(tl.float32)
    p = _row_probs(x, offs, valid, V, tl.load(temp_ptr + b * stride_t), tl.load(top_k_ptr + b * stride_k),
                   tl.load(top_p_ptr + b * stride_p), K_MAX, TOP_K, TOP_P)
    tl.store(out_ptr + b * stride_o + offs, p, mask=valid)


@triton.jit
def _choose_rows_kernel(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, seed_ptr, pos_ptr, out_ptr, stride_l, stride_lv,
                        stride_t, stride_k, stride_p, stride_s, stride_pos, V, K_MAX,
                        TOP_K: tl.constexpr, TOP_P: tl.constexpr, BLOCK_V: tl.constexpr):
    """A row's token: its draw from its distribution (its STREAM_TOKEN uniform), or the argmax
    of its logits where its temperature is 0 (the first of the largest; NaN above every number,
    as torch.argmax)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    x = tl.load(logits_ptr + b * stride_l + offs * stride_lv, mask=valid, other=float("-inf")).to(tl.float32)
    t = tl.load(temp_ptr + b * stride_t)
    if t > 0:
        p = _row_probs(x, offs, valid, V, t, tl.load(top_k_ptr + b * stride_k), tl.load(top_p_ptr + b * stride_p),
                       K_MAX, TOP_K, TOP_P)
        u = uniform_of(tl.load(seed_ptr + b * stride_s), tl.load(pos_ptr + b * stride_pos), _TOKEN)
        tok = _draw_row(p, offs, valid, V, u)
    else:
        key = tl.max(_order_keys(x, offs, valid, V, -9223372036854775807), axis=0)  # below every logit's key
        tok = V - 1 - (key & 0xFFFFFFFF)
    tl.store(out_ptr + b, tok)


@triton.jit
def _draw_row(p, offs, valid, V, u):
    """The inverse-CDF draw of u from one row's fp32 probabilities p (valid lanes): the token."""
    ordered = tl.sort(_order_keys(p, offs, valid, V), descending=True)
    sp = _key_prob(ordered)
    cdf = tl.cumsum(sp.to(tl.float64), axis=0)
    target = u * tl.max(tl.where(offs == V - 1, cdf, float("-inf")), axis=0)
    pick = tl.minimum(tl.sum(tl.where(valid & (cdf <= target), 1, 0), axis=0), V - 1)
    positive = tl.sum(tl.where(valid & (sp > 0), 1, 0), axis=0)
    pick = tl.maximum(tl.minimum(pick, positive - 1), 0)
    key = tl.max(tl.where(offs == pick, ordered, -1), axis=0)
    return V - 1 - (key & 0xFFFFFFFF)


@triton.jit
def _draw_row64(r, offs, valid, V, u):
    """`_draw_row` for float64 masses r >= 0 (a residual's), which an int64 key cannot hold with
    its index: the values sorted alone, then the picked value's index found among its ties in
    ascending order (the stable sort's)."""
    r = tl.where(valid, r, -1.0)  # the padding below every mass: sorted last
    ordered = tl.sort(r, descending=True)
    sp = tl.where(ordered > 0, ordered, 0.0)
    cdf = tl.cumsum(sp, axis=0)
    target = u * tl.max(tl.where(offs == V - 1, cdf, float("-inf")), axis=0)
    pick = tl.minimum(tl.sum(tl.where(valid & (cdf <= target), 1, 0), axis=0), V - 1)
    positive = tl.sum(tl.where(sp > 0, 1, 0), axis=0)
    pick = tl.maximum(tl.minimum(pick, positive - 1), 0)
    v = tl.max(tl.where(offs == pick, ordered, -2.0), axis=0)
    tie = valid & (r == v)
    nth = pick - tl.sum(tl.where(valid & (r > v), 1, 0), axis=0)  # v's place among its ties
    return tl.sum(tl.where(tie & (tl.cumsum(tie.to(tl.int32), axis=0) == nth + 1), offs, 0), axis=0).to(tl.int64)


@triton.jit
def _draw_rows_kernel(pr_ptr, u_ptr, out_ptr, stride_p, stride_pv, stride_u, V, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    p = tl.load(pr_ptr + b * stride_p + offs * stride_pv, mask=valid, other=0.0)
    tl.store(out_ptr + b, _draw_row(p, offs, valid, V, tl.load(u_ptr + b * stride_u)))


@triton.jit
def _verdict_kernel(p_ptr, q_ptr, drafts_ptr, seed_ptr, pos_ptr, out_ptr, stride_p, stride_pv, stride_q, stride_qv,
                    stride_d, stride_pos, K, V, BLOCK_V: tl.constexpr):
    """Program i < K: draft i's accept test and, rejected, its residual draw; program K: the
    bonus draw from p_K. Program 0 also counts the drafts accepted before the first rejection
    (each test is two loads and a uniform: it repeats them rather than wait for the others)."""
    i = tl.program_id(0)
    seed = tl.load(seed_ptr)
    if i == 0:
        n = K
        alive = K > 0
        for j in range(0, K):
            d = tl.load(drafts_ptr + j * stride_d)
            pd = tl.load(p_ptr + j * stride_p + d * stride_pv).to(tl.float64)
            qd = tl.load(q_ptr + j * stride_q + d * stride_qv).to(tl.float64)
            ok = uniform_of(seed, tl.load(pos_ptr + j * stride_pos), _ACCEPT) * qd < pd
            n = tl.where(alive & ~ok, j, n)
            alive = alive & ok
        tl.store(out_ptr, n.to(tl.int64))
    offs = tl.arange(0, BLOCK_V)
    valid = offs < V
    pos = tl.load(pos_ptr + i * stride_pos)
    p = tl.load(p_ptr + i * stride_p + offs * stride_pv, mask=valid, other=0.0)
    if i == K:
        tok = _draw_row(p, offs, valid, V, uniform_of(seed, pos, _TOKEN))
    else:
        d = tl.load(drafts_ptr + i * stride_d)
        q = tl.load(q_ptr + i * stride_q + offs * stride_qv, mask=valid, other=0.0)
        pd = tl.sum(tl.where(offs == d, p, 0.0), axis=0).to(tl.float64)
        qd = tl.sum(tl.where(offs == d, q, 0.0), axis=0).to(tl.float64)
        if uniform_of(seed, pos, _ACCEPT) * qd < pd:
            tok = d
        else:
            u = uniform_of(seed, pos, _RESIDUAL)
            r = tl.maximum(p.to(tl.float64) - q.to(tl.float64), 0.0)
            if tl.sum(tl.where(valid, r, 0.0), axis=0) > 0:
                tok = _draw_row64(r, offs, valid, V, u)
            else:  # p == q leaves no residual mass (and accepts every draft): the spec draws from p
                tok = _draw_row(p, offs, valid, V, u)
    tl.store(out_ptr + 1 + i, tok)


def _warps(V: int) -> int:
    """Warps a row's program takes: 4 up to 1024 tokens, then one per 256, at most 16, so the
    row's keys stay in registers (sm_90's ptxas: 56 registers at 256 tokens on 4 warps, 80 at
    2048 on 8, 128 at 8192 on 16, with a few spilled bytes there; 4 warps at 8192 spill kilobytes)."""
    return max(4, min(16, triton.next_power_of_2(V) // 256))


def _check_rows(op, x, name, dtypes):
    check_rank(op, name, x, 2, "(B, V)")
    check_dtype(op, name, x, dtypes)
    V = x.shape[1]
    if not 1 <= V <= MAX_VOCAB:
        raise ValueError(f"{op}: {name} (B, V) needs 1 <= V <= MAX_VOCAB = {MAX_VOCAB} (a row in one "
                         f"program), got V = {V}")
    return x.shape[0], V


def _check_params(op, logits, temperature, top_k, top_p, k_max):
    """probs_rows' and choose_rows' checks of the logits and the rows' parameters -> (B, V)."""
    B, V = _check_rows(op, logits, "logits", (torch.float16, torch.bfloat16, torch.float32))
    check_device(op, logits=logits, temperature=temperature, top_k=top_k, top_p=top_p)
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                           ("top_p", top_p, torch.float32)):
        check_shape(op, name, t, (B,))
        check_dtype(op, name, t, (dtype,))
    if not 0 <= k_max <= V:
        raise ValueError(f"{op}: k_max is 0 (no top-k) or a width in 1..V = {V}, got {k_max}")
    return B, V


def probs_rows(logits, temperature, top_k, top_p, k_max: int, top_p_any: bool):
    """logits (B, V) fp16 / bf16 / fp32; temperature, top_p (B,) fp32; top_k (B,) int64; the
    host's k_max (the largest top-k in force, 0: none) and top_p_any -> (B, V) fp32 (module
    docstring). Any strides (a row's parameters expanded from one value: stride 0)."""
    B, V = _check_params("probs_rows", logits, temperature, top_k, top_p, k_max)
    out = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    if B:
        _probs_rows_kernel[(B,)](logits, temperature, top_k, top_p, out, *logits.stride(), temperature.stride(0),
                                 top_k.stride(0), top_p.stride(0), out.stride(0), V, max(k_max, 1), TOP_K=k_max > 0, TOP_P=bool(top_p_any),
                                 BLOCK_V=triton.next_power_of_2(V), num_warps=_warps(V))
    return out


def choose_rows(logits, temperature, top_k, top_p, k_max: int, top_p_any: bool, seed, position):
    """A sampling step in one launch: logits (B, V) fp16 / bf16 / fp32; `probs_rows`'
    parameters; seed, position (B,) int64 -> (B,) int64: row b's STREAM_TOKEN draw (its seed
    and position's counter-based uniform) from its distribution, or its logits' argmax where its
    temperature is 0 (`choose_rows_ref` is the spec). Any strides."""
    op = "choose_rows"
    B, V = _check_params(op, logits, temperature, top_k, top_p, k_max)
    check_device(op, logits=logits, seed=seed, position=position)
    for name, t in (("seed", seed), ("position", position)):
        check_shape(op, name, t, (B,))
        check_dtype(op, name, t, (torch.int64,))
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        _choose_rows_kernel[(B,)](logits, temperature, top_k, top_p, seed, position, out, *logits.stride(),
                                  temperature.stride(0), top_k.stride(0), top_p.stride(0), seed.stride(0),
                                  position.stride(0), V, max(k_max, 1), TOP_K=k_max > 0, TOP_P=bool(top_p_any),
                                  BLOCK_V=triton.next_power_of_2(V), num_warps=_warps(V))
    return out


def draw_rows(pr, u):
    """pr (B, V) fp32, u (B,) fp64 -> (B,) int64 (module docstring). Any strides."""
    op = "draw_rows"
    B, _ = _check_rows(op, pr, "pr", (torch.float32,))
    check_device(op, pr=pr, u=u)
    check_shape(op, "u", u, (B,))
    check_dtype(op, "u", u, (torch.float64,))
    out = torch.empty(B, dtype=torch.int64, device=pr.device)
    if B:
        _draw_rows_kernel[(B,)](pr, u, out, *pr.stride(), u.stride(0), pr.shape[1], BLOCK_V=triton.next_power_of_2(pr.shape[1]),
                                num_warps=_warps(pr.shape[1]))
    return out


def verdict_rows(p, q, drafts, seed, positions):
    """A sampled chain round's decision in one launch. p (k + 1, V) fp32: the verifier's
    distributions over the chunk; q (k, V) fp32 and drafts (k,) int64: the drafts'; seed (1,)
    int64; positions (k + 1,) int64: the position each row of p decides -> (k + 2,) int64:
    n, the drafts accepted before the first rejection, then the k + 1 targets (module
    docstring: `verdict_rows_ref` is the spec). Any strides."""
    op = "verdict_rows"
    k1, V = _check_rows(op, p, "p", (torch.float32,))
    k = k1 - 1
    check_device(op, p=p, q=q, drafts=drafts, seed=seed, positions=positions)
    check_shape(op, "q", q, (k, V))
    check_dtype(op, "q", q, (torch.float32,))
    for name, t, shape in (("drafts", drafts, (k,)), ("seed", seed, (1,)), ("positions", positions, (k1,))):
        check_shape(op, name, t, shape)
        check_dtype(op, name, t, (torch.int64,))
    out = torch.empty(k + 2, dtype=torch.int64, device=p.device)
    _verdict_kernel[(k1,)](p, q, drafts, seed, positions, out, *p.stride(), *q.stride(), drafts.stride(0),
                           positions.stride(0), k, V, BLOCK_V=triton.next_power_of_2(V), num_warps=_warps(V))
    return out


def accept_or_resample_ref(p, q, draft, u_accept, u_residual):
    """Speculative sampling's decision at one position, batched over rows (Leviathan et al.
    2023; Chen et al. 2023). p, q (B, V) target and draft distributions, draft (B,) tokens
    drawn from q, uniforms (B,) -> (accepted (B,) bool, token (B,)): the draft where accepted
    (probability min(1, p / q)), else a draw from normalize(max(0, p - q)). The token is
    distributed as p."""
    p, q = p.double(), q.double()
    pd, qd = p.gather(1, draft[:, None])[:, 0], q.gather(1, draft[:, None])[:, 0]
    accepted = u_accept * qd < pd  # u < p / q without dividing; always true where p >= q
    residual = (p - q).clamp_min(0)
    # p == q leaves no residual mass (and then every draft is accepted): fall back to p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return accepted, torch.where(accepted, draft, draw_rows_ref(residual, u_residual))


def verdict_rows_ref(p, q, drafts, seed, positions, uniform=uniform_ref):
    """The spec, in torch: verdict_rows -- (n (a 0-d tensor), targets (k + 1,)): draft i is
    accepted with probability min(1, p_i / q_i) (its STREAM_ACCEPT uniform), targets[i] the
    draft where accepted, else the STREAM_RESIDUAL draw from max(0, p_i - q_i); targets[k] the
    STREAM_TOKEN draw from p_k (the bonus after a whole chunk); n the leading drafts accepted.
    uniform: kernels/counter_hash.py's, or its reference (the same numbers)."""
    k = q.shape[0]
    seeds = seed.expand(k + 1)
    bonus = draw_rows_ref(p[k:], uniform(seeds[k:], positions[k:], STREAM_TOKEN))
    if k == 0:
        return torch.zeros((), dtype=torch.long, device=p.device), bonus
    accepted, toks = accept_or_resample_ref(p[:k], q, drafts, uniform(seeds[:k], positions[:k], STREAM_ACCEPT),
                                            uniform(seeds[:k], positions[:k], STREAM_RESIDUAL))
    return accepted.long().cumprod(0).sum(), torch.cat([toks, bonus])


def probs_rows_ref(logits, temperature, top_k, top_p, k_max: int, top_p_any: bool):
    """The spec, in torch (the runtime's path where the kernels do not apply): probs_rows."""
    logits = logits.float()
    V = logits.shape[-1]
    t = torch.where(temperature > 0, temperature, 1.0)[:, None]
    logits = (logits - logits.amax(-1, keepdim=True)) / t
    if k_max:
        has_k = ((top_k > 0) & (top_k < V))[:, None]
        kth = torch.topk(logits, k_max, dim=-1).values.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])
        logits = logits.masked_fill(has_k & (logits < kth), float("-inf"))
    pr = torch.softmax(logits, dim=-1)
    if top_p_any:
        has_p = (top_p < 1.0)[:, None]
        sorted_p, idx = torch.sort(pr, dim=-1, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = ((sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]) & has_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        kept = pr.masked_fill(drop, 0.0)
        pr = torch.where(has_p, kept / kept.sum(-1, keepdim=True), pr)
    return pr


def choose_rows_ref(logits, temperature, top_k, top_p, k_max: int, top_p_any: bool, seed, position,
                    uniform=uniform_ref):
    """The spec, in torch: choose_rows (uniform: kernels/counter_hash.py's, or its reference)."""
    best = logits.float().argmax(-1)
    pr = probs_rows_ref(logits, temperature, top_k, top_p, k_max, top_p_any)
    return torch.where(temperature > 0, draw_rows_ref(pr, uniform(seed, position, STREAM_TOKEN)), best)


def draw_rows_ref(pr, u):
    """The spec, in torch: draw_rows, for a pr of any float dtype (the CDF summed in float64; a
    float32 pr is sorted as it is and widened after: widening is exact and keeps every order and
    tie, so the draw is that of the widened sort, and a GPU sorts four-byte keys several times
    faster than eight-byte ones)."""
    sorted_p, idx = torch.sort(pr, dim=-1, descending=True, stable=True)
    sorted_p = sorted_p.double()
    cdf = sorted_p.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    pick = torch.searchsorted(cdf, target, right=True).clamp_max(pr.shape[-1] - 1)
    # never land on a zero-probability tail token through rounding at the very end
    # (a row with no positive probability, NaN logits from a diverged model, takes its first
    # token rather than an index of -1)
    n_pos = (sorted_p > 0).sum(-1, keepdim=True)
    pick = torch.minimum(pick, n_pos - 1).clamp_min(0)
    return idx.gather(-1, pick).squeeze(-1)
