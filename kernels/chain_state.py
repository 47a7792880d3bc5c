"""A speculative chain round's lane state on the device: where a round starts and what it leaves
(worker/runner/rounds.py). Each is one program of one launch, where its torch spec takes a
handful of small kernels (five and about ten): a round of the small models is bound by its
launches, so they count.

``chain_load``: state (lanes, 2) int64 rows (token, position), slot (1,) int64 the lane ->
the round's inputs, written in place: tokens (1, 1) the token, positions (1, 1) its position p,
chunk_positions (1, T) p + 0 .. p + T - 1, x (1, 1, D) the token's row of the embedding table.

``chain_leave``: targets (T,) int64, the verifier's tokens at p + 1 .. p + T (p =
chunk_positions[0, 0]); n the drafts accepted: with drafts (T - 1,) int64 (greedy) the number of
leading drafts equal to their targets, else n (1,) int64 as given (a sampled round's verdict).
-> out (T + 1,) = [n, targets[0], ..., targets[T - 1]] and state[slot] = (targets[n], p + n + 1),
the next round's token and position, written in place.
"""
import torch
import triton
import triton.language as tl

from ._checks import check_device, check_dtype, check_shape


@triton.jit
def _chain_load_kernel(state_ptr, slot_ptr, tokens_ptr, positions_ptr, chunk_ptr, table_ptr, x_ptr,
                       stride_state, stride_table, T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    row = state_ptr + tl.load(slot_ptr) * stride_state
    token = tl.load(row)
    p = tl.load(row + 1)
    tl.store(tokens_ptr, token)
    tl.store(positions_ptr, p)
    offs = tl.arange(0, BLOCK_T)
    tl.store(chunk_ptr + offs, p + offs, mask=offs < T)
    emb = table_ptr + token * stride_table
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        tl.store(x_ptr + d, tl.load(emb + d, mask=d < D), mask=d < D)


@triton.jit
def _chain_leave_kernel(targets_ptr, drafts_ptr, n_ptr, chunk_ptr, state_ptr, slot_ptr, out_ptr, stride_state, T,
                        BLOCK_T: tl.constexpr, GREEDY: tl.constexpr):
    offs = tl.arange(0, BLOCK_T)
    targets = tl.load(targets_ptr + offs, mask=offs < T, other=0)
    if GREEDY:
        drafts = tl.load(drafts_ptr + offs, mask=offs < T - 1, other=0)
        # the first target that no equal draft precedes (the last one has no draft): its index
        # is the number of leading drafts accepted
        miss = (offs >= T - 1) | (targets != drafts)
        n = tl.min(tl.where(miss, offs, BLOCK_T), axis=0).to(tl.int64)
    else:
        n = tl.load(n_ptr)
    tl.store(out_ptr, n)
    tl.store(out_ptr + 1 + offs, targets, mask=offs < T)
    nxt = tl.sum(tl.where(offs == n, targets, 0), axis=0)
    row = state_ptr + tl.load(slot_ptr) * stride_state
    tl.store(row, nxt)
    tl.store(row + 1, tl.load(chunk_ptr) + n + 1)


def _check_state(op, state, slot):
    check_dtype(op, "state", state, (torch.int64,))
    check_dtype(op, "slot", slot, (torch.int64,))
    if state.dim() != 2 or state.shape[1] != 2 or state.stride(1) != 1:
        raise ValueError(f"{op}: state must be (lanes, 2) rows (token, position) with unit stride along "
                         f"the row, got shape {tuple(state.shape)} strides {state.stride()}")
    check_shape(op, "slot", slot, (1,))


def chain_load(state, slot, table, tokens, positions, chunk_positions, x):
    """The round's inputs from its lane's state (module docstring); all tensors on one device,
    written in place. -> None."""
    op = "chain_load"
    check_device(op, state=state, slot=slot, table=table, tokens=tokens, positions=positions,
                 chunk_positions=chunk_positions, x=x)
    _check_state(op, state, slot)
    for name, t in (("tokens", tokens), ("positions", positions), ("chunk_positions", chunk_positions)):
        check_dtype(op, name, t, (torch.int64,))
    check_shape(op, "tokens", tokens, (1, 1))
    check_shape(op, "positions", positions, (1, 1))
    if chunk_positions.dim() != 2 or chunk_positions.shape[0] != 1 or not chunk_positions.is_contiguous():
        raise ValueError(f"{op}: chunk_positions must be (1, T) contiguous, got shape {tuple(chunk_positions.shape)}")
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"{op}: table must be (V, D) with unit stride along D, got shape {tuple(table.shape)} "
                         f"strides {table.stride()}")
    D = table.shape[1]
    check_shape(op, "x", x, (1, 1, D))
    if x.dtype != table.dtype or not x.is_contiguous():
        raise ValueError(f"{op}: x must be contiguous in the table's dtype {table.dtype}, got {x.dtype}")
    T = chunk_positions.shape[1]
    _chain_load_kernel[(1,)](state, slot, tokens, positions, chunk_positions, table, x, state.stride(0),
                             table.stride(0), T, D, BLOCK_T=triton.next_power_of_2(T),
                             BLOCK_D=min(1024, triton.next_power_of_2(D)))


def chain_load_ref(state, slot, table, tokens, positions, chunk_positions, x):
    """The spec of chain_load, in plain torch."""
    lane = state.index_select(0, slot)                       # (1, 2): token, position
    tokens.copy_(lane[:, :1])
    positions.copy_(lane[:, 1:])
    T = chunk_positions.shape[1]
    torch.add(torch.arange(T, device=positions.device)[None], positions, out=chunk_positions)
    torch.index_select(table, 0, tokens.view(1), out=x.view(1, -1))


def _check_leave(op, targets, state, slot, chunk_positions, out, drafts, n):
    check_device(op, targets=targets, state=state, slot=slot, chunk_positions=chunk_positions, out=out,
                 **({"drafts": drafts} if drafts is not None else {}), **({"n": n} if n is not None else {}))
    _check_state(op, state, slot)
    if (drafts is None) == (n is None):
        raise ValueError(f"{op}: pass drafts (a greedy round: n is counted) or n (a sampled round's verdict), "
                         f"one of them")
    if targets.dim() != 1 or not targets.is_contiguous():
        raise ValueError(f"{op}: targets must be (T,) contiguous, got shape {tuple(targets.shape)}")
    T = targets.shape[0]
    for name, t, shape in (("targets", targets, (T,)), ("out", out, (T + 1,)), ("drafts", drafts, (T - 1,)),
                           ("n", n, (1,))):
        if t is not None:
            check_dtype(op, name, t, (torch.int64,))
            check_shape(op, name, t, shape)
    if chunk_positions.dim() != 2 or chunk_positions.shape[0] != 1:
        raise ValueError(f"{op}: chunk_positions must be (1, T), got shape {tuple(chunk_positions.shape)}")


def chain_leave(targets, state, slot, chunk_positions, out, *, drafts=None, n=None):
    """The round's result and its lane's next state (module docstring): drafts (greedy) or n
    (sampled), one of them. Written in place. -> None."""
    op = "chain_leave"
    _check_leave(op, targets, state, slot, chunk_positions, out, drafts, n)
    T = targets.shape[0]
    greedy = drafts is not None
    _chain_leave_kernel[(1,)](targets, drafts if greedy else targets, targets if greedy else n, chunk_positions,
                              state, slot, out, state.stride(0), T, BLOCK_T=triton.next_power_of_2(T),
                              GREEDY=greedy)


def chain_leave_ref(targets, state, slot, chunk_positions, out, *, drafts=None, n=None):
    """The spec of chain_leave, in plain torch."""
    _check_leave("chain_leave_ref", targets, state, slot, chunk_positions, out, drafts, n)
    if drafts is not None:
        T = targets.shape[0]
        n = (targets[:T - 1] == drafts).long().cumprod(0).sum().view(1)  # leading drafts the verifier agrees with
    out[0] = n[0]
    out[1:].copy_(targets)
    nxt = torch.stack([targets.gather(0, n)[0], chunk_positions[0, 0] + n[0] + 1])
    state.index_copy_(0, slot, nxt.view(1, 2))
