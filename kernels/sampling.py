"""Token selection from logits: greedy argmax and top-k sampling with caller-supplied uniforms.

``argmax``: logits (B, V) -> (B,) int64, the first index of the row maximum (torch.argmax's
tie rule). One program per row scans V in BLOCK_V chunks, keeping the earliest best.

``greedy_feed``: the captured batch-1 decode step's last kernel. Its head projection leaves the
argmax as a key (kernels.gemv's ``argmax_key``); this reads it, feeds the token forward into the
next step's inputs (embedded) and the host ring, and sets the key back.

``sample_top_k``: logits (B, V), top_k in 1..1024, temperature > 0, u (B,) fp32 in [0, 1).
Order the row by descending logit, ties by ascending index, keep the first k = min(top_k, V):
    w_i = exp((l_i - l_0) * (1 / temperature))        (fp32, l_0 the largest logit)
and return the first kept token whose cumulative weight exceeds u * (total cumulative weight),
the last kept token if rounding leaves none. The caller draws u (a counter-based stream keyed by seed and
position), so every path that reaches a position draws the same token.

Selection: a kernel writes a unique int64 key per logit (order-preserving bits of the fp32
logit in the high word, V - 1 - index in the low word) and torch.topk takes the k largest keys:
with no equal keys the kept set and its order are fully determined on every device, which plain
topk does not promise for tied logits. A second kernel gathers the kept logits, scans their
weights and picks. No host sync anywhere.
Dtypes: logits fp16 / bf16 / fp32, math in fp32. NaN logits are not supported.
"""
import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_dtype, check_rank, check_shape, interpreting
from ._launch import use_pdl
from .gemv import ARGMAX_KEY_NONE

_KEY_NONE = tl.constexpr(ARGMAX_KEY_NONE)

MAX_TOP_K = 1024


@triton.jit
def _argmax_kernel(
    logits_ptr,  # (B, V)
    out_ptr,  # (B,) int64
    stride_logits_b, stride_logits_v,
    V,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = logits_ptr + b * stride_logits_b
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row + offs * stride_logits_v, mask=offs < V, other=float("-inf")).to(tl.float32)
        x_max = tl.max(x, axis=0)
        x_idx = v0 + tl.argmax(x, axis=0, tie_break_left=True)
        # Strictly greater: an equal maximum in a later chunk must not replace the earlier index.
        better = x_max > best
        best_idx = tl.where(better, x_idx.to(tl.int64), best_idx)
        best = tl.where(better, x_max, best)
    tl.store(out_ptr + b, best_idx)


@triton.jit
def _greedy_feed_kernel(
    key_ptr,  # (1,) int64: the argmax key of the step's logits (kernels.gemv), set back to NONE
    out_ptr,  # (1,) int64: the greedy token
    tokens_ptr,  # (1, 1) int64: the step's token input
    positions_ptr,  # (1, 1) int64: the step's position input
    host_ptr,  # (2,) int64 ring in pinned host memory
    table_ptr,  # (V, D) embedding table
    x_ptr,  # (D,) the next step's input: row `greedy` of the table
    stride_table_v, stride_table_d,
    V,
    D,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        # The key is the head's: wait for it. No gdc_launch_dependents: the next kernel may read
        # positions before its own wait (kernels/decode_attention.py), so it must not start
        # before this one has written them.
        tl.extra.cuda.gdc_wait()
    key = tl.load(key_ptr)
    tok = (V - 1) - (key & 0xFFFFFFFF)
    tl.store(key_ptr, _KEY_NONE)
    pos = tl.load(positions_ptr) + 1  # the position of the token just chosen
    tl.store(out_ptr, tok)
    tl.store(tokens_ptr, tok)
    tl.store(positions_ptr, pos)
    tl.store(host_ptr + pos % 2, tok)
    row = table_ptr + tok * stride_table_v
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        tl.store(x_ptr + offs, tl.load(row + offs * stride_table_d, mask=offs < D), mask=offs < D)


@triton.jit
def order_key(x, offs, V):
    """One int64 key per fp32 x at index offs of V: x's order-preserving bits in the high word,
    V - 1 - offs in the low one, so descending keys are descending values, ties by ascending
    index, and no two keys are equal."""
    # -0.0 and +0.0 compare equal, so they must get one key prefix (+0.0's) and tie by index.
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    # Flipping the magnitude bits of negatives makes signed integer order equal float order.
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return (ordered << 32) | (V - 1 - offs).to(tl.int64)


@triton.jit
def _selection_key_kernel(
    logits_ptr,  # (B, V)
    keys_ptr,  # (B, V) int64 contiguous
    stride_logits_b, stride_logits_v,
    V,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    x = tl.load(logits_ptr + b * stride_logits_b + offs * stride_logits_v, mask=mask, other=0.0)
    tl.store(keys_ptr + b * V + offs, order_key(x.to(tl.float32), offs, V), mask=mask)


@triton.jit
def _sample_top_k_kernel(
    logits_ptr,  # (B, V)
    top_idx_ptr,  # (B, K) int64, kept token ids in selection order
    u_ptr,  # (B,) fp32
    out_ptr,  # (B,) int64
    stride_logits_b, stride_logits_v,
    stride_top_b, stride_top_k,
    K,
    inv_temperature,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    idx = tl.load(top_idx_ptr + b * stride_top_b + offs * stride_top_k, mask=mask, other=0)
    x = tl.load(logits_ptr + b * stride_logits_b + idx * stride_logits_v, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.max(tl.where(offs == 0, x, float("-inf")), axis=0)  # the largest kept logit
    w = tl.where(mask, tl.exp((x - x0) * inv_temperature), 0.0)
    cdf = tl.cumsum(w, axis=0)
    # The total is the scan's own last value (cdf is non-decreasing, padding adds 0), so the
    # threshold and the cdf it is compared to come from the same additions.
    threshold = tl.load(u_ptr + b) * tl.max(cdf, axis=0)
    # First position whose cdf exceeds the threshold = number of positions at or below it.
    pick = tl.minimum(tl.sum(((cdf <= threshold) & mask).to(tl.int32), axis=0), K - 1)
    tl.store(out_ptr + b, tl.sum(tl.where(offs == pick, idx, 0), axis=0))


def _check_logits(op, logits):
    check_rank(op, "logits", logits, 2, "(B, V)")
    check_dtype(op, "logits", logits, FLOAT_DTYPES)
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits must have a non-empty vocab dim, got shape {tuple(logits.shape)}")


# (BLOCK_V cap, num_warps at the cap): a 32000-word vocabulary in one pass of 32 warps, so the
# batch-1 argmax is one wide load and one reduction; smaller tiles loop over several passes, each
# a dependent round trip to memory on the decode step's critical path.
_ARGMAX_TILE = (32768, 32)


def argmax(logits):
    """logits (B, V) -> (B,) int64 greedy tokens."""
    check_device("argmax", logits=logits)
    _check_logits("argmax", logits)
    B, V = logits.shape
    out = torch.empty((B,), dtype=torch.int64, device=logits.device)
    if B:
        cap, warps = _ARGMAX_TILE
        BLOCK_V = min(cap, triton.next_power_of_2(V))
        _argmax_kernel[(B,)](logits, out, *logits.stride(), V, BLOCK_V=BLOCK_V,
                             num_warps=warps if BLOCK_V >= cap else 4)
    return out


def greedy_feed(key, tokens, positions, host, table, x, *, pdl=None):
    """A batch-1 decode step's greedy token from the argmax key its head projection left
    (`gemv(..., argmax_key=key)`), fed forward in one kernel: greedy (1,) int64 =
    (V - 1) - (key & 0xFFFFFFFF); then tokens (1, 1) = greedy, positions += 1,
    host[p % 2] = greedy (p the new position), x (1, 1, D) = table[greedy] (the next step's
    input, embedded), and key = ARGMAX_KEY_NONE for the next step's head.

    `host` is a (2,) int64 ring in pinned host memory, which the kernel writes through its
    device mapping: a captured step leaves its token on the host with no copy launched after
    it, and a replay writes the slot of its own token only, so the host may read a token while
    the next step (launched ahead) runs. No kernel reads the logits back: an argmax pass over
    the vocabulary would be one more serial kernel on the step's critical path, which the key the
    head leaves makes unnecessary, and the embedding gather rides in this one. With PDL
    (pdl: `use_pdl`'s; None, where the hardware allows it, never under the interpreter) it
    launches while the head runs and waits for it."""
    op = "greedy_feed"
    check_device(op, key=key, tokens=tokens, positions=positions, table=table, x=x)
    check_shape(op, "key", key, (1,))
    for name, t in (("key", key), ("tokens", tokens), ("positions", positions), ("host", host)):
        check_dtype(op, name, t, (torch.int64,))
    for name, t in (("tokens", tokens), ("positions", positions)):
        check_shape(op, name, t, (1, 1))
    check_shape(op, "host", host, (2,))
    check_rank(op, "table", table, 2, "(V, D)")
    V, D = table.shape
    check_shape(op, "x", x, (1, 1, D))
    if x.dtype != table.dtype or not x.is_contiguous():
        raise ValueError(f"{op}: x must be contiguous in the table's dtype {table.dtype}, got {x.dtype}")
    if key.is_cuda and not torch.cuda.is_current_stream_capturing() and not host.is_pinned():
        raise ValueError(f"{op}: host must be pinned host memory (the kernel writes it from the GPU)")
    out = torch.empty((1,), dtype=torch.int64, device=key.device)
    pdl = use_pdl(key.device, pdl) and not interpreting()
    _greedy_feed_kernel[(1,)](key, out, tokens, positions, host, table, x, *table.stride(), V, D,
                              BLOCK_D=min(triton.next_power_of_2(D), 4096), PDL=pdl, num_warps=4,
                              launch_pdl=pdl)
    return out


def _selection_order(logits, k):
    """(B, V) -> (B, k) int64 token ids: descending logit, ties by ascending index."""
    B, V = logits.shape
    keys = torch.empty((B, V), dtype=torch.int64, device=logits.device)
    BLOCK_V = min(4096, triton.next_power_of_2(V))
    _selection_key_kernel[(B, triton.cdiv(V, BLOCK_V))](
        logits, keys, *logits.stride(), V, BLOCK_V=BLOCK_V, num_warps=4)
    return keys.topk(k, dim=1).indices


def sample_top_k(logits, top_k, temperature, u):
    """logits (B, V), top_k int, temperature float, u (B,) fp32 -> (B,) int64 sampled tokens."""
    op = "sample_top_k"
    check_device(op, logits=logits, u=u)
    _check_logits(op, logits)
    B, V = logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"{op}: top_k must be an int in [1, {MAX_TOP_K}], got {top_k!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{op}: temperature must be a number > 0, got {temperature!r}")
    check_shape(op, "u", u, (B,))
    check_dtype(op, "u", u, (torch.float32,))
    out = torch.empty((B,), dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    k = min(top_k, V)
    top_idx = _selection_order(logits, k)  # (B, k)
    BLOCK_K = triton.next_power_of_2(k)
    _sample_top_k_kernel[(B,)](
        logits, top_idx, u, out,
        *logits.stride(), *top_idx.stride(),
        k, 1.0 / temperature,
        BLOCK_K=BLOCK_K,
        num_warps=4 if BLOCK_K >= 256 else 1,
    )
    return out


def argmax_ref(logits):
    """The spec, in plain torch."""
    return logits.argmax(dim=-1)


def greedy_feed_ref(key, tokens, positions, host, table, x, *, pdl=None):
    """The spec, in plain torch (CPU: the host ring is written like any tensor; pdl: how the
    kernel launches, not what it computes)."""
    V = table.shape[0]
    out = (V - 1) - (key & 0xFFFFFFFF)
    key.fill_(ARGMAX_KEY_NONE)
    positions += 1
    tokens.copy_(out.view(1, 1))
    host[int(positions) % 2] = out[0]
    x.copy_(table[out].view(x.shape))
    return out


def sample_top_k_ref(logits, top_k, temperature, u):
    """The spec, in plain torch: stable descending sort, fp32 weights, inverse CDF."""
    k = min(top_k, logits.shape[1])
    x, idx = logits.float().sort(dim=1, descending=True, stable=True)
    x, idx = x[:, :k], idx[:, :k]  # (B, k)
    inv_t = torch.tensor(1.0 / temperature, dtype=torch.float32)
    w = torch.exp((x - x[:, :1]) * inv_t)
    cdf = w.cumsum(dim=1)
    threshold = u[:, None] * cdf[:, -1:]
    pick = (cdf <= threshold).sum(dim=1).clamp(max=k - 1)
    return idx.gather(1, pick[:, None])[:, 0]
