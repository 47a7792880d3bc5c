"""Store-h kernels (kernels/hcache.py) against their references: the write (h, fp16, int8,
int4, delta against a chain) and the decode attention that rebuilds K / V from ĥ."""
import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels.hcache import (HLayer, h_cache_write, h_cache_write_ref, h_decode_attention,
                                     h_decode_attention_ref, h_rows_ref)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_layer(encoding, n_slots, S, D, G, dtype, chain, g, delta=False):
    """A layer whose tensors hold random content (a delta layer's anchor and chain too)."""
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if encoding in ("h", "fp16"):
        q = rnd(n_slots, S, D).to(DEVICE, dtype if encoding == "h" else F16)
        return HLayer(encoding, q)
    width = D if encoding == "int8" else D // 2
    lo, hi = (-127, 128) if encoding == "int8" else (0, 256)
    q = torch.randint(lo, hi, (n_slots, S, width), generator=g).to(DEVICE, torch.int8 if encoding == "int8" else torch.uint8)
    scale = (rnd(n_slots, S, G).abs() * 0.02).to(DEVICE, F16)
    if not delta:
        return HLayer(encoding, q, scale)
    base = rnd(n_slots, S, D).to(DEVICE, F16)
    cq = torch.randint(-127, 128, (chain, n_slots, S, D), generator=g).to(DEVICE, torch.int8) if chain else None
    cs = (rnd(chain, n_slots, S, G).abs() * 0.01).to(DEVICE, F16) if chain else None
    return HLayer("int8", q, scale, base, cq, cs)


def clone(layer):
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return HLayer(layer.encoding, c(layer.q), c(layer.scale), c(layer.base), c(layer.chain_q), c(layer.chain_scale))


CASES = [("h", False, 0), ("fp16", False, 0), ("int8", False, 0), ("int4", False, 0), ("int8", True, 0),
         ("int8", True, 3)]


@pytest.mark.parametrize("encoding, delta, chain", CASES)
@pytest.mark.parametrize("D, G", [(40, 5), (96, 3)])
def test_write_matches_ref(encoding, delta, chain, D, G):
    g = torch.Generator().manual_seed(D * 10 + chain)
    layer = make_layer(encoding, 3, 9, D, G, F32, chain, g, delta)
    h = (torch.randn(2, 4, D, generator=g) * 3).to(DEVICE)
    idx = torch.tensor([[0, 8, 3, 9], [5, -1, 2, 7]], device=DEVICE)   # 9 and -1: outside, no write
    slots = torch.tensor([2, 0], device=DEVICE)
    want, got = clone(layer), clone(layer)
    h_cache_write_ref(h, idx, slots, want)
    h_cache_write(h, idx, slots, got)
    # the rows as read back: a tie rounded the other way would move one element by one step
    rows = torch.arange(9, device=DEVICE).expand(3, 9)
    every = torch.arange(3, device=DEVICE)
    assert_close(h_rows_ref(got, every, rows), h_rows_ref(want, every, rows), "elementwise")
    if got.scale is not None:
        assert torch.equal(got.scale, want.scale)
    assert (got.q != want.q).float().mean() < 1e-3


# every encoding and every shape (odd lengths, GQA 1 / 2 / 4, head dims 16 to 128, fp32 / fp16),
# without the full product the interpreter could not run in the CI budget
GQA2, MHA, GQA4_F16, MQA_HD128 = (4, 2, 16, 37, F32), (3, 3, 32, 20, F32), (8, 2, 32, 33, F16), (2, 1, 128, 19, F32)


@pytest.mark.parametrize("encoding, delta, chain, H, Hkv, hd, S, dtype", [
    ("h", False, 0, *GQA2), ("fp16", False, 0, *MHA), ("int8", False, 0, *GQA4_F16), ("int8", False, 0, *MQA_HD128),
    ("int4", False, 0, *GQA2), ("int4", False, 0, *GQA4_F16), ("int8", True, 0, *MHA), ("int8", True, 3, *MQA_HD128),
    ("int8", True, 3, *GQA4_F16),
])
def test_decode_attention_matches_ref(encoding, delta, chain, H, Hkv, hd, S, dtype):
    g = torch.Generator().manual_seed(S * 7 + H + chain)
    D = H * hd  # d_model = n_heads · head_dim; G = n_heads groups
    layer = make_layer(encoding, 3, S, D, H, dtype, chain, g, delta)
    wk = (torch.randn(Hkv * hd, D, generator=g) * D ** -0.5).to(DEVICE, dtype)
    wv = (torch.randn(Hkv * hd, D, generator=g) * D ** -0.5).to(DEVICE, dtype)
    kb = torch.randn(Hkv * hd, generator=g).to(DEVICE, dtype) if chain else None
    q = torch.randn(3, 1, H, hd, generator=g).to(DEVICE, dtype)
    ang = torch.arange(S + 3)[:, None].float() * (1e-2 ** (torch.arange(hd // 2) / (hd // 2)))
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    positions = torch.tensor([S - 1, 4, S], device=DEVICE)  # S: an idle row
    slots = torch.tensor([1, 2, 0], device=DEVICE)
    args = (q, positions, layer, wk, wv, kb, cos, sin, hd ** -0.5, slots)
    assert_close(h_decode_attention(*args), h_decode_attention_ref(*args), "attention")


# -- GPU: bench-285m's shapes (D 2048, 16 heads of 128, MHA), bf16, graphs ----------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("encoding, delta, chain", [("h", False, 0), ("int8", False, 0), ("int4", False, 0),
                                                    ("int8", True, 5)])
@pytest.mark.parametrize("S", [1031, 4096])
def test_decode_attention_gpu_bench_285m(encoding, delta, chain, S):
    g = torch.Generator().manual_seed(S + chain)
    H = Hkv = 16
    hd, D, B = 128, 2048, 3
    layer = make_layer(encoding, 4, S, D, H, BF16, chain, g, delta)
    wk = (torch.randn(Hkv * hd, D, generator=g) * D ** -0.5).to(DEVICE, BF16)
    wv = (torch.randn(Hkv * hd, D, generator=g) * D ** -0.5).to(DEVICE, BF16)
    q = torch.randn(B, 1, H, hd, generator=g).to(DEVICE, BF16)
    ang = torch.arange(S)[:, None].float() * (1e4 ** (-torch.arange(hd // 2) / (hd // 2)))
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    positions = torch.tensor([S - 1, 700, S], device=DEVICE)
    slots = torch.tensor([3, 0, 1], device=DEVICE)
    args = (q, positions, layer, wk, wv, None, cos, sin, hd ** -0.5, slots)
    out = h_decode_attention(*args)
    assert_close(out, h_decode_attention_ref(*args), "attention")
    # one captured graph of the write and the read, replayed at other positions
    h = torch.randn(B, 1, D, generator=g).to(DEVICE, BF16)
    static_pos = positions.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        h_cache_write(h, static_pos[:, None], slots, layer)
        h_decode_attention(q, static_pos, layer, wk, wv, None, cos, sin, hd ** -0.5, slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h_cache_write(h, static_pos[:, None], slots, layer)
        got = h_decode_attention(q, static_pos, layer, wk, wv, None, cos, sin, hd ** -0.5, slots)
    for pos in ([5, S - 2, 0], [S, 1, 2000]):
        static_pos.copy_(torch.tensor(pos, device=DEVICE))
        want_layer = clone(layer)
        h_cache_write_ref(h, static_pos[:, None], slots, want_layer)
        graph.replay()
        assert_close(got, h_decode_attention_ref(q, static_pos, want_layer, wk, wv, None, cos, sin, hd ** -0.5,
                                                 slots), "attention")
