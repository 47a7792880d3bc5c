import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels import decode_attention, decode_attention_ref
from tinyloop.kernels.decode_attention import _decode_attention


def make_inputs(B, H, Hkv, hd, S, dtype, seed):
    """q (B, H, hd) and caches as (B, Hkv, S, hd) views into a (layers, B, S + 2, Hkv, hd) buffer."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, hd, generator=g).to(DEVICE, dtype)
    caches = [torch.randn(3, B, S + 2, Hkv, hd, generator=g).to(DEVICE, dtype)[1, :, :S].permute(0, 2, 1, 3)
              for _ in range(2)]
    return q, caches[0], caches[1]


F32, F16 = torch.float32, torch.float16


# Every S, hd and GQA ratio (1 / 2 / 4) appears with both dtypes without the full product,
# which the interpreter could not run in the CI budget.
@pytest.mark.parametrize("S, hd, H, Hkv, dtype", [
    (1, 16, 2, 2, F32), (1, 24, 8, 2, F16),
    (7, 24, 4, 2, F32), (7, 32, 2, 2, F16),
    (33, 32, 8, 2, F32), (33, 16, 4, 2, F16), (33, 24, 4, 1, F32),
    (130, 24, 2, 2, F32), (130, 32, 4, 2, F16), (130, 16, 8, 2, F16),
])
def test_decode_attention_matches_ref(S, hd, H, Hkv, dtype):
    B = 3
    q, k_cache, v_cache = make_inputs(B, H, Hkv, hd, S, dtype, seed=S * 1000 + hd * 10 + H)
    seq_lens = torch.tensor([S, max(S // 2, 1), S + 5], device=DEVICE)  # S + 5: a full ring buffer
    scale = hd ** -0.5
    assert_close(decode_attention(q, k_cache, v_cache, seq_lens, scale),
                 decode_attention_ref(q, k_cache, v_cache, seq_lens, scale), "attention")


@pytest.mark.parametrize("split_len", [16, 32, 48])
@pytest.mark.parametrize("S", [33, 130])
def test_decode_attention_many_splits(S, split_len):
    """Splits past seq_len (and whole empty sequences) must write neutral partials."""
    q, k_cache, v_cache = make_inputs(4, 4, 2, 24, S, torch.float32, seed=S + split_len)
    seq_lens = torch.tensor([S, 1, 0, 17], dtype=torch.int32, device=DEVICE)
    out = _decode_attention(q, k_cache, v_cache, seq_lens, 0.2, split_len)
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, seq_lens, 0.2), "attention")
    assert torch.all(out[2] == 0)  # empty sequence: zeros, not NaN


@pytest.mark.parametrize("split_len", [16, 48])
@pytest.mark.parametrize("H, Hkv, dtype", [(3, 3, F32), (4, 2, F32), (8, 2, F16)])
def test_decode_attention_merge_of_many_splits(H, Hkv, dtype, split_len):
    """The merge kernel combines every split of each head, empty ones included (splits past
    seq_len, an empty sequence), over GQA groups of 1, 2 and 4: the output equals the reference
    after every launch, and repeated launches agree bitwise."""
    S = 130  # 9 splits of 16, 3 of 48
    q, k_cache, v_cache = make_inputs(5, H, Hkv, 24, S, dtype, seed=H * 100 + split_len)
    seq_lens = torch.tensor([S, 0, 1, 16, 49], device=DEVICE)
    expected = decode_attention_ref(q, k_cache, v_cache, seq_lens, 0.3)
    outs = []
    for _ in range(3):
        outs.append(_decode_attention(q, k_cache, v_cache, seq_lens, 0.3, split_len))
        assert_close(outs[-1], expected, "attention")
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.all(outs[0][1] == 0)


@pytest.mark.parametrize("split_len", [16, 144])
def test_decode_attention_ignores_slots_beyond_seq_len(split_len):
    S, hd = 130, 24
    q, k_cache, v_cache = make_inputs(3, 4, 2, hd, S, torch.float32, seed=7)
    seq_lens = torch.tensor([5, 64, 129], device=DEVICE)
    for b, n in enumerate(seq_lens.tolist()):  # garbage past seq_len must not reach the output
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("inf")
    out = _decode_attention(q, k_cache, v_cache, seq_lens, hd ** -0.5, split_len)
    for b, n in enumerate(seq_lens.tolist()):
        expected = decode_attention_ref(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                                        seq_lens[b:b + 1], hd ** -0.5)
        assert_close(out[b:b + 1], expected, "attention")


def test_decode_attention_rejects_bad_inputs():
    q, k_cache, v_cache = make_inputs(2, 4, 2, 16, 8, torch.float32, seed=0)
    seq_lens = torch.tensor([8, 8], device=DEVICE)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q[:, :3], k_cache, v_cache, seq_lens, 1.0)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        decode_attention(q, k_cache, v_cache[..., :8], seq_lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens dtype"):
        decode_attention(q, k_cache, v_cache, seq_lens.float(), 1.0)
    with pytest.raises(ValueError, match="k_cache dtype"):
        decode_attention(q, k_cache.half(), v_cache, seq_lens, 1.0)



def make_slot_inputs(B, n_slots, H, Hkv, hd, S, dtype, seed):
    """q (B, H, hd) and whole cache layers (n_slots, Hkv, S, hd), views as make_inputs'."""
    q, k_cache, v_cache = make_inputs(n_slots, H, Hkv, hd, S, dtype, seed)
    return q[:B], k_cache, v_cache


# slots: a permuted subset of 5 cache slots (int64 / int32), or two rows sharing one (read only)
@pytest.mark.parametrize("hd, dtype, slots, slots_dtype", [
    (64, F32, [4, 0, 2], torch.int64), (24, F16, [4, 0, 2], torch.int32), (24, F32, [3, 3, 1], torch.int64),
])
def test_decode_attention_slots_matches_ref(hd, dtype, slots, slots_dtype):
    """Rows on cache slots slots[b] of a whole layer (n_slots = 5 > B = 3, GQA 2, odd S): the
    launcher equals the reference; the reference equals the slot-less one on the gathered rows
    k_cache[slots] bitwise, and so does the launcher (only the addresses differ)."""
    B, H, Hkv, S = 3, 4, 2, 19
    q, k_cache, v_cache = make_slot_inputs(B, 5, H, Hkv, hd, S, dtype, seed=hd + len(set(slots)))
    slots = torch.tensor(slots, dtype=slots_dtype, device=DEVICE)
    seq_lens = torch.tensor([S, 7, 0], device=DEVICE)
    scale = hd ** -0.5
    out = decode_attention(q, k_cache, v_cache, seq_lens, scale, slots=slots)
    ref = decode_attention_ref(q, k_cache, v_cache, seq_lens, scale, slots=slots)
    assert_close(out, ref, "attention")
    k_rows, v_rows = k_cache[slots], v_cache[slots]  # (B, Hkv, S, hd) copies
    assert torch.equal(ref, decode_attention_ref(q, k_rows, v_rows, seq_lens, scale))
    assert torch.equal(out, decode_attention(q, k_rows, v_rows, seq_lens, scale))
    assert torch.all(out[2] == 0)  # an empty sequence reads nothing


def test_decode_attention_slots_many_splits():
    """Slots through the split kernel's many splits and the merge (splits of 16 slots)."""
    S = 33
    q, k_cache, v_cache = make_slot_inputs(3, 5, 8, 2, 24, S, F32, seed=11)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    seq_lens = torch.tensor([S, 17, 1], device=DEVICE)
    out = _decode_attention(q, k_cache, v_cache, seq_lens, 0.2, 16, slots)
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, seq_lens, 0.2, slots=slots), "attention")
    assert torch.equal(out, _decode_attention(q, k_cache[slots], v_cache[slots], seq_lens, 0.2, 16))


@pytest.mark.parametrize("op", [decode_attention, decode_attention_ref])
def test_decode_attention_rejects_bad_slots(op):
    q, k_cache, v_cache = make_slot_inputs(2, 4, 4, 2, 16, 8, F32, seed=0)
    seq_lens = torch.tensor([8, 3], device=DEVICE)
    name = op.__name__
    with pytest.raises(ValueError, match=rf"{name}: slots\[1\] = 4 is outside \[0, 4\)"):
        op(q, k_cache, v_cache, seq_lens, 1.0, slots=torch.tensor([0, 4], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots\[0\] = -1 is outside"):
        op(q, k_cache, v_cache, seq_lens, 1.0, slots=torch.tensor([-1, 0], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots must have shape \(2,\), got \(2, 1\)"):
        op(q, k_cache, v_cache, seq_lens, 1.0, slots=torch.tensor([[0], [1]], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots must have shape \(2,\), got \(3,\)"):
        op(q, k_cache, v_cache, seq_lens, 1.0, slots=torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots dtype"):
        op(q, k_cache, v_cache, seq_lens, 1.0, slots=torch.tensor([0., 1.], device=DEVICE))
    if op is decode_attention:
        with pytest.raises(ValueError, match=r"v_cache must have shape \(4, 2, 8, 16\)"):
            op(q, k_cache, v_cache[:3], seq_lens, 1.0, slots=torch.tensor([0, 1], device=DEVICE))
        with pytest.raises(ValueError, match=r"k_cache must have shape \(2, 2, 8, 16\)"):
            op(q, k_cache, v_cache, seq_lens, 1.0)  # a whole layer needs slots

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B, H, Hkv, hd, S", [(1, 32, 8, 128, 8191), (16, 16, 16, 64, 1031), (4, 28, 4, 96, 4096)])
def test_decode_attention_gpu_bf16(B, H, Hkv, hd, S):
    q, k_cache, v_cache = make_inputs(B, H, Hkv, hd, S, torch.bfloat16, seed=S)
    seq_lens = torch.randint(0, S + 10, (B,), device="cuda")
    seq_lens[0] = S
    out = decode_attention(q, k_cache, v_cache, seq_lens, hd ** -0.5)
    assert_close(out, decode_attention_ref(q, k_cache, v_cache, seq_lens, hd ** -0.5), "attention")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_len", [None, 64])
@pytest.mark.parametrize("Hkv", [16, 4])
def test_decode_attention_gpu_split_merge_cuda_graph(Hkv, split_len):
    """The split and merge kernels on the GPU, over the launcher's splits and over 32 forced
    ones: eager launches agree bitwise, then one captured graph replayed at three sets of
    seq_lens (empty and full sequences included)."""
    B, H, hd, S = 4, 16, 128, 2048
    q, k_cache, v_cache = make_inputs(B, H, Hkv, hd, S, torch.bfloat16, seed=Hkv)
    seq_lens = torch.tensor([S, 1, 0, 1000], device="cuda")
    scale = hd ** -0.5

    def launch():
        if split_len is None:
            return decode_attention(q, k_cache, v_cache, seq_lens, scale)
        return _decode_attention(q, k_cache, v_cache, seq_lens, scale, split_len)

    expected = decode_attention_ref(q, k_cache, v_cache, seq_lens, scale)
    first = launch()
    assert_close(first, expected, "attention")
    assert torch.equal(launch(), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    for lens in ([0, 127, S, 2047], [S, 0, 1, 300], [5, S, 2000, 0]):
        seq_lens.copy_(torch.tensor(lens))
        graph.replay()
        assert_close(out.clone(), decode_attention_ref(q, k_cache, v_cache, seq_lens, scale), "attention")



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_len", [None, 64])
def test_decode_attention_gpu_slots_cuda_graph(split_len):
    """One graph captured with a slots tensor serves any lanes: replayed at three sets of slots
    (a permutation, a shared slot) and seq_lens, each equal to the reference with those slots."""
    B, n_slots, H, Hkv, hd, S = 4, 7, 16, 4, 128, 2048
    q, k_cache, v_cache = make_slot_inputs(B, n_slots, H, Hkv, hd, S, torch.bfloat16, seed=3)
    slots = torch.tensor([6, 0, 3, 1], device="cuda")
    seq_lens = torch.tensor([S, 1, 0, 1000], device="cuda")
    scale = hd ** -0.5

    def launch():
        if split_len is None:
            return decode_attention(q, k_cache, v_cache, seq_lens, scale, slots=slots)
        return _decode_attention(q, k_cache, v_cache, seq_lens, scale, split_len, slots)

    first = launch()
    assert_close(first, decode_attention_ref(q, k_cache, v_cache, seq_lens, scale, slots=slots), "attention")
    assert torch.equal(first, decode_attention(q, k_cache[slots], v_cache[slots], seq_lens, scale)
                       if split_len is None else _decode_attention(q, k_cache[slots], v_cache[slots],
                                                                   seq_lens, scale, split_len))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    for lanes, lens in (([2, 5, 4, 6], [0, 127, S, 2047]), ([1, 1, 0, 3], [S, 0, 1, 300])):
        slots.copy_(torch.tensor(lanes))
        seq_lens.copy_(torch.tensor(lens))
        graph.replay()
        expected = decode_attention_ref(q, k_cache, v_cache, seq_lens, scale, slots=slots)
        assert_close(out.clone(), expected, "attention")
