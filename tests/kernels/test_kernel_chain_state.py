"""A chain round's lane state kernels against their torch spec: the round's inputs loaded from a
lane's (token, position), and its result and next state written, greedy (every count of
accepted drafts) and sampled (a given verdict), on one lane among others that stay untouched."""
import pytest
import torch
from kernel_tolerances import DEVICE

from tinyloop.kernels.chain_state import chain_leave, chain_leave_ref, chain_load, chain_load_ref

LANES, V, D = 5, 50, 37


def lane_state(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, V, (LANES,), generator=g), torch.randint(0, 400, (LANES,), generator=g)], 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [2, 5, 9])
def test_chain_load_is_its_spec(T, dtype):
    state = lane_state(T).to(DEVICE)
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    for lane in (0, 3, LANES - 1):
        slot = torch.tensor([lane], device=DEVICE)
        outs = []
        for fn in (chain_load, chain_load_ref):
            bufs = (torch.full((1, 1), -1, device=DEVICE), torch.full((1, 1), -1, device=DEVICE),
                    torch.full((1, T), -1, device=DEVICE), torch.zeros(1, 1, D, dtype=dtype, device=DEVICE))
            fn(state, slot, table, *bufs)
            outs.append(bufs)
        token, pos = state[lane].tolist()
        assert outs[0][0].item() == token and outs[0][1].item() == pos
        assert outs[0][2].tolist() == [list(range(pos, pos + T))]
        assert torch.equal(outs[0][3].view(-1), table[token])
        for got, want in zip(*outs):
            assert torch.equal(got, want)


@pytest.mark.parametrize("T", [2, 5, 9])
def test_chain_leave_counts_the_leading_drafts_as_its_spec(T):
    g = torch.Generator().manual_seed(T)
    targets = torch.randint(0, V, (T,), generator=g).to(DEVICE)
    for n_agree in range(T):  # drafts equal to their targets up to n_agree (all of them at T - 1)
        drafts = targets[:T - 1].clone()  # (the drafts after a miss still equal their targets: they do not count)
        if n_agree < T - 1:
            drafts[n_agree] = (drafts[n_agree] + 1) % V
        got = _leave(targets, chain_leave, 2, drafts=drafts)
        want = _leave(targets, chain_leave_ref, 2, drafts=drafts)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        out, state, base = got
        pos = base[2, 1].item()
        assert out.tolist() == [n_agree, *targets.tolist()]
        assert state[2].tolist() == [targets[n_agree].item(), pos + n_agree + 1]
        assert torch.equal(torch.cat([state[:2], state[3:]]), torch.cat([base[:2], base[3:]]))  # other lanes


def test_chain_leave_takes_a_sampled_verdict():
    targets = torch.tensor([7, 3, 9, 4]).to(DEVICE)
    for n in range(4):
        got = _leave(targets, chain_leave, 4, n=torch.tensor([n], device=DEVICE))
        want = _leave(targets, chain_leave_ref, 4, n=torch.tensor([n], device=DEVICE))
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert got[0].tolist() == [n, 7, 3, 9, 4] and got[1][4, 0].item() == targets[n].item()


def _leave(targets, fn, lane, **kw):
    """(out, state after, state before) of fn on `lane` of a fresh state, its round at the lane's position."""
    base = lane_state(11).to(DEVICE)
    state = base.clone()
    chunk = base[lane, 1] + torch.arange(targets.shape[0], device=DEVICE)[None]
    out = torch.full((targets.shape[0] + 1,), -5, device=DEVICE)
    fn(targets, state, torch.tensor([lane], device=DEVICE), chunk, out, **kw)
    return out, state, base


def test_bad_arguments_are_refused():
    state, slot = lane_state(0).to(DEVICE), torch.tensor([1], device=DEVICE)
    targets, out = torch.zeros(3, dtype=torch.long, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE)
    chunk = torch.zeros(1, 3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="pass drafts .* or n"):
        chain_leave(targets, state, slot, chunk, out)
    with pytest.raises(ValueError, match=r"drafts must have shape \(2,\)"):
        chain_leave(targets, state, slot, chunk, out, drafts=torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"state must be \(lanes, 2\)"):
        chain_leave(targets, state.t().contiguous(), slot, chunk, out, n=torch.zeros(1, dtype=torch.long,
                                                                                      device=DEVICE))
    table = torch.zeros(V, D, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must have shape \(1, 1, 37\)"):
        chain_load(state, slot, table, out[:1].view(1, 1), out[1:2].view(1, 1), chunk,
                   torch.zeros(1, D + 1, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_chain_state_gpu_is_its_spec(greedy):
    """The compiled launches on CUDA (bf16 table) against the spec on the same tensors."""
    T, D_gpu = 5, 2048
    state = lane_state(3).cuda()
    table = torch.randn(V, D_gpu, device="cuda").to(torch.bfloat16)
    slot = torch.tensor([2], device="cuda")
    loads = []
    for fn in (chain_load, chain_load_ref):
        bufs = (torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.zeros(1, 1, dtype=torch.long, device="cuda"),
                torch.zeros(1, T, dtype=torch.long, device="cuda"),
                torch.zeros(1, 1, D_gpu, dtype=torch.bfloat16, device="cuda"))
        fn(state, slot, table, *bufs)
        loads.append(bufs)
    assert all(torch.equal(a, b) for a, b in zip(*loads))
    targets = torch.tensor([4, 9, 9, 1, 7], device="cuda")
    kw = {"drafts": torch.tensor([4, 9, 2, 1], device="cuda")} if greedy else {"n": torch.tensor([3], device="cuda")}
    outs = []
    for fn in (chain_leave, chain_leave_ref):
        st, out = state.clone(), torch.zeros(T + 1, dtype=torch.long, device="cuda")
        fn(targets, st, slot, loads[0][2], out, **kw)
        outs.append((out, st))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert outs[0][0][0].item() == (2 if greedy else 3)
