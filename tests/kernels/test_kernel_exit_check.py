"""The early-exit check kernel against its torch reference: every row's decisions over a run of
checks with rows of all four criteria mixed, a shrinking and reordered active set (as an exit
step moves its stopped rows behind), with and without logits, and the running state each
criterion keeps."""
import pytest
import torch
from kernel_tolerances import DEVICE

from tinyloop.kernels.exit_check import ARGMAX, GATE, KL, LATENT, exit_check, exit_check_ref


def buffers(n, D, V, params):
    f32 = dict(dtype=torch.float32, device=DEVICE)
    return dict(params=params.to(DEVICE), d=torch.zeros(n, **f32), remaining=torch.ones(n, **f32),
                cum=torch.zeros(n, **f32), prev_n=torch.zeros(n, D, **f32), prev_logp=torch.zeros(n, V, **f32),
                prev_arg=torch.full((n,), -1, dtype=torch.long, device=DEVICE),
                streak=torch.zeros(n, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("D,V", [(24, 40), (64, 300)])
def test_exit_check_matches_ref(D, V, gate):
    g = torch.Generator().manual_seed(D + V + gate)
    n, L, W = 12, 7, D + 8  # W: the residual is wider than the state (a strided view)
    crits = torch.tensor([GATE if gate else LATENT, LATENT, KL, ARGMAX, 0, LATENT, KL, ARGMAX, KL, LATENT,
                          ARGMAX, GATE if gate else 0], dtype=torch.float32)
    thr = torch.where(crits == KL, torch.rand(n, generator=g) * 0.5, torch.rand(n, generator=g) * 0.9 + 0.05)
    earliest = torch.randint(1, 4, (n,), generator=g).float()
    first = torch.where((crits == KL) | (crits == ARGMAX), torch.clamp(earliest - 1, min=1), 1 << 30)
    patience = torch.randint(1, 3, (n,), generator=g).float()
    depth = torch.randint(3, L + 1, (n,), generator=g).float()
    params = torch.stack([crits, thr, earliest, first, patience, depth], -1)
    ker, ref = buffers(n, D, V, params), buffers(n, D, V, params)
    gw = (torch.randn(D, generator=g) * 0.3).to(DEVICE) if gate else None
    gb = torch.randn(1, generator=g).to(DEVICE) if gate else None
    depth_k = depth.long().to(DEVICE)
    depth_r = depth_k.clone()
    stop_k = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    stop_r = stop_k.clone()
    order = list(range(n))
    m = n
    fired = 0
    x = torch.randn(n, W, generator=g)
    # few distinct logit rows, so argmax streaks build up and the kl criterion sees both sides
    base = torch.randn(3, V, generator=g) * 3
    for i in range(L):
        x = x + 0.6 ** i * torch.randn(n, W, generator=g)  # successive states converge: latent fires
        lg = (base[torch.arange(n) % 3] + 0.3 ** i * torch.randn(n, V, generator=g)).to(DEVICE)
        states = x[order[:m]].to(DEVICE)[:, :D]
        logits = lg[order[:m]].contiguous() if i % 3 != 1 else None
        od = torch.tensor(order, device=DEVICE)
        for b, dr, st, fn in ((ker, depth_k, stop_k, exit_check), (ref, depth_r, stop_r, exit_check_ref)):
            fn(b["params"], b["d"], b["remaining"], b["cum"], b["prev_n"], b["prev_logp"], b["prev_arg"],
               b["streak"], od, states, logits, dr, st, gw, gb, 1e-6)
        assert torch.equal(stop_k[:m], stop_r[:m]), i
        assert torch.equal(depth_k[:m], depth_r[:m]), i
        rows = od[:m]
        assert torch.equal(ker["d"], ref["d"])
        mine = lambda c: rows[params.to(DEVICE)[rows, 0] == c]  # noqa: E731
        torch.testing.assert_close(ker["prev_n"][mine(LATENT)], ref["prev_n"][mine(LATENT)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ker["prev_logp"][mine(KL)], ref["prev_logp"][mine(KL)], rtol=1e-5, atol=1e-5)
        assert torch.equal(ker["streak"][mine(ARGMAX)], ref["streak"][mine(ARGMAX)])
        assert torch.equal(ker["prev_arg"][mine(ARGMAX)], ref["prev_arg"][mine(ARGMAX)])
        if gate:
            torch.testing.assert_close(ker["cum"][mine(GATE)], ref["cum"][mine(GATE)], rtol=1e-5, atol=1e-6)
        # the stopped rows move behind; the rest go on, in a new order
        stopped = [r for r, s in zip(order[:m], stop_k[:m].tolist()) if s]
        fired += sum(1 for r in stopped if depth_k[order.index(r)] < depth[r])
        going = [r for r in order[:m] if r not in stopped][::-1]
        depth_k = torch.cat([depth_k[[order.index(r) for r in going]], depth_k[[order.index(r) for r in stopped]],
                             depth_k[m:]])
        depth_r = depth_k.clone()
        order = going + stopped + order[m:]
        m = len(going)
        if not m:
            break
    assert fired >= 3, "too few rules fired: the case tests little"
    assert ker["streak"].max() >= 1, "no argmax streak: the case tests little"


def test_exit_check_refuses_bad_input():
    n, D, V = 2, 8, 16
    b = buffers(n, D, V, torch.zeros(n, 6))
    od = torch.arange(n, device=DEVICE)
    depth = torch.ones(n, dtype=torch.long, device=DEVICE)
    args = [b[k] for k in ("params", "d", "remaining", "cum", "prev_n", "prev_logp", "prev_arg", "streak")]
    with pytest.raises(ValueError, match="unit stride along D"):
        exit_check(*args, od, torch.zeros(D, n, device=DEVICE).t(), None, depth,
                   torch.zeros(n, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="logits must be contiguous fp32"):
        exit_check(*args, od, torch.zeros(n, D, device=DEVICE), torch.zeros(n, V, dtype=torch.float16, device=DEVICE),
                   depth, torch.zeros(n, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="stop a bool tensor"):
        exit_check(*args, od, torch.zeros(n, D, device=DEVICE), None, depth, torch.zeros(n, device=DEVICE))
