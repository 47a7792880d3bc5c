"""An interleaved pass's bookkeeping (kernels/interleave.py): the one-launch kernel against its
torch reference, for rows at every stage of their token (starting, midway, at their last
iteration, past it) and idle rows, one and several loop layers, odd row counts; and the
values themselves against the layer arithmetic they stand for."""
import pytest
import torch
from kernel_tolerances import DEVICE

from tinyloop.kernels.interleave import (interleave_next, interleave_next_ref, interleave_pass, interleave_pass_ref,
                                         interleave_stop, interleave_stop_ref)


def case(B, n_loop, n_prelude=2, n_slots=7, S=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    depth = torch.randint(1, 9, (B,), generator=g)
    its = (torch.rand(B, generator=g) * (depth + 2)).long()  # some rows past their depth
    lanes = torch.randint(0, n_slots, (B,), generator=g)
    flat = lambda it, lane: (it * n_loop + n_prelude) * n_slots + lane  # noqa: E731
    base, last = flat(its, lanes), flat(depth - 1, lanes)
    idle = torch.arange(B) % 5 == 4
    base[idle], last[idle] = flat(1, 0), flat(0, 0)
    positions = torch.randint(0, S, (B,), generator=g)
    return [t.to(DEVICE) for t in (base, last, positions, its, depth, lanes, idle)], flat


@pytest.mark.parametrize("B", [1, 5, 16, 33, 128])
@pytest.mark.parametrize("n_loop", [1, 3])
@pytest.mark.parametrize("with_order", [False, True])
def test_interleave_pass_matches_ref_and_the_layers(B, n_loop, with_order):
    """With order (an exit check's rows), each row's xrows entry where live, else n_slots."""
    n_slots, S = 7, 50
    (base, last, positions, its, depth, lanes, idle), flat = case(B, n_loop, n_slots=n_slots, S=S, seed=B + n_loop)
    xrows = torch.where(idle, n_slots, lanes)
    outs = []
    for op in (interleave_pass, interleave_pass_ref):
        b = base.clone()
        rows = torch.full((n_loop, B), -7, dtype=torch.long, device=DEVICE)
        pos = torch.full((B,), -7, dtype=torch.long, device=DEVICE)
        live = torch.zeros(B, dtype=torch.bool, device=DEVICE)
        order = torch.full((B,), -7, dtype=torch.long, device=DEVICE) if with_order else None
        op(b, last, positions, S, n_loop * n_slots, n_slots, rows, pos, live, order, xrows if with_order else None)
        outs.append((b, rows, pos, live) + ((order,) if with_order else ()))
    for a, r in zip(*outs):
        assert torch.equal(a, r)
    b, rows, pos, live = outs[0][:4]
    if with_order:
        assert torch.equal(outs[0][4], torch.where(live, xrows, n_slots))
    want_live = (its < depth) & ~idle
    assert torch.equal(live, want_live)
    assert torch.equal(pos, torch.where(want_live, positions, S))
    at = torch.where(idle, 0, torch.minimum(its, depth - 1))
    for j in range(n_loop):
        assert torch.equal(rows[j], torch.where(idle, flat(0, 0), flat(at, lanes)) + j * n_slots)
    assert torch.equal(b, base + n_loop * n_slots)
    if B > 4:
        assert live.any() and not live.all(), "the case tests little"


def test_interleave_pass_refuses_bad_input():
    (base, last, positions, *_), _ = case(4, 2)
    rows = torch.zeros(2, 4, dtype=torch.long, device=DEVICE)
    pos = torch.zeros(4, dtype=torch.long, device=DEVICE)
    live = torch.zeros(4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="rows must be"):
        interleave_pass(base, last, positions, 9, 14, 7, rows[:, :3], pos, live)
    with pytest.raises(ValueError, match="last must have shape"):
        interleave_pass(base, last[:3], positions, 9, 14, 7, rows, pos, live)
    with pytest.raises(ValueError, match="live dtype"):
        interleave_pass(base, last, positions, 9, 14, 7, rows, pos, live.long())
    with pytest.raises(ValueError, match="contiguous"):
        interleave_pass(base, last, positions, 9, 14, 7, torch.zeros(4, 2, dtype=torch.long, device=DEVICE).t(),
                        pos, live)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B,n_loop,n_prelude", [(64, 1, 2), (128, 1, 2), (7, 24, 0)])  # bench-285m, Ouro-1.4B
def test_interleave_pass_on_gpu_at_served_shapes(B, n_loop, n_prelude):
    """The kernel on the GPU at the served models' shapes, and inside a captured graph, where
    its replays advance the rows as its eager calls do."""
    n_slots, S = 128, 512
    (base, last, positions, *_), _ = case(B, n_loop, n_prelude=n_prelude, n_slots=n_slots, S=S, seed=B)
    bufs = lambda: (torch.zeros(n_loop, B, dtype=torch.long, device="cuda"),  # noqa: E731
                    torch.zeros(B, dtype=torch.long, device="cuda"), torch.zeros(B, dtype=torch.bool, device="cuda"))
    ref_base, ref = base.clone(), bufs()
    got_base, got = base.clone(), bufs()
    args = lambda b, o: (b, last, positions, S, n_loop * n_slots, n_slots, *o)  # noqa: E731
    interleave_pass(*args(got_base, got))  # compiled and warm before the capture
    interleave_pass_ref(*args(ref_base, ref))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        interleave_pass(*args(got_base, got))
    for _ in range(3):
        graph.replay()
        interleave_pass_ref(*args(ref_base, ref))
        torch.cuda.synchronize()
        assert torch.equal(got_base, ref_base) and all(torch.equal(a, r) for a, r in zip(got, ref))


@pytest.mark.parametrize("B", [1, 6, 33, 128])
@pytest.mark.parametrize("n_loop", [1, 3])
def test_interleave_stop_matches_ref_and_pulls_back_the_stopped_rows(B, n_loop):
    """A row its rule stopped (ran < depth) has its last flat row at iteration ran - 1 (or
    earlier, where it was already); a row still going keeps its last."""
    n_prelude, n_slots = 2, 7
    (_, last, _, _, depth, lanes, idle), flat = case(B, n_loop, n_prelude=n_prelude, n_slots=n_slots, seed=B * 3 + n_loop)
    g = torch.Generator().manual_seed(B)
    stops = torch.rand(B, generator=g) < 0.5
    ran = torch.where(stops, (torch.rand(B, generator=g) * depth.cpu()).long().clamp(min=1), depth.cpu()).to(DEVICE)
    outs = []
    for op in (interleave_stop, interleave_stop_ref):
        x = last.clone()
        op(ran, depth, x, lanes, n_prelude, n_loop, n_slots)
        outs.append(x)
    assert torch.equal(*outs)
    want = torch.where(ran < depth, torch.minimum(last, flat(ran - 1, lanes)), last)
    assert torch.equal(outs[0], want)
    stopped = (ran < depth) & ~idle  # a loaded row's last is its depth's: a stop pulls it back
    assert torch.equal(outs[0][stopped], flat(ran - 1, lanes)[stopped])


@pytest.mark.parametrize("B", [1, 7, 64])
def test_interleave_next_matches_ref_and_moves_ended_rows_on(B):
    """Rows whose token ended start their next token one position on with their greedy token;
    rows still going keep their control rows, marked midway (start 1); idle rows stay idle. The
    control rows may be a view of a wider buffer (the buckets share one)."""
    g = torch.Generator().manual_seed(B)
    wide = torch.randint(0, 1000, (9, B + 5), generator=g)
    loaded = torch.randint(0, 1000, (12, B), generator=g)
    live = (torch.arange(B) % 4 != 3).long()
    loaded[9] = live
    ended = torch.rand(B, generator=g) < 0.5
    wide[5, :B] = torch.where(ended, wide[6, :B] + 1, wide[6, :B] - 1)
    greedy = torch.randint(0, 50, (B,), generator=g)
    outs = []
    for op in (interleave_next, interleave_next_ref):
        w, ld = wide.clone().to(DEVICE), loaded.clone().to(DEVICE)
        op(w[:, :B], ld, greedy.to(DEVICE))
        outs.append((w.cpu(), ld.cpu()))
    (w, ld), (wr, ldr) = outs
    assert torch.equal(w, wr) and torch.equal(ld, ldr)
    assert torch.equal(w[:, B:], wide[:, B:])  # the rest of the wide buffer untouched
    e, go = ended & (live == 1), ~ended & (live == 1)
    assert torch.equal(ld[1], loaded[1] + e.long())
    for k in (2, 4, 5, 6, 7, 8):
        assert torch.equal(w[k, :B][go], wide[k, :B][go]) and torch.equal(w[k, :B][~go], loaded[k][~go])
    assert torch.equal(w[1, :B][~go], loaded[1][~go] + e.long()[~go])
    assert torch.equal(w[0, :B], torch.where(e, greedy, 0)) and torch.equal(w[3, :B], go.long())
