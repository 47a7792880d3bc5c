"""The counter-based uniforms' launch against its torch spec: bit for bit (integer hash,
exact conversion), over seeds and positions that set every bit, broadcast seeds, each stream."""
import pytest
import torch
from kernel_tolerances import DEVICE

from tinyloop.kernels.counter_hash import uniform, uniform_ref


def edge_values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g) * 2 + torch.randint(0, 2, (n,), generator=g)
    edges = torch.tensor([0, 1, -1, (1 << 63) - 1, -(1 << 63), 0x5DEECE66D])[:n]
    x[:len(edges)] = edges
    return x


@pytest.mark.parametrize("stream", [0, 1, 2, 65535])
@pytest.mark.parametrize("n", [1, 7, 128, 300])
def test_uniform_is_its_spec_bit_for_bit(n, stream):
    seed, pos = edge_values(n, n), edge_values(n, n + 1).flip(0)
    got = uniform(seed.to(DEVICE), pos.to(DEVICE), stream)
    want = uniform_ref(seed, pos, stream)
    assert got.dtype == torch.float64 and torch.equal(got.cpu(), want)
    assert bool(((got >= 0) & (got < 1)).all())


def test_one_seed_serves_every_position_and_views_are_read_as_they_are():
    seed = torch.tensor([1234]).to(DEVICE)
    pos = torch.arange(0, 40, 2).to(DEVICE)[::2]                     # a strided view
    assert torch.equal(uniform(seed, pos, 1).cpu(), uniform_ref(seed.cpu().expand(10), pos.cpu(), 1))
    assert torch.equal(uniform(seed.expand(10), pos, 1), uniform(seed, pos, 1))
    assert uniform(seed[:0], pos[:0]).shape == (0,)


def test_bad_input_is_named():
    s = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="seed dtype"):
        uniform(s.int(), s)
    with pytest.raises(ValueError, match="must be 1-D"):
        uniform(s[None], s[None])
    with pytest.raises(ValueError, match=r"stream must be in \[0, 65535\]"):
        uniform(s, s, -1)
