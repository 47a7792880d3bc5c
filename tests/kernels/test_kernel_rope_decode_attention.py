from collections import namedtuple

import pytest
import torch
from kernel_tolerances import DEVICE, assert_close
from test_kernel_rope import rope_tables

from tinyloop.kernels import (
    decode_attention,
    rope_cache_write,
    rope_chunk_attention,
    rope_chunk_attention_ref,
    rope_decode_attention,
    rope_decode_attention_ref,
    rope_tree_attention,
    rope_tree_attention_ref,
)
from tinyloop.kernels.decode_attention import (_rope_chunk_attention, _rope_decode_attention, _rope_splits,
                                               _rope_tree_attention)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

Inputs = namedtuple("Inputs", "q k v cos sin positions k_cache v_cache k_buf v_buf")


def make_inputs(B, H, Hkv, hd, S, dtype, positions, seed, rows=None):
    """q (B, 1, H, hd), k, v (B, 1, Hkv, hd) as views of one fused projection output; caches
    (B, Hkv, S, hd) as views into a (layers, B, S + 2, Hkv, hd) buffer (k_buf / v_buf), so every
    stride differs from the contiguous one; cos, sin tables of `rows` positions (default S, the
    fewest allowed) as views into NaN-filled buffers, so a row read outside the table (an idle
    lane's position -1 or >= rows) poisons the output. Deterministic in seed: a second call gives
    an identical copy, for the reference and for the untouched-slots check."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * hd, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    q, k, v = q.view(B, 1, H, hd), k.view(B, 1, Hkv, hd), v.view(B, 1, Hkv, hd)
    bufs = [torch.randn(3, B, S + 2, Hkv, hd, generator=g).to(DEVICE, dtype) for _ in range(2)]
    k_cache, v_cache = (buf[1, :, :S].permute(0, 2, 1, 3) for buf in bufs)
    positions = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
    P, half = S if rows is None else rows, hd // 2
    tables = []
    for t in rope_tables(torch.arange(P, device=DEVICE)[None], hd):  # (1, P, hd // 2)
        buf = torch.full((P + 4, half + 3), float("nan"), device=DEVICE)
        buf[2:P + 2, 1:half + 1] = t[0]
        tables.append(buf[2:P + 2, 1:half + 1])  # (P, hd // 2) view
    return Inputs(q, k, v, *tables, positions, k_cache, v_cache, *bufs)


def table_rows(inputs, S):
    """cos, sin (B, 1, hd // 2) at each lane's position (row 0 for an idle lane), for the
    unfused kernels."""
    p = inputs.positions
    rows = torch.where((p >= 0) & (p < S), p, 0)[:, None]
    return inputs.cos[rows], inputs.sin[rows]


def lane_positions(S):
    """pos 0 (no cache key), a middle one, the last slot, and an idle lane (pos = S)."""
    return [0, S // 2, S - 1, S]


def assert_caches(got, ref, orig, S, slots=None):
    """Slot pos of every live lane holds the reference's rot(k) / v; every other element of the
    whole buffer (other slots, idle lanes, other layers, the two slots past S) is untouched.
    slots: lane b is cache slot slots[b] of the buffer (unused slots untouched too)."""
    live = (ref.positions >= 0) & (ref.positions < S)
    written = torch.zeros(got.k_buf.shape[:3], dtype=torch.bool, device=DEVICE)  # (layers, n, S + 2)
    lanes = (torch.arange(len(live), device=DEVICE) if slots is None else slots.to(DEVICE, torch.int64))[live]
    written[1, lanes, ref.positions[live]] = True
    for name in ("k_buf", "v_buf"):
        buf, buf_ref, buf_orig = getattr(got, name), getattr(ref, name), getattr(orig, name)
        assert torch.equal(buf[~written], buf_orig[~written]), f"{name}: a slot other than pos changed"
        if name == "k_buf":
            assert_close(buf[written], buf_ref[written])
        else:
            assert torch.equal(buf[written], buf_ref[written])  # v is copied, not computed


def run_both(launch, B, H, Hkv, hd, S, dtype, positions, seed, scale, rows=None):
    """launch(*args, scale) on one copy of the inputs and the reference on another: both outputs
    and the caches checked (against a third, untouched copy)."""
    got, ref, orig = (make_inputs(B, H, Hkv, hd, S, dtype, positions, seed, rows) for _ in range(3))
    out = launch(*got[:8], scale)
    assert out.shape == (B, H, hd)
    assert_close(out, rope_decode_attention_ref(*ref[:8], scale), "attention")
    assert_caches(got, ref, orig, S)
    return out, got


# Every S, hd and GQA ratio (1 / 2 / 4) appears with both dtypes without the full product,
# which the interpreter could not run in the CI budget. Each case has 4 lanes: pos 0, S // 2,
# S - 1 and an idle lane.
@pytest.mark.parametrize("S, hd, H, Hkv, dtype", [
    (1, 16, 2, 2, F32), (1, 24, 8, 2, F16),
    (7, 24, 4, 2, F32), (7, 32, 2, 2, F16),
    (33, 32, 8, 2, F32), (33, 16, 4, 2, F16), (33, 24, 4, 1, F32),
    (130, 16, 8, 2, F32), (130, 32, 4, 1, F16), (130, 24, 2, 2, F16),
])
def test_rope_decode_attention_matches_ref(S, hd, H, Hkv, dtype):
    out, got = run_both(rope_decode_attention, 4, H, Hkv, hd, S, dtype, lane_positions(S),
                        seed=S * 1000 + hd * 10 + H, scale=hd ** -0.5)
    G = H // Hkv
    # the idle lane attends to its new key alone: its output is its own v, exactly
    assert torch.equal(out[3], got.v[3, 0].repeat_interleave(G, dim=0))


@pytest.mark.parametrize("tile", [(32, 1), (64, 2)])
def test_rope_decode_attention_takes_any_split_tile(tile):
    """An explicit (BLOCK_N, num_stages), as bench/attention_tiles.py sweeps them: the same
    attention and cache writes as the reference; a tile no launch can take is refused."""
    S, hd, H, Hkv = 130, 32, 4, 2

    def launch(*args):
        return rope_decode_attention(*args, tile=tile)
    run_both(launch, 4, H, Hkv, hd, S, F16, lane_positions(S), seed=7, scale=hd ** -0.5)
    got = make_inputs(4, H, Hkv, hd, S, F16, lane_positions(S), seed=7)
    for bad in ((48, 1), (8, 2), (32, 0)):
        with pytest.raises(ValueError, match="split tile"):
            rope_decode_attention(*got[:8], hd ** -0.5, tile=bad)


@pytest.mark.parametrize("split_len", [16, 48])
@pytest.mark.parametrize("S", [33, 130])
@pytest.mark.parametrize("H, Hkv", [(3, 3), (4, 2), (8, 2)])
def test_rope_decode_attention_many_splits(H, Hkv, S, split_len):
    """Splits at or past pos (and every split of an idle lane) must write neutral partials, and
    the merge kernel combines them, over GQA groups of 1, 2 and 4: pos 16 ends a split of 16
    exactly, pos 17 leaves one slot in the next; -1 and S are idle (tables of S rows, or longer
    as the engine's). A second launch on the same inputs (slot pos now holds the key it writes
    again) gives the same output bitwise."""
    out, got = run_both(lambda *a: _rope_decode_attention(*a, split_len), 6, H, Hkv, 24, S, F32,
                        [S - 1, 16, 17, 0, -1, S], seed=S + split_len + H, scale=0.2,
                        rows=S if split_len == 16 else S + 7)
    assert torch.equal(_rope_decode_attention(*got[:8], 0.2, split_len), out)


@pytest.mark.parametrize("split_len, max_active, lane_split_len", [
    (16, 1, None), (16, 2, None), (16, 3, None), (48, 3, 16), (48, 3, 5), (144, 1, 16)])
def test_rope_decode_attention_capped_splits(split_len, max_active, lane_split_len):
    """Fewer active splits a lane than a full cache's (the launcher's one-wave cap): a lane
    needing more spreads its slots evenly over max_active longer splits, whose ends fall inside
    tiles (pos 129 in 3 splits: 43 slots each; pos 100 in 2: 50), and one split writes o itself.
    A lane split length below the grid's (the launcher's LANE_SPLIT_LEN) splits a lane more
    finely than the grid's split length would (pos 33 in 3 splits of 5 slots at least: 11 each;
    in splits of 16: 3 of 11, where the grid's 48 would give one). Checked against the
    reference, then the slots >= pos poisoned as below: none is read."""
    S, hd = 130, 24
    positions = [129, 100, 33, 17, 16, 0, S]
    args = (split_len, max_active, lane_split_len)
    out, got = run_both(lambda *a: _rope_decode_attention(*a, *args), 7, 4, 2, hd, S, F32,
                        positions, seed=max_active + split_len, scale=0.3)
    for b, p in enumerate(positions):
        first_unread = p + 1 if p < S else 0  # slot p now holds the new key
        got.k_cache[b, :, first_unread:] = float("nan")
        got.v_cache[b, :, first_unread:] = float("inf")
    assert torch.equal(_rope_decode_attention(*got[:8], 0.3, *args), out)


@pytest.mark.parametrize("split_len", [16, 144])
def test_rope_decode_attention_reads_only_slots_before_pos(split_len):
    """Slots >= pos of a live lane and every slot of an idle lane hold garbage (NaN keys, inf
    values): none may reach the output. Slot pos is overwritten, the ones past it stay."""
    S, hd = 130, 24
    positions = [5, 64, 129, 0, S]
    got, ref = (make_inputs(5, 4, 2, hd, S, F32, positions, seed=7) for _ in range(2))
    for b, p in enumerate(positions):
        first_unread = p if p < S else 0  # the idle lane: all of it
        got.k_cache[b, :, first_unread:] = float("nan")
        got.v_cache[b, :, first_unread:] = float("inf")
    out = _rope_decode_attention(*got[:8], hd ** -0.5, split_len)
    assert_close(out, rope_decode_attention_ref(*ref[:8], hd ** -0.5), "attention")
    for b, p in enumerate(positions[:-1]):
        assert_close(got.k_cache[b, :, p], ref.k_cache[b, :, p])
        assert torch.isnan(got.k_cache[b, :, p + 1:]).all()


def assert_equals_unfused(B, H, Hkv, hd, S, dtype, positions, seed):
    """The fused op is rope_cache_write then decode_attention(seq_lens = pos + 1) on the live
    lanes: same output, same caches (the whole buffers)."""
    fused, u = (make_inputs(B, H, Hkv, hd, S, dtype, positions, seed) for _ in range(2))
    scale = hd ** -0.5
    out = rope_decode_attention(*fused[:8], scale)
    q_rot = rope_cache_write(u.q, u.k, u.v, *table_rows(u, S), u.positions[:, None], u.k_cache, u.v_cache)
    expected = decode_attention(q_rot[:, :, 0], u.k_cache, u.v_cache, u.positions + 1, scale)
    live = (u.positions >= 0) & (u.positions < S)
    assert_close(out[live], expected[live], "attention")
    assert_close(fused.k_buf, u.k_buf)
    assert torch.equal(fused.v_buf, u.v_buf)


@pytest.mark.parametrize("S, hd, H, Hkv, dtype", [
    (33, 32, 4, 1, F32), (130, 24, 8, 2, F16), (7, 16, 2, 2, F16),
])
def test_rope_decode_attention_equals_unfused_kernels(S, hd, H, Hkv, dtype):
    assert_equals_unfused(4, H, Hkv, hd, S, dtype, lane_positions(S), seed=S + hd)


def test_rope_decode_attention_rejects_bad_inputs():
    a = make_inputs(2, 4, 2, 16, 8, F32, [3, 8], seed=0)
    op = "rope_decode_attention"

    def call(**kw):
        args = {**a._asdict(), **kw}
        args.pop("k_buf"), args.pop("v_buf")
        rope_decode_attention(**args, scale=1.0)

    with pytest.raises(ValueError, match=f"{op}: positions dtype"):
        call(positions=a.positions.int())
    with pytest.raises(ValueError, match=f"{op}: positions must have shape \\(2,\\)"):
        call(positions=a.positions[:, None])
    with pytest.raises(ValueError, match=f"{op}: k_cache dtype"):
        call(k_cache=a.k_cache.half())
    with pytest.raises(ValueError, match=f"{op}: v_cache dtype"):
        call(v_cache=a.v_cache.double())
    with pytest.raises(ValueError, match=f"{op}: one new token per lane"):
        call(q=a.q.expand(2, 2, 4, 16))
    with pytest.raises(ValueError, match=f"{op}: cos must have shape"):
        call(cos=a.cos[..., :-1])
    with pytest.raises(ValueError, match=f"{op}: cos must have shape \\(P, 8\\) with P >= S = 8"):
        call(cos=a.cos[:-1])  # a cache slot with no row
    with pytest.raises(ValueError, match=f"{op}: sin must have shape \\(8, 8\\)"):
        call(sin=a.sin[:, :-1])
    with pytest.raises(ValueError, match=f"{op}: cos must be 2-D"):
        call(cos=a.cos[None])
    with pytest.raises(ValueError, match=f"{op}: query heads 3 must be a multiple of kv heads 2"):
        call(q=a.q[:, :, :3])
    with pytest.raises(ValueError, match=f"{op}: head dim must be even"):
        call(q=a.q[..., :15], k=a.k[..., :15], v=a.v[..., :15], k_cache=a.k_cache[..., :15],
             v_cache=a.v_cache[..., :15])
    with pytest.raises(ValueError, match=f"{op}: v_cache must have shape"):
        call(v_cache=a.v_cache[:, :, :3])



def make_slot_inputs(B, n_slots, H, Hkv, hd, S, dtype, positions, seed, rows=None):
    """make_inputs' inputs for B lanes at positions over whole cache layers of n_slots slots:
    the caches (n_slots, Hkv, S, hd) and buffers as make_inputs', q, k, v, positions of B rows."""
    a = make_inputs(n_slots, H, Hkv, hd, S, dtype, list(positions) + [0] * (n_slots - B), seed, rows)
    return a._replace(q=a.q[:B], k=a.k[:B], v=a.v[:B], positions=a.positions[:B])


SLOT_POSITIONS = [0, 9, 18, 19, -1]  # S = 19: pos 0, a middle one, the last slot, two idle lanes
SLOTS = [4, 0, 5, 2, 1]  # a permutation of 5 of the 6 cache slots (slot 3 unused)


@pytest.mark.parametrize("hd, H, Hkv, dtype, slots_dtype, split_len", [
    (64, 4, 2, F32, torch.int64, None), (24, 8, 2, F16, torch.int32, None), (24, 4, 1, F32, torch.int64, 16),
])
def test_rope_decode_attention_slots_matches_ref(hd, H, Hkv, dtype, slots_dtype, split_len):
    """Lanes on cache slots slots[b] of whole layers (n_slots = 6 > B = 5, odd S, GQA; one case
    through many splits and the merge): the launcher equals the reference with slots, output and
    caches (slot pos of a live lane's own cache slot written, nothing else in the buffers); the
    reference equals the slot-less one on the gathered rows k_cache[slots] bitwise, writes
    included, and so does the launcher."""
    B, n_slots, S = 5, 6, 19
    scale = hd ** -0.5
    slots = torch.tensor(SLOTS, dtype=slots_dtype, device=DEVICE)
    got, ref, orig = (make_slot_inputs(B, n_slots, H, Hkv, hd, S, dtype, SLOT_POSITIONS, seed=hd + H)
                      for _ in range(3))

    def launch(a, k_cache, v_cache, **kw):
        args = (a.q, a.k, a.v, a.cos, a.sin, a.positions, k_cache, v_cache, scale)
        if split_len is None:
            return rope_decode_attention(*args, **kw)
        return _rope_decode_attention(*args, split_len, **kw)

    out = launch(got, got.k_cache, got.v_cache, slots=slots)
    out_ref = rope_decode_attention_ref(*ref[:8], scale, slots=slots)
    assert_close(out, out_ref, "attention")
    assert_caches(got, ref, orig, S, slots)
    assert_caches(ref, ref, orig, S, slots)  # the reference too writes its lanes' slots alone
    G = H // Hkv
    for b in (3, 4):  # an idle lane attends to its new key alone: its own v, exactly
        assert torch.equal(out[b], got.v[b, 0].repeat_interleave(G, dim=0))

    # the slot-less ops on the gathered rows, from the untouched copy: same outputs, same writes
    gathered = [orig.k_cache[slots], orig.v_cache[slots]]  # (B, Hkv, S, hd) copies
    assert torch.equal(out_ref, rope_decode_attention_ref(*orig[:6], *gathered, scale))
    assert torch.equal(ref.k_cache[slots], gathered[0]) and torch.equal(ref.v_cache[slots], gathered[1])
    gathered = [orig.k_cache[slots], orig.v_cache[slots]]
    assert torch.equal(out, launch(orig, *gathered))
    assert torch.equal(got.k_cache[slots], gathered[0]) and torch.equal(got.v_cache[slots], gathered[1])


@pytest.mark.parametrize("op", [rope_decode_attention, rope_decode_attention_ref])
def test_rope_decode_attention_slots_idle_lanes_touch_nothing(op):
    """Idle lanes (pos S, -1) with slots neither read nor write their cache slot: with it
    poisoned (NaN keys, inf values) they output their own v and the slot stays as it was; the
    live lanes match the reference on clean caches."""
    B, n_slots, H, Hkv, hd, S = 4, 5, 4, 2, 24, 19
    positions, slots = [S, 7, -1, 18], torch.tensor([2, 4, 0, 1], device=DEVICE)
    got, ref = (make_slot_inputs(B, n_slots, H, Hkv, hd, S, F32, positions, seed=5) for _ in range(2))
    for b in (0, 2):
        got.k_cache[slots[b]] = float("nan")
        got.v_cache[slots[b]] = float("inf")
    before = got.k_buf.clone(), got.v_buf.clone()
    out = op(*got[:8], hd ** -0.5, slots=slots)
    G = H // Hkv
    for b in (0, 2):
        assert torch.equal(out[b], got.v[b, 0].repeat_interleave(G, dim=0))
        s = slots[b]
        assert torch.isnan(got.k_cache[s]).all() and torch.isinf(got.v_cache[s]).all()
    live = torch.tensor([1, 3], device=DEVICE)
    expected = rope_decode_attention_ref(*ref[:8], hd ** -0.5, slots=slots)
    assert_close(out[live], expected[live], "attention")
    for buf, old in zip((got.k_buf, got.v_buf), before):  # only the live lanes' slot pos changed
        changed = (buf != old) & ~(buf.isnan() & old.isnan())
        assert changed.any(dim=(-1, -2)).nonzero().tolist() == [[1, 1, 18], [1, 4, 7]]


@pytest.mark.parametrize("op", [rope_decode_attention, rope_decode_attention_ref])
def test_rope_decode_attention_rejects_bad_slots(op):
    a = make_slot_inputs(2, 4, 4, 2, 16, 8, F32, [3, 8], seed=0)
    name = op.__name__

    def call(slots, **kw):
        args = {**a._asdict(), **kw}
        args.pop("k_buf"), args.pop("v_buf")
        op(**args, scale=1.0, slots=slots)

    with pytest.raises(ValueError, match=rf"{name}: slots\[1\] = 4 is outside \[0, 4\)"):
        call(torch.tensor([0, 4], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots\[0\] = -1 is outside"):
        call(torch.tensor([-1, 0], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots must have shape \(2,\), got \(1,\)"):
        call(torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots must have shape \(2,\), got \(2, 1\)"):
        call(torch.tensor([[0], [1]], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots dtype"):
        call(torch.tensor([0, 1], dtype=torch.int16, device=DEVICE))
    if op is rope_decode_attention:
        with pytest.raises(ValueError, match=r"v_cache must have shape \(4, 2, 8, 16\)"):
            call(torch.tensor([0, 1], device=DEVICE), v_cache=a.v_cache[:3])


# -- batch invariance and chunks ------------------------------------------------------------
# Forced split parameters (split_len, max_active, lane_split_len) at S = 64: the grid's 4 splits
# of 16, a lane split of 8 slots, at most 3 active. Position 40 takes 3 splits of 14 slots, 20
# three of 7, 63 three of 21, 7 one (o written by the split kernel): the interpreter's own
# launcher would keep every lane in one split, where invariance is trivial.
FORCED = (16, 3, 8)
INV_S = 64
INV_POSITIONS = [40, 7, 63, 20, INV_S]  # the last lane idle
INV_SLOTS = [4, 0, 5, 2, 1]  # of 6 cache slots (slot 3 unused)
# GQA 2, MHA, GQA 3. fp16 for the half-precision cases: the interpreter's tl.dot multiplies
# bf16 operands wrongly (their raw bits), so bf16 attention is checked on the GPU only.
INV_CASES = [(4, 2, 16, F32), (4, 4, 32, F16), (6, 2, 16, F16)]


def split_launch(split_params):
    """rope_decode_attention(invariant=True), or with split_params its private launcher."""
    def launch(*args, slots):
        if split_params is None:
            return rope_decode_attention(*args, slots=slots, invariant=True)
        return _rope_decode_attention(*args, *split_params, slots=slots)
    return launch


def assert_lanes_equal_batch_one(B_list, n_slots, H, Hkv, hd, S, dtype, positions, slots, seed, split_params):
    """Lane b of a B-lane call is bitwise a B = 1 call on lane b alone, other lanes at other
    positions on other slots; the B-lane call's caches are those of the B = 1 calls one after
    another (whole buffers)."""
    launch, scale = split_launch(split_params), hd ** -0.5
    n = max(B_list)
    slots = torch.tensor(slots[:n], device=DEVICE)
    alone, singles = make_slot_inputs(n, n_slots, H, Hkv, hd, S, dtype, positions[:n], seed), []
    for b in range(n):
        singles.append(launch(alone.q[b:b + 1], alone.k[b:b + 1], alone.v[b:b + 1], alone.cos, alone.sin,
                              alone.positions[b:b + 1], alone.k_cache, alone.v_cache, scale,
                              slots=slots[b:b + 1])[0])
    for B in B_list:
        a = make_slot_inputs(B, n_slots, H, Hkv, hd, S, dtype, positions[:B], seed)
        out = launch(*a[:8], scale, slots=slots[:B])
        for b in range(B):
            assert torch.equal(out[b], singles[b]), f"B = {B}: lane {b} (pos {positions[b]}) differs from B = 1"
        if B == n:
            assert torch.equal(a.k_buf, alone.k_buf) and torch.equal(a.v_buf, alone.v_buf)
    return singles


@pytest.mark.parametrize("H, Hkv, hd, dtype", INV_CASES)
@pytest.mark.parametrize("split_params", [FORCED, None])
def test_rope_decode_attention_invariant_lanes_equal_batch_one(H, Hkv, hd, dtype, split_params):
    """invariant=True (None: the public flag; FORCED: several splits a lane, the merge) at
    B = 1, 2, 5."""
    singles = assert_lanes_equal_batch_one([1, 2, 5], 6, H, Hkv, hd, INV_S, dtype, INV_POSITIONS, INV_SLOTS,
                                           seed=hd + H, split_params=split_params)
    ref = make_slot_inputs(5, 6, H, Hkv, hd, INV_S, dtype, INV_POSITIONS, seed=hd + H)
    expected = rope_decode_attention_ref(*ref[:8], hd ** -0.5, slots=torch.tensor(INV_SLOTS, device=DEVICE))
    assert_close(torch.stack(singles), expected, "attention")


def make_chunk_inputs(B, T, n_slots, H, Hkv, hd, S, dtype, positions, seed):
    """A chunk of T tokens for each of B sequences: q (B, T, H, hd), k, v (B, T, Hkv, hd) views of
    one fused projection (B, T, (H + 2 Hkv) hd), positions (B, T); caches of n_slots rows, tables
    and buffers as make_inputs'. Deterministic in seed."""
    a = make_inputs(n_slots, H, Hkv, hd, S, dtype, [0] * n_slots, seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * hd, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    return a._replace(q=q.view(B, T, H, hd), k=k.view(B, T, Hkv, hd), v=v.view(B, T, Hkv, hd),
                      positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE))


def sequential_decode(a, scale, slots, decode, order=None):
    """The chunk's tokens as T decode steps, token t of every sequence at step t (or at step
    order.index(t)): (B, H, T, hd) in token order."""
    T = a.q.shape[1]
    out = [None] * T
    for t in range(T) if order is None else order:
        out[t] = decode(a.q[:, t:t + 1], a.k[:, t:t + 1], a.v[:, t:t + 1], a.cos, a.sin, a.positions[:, t],
                        a.k_cache, a.v_cache, scale, slots=slots)
    return torch.stack(out, dim=2)


CHUNK_POSITIONS = [[40 + t for t in range(5)], [21 + t for t in range(5)]]  # 3 active splits each
CHUNK_SLOTS = [3, 1]  # of 4 cache slots


@pytest.mark.parametrize("H, Hkv, hd, dtype, split_params, descending", [
    (*INV_CASES[0], FORCED, False), (*INV_CASES[1], FORCED, True),
    (*INV_CASES[0], None, True), (*INV_CASES[1], None, False)])
def test_rope_chunk_attention_equals_sequential_decode(H, Hkv, hd, dtype, split_params, descending):
    """A chunk of T = 5 at consecutive positions for two sequences on different slots: bitwise
    the T invariant decode steps one after another (by position), outputs and the whole cache
    buffers. descending: the chunk's tokens come in descending position, so a row reads slots
    that rows after it hold: the interpreter runs rows in order, and only the write-only launch
    puts those keys in the cache before the row that needs them runs."""
    scale, slots = hd ** -0.5, torch.tensor(CHUNK_SLOTS, device=DEVICE)
    positions = [row[::-1] for row in CHUNK_POSITIONS] if descending else CHUNK_POSITIONS
    chunk, seq = (make_chunk_inputs(2, 5, 4, H, Hkv, hd, INV_S, dtype, positions, seed=hd) for _ in range(2))
    if split_params is None:
        out = rope_chunk_attention(*chunk[:8], scale, slots)
    else:
        out = _rope_chunk_attention(*chunk[:8], scale, slots, *split_params)
    assert out.shape == (2, H, 5, hd) and out.dtype == dtype
    expected = sequential_decode(seq, scale, slots, split_launch(split_params),
                                 order=[4, 3, 2, 1, 0] if descending else None)
    assert torch.equal(out, expected)
    assert torch.equal(chunk.k_buf, seq.k_buf) and torch.equal(chunk.v_buf, seq.v_buf)


@pytest.mark.parametrize("H, Hkv, hd, dtype", INV_CASES)
def test_rope_chunk_attention_matches_ref(H, Hkv, hd, dtype):
    """Positions not consecutive, out of order and idle (S, -1) mixed in: the op (forced splits)
    against the reference, outputs and caches (each live token's slot written, nothing else); the
    reference is bitwise the sequential decode reference where positions ascend (sequence 0)."""
    S, scale = INV_S, hd ** -0.5
    positions = [[10, 11, 12, 13, 14], [50, 9, S, -1, 30]]
    slots = torch.tensor(CHUNK_SLOTS, device=DEVICE)
    got, ref, orig, seq = (make_chunk_inputs(2, 5, 4, H, Hkv, hd, S, dtype, positions, seed=H + hd) for _ in range(4))
    out = _rope_chunk_attention(*got[:8], scale, slots, *FORCED)
    out_ref = rope_chunk_attention_ref(*ref[:8], scale, slots)
    assert_close(out, out_ref, "attention")
    live = (ref.positions >= 0) & (ref.positions < S)
    written = torch.zeros(got.k_buf.shape[:3], dtype=torch.bool, device=DEVICE)  # (layers, n_slots, S + 2)
    lane = slots[:, None].expand(2, 5)
    written[1, lane[live], ref.positions[live]] = True
    for name in ("k_buf", "v_buf"):
        buf, buf_ref, buf_orig = getattr(got, name), getattr(ref, name), getattr(orig, name)
        assert torch.equal(buf[~written], buf_orig[~written]), f"{name}: a slot no live token holds changed"
        assert torch.equal(buf_ref[~written], buf_orig[~written])
        assert_close(buf[written], buf_ref[written])
    seq_out = sequential_decode(seq._replace(q=seq.q[:1], k=seq.k[:1], v=seq.v[:1], positions=seq.positions[:1]),
                                scale, slots[:1], rope_decode_attention_ref)
    assert torch.equal(out_ref[:1], seq_out)


@pytest.mark.parametrize("op", [rope_chunk_attention, rope_chunk_attention_ref])
def test_rope_chunk_attention_idle_rows(op):
    """Idle tokens (positions S, -1, a whole sequence of them on a poisoned slot) output their
    own v exactly and write nothing; the poisoned slot is never read."""
    H, Hkv, hd, S = 4, 2, 16, INV_S
    positions = [[S, 5, -1, 6, S + 3], [-1, S, -1, S, 2 * S]]
    slots = torch.tensor([0, 2], device=DEVICE)
    got = make_chunk_inputs(2, 5, 3, H, Hkv, hd, S, F32, positions, seed=9)
    got.k_cache[2] = float("nan")
    got.v_cache[2] = float("inf")
    before = got.k_buf.clone(), got.v_buf.clone()
    out = op(*got[:8], hd ** -0.5, slots)
    G = H // Hkv
    idle = (got.positions < 0) | (got.positions >= S)
    for b, t in idle.nonzero().tolist():
        assert torch.equal(out[b, :, t], got.v[b, t].repeat_interleave(G, dim=0))
    assert not torch.isnan(out).any()
    for buf, old in zip((got.k_buf, got.v_buf), before):  # only slots 5 and 6 of sequence 0 changed
        changed = (buf != old) & ~(buf.isnan() & old.isnan())
        assert changed.any(dim=(-1, -2)).nonzero().tolist() == [[1, 0, 5], [1, 0, 6]]


def test_rope_chunk_attention_write_only_launch():
    """The write-only launch stores exactly what the normal launch stores (the whole buffers
    bitwise equal after each), idle lanes nothing, and writes no output. bf16 too: the cache
    write takes no tl.dot, which the interpreter gets wrong in bf16 (only the writes compared)."""
    H, Hkv, hd, S = 4, 2, 32, INV_S
    positions, slots = [33, 0, S, 63, -1], torch.tensor(INV_SLOTS, device=DEVICE)
    for dtype in (F32, BF16):
        w, n, orig = (make_slot_inputs(5, 6, H, Hkv, hd, S, dtype, positions, seed=4) for _ in range(3))
        assert _rope_decode_attention(*w[:8], 0.2, *FORCED, slots=slots, write_only=True) is None
        _rope_decode_attention(*n[:8], 0.2, *FORCED, slots=slots)
        assert torch.equal(w.k_buf, n.k_buf) and torch.equal(w.v_buf, n.v_buf)
        assert not torch.equal(w.k_buf, orig.k_buf)


@pytest.mark.parametrize("op", [rope_chunk_attention, rope_chunk_attention_ref])
def test_rope_chunk_attention_rejects_bad_inputs(op):
    a = make_chunk_inputs(2, 5, 3, 4, 2, 16, 8, F32, [[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]], seed=0)
    slots = torch.tensor([0, 2], device=DEVICE)
    name = op.__name__

    def call(**kw):
        args = {**a._asdict(), "slots": slots, **kw}
        args.pop("k_buf"), args.pop("v_buf")
        op(**args, scale=1.0)

    with pytest.raises(ValueError, match=rf"{name}: slots \(B,\) is required"):
        call(slots=None)
    with pytest.raises(ValueError, match=rf"{name}: slots must have shape \(2,\), got \(3,\)"):
        call(slots=torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: slots\[1\] = 3 is outside \[0, 3\)"):
        call(slots=torch.tensor([0, 3], device=DEVICE))
    if op is rope_chunk_attention_ref:
        return
    with pytest.raises(ValueError, match=rf"{name}: positions must have shape \(2, 5\), got \(2,\)"):
        call(positions=a.positions[:, 0])
    with pytest.raises(ValueError, match=rf"{name}: positions must have shape \(2, 5\), got \(2, 4\)"):
        call(positions=a.positions[:, :4])
    with pytest.raises(ValueError, match=rf"{name}: positions dtype"):
        call(positions=a.positions.int())
    with pytest.raises(ValueError, match=rf"{name}: q must be 4-D \(B, T, H, hd\)"):
        call(q=a.q[:, 0])
    with pytest.raises(ValueError, match=rf"{name}: k must have shape \(2, 5, 2, 16\), got \(2, 4, 2, 16\)"):
        call(k=a.k[:, :4])
    with pytest.raises(ValueError, match=rf"{name}: v must have shape \(2, 5, 2, 16\)"):
        call(v=a.v[:1])
    with pytest.raises(ValueError, match=rf"{name}: k must be 4-D \(B, T, Hkv, hd\)"):
        call(k=a.k[0])
    with pytest.raises(ValueError, match=rf"{name}: query heads 3 must be a multiple of kv heads 2"):
        call(q=a.q[:, :, :3])
    with pytest.raises(ValueError, match=rf"{name}: k_cache must be 4-D \(n_slots, Hkv, S, hd\)"):
        call(k_cache=a.k_cache[0])
    with pytest.raises(ValueError, match=rf"{name}: cos must have shape \(P, 8\) with P >= S = 8"):
        call(cos=a.cos[:-1])



GPU_POSITIONS = [[0], [127], [2047], [2048], [0, 127, 2047, 2048]]  # 2048 = S: an idle lane


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("Hkv", [16, 4])
@pytest.mark.parametrize("positions", GPU_POSITIONS)
def test_rope_decode_attention_gpu_bf16(positions, Hkv):
    B, H, hd, S = len(positions), 16, 128, 2048
    out, got = run_both(rope_decode_attention, B, H, Hkv, hd, S, torch.bfloat16, positions,
                        seed=Hkv + sum(positions), scale=hd ** -0.5)
    assert torch.equal(rope_decode_attention(*got[:8], hd ** -0.5), out)
    assert_equals_unfused(B, H, Hkv, hd, S, torch.bfloat16, positions, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_decode_attention_gpu_stages_change_nothing():
    """A batch whose (row, kv head) pairs fill more than a wave launches with one pipeline
    stage (`_split_stages`): its output is bit for bit that of three stages, and the reference's."""
    from tinyloop.kernels._launch import sm_count
    from tinyloop.kernels.decode_attention import SPLIT_STAGES, _split_stages
    H, Hkv, hd, S = 16, 16, 128, 2048
    B = sm_count(torch.device("cuda")) // Hkv + 4
    assert _split_stages(B, Hkv, torch.device("cuda"), True) == 1
    positions = [(97 * i) % S for i in range(B - 1)] + [S]  # and an idle lane
    out, _ = run_both(rope_decode_attention, B, H, Hkv, hd, S, torch.bfloat16, positions, seed=3,
                      scale=hd ** -0.5)
    again = make_inputs(B, H, Hkv, hd, S, torch.bfloat16, positions, seed=3)
    assert torch.equal(rope_decode_attention(*again[:8], hd ** -0.5, tile=(128, SPLIT_STAGES)), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_len, max_active", [(None, None), (64, None), (256, 3)])
def test_rope_decode_attention_gpu_cuda_graph(split_len, max_active):
    """No host sync and grids independent of the positions: one captured graph replays at any
    positions (the tables stay put), idle lanes included, over the launcher's splits, over 32
    forced ones and over 3 splits of up to 683 slots (a cap below the full cache's 8)."""
    B, H, Hkv, hd, S = 4, 16, 4, 128, 2048
    got = make_inputs(B, H, Hkv, hd, S, torch.bfloat16, [0, 1, 2, 3], seed=5, rows=4096)
    static_pos = got.positions.clone()
    args = (got.q, got.k, got.v, got.cos, got.sin, static_pos, got.k_cache, got.v_cache, hd ** -0.5)

    def launch():
        if split_len is None:
            return rope_decode_attention(*args)
        return _rope_decode_attention(*args, split_len, max_active)

    launch()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    for positions in ([0, 127, 2047, 2048], [2048, 1000, 5, 2047], [64, 2048, 0, 1]):
        ref = make_inputs(B, H, Hkv, hd, S, torch.bfloat16, positions, seed=5, rows=4096)
        new = make_inputs(B, H, Hkv, hd, S, torch.bfloat16, positions, seed=5, rows=4096)
        got.k_buf.copy_(new.k_buf)
        got.v_buf.copy_(new.v_buf)
        static_pos.copy_(new.positions)
        graph.replay()
        assert_close(out.clone(), rope_decode_attention_ref(*ref[:8], hd ** -0.5), "attention")
        assert_caches(got, ref, new, S)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_len, max_active", [(None, None), (256, 3)])
def test_rope_decode_attention_gpu_slots_cuda_graph(split_len, max_active):
    """One graph captured with a slots tensor serves any lanes of a 7-slot cache: replayed at
    three sets of slots and positions (idle lanes included), each equal to the reference with
    those slots, output and caches (only the live lanes' slot pos written)."""
    B, n_slots, H, Hkv, hd, S = 4, 7, 16, 4, 128, 2048
    got = make_slot_inputs(B, n_slots, H, Hkv, hd, S, torch.bfloat16, [0, 1, 2, 3], seed=5, rows=4096)
    static_pos, static_slots = got.positions.clone(), torch.tensor([0, 1, 2, 3], device="cuda")
    args = (got.q, got.k, got.v, got.cos, got.sin, static_pos, got.k_cache, got.v_cache, hd ** -0.5)

    def launch():
        if split_len is None:
            return rope_decode_attention(*args, slots=static_slots)
        return _rope_decode_attention(*args, split_len, max_active, slots=static_slots)

    launch()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    for lanes, positions in (([6, 0, 3, 1], [0, 127, 2047, 2048]), ([2, 5, 4, 0], [2048, 1000, 5, 2047]),
                             ([1, 6, 0, 2], [64, 2048, 0, 1])):
        slots = torch.tensor(lanes, device="cuda")
        ref, new = (make_slot_inputs(B, n_slots, H, Hkv, hd, S, torch.bfloat16, positions, seed=5, rows=4096)
                    for _ in range(2))
        got.k_buf.copy_(new.k_buf)
        got.v_buf.copy_(new.v_buf)
        static_pos.copy_(new.positions)
        static_slots.copy_(slots)
        graph.replay()
        assert_close(out.clone(), rope_decode_attention_ref(*ref[:8], hd ** -0.5, slots=slots), "attention")
        assert_caches(got, ref, new, S, slots)


# bench-285m's attention (16 heads of 128, MHA, S 4096) and the embedded default model's (5 heads
# of 64, 1 KV head, S 512): positions with several active splits (a batch-1 lane of 3000 slots
# takes one wave's cap), a short one in one split, the last slot, an idle lane.
GPU_INV_SHAPES = {
    "bench-285m": (16, 16, 128, 4096, [1000, 3000, 17, 4095, 2500], [[1000 + t for t in range(5)],
                                                                      [3000 + t for t in range(5)]]),
    "embedded": (5, 1, 64, 512, [200, 450, 0, 511, 300], [[200 + t for t in range(5)], [450 + t for t in range(5)]]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_INV_SHAPES)
def test_rope_decode_attention_gpu_invariant_bf16(shape):
    """invariant=True on the H200: lane b of B = 1, 2, 5 lanes bitwise a B = 1 call on it alone,
    where the default's split parameters differ with B (bench-285m's: 8 active splits a lane at
    B = 1, 1 at B = 5)."""
    H, Hkv, hd, S, positions, _ = GPU_INV_SHAPES[shape]
    device = torch.device("cuda")
    assert all(_rope_splits(B, Hkv, S, hd, device, True) == _rope_splits(1, Hkv, S, hd, device, False)
               for B in (2, 5))
    if shape == "bench-285m":  # the default groups a lane's partials by B here
        assert _rope_splits(5, Hkv, S, hd, device, False) != _rope_splits(1, Hkv, S, hd, device, False)
    assert_lanes_equal_batch_one([1, 2, 5], 6, H, Hkv, hd, S, BF16, positions, INV_SLOTS, seed=11,
                                 split_params=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_INV_SHAPES)
def test_rope_chunk_attention_gpu_bf16(shape):
    """A chunk of 5 tokens for two sequences (several active splits each) on the H200: bitwise
    the 5 invariant decode steps, outputs and caches, and close to the reference."""
    H, Hkv, hd, S, _, positions = GPU_INV_SHAPES[shape]
    scale, slots = hd ** -0.5, torch.tensor(CHUNK_SLOTS, device=DEVICE)
    chunk, seq, ref = (make_chunk_inputs(2, 5, 4, H, Hkv, hd, S, BF16, positions, seed=12) for _ in range(3))
    out = rope_chunk_attention(*chunk[:8], scale, slots)
    assert torch.equal(out, sequential_decode(seq, scale, slots, split_launch(None)))
    assert torch.equal(chunk.k_buf, seq.k_buf) and torch.equal(chunk.v_buf, seq.v_buf)
    assert_close(out.contiguous(), rope_chunk_attention_ref(*ref[:8], scale, slots), "attention")


# -- trees ----------------------------------------------------------------------------------
# A draft tree of K branches and `depth` levels rooted at pos, breadth first as the engine lays
# it out (worker/runner/stages.py tree_layout): node 0 the root, node 1 + (i - 1) K + c the
# depth-i node of branch c, whose parent is node 0 (i = 1) or the node K before it. Node u sits
# at cache slot pos + u, its RoPE position is pos + depth(u), and it attends to the prefix [0,
# pos), its ancestors and itself. Forced split parameters at S = 64: lane splits of 4 slots, at
# most 4 active, so the tree part of a virtual sequence rooted at 11 crosses a split boundary
# (depth 3: 14 slots in 4 splits of 4, the last from 12). With the chunk tests' FORCED one
# rooted at 49 crosses a tile boundary (BLOCK_N 16 on the interpreter; depth 2: 51 slots in 3
# splits of 17, the last 34 .. 50 with a tile from 50).
TREE_FORCED = (16, 4, 4)
TREE_POS = [11, 49]
TREE_SLOTS = [2, 0]  # of 3 cache slots


def tree_nodes(K, depth):
    """(depths, ancestors) of the N = 1 + K depth nodes: ancestors[u] the nodes from the root
    down to u's parent."""
    N = 1 + K * depth
    depths = [0] + [(u - 1) // K + 1 for u in range(1, N)]
    parents = [-1] + [0 if depths[u] == 1 else u - K for u in range(1, N)]
    ancestors = [[]]
    for u in range(1, N):
        ancestors.append(ancestors[parents[u]] + [parents[u]])
    return depths, ancestors


def tree_args(K, depth, pos, pads=0, D=None):
    """rope_tree_attention's (positions, write_slots, depth, ancestor_slots, base) for one tree a
    sequence rooted at pos[b], followed by `pads` rows as the engine pads a bucket: at the slots
    after the tree, at RoPE positions equal to their slots, depth 0 (the prefix and themselves).
    D: ancestor_slots' last dim (default depth), entries past a row's depth -1 (never read)."""
    depths, ancestors = tree_nodes(K, depth)
    N, D = len(depths), depth if D is None else D
    T = N + pads
    rows = []
    for p in pos:
        positions = [p + d for d in depths] + [p + u for u in range(N, T)]
        anc = [[p + a for a in ancestors[u]] + [-1] * (D - len(ancestors[u])) for u in range(N)]
        rows.append((positions, [p + u for u in range(T)], depths + [0] * pads, anc + [[-1] * D] * pads))
    t = [torch.tensor([r[i] for r in rows], dtype=torch.int64, device=DEVICE) for i in range(4)]
    return (*t, torch.tensor(pos, dtype=torch.int64, device=DEVICE))


def tree_launch(split_params):
    """rope_tree_attention, or with split_params its private launcher."""
    def launch(*args, scale, slots):
        if split_params is None:
            return rope_tree_attention(*args, scale, slots)
        return _rope_tree_attention(*args, scale, slots, *split_params)
    return launch


def call_tree(launch, a, tree, scale, slots):
    """launch on the inputs a (make_chunk_inputs') and the tree's tensors (tree_args')."""
    return launch(a.q, a.k, a.v, a.cos, a.sin, *tree, a.k_cache, a.v_cache, scale=scale, slots=slots)


def assert_tree_equals_branch_decode(K, depth, H, Hkv, hd, S, dtype, pos, slot_list, n_slots, seed,
                                     split_params, pads=0):
    """Every node's output bitwise an invariant decode step at pos + depth(u) of its branch
    decoded linearly (its ancestors' K / V written at slots pos .. pos + depth - 1 by the steps
    before) on a copy of the cache, and every node's K / V at its write slot pos + u the bits that
    decode wrote at pos + depth(u); nothing outside the tree's (and pads') slots changed. Pads
    finite. -> the op's output and inputs."""
    depths, ancestors = tree_nodes(K, depth)
    N = len(depths)
    scale, slots = hd ** -0.5, torch.tensor(slot_list, device=DEVICE)
    tree = tree_args(K, depth, pos, pads)
    T = N + pads
    got, orig = (make_chunk_inputs(len(pos), T, n_slots, H, Hkv, hd, S, dtype, tree[0].tolist(), seed)
                 for _ in range(2))
    out = call_tree(tree_launch(split_params), got, tree, scale, slots)
    assert out.shape == (len(pos), H, T, hd) and out.dtype == dtype
    assert torch.isfinite(out).all()
    decode = split_launch(None if split_params is None else split_params)
    base = torch.tensor(pos, device=DEVICE)
    for leaf in range(N - K, N):  # one linear decode per branch, on its own copy of the cache
        lin = make_chunk_inputs(len(pos), T, n_slots, H, Hkv, hd, S, dtype, tree[0].tolist(), seed)
        for d, u in enumerate(ancestors[leaf] + [leaf]):
            o = decode(lin.q[:, u:u + 1], lin.k[:, u:u + 1], lin.v[:, u:u + 1], lin.cos, lin.sin, base + d,
                       lin.k_cache, lin.v_cache, scale, slots=slots)
            assert torch.equal(out[:, :, u], o), f"node {u} (branch of leaf {leaf}, depth {d}) differs"
            for b, (p, s) in enumerate(zip(pos, slot_list)):
                assert torch.equal(got.k_cache[s, :, p + u], lin.k_cache[s, :, p + d]), f"k of node {u}"
                assert torch.equal(got.v_cache[s, :, p + u], lin.v_cache[s, :, p + d]), f"v of node {u}"
    written = torch.zeros(got.k_buf.shape[:3], dtype=torch.bool, device=DEVICE)  # (layers, n_slots, S + 2)
    for p, s in zip(pos, slot_list):
        written[1, s, p:p + T] = True
    for name in ("k_buf", "v_buf"):
        buf, buf_orig = getattr(got, name), getattr(orig, name)
        assert torch.equal(buf[~written], buf_orig[~written]), f"{name}: a slot outside the tree changed"
        assert not torch.equal(buf[written], buf_orig[written])
    return out, got, tree


@pytest.mark.parametrize("K, H, Hkv, hd, dtype, split_params, pads", [
    (3, *INV_CASES[0], TREE_FORCED, 0), (2, *INV_CASES[1], TREE_FORCED, 2), (2, *INV_CASES[2], FORCED, 1),
    (3, *INV_CASES[1], None, 0)])
def test_rope_tree_attention_equals_branch_decode(K, H, Hkv, hd, dtype, split_params, pads):
    """Trees of K = 2, 3 branches and depth 3 rooted at 11 and 49 (forced splits, a split and a
    tile boundary inside the tree's part, and the chunk tests' splits; the public launcher),
    pads after some: bitwise the branches decoded linearly, outputs and caches."""
    assert_tree_equals_branch_decode(K, 3, H, Hkv, hd, INV_S, dtype, TREE_POS, TREE_SLOTS, 3, seed=K + hd,
                                     split_params=split_params, pads=pads)


@pytest.mark.parametrize("H, Hkv, hd, dtype, split_params", [(*INV_CASES[0], TREE_FORCED), (*INV_CASES[1], None)])
def test_rope_tree_attention_chain_equals_chunk(H, Hkv, hd, dtype, split_params):
    """A chain (K = 1: node u at slot and position pos + u, its ancestors the nodes before it) is
    rope_chunk_attention of the same tokens, bitwise: outputs and the whole cache buffers. The
    chain's ancestor_slots has room past the deepest node (D = 6 > depth 4)."""
    scale, slots = hd ** -0.5, torch.tensor(TREE_SLOTS, device=DEVICE)
    tree = tree_args(1, 4, TREE_POS, D=6)
    assert torch.equal(tree[0], tree[1])  # a chain's positions are its slots
    tree_in, chunk_in = (make_chunk_inputs(2, 5, 3, H, Hkv, hd, INV_S, dtype, tree[0].tolist(), seed=hd)
                         for _ in range(2))
    out = call_tree(tree_launch(split_params), tree_in, tree, scale, slots)
    if split_params is None:
        expected = rope_chunk_attention(*chunk_in[:8], scale, slots)
    else:
        expected = _rope_chunk_attention(*chunk_in[:8], scale, slots, *split_params)
    assert torch.equal(out, expected)
    assert torch.equal(tree_in.k_buf, chunk_in.k_buf) and torch.equal(tree_in.v_buf, chunk_in.v_buf)


@pytest.mark.parametrize("H, Hkv, hd, dtype", INV_CASES)
def test_rope_tree_attention_matches_ref(H, Hkv, hd, dtype):
    """The op (forced splits) against the reference: a tree of K = 2, depth 3 a sequence with two
    pads, one of them idle in sequence 1 (position S; its write slot must stay untouched), the
    slots past the tree poisoned in the op's cache (NaN keys, inf values: never read); outputs
    and caches (the tree's and live pads' slots written, nothing else). The idle row outputs its
    own v exactly."""
    S, scale, slots = INV_S, hd ** -0.5, torch.tensor(TREE_SLOTS, device=DEVICE)
    tree = list(tree_args(2, 3, TREE_POS, pads=2))
    tree[0][1, -1] = S  # idle
    T = tree[0].shape[1]
    got, ref, orig = (make_chunk_inputs(2, T, 3, H, Hkv, hd, S, dtype, tree[0].tolist(), seed=H + hd)
                      for _ in range(3))
    for p, s in zip(TREE_POS, TREE_SLOTS):
        got.k_cache[s, :, p + T:] = float("nan")
        got.v_cache[s, :, p + T:] = float("inf")
    out = call_tree(tree_launch(TREE_FORCED), got, tree, scale, slots)
    out_ref = call_tree(rope_tree_attention_ref, ref, tree, scale, slots)
    assert_close(out, out_ref, "attention")
    G = H // Hkv
    assert torch.equal(out[1, :, -1], got.v[1, -1].repeat_interleave(G, dim=0))
    written = torch.zeros(got.k_buf.shape[:3], dtype=torch.bool, device=DEVICE)
    live = (tree[0] >= 0) & (tree[0] < S)
    for b, s in enumerate(TREE_SLOTS):
        written[1, s, tree[1][b][live[b]]] = True
    for p, s in zip(TREE_POS, TREE_SLOTS):
        got.k_buf[1, s, p + T:S], got.v_buf[1, s, p + T:S] = ref.k_buf[1, s, p + T:S], ref.v_buf[1, s, p + T:S]
    for name in ("k_buf", "v_buf"):
        buf, buf_ref, buf_orig = getattr(got, name), getattr(ref, name), getattr(orig, name)
        assert torch.equal(buf[~written], buf_orig[~written]), f"{name}: a slot no live row writes changed"
        assert torch.equal(buf_ref[~written], buf_orig[~written])
        assert_close(buf[written], buf_ref[written])


@pytest.mark.parametrize("op", [rope_tree_attention, rope_tree_attention_ref])
def test_rope_tree_attention_rejects_bad_inputs(op):
    S = 16
    tree = tree_args(2, 2, [3, 7])  # T = 5, D = 2
    a = make_chunk_inputs(2, 5, 3, 4, 2, 16, S, F32, tree[0].tolist(), seed=0)
    slots = torch.tensor([0, 2], device=DEVICE)
    name = op.__name__
    keys = ("positions", "write_slots", "depth", "ancestor_slots", "base")

    def call(**kw):
        args = {**a._asdict(), **dict(zip(keys, tree)), "slots": slots, **kw}
        args.pop("k_buf"), args.pop("v_buf")
        op(**args, scale=1.0)

    def with_value(i, index, value):
        t = tree[i].clone()
        t[index] = value
        return {keys[i]: t}

    with pytest.raises(ValueError, match=rf"{name}: slots \(B,\) is required"):
        call(slots=None)
    with pytest.raises(ValueError, match=rf"{name}: slots\[1\] = 3 is outside \[0, 3\)"):
        call(slots=torch.tensor([0, 3], device=DEVICE))
    with pytest.raises(ValueError, match=rf"{name}: write_slots must have shape \(2, 5\), got \(2, 4\)"):
        call(write_slots=tree[1][:, :4])
    with pytest.raises(ValueError, match=rf"{name}: depth must have shape \(2, 5\), got \(5,\)"):
        call(depth=tree[2][0])
    with pytest.raises(ValueError, match=rf"{name}: ancestor_slots must be 3-D \(B, T, D\)"):
        call(ancestor_slots=tree[3][..., 0])
    with pytest.raises(ValueError, match=rf"{name}: ancestor_slots must have shape \(2, 5, 2\), got \(1, 5, 2\)"):
        call(ancestor_slots=tree[3][:1])
    with pytest.raises(ValueError, match=rf"{name}: base must have shape \(2,\), got \(1,\)"):
        call(base=tree[4][:1])
    for i in range(1, 5):
        with pytest.raises(ValueError, match=rf"{name}: {keys[i]} dtype must be one of"):
            call(**{keys[i]: tree[i].int()})
    with pytest.raises(ValueError, match=rf"{name}: depth\[1, 4\] = 3 is outside \[0, D = 2\]"):
        call(**with_value(2, (1, 4), 3))  # deeper than ancestor_slots holds
    with pytest.raises(ValueError, match=rf"{name}: depth\[0, 1\] = -1 is outside"):
        call(**with_value(2, (0, 1), -1))
    with pytest.raises(ValueError, match=rf"{name}: base\[1\] = 17 is outside \[0, S = 16\]"):
        call(**with_value(4, 1, 17))
    with pytest.raises(ValueError, match=rf"{name}: write_slots\[0, 2\] = 16 is outside \[0, S = 16\) of a live row"):
        call(**with_value(1, (0, 2), 16))
    with pytest.raises(ValueError, match=rf"{name}: ancestor_slots\[1, 3, 1\] = -1 is outside \[0, S = 16\)"):
        call(**with_value(3, (1, 3, 1), -1))
    # an idle row's write slot and ancestors are never used: any value passes
    idle = {**with_value(0, (0, 4), S), **with_value(1, (0, 4), 99)}
    call(**idle, ancestor_slots=with_value(3, (0, 4, 0), -5)["ancestor_slots"])
    if op is rope_tree_attention_ref:
        return
    with pytest.raises(ValueError, match=rf"{name}: positions must have shape \(2, 5\), got \(2, 4\)"):
        call(positions=tree[0][:, :4])
    with pytest.raises(ValueError, match=rf"{name}: q must be 4-D \(B, T, H, hd\)"):
        call(q=a.q[:, 0])
    with pytest.raises(ValueError, match=rf"{name}: k_cache dtype"):
        call(k_cache=a.k_cache.half())


# bench-285m's and the embedded model's attention (GPU_INV_SHAPES) with trees of K = 2, 4 branches
# and depth 4 (N = 9, 17) rooted near 1000 / 300 for two sequences, pads to a bucket of 20.
GPU_TREE_SHAPES = {"bench-285m": (16, 16, 128, 4096, [1000, 1237]), "embedded": (5, 1, 64, 512, [300, 211])}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("shape", GPU_TREE_SHAPES)
def test_rope_tree_attention_gpu_bf16(shape, K):
    """On the H200, bf16, the public launcher: every node bitwise its branch decoded linearly
    (invariant decode steps), caches included; a chain bitwise rope_chunk_attention; close to the
    reference."""
    H, Hkv, hd, S, pos = GPU_TREE_SHAPES[shape]
    N = 1 + 4 * K
    out, _, tree = assert_tree_equals_branch_decode(K, 4, H, Hkv, hd, S, BF16, pos, TREE_SLOTS, 3, seed=K,
                                                    split_params=None, pads=20 - N)
    scale, slots = hd ** -0.5, torch.tensor(TREE_SLOTS, device=DEVICE)
    ref = make_chunk_inputs(2, 20, 3, H, Hkv, hd, S, BF16, tree[0].tolist(), seed=K)
    assert_close(out.contiguous(), call_tree(rope_tree_attention_ref, ref, tree, scale, slots), "attention")
    chain = tree_args(1, 8, pos, D=8)
    tree_in, chunk_in = (make_chunk_inputs(2, 9, 3, H, Hkv, hd, S, BF16, chain[0].tolist(), seed=K + 1)
                         for _ in range(2))
    out = call_tree(tree_launch(None), tree_in, chain, scale, slots)
    assert torch.equal(out, rope_chunk_attention(*chunk_in[:8], scale, slots))
    assert torch.equal(tree_in.k_buf, chunk_in.k_buf) and torch.equal(tree_in.v_buf, chunk_in.v_buf)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_TREE_SHAPES)
def test_rope_tree_attention_gpu_cuda_graph(shape):
    """One captured rope_tree_attention (K = 4, depth 4) replayed with the tree rooted elsewhere
    (its tensors copied into the captured ones): bitwise the branches decoded linearly at the
    new roots, outputs and caches."""
    H, Hkv, hd, S, pos = GPU_TREE_SHAPES[shape]
    K, depth = 4, 4
    scale, slots = hd ** -0.5, torch.tensor(TREE_SLOTS, device=DEVICE)
    static = [t.clone() for t in tree_args(K, depth, pos)]
    got = make_chunk_inputs(2, 1 + K * depth, 3, H, Hkv, hd, S, BF16, static[0].tolist(), seed=3)
    launch = tree_launch(None)
    call_tree(launch, got, static, scale, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call_tree(launch, got, static, scale, slots)
    depths, ancestors = tree_nodes(K, depth)
    for new_pos in ([p + 37 for p in pos], [p - 100 for p in pos]):
        for t, new in zip(static, tree_args(K, depth, new_pos)):
            t.copy_(new)
        fresh = make_chunk_inputs(2, 1 + K * depth, 3, H, Hkv, hd, S, BF16, static[0].tolist(), seed=3)
        got.k_buf.copy_(fresh.k_buf)
        got.v_buf.copy_(fresh.v_buf)
        graph.replay()
        base = torch.tensor(new_pos, device=DEVICE)
        for leaf in range(len(depths) - K, len(depths)):
            lin = make_chunk_inputs(2, 1 + K * depth, 3, H, Hkv, hd, S, BF16, static[0].tolist(), seed=3)
            for d, u in enumerate(ancestors[leaf] + [leaf]):
                o = rope_decode_attention(lin.q[:, u:u + 1], lin.k[:, u:u + 1], lin.v[:, u:u + 1], lin.cos, lin.sin,
                                          base + d, lin.k_cache, lin.v_cache, scale, slots=slots, invariant=True)
                assert torch.equal(out[:, :, u], o), f"root {new_pos}: node {u} differs"
                for p, s in zip(new_pos, TREE_SLOTS):
                    assert torch.equal(got.k_cache[s, :, p + u], lin.k_cache[s, :, p + d])

