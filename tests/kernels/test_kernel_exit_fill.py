"""Early exit's copy fill with the exit depth on the device: the kernel against its torch
reference and against the host-indexed fill it replaces, for every exit depth of a step
(an idle row's 0, each early exit, none), odd head shapes and a strided slot / position."""
import pytest
import torch
from kernel_tolerances import DEVICE

from tinyloop.kernels.exit_fill import exit_fill, exit_fill_ref, exit_fill_rows, exit_fill_rows_ref


def tables(top, nl, n_prelude):
    cells = [(i, j) for i in range(1, top) for j in range(nl)]
    layer = lambda i, j: n_prelude + i * nl + j  # noqa: E731
    its = torch.tensor([i for i, _ in cells], device=DEVICE)
    dst = torch.tensor([layer(i, j) for i, j in cells], device=DEVICE)
    src = torch.tensor([[layer(e - 1, j) for _, j in cells] for e in range(1, top + 1)], device=DEVICE)
    return its, dst, src, layer


@pytest.mark.parametrize("H,hd", [(1, 8), (3, 20), (4, 64)])
@pytest.mark.parametrize("top,nl", [(2, 1), (5, 2), (7, 3)])
def test_exit_fill_matches_ref_and_the_host_fill(H, hd, top, nl):
    n_prelude, slots, S = 1, 3, 11
    layers = n_prelude + top * nl + 1
    g = torch.Generator().manual_seed(H * 100 + hd + top * nl)
    its, dst, src, layer = tables(top, nl, n_prelude)
    for e in range(0, top + 1):
        slot, pos = (0, S) if e == 0 else (e % slots, (3 * e) % S)  # an idle row sits past the cache
        k0 = torch.randn(layers, slots, H, S, hd, generator=g).to(DEVICE)
        v0 = torch.randn(layers, slots, H, S, hd, generator=g).to(DEVICE)
        ctl = torch.tensor([[9, pos, e, slot], [0, 0, 0, 0]], device=DEVICE).t()  # (4, 2): columns as a step's
        outs = []
        for fill in (exit_fill, exit_fill_ref):
            k, v = k0.clone(), v0.clone()
            fill(k, v, ctl[2], ctl[3], ctl[1], its, dst, src)
            outs.append((k, v))
        (kk, kv), (rk, rv) = outs
        assert torch.equal(kk, rk) and torch.equal(kv, rv), e
        want_k, want_v = k0.clone(), v0.clone()  # the host-indexed fill (early_exit.fill_skipped's copy)
        for i in range(max(e, 1), top) if e > 0 else ():
            for j in range(nl):
                want_k[layer(i, j), slot, :, pos] = k0[layer(e - 1, j), slot, :, pos]
                want_v[layer(i, j), slot, :, pos] = v0[layer(e - 1, j), slot, :, pos]
        assert torch.equal(kk, want_k) and torch.equal(kv, want_v), e
        if 0 < e < top:
            assert not torch.equal(kk, k0), "the fill moved nothing: the case tests little"


def test_exit_fill_refuses_bad_input():
    its, dst, src, _ = tables(4, 2, 1)
    k = torch.zeros(10, 2, 2, 8, 4, device=DEVICE)
    row = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="k and v must be alike"):
        exit_fill(k, torch.zeros(10, 2, 2, 8, 5, device=DEVICE), row, row, row, its, dst, src)
    with pytest.raises(ValueError, match="src a contiguous"):
        exit_fill(k, k.clone(), row, row, row, its, dst, src[:, :3])
    with pytest.raises(ValueError, match="int64"):
        exit_fill(k, k.clone(), row.int(), row, row, its, dst, src)


def test_exit_publish_writes_depth_and_token():
    from tinyloop.kernels.exit_fill import exit_publish, exit_publish_ref
    ctl = torch.tensor([[5, 17, 3, 1]], device=DEVICE).t()  # (4, 1): token, position, depth, slot
    greedy = torch.tensor([[11], [42]], device=DEVICE)
    pin = DEVICE == "cuda"
    for op in (exit_publish, exit_publish_ref):
        host = torch.full((2, 2), -1, dtype=torch.long, pin_memory=pin)
        op(ctl[2], greedy[1], host[1])
        if pin:
            torch.cuda.synchronize()
        assert host.tolist() == [[-1, -1], [3, 42]]
    with pytest.raises(ValueError, match="contiguous \\(2,\\) int64"):
        exit_publish(ctl[2], greedy[1], torch.zeros(3, dtype=torch.long, pin_memory=pin))
    with pytest.raises(ValueError, match="int64"):
        exit_publish(ctl[2].int(), greedy[1], torch.zeros(2, dtype=torch.long, pin_memory=pin))


@pytest.mark.parametrize("H,hd", [(1, 8), (3, 20)])
@pytest.mark.parametrize("top,nl", [(2, 1), (6, 2), (5, 3)])
def test_exit_fill_rows_matches_ref_and_the_host_fill(H, hd, top, nl):
    """An interleaved launch's rows: idle (ran 0), exited at every depth below theirs, run to
    their depth, with depths below the cache's top; each against the per-row host fill."""
    n_prelude, slots, S = 1, 9, 13
    layers = n_prelude + top * nl + 1
    g = torch.Generator().manual_seed(H * 100 + hd + top * nl)
    layer = lambda i, j: n_prelude + i * nl + j  # noqa: E731
    rows = [(0, top, 0, S)]  # an idle row: sits past the cache, moves nothing
    rows += [(e, L, 1 + len(rows) + e, (5 * e + L) % S) for L in range(2, top + 1) for e in range(1, L + 1)]
    rows = rows[:slots]
    ran, depth, lanes, positions = (torch.tensor(c, device=DEVICE) for c in zip(*rows))
    lanes = torch.arange(len(rows), device=DEVICE)  # each row its own lane
    k0 = torch.randn(layers, slots, H, S, hd, generator=g).to(DEVICE)
    v0 = torch.randn(layers, slots, H, S, hd, generator=g).to(DEVICE)
    outs = []
    for fill in (exit_fill_rows, exit_fill_rows_ref):
        k, v = k0.clone(), v0.clone()
        fill(k, v, ran, depth, lanes, positions, n_prelude, nl, top)
        outs.append((k, v))
    (kk, kv), (rk, rv) = outs
    assert torch.equal(kk, rk) and torch.equal(kv, rv)
    want_k, want_v = k0.clone(), v0.clone()
    for b, (e, L, _, pos) in enumerate(rows):
        for i in range(max(e, 1), L) if e > 0 else ():
            for j in range(nl):
                want_k[layer(i, j), b, :, pos] = k0[layer(e - 1, j), b, :, pos]
                want_v[layer(i, j), b, :, pos] = v0[layer(e - 1, j), b, :, pos]
    assert torch.equal(kk, want_k) and torch.equal(kv, want_v)
    assert not torch.equal(kk, k0), "the fill moved nothing: the case tests little"


def test_exit_fill_rows_refuses_bad_input():
    k = torch.zeros(10, 2, 2, 8, 4, device=DEVICE)
    row = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="k and v must be alike"):
        exit_fill_rows(k, torch.zeros(10, 2, 2, 8, 5, device=DEVICE), row, row, row, row, 1, 2, 4)
    with pytest.raises(ValueError, match="int64"):
        exit_fill_rows(k, k.clone(), row.int(), row, row, row, 1, 2, 4)
    with pytest.raises(ValueError, match="do not fit"):
        exit_fill_rows(k, k.clone(), row, row, row, row, 1, 2, 5)
