import itertools

import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels.gemv import ARGMAX_KEY_NONE, argmax_key_ref, gemv, gemv_ref

CASES = [  # (N, K): the interpreter's row block and K chunk (INTERPRET_TILE) that divide, and ones that do not
    (64, 64), (24, 192), (13, 100), (70, 33),
]
# (N, K, swiglu) of bench-285m's projections (wqkv, wo, w13, w2, head), bf16 on the GPU
GPU_SHAPES = [(6144, 2048, False), (2048, 2048, False), (11264, 2048, True), (2048, 5632, False),
              (32000, 2048, False)]


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", CASES)
@pytest.mark.parametrize("norm,swiglu,residual", [
    (False, False, False), (True, False, False), (False, False, True), (True, True, False),
])
def test_gemv_matches_ref(N, K, dtype, norm, swiglu, residual, pdl):
    g = torch.Generator().manual_seed(N * 1000 + K)
    x = (3 * torch.randn(1, 1, K, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(2 * N if swiglu else N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    kw = {}
    if norm:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
        kw["eps"] = 1e-5
    if residual:
        kw["residual"] = torch.randn(1, 1, N, generator=g).to(DEVICE, dtype)
    y = gemv(x, w, swiglu=swiglu, pdl=pdl, **kw)
    assert y.shape == (1, 1, N)
    assert_close(y, gemv_ref(x, w, swiglu=swiglu, **kw), "projection")


def test_gemv_equals_the_unfused_layer_ops():
    """norm + projection, and residual + projection, against the model's own unfused path."""
    from tinyloop.kernels.rmsnorm import rms_norm_ref
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 96, generator=g).to(DEVICE)
    w = torch.randn(40, 96, generator=g).to(DEVICE)
    nw = torch.rand(96, generator=g).to(DEVICE)
    r = torch.randn(1, 1, 40, generator=g).to(DEVICE)
    assert_close(gemv(x, w, norm_weight=nw, eps=1e-6), rms_norm_ref(x, nw, 1e-6) @ w.t(), "projection")
    assert_close(gemv(x, w, residual=r), r + x @ w.t(), "projection")


def test_gemv_rejects_bad_inputs():
    x = torch.randn(1, 16, device=DEVICE)
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"gemv: x \(\.\.\., K\) must hold 1 <= M <= 64 rows, got shape \(65, 1, 16\)"):
        gemv(torch.randn(65, 1, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"1 <= M <= 64 rows, got shape \(0, 16\) \(M = 0\)"):
        gemv(torch.randn(0, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="K = 16 columns"):
        gemv(x, torch.randn(8, 15, device=DEVICE))
    with pytest.raises(ValueError, match="weight dtype"):
        gemv(x, w.double())
    with pytest.raises(ValueError, match="unit stride"):
        gemv(x, torch.randn(16, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="even row count"):
        gemv(x, torch.randn(7, 16, device=DEVICE), swiglu=True)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        gemv(x, w, norm_weight=torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="residual must have shape"):
        gemv(x, w, residual=torch.ones(1, 9, device=DEVICE))
    with pytest.raises(ValueError, match=r"eviction_policy must be one of .*got 'evict_normal'"):
        gemv(x, w, eviction_policy="evict_normal")


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("policy", ["evict_first", "evict_last"])
def test_gemv_eviction_policy_leaves_y_unchanged(policy, M):
    """The weight loads' L2 policy changes how they are cached, never what is computed: y is
    bitwise the default call's, and matches the reference."""
    g = torch.Generator().manual_seed(7)
    N, K = 24, 96
    x = torch.randn(M, 1, K, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(2 * N, K, generator=g) / K ** 0.5).to(DEVICE, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, torch.bfloat16)
    y = gemv(x, w, norm_weight=nw, swiglu=True, eviction_policy=policy)
    assert torch.equal(y, gemv(x, w, norm_weight=nw, swiglu=True))
    assert_close(y, gemv_ref(x, w, norm_weight=nw, swiglu=True), "projection")



def argmax_of(key: torch.Tensor, N: int) -> int:
    """The row an argmax key names (kernels.gemv's key: N - 1 - row in its low word)."""
    return N - 1 - (int(key) & 0xFFFFFFFF)


def new_key(device=DEVICE) -> torch.Tensor:
    return torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.int64, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", CASES + [(1000, 64)])
@pytest.mark.parametrize("kw", [{}, {"norm": True}, {"residual": True}, {"out_dtype": torch.float32}])
def test_gemv_argmax_key_is_the_argmax_of_y(N, K, dtype, kw):
    """The head's epilogue: after one call the key names y's argmax (torch.argmax of the y it
    wrote) and equals argmax_key_ref; y is the y of a call without the key."""
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(1, 1, K, generator=g).to(DEVICE, dtype)
    w = torch.randn(N, K, generator=g).to(DEVICE, dtype)
    opts = {"out_dtype": kw.get("out_dtype")}
    if kw.get("norm"):
        opts["norm_weight"] = torch.rand(K, generator=g).to(DEVICE, dtype)
    if kw.get("residual"):
        opts["residual"] = torch.randn(1, 1, N, generator=g).to(DEVICE, dtype)
    key = new_key()
    y = gemv(x, w, argmax_key=key, **opts)
    assert torch.equal(y, gemv(x, w, **opts))
    assert argmax_of(key, N) == int(y.argmax())
    assert int(key) == int(argmax_key_ref(y.reshape(N)))
    want = new_key()  # the spec's key names the spec's argmax (its y differs in the last bits)
    y_ref = gemv_ref(x, w, argmax_key=want, **opts)
    assert argmax_of(want, N) == int(y_ref.argmax())


@pytest.mark.parametrize("values,want", [
    ([0.0, 3.0, 1.0, 3.0, 3.0], 1),        # a tie across row blocks: the first maximum
    ([-5.0, -2.0, -7.0, -2.0, -3.0], 1),  # negative values order by magnitude, reversed
    ([-0.0, -1.0, 0.0, -3.0, -2.0], 0),   # -0.0 and +0.0 are equal: the first of them
    ([-1.0, -0.0, -2.0, 0.0, -5.0], 1),
    ([float("-inf")] * 5, 0),
])
def test_gemv_argmax_key_follows_torch_argmax_ties_and_signs(values, want):
    """Rows 0, 9, 18, 27, 36 (different row blocks) hold the values, every other row -inf: the
    key's row is torch.argmax's, ties included."""
    N, K = 40, 16
    w = torch.zeros(N, K)
    x = torch.zeros(1, K)
    rows = [0, 9, 18, 27, 36]
    y_want = torch.full((N,), float("-inf"))
    y_want[rows] = torch.tensor(values)
    # y through a residual: y = residual + 0 (the projection of a zero row)
    key = new_key()
    y = gemv(x.to(DEVICE), w.to(DEVICE), residual=y_want.view(1, N).to(DEVICE), argmax_key=key)
    assert torch.equal(y.cpu(), y_want.view(1, N))
    assert argmax_of(key, N) == rows[want] == int(y_want.argmax())


def test_gemv_argmax_key_keeps_a_larger_key():
    """The key is maxed, not set: a call whose argmax key is lower leaves it (what resetting it
    to ARGMAX_KEY_NONE between steps is for)."""
    w = torch.eye(8, device=DEVICE)
    key = new_key()
    gemv(torch.arange(8.0, device=DEVICE).view(1, 8), w, argmax_key=key)
    assert argmax_of(key, 8) == 7
    gemv(torch.arange(8.0, device=DEVICE).flip(0).view(1, 8) / 2, w, argmax_key=key)  # max 3.5 at row 0
    assert argmax_of(key, 8) == 7


def _launchable(tile, K):
    bn, bk, warps, stages = tile
    return (all(v > 0 and v & (v - 1) == 0 for v in (bn, bk)) and bk <= max(16, 2 ** (K - 1).bit_length())
            and warps in (1, 2, 4, 8, 16, 32) and stages >= 1)


def _rows_launchable(tile, K):
    """A rows tile: launchable, a PDL mode the launch knows, and BLOCK_N >= 16 (the weight rows
    are tl.dot's row operand, which takes no fewer)."""
    from tinyloop.kernels.gemv import ROWS_PDL_MODES
    return len(tile) == 5 and _launchable(tile[:4], K) and tile[0] >= 16 and tile[4] in ROWS_PDL_MODES


def test_fixed_tiles_are_launchable():
    """kernels.gemv.TILES and ROWS_TILES (the tiles fixed per device and shape) and the default
    tiles of the shapes they do not hold: each key names a shape and its options, each tile is
    one the kernel compiles (power-of-two blocks no wider than the padded K, a warp count
    Triton takes; for rows, a PDL mode and a row block tl.dot takes)."""
    from tinyloop.kernels.gemv import ROWS_TILES, TILES, default_rows_tile, default_tile
    assert TILES and ROWS_TILES, "no fixed tiles"
    for rows, tables in ((False, TILES), (True, ROWS_TILES)):
        for device, table in tables.items():
            assert isinstance(device, str) and table, device
            for key, tile in table.items():
                # TILES: (N, K, norm, swiglu, residual, pdl); ROWS_TILES: (N, K, norm, swiglu, residual, BLOCK_M)
                flags = key[2:5] if rows else key[2:]
                assert len(key) == 6 and all(isinstance(v, int) and v > 0 for v in key[:2]), key
                assert all(isinstance(v, bool) for v in flags), key
                assert not rows or key[5] in (16, 32, 64), key
                assert (_rows_launchable if rows else _launchable)(tile, key[1]), (key, tile)
    for K in (1, 64, 320, 704, 2048, 5632):
        assert _launchable(default_tile(K), K), K
        assert _launchable(default_tile(K, 320 * K * 2), K), K
    for N, bm in itertools.product((256, 2048, 4096, 6144, 32000), (16, 32, 64)):
        assert _rows_launchable(default_rows_tile(N, bm), 2048) and N / default_rows_tile(N, bm)[0] >= 16, N


def test_small_one_chunk_weights_take_one_warp():
    """default_tile: a weight that stays in the L2 (under SMALL_WEIGHT_BYTES) and fits one chunk
    takes one warp; a large weight, one that loops over K, or an unknown size four -- and the
    rest of the tile is the same either way."""
    from tinyloop.kernels.gemv import SMALL_WEIGHT_BYTES, default_tile
    assert default_tile(320, 448 * 320 * 2) == (2, 512, 1, 3)
    assert default_tile(704, 320 * 704 * 2) == (2, 1024, 1, 3)
    assert default_tile(320) == (2, 512, 4, 3)
    assert default_tile(320, SMALL_WEIGHT_BYTES) == (2, 512, 4, 3)
    assert default_tile(2048, 256 * 2048 * 2) == (2, 1024, 4, 3)    # loops over K: two chunks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_untabled_shapes_take_a_fixed_tile_not_the_autotuner():
    """Without autotune (gemv's default; Settings.autotune off) a shape no table holds runs its
    default tile, never the autotuner (whose pick is per process): the autotuners' caches stay
    empty, and the result is the reference's."""
    import importlib
    gemv_mod = importlib.import_module("tinyloop.kernels.gemv")
    torch.manual_seed(0)
    for M, invariant in ((1, False), (3, False), (12, False), (3, True), (33, True)):
        x = torch.randn(M, 1, 320, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(448, 320, device="cuda") / 320 ** 0.5).to(torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(320, device="cuda")).to(torch.bfloat16)
        assert_close(gemv(x, w, norm_weight=nw, invariant=invariant),
                     gemv_ref(x, w, norm_weight=nw, invariant=invariant), "projection")
    assert not gemv_mod._gemv_tuned.cache and not gemv_mod._gemv_rows_tuned.cache


def test_tiles_tables_come_before_the_code_tables(monkeypatch):
    """A tiles table handed to the launch (gemv's `tables`: Settings.gemv_tiles) wins over the
    code's TILES / ROWS_TILES entry for its key; a key it lacks takes the code's, then the
    default tile (or, with autotune, the autotuner: None). (The device name is stubbed: the code's
    tables are per GPU name, and this runs without one.)"""
    import importlib
    gemv_mod = importlib.import_module("tinyloop.kernels.gemv")
    monkeypatch.setattr(gemv_mod, "_device_name", lambda device: "NVIDIA H200")
    gpu = torch.device("cuda", 0)
    key, code = next(iter(gemv_mod.TILES["NVIDIA H200"].items()))
    rows_key, rows_code = next(iter(gemv_mod.ROWS_TILES["NVIDIA H200"].items()))
    mine, rows_mine = (1, 64, 2, 1), (16, 64, 4, 2, "off")
    assert mine != code and rows_mine != rows_code
    tables = ({key: mine}, {rows_key: rows_mine})
    assert gemv_mod.table_entry(gemv_mod.TILES, 0, tables, gpu, key) == mine
    assert gemv_mod.table_entry(gemv_mod.TILES, 0, None, gpu, key) == code
    assert gemv_mod.tile(gpu, *key, tables=tables) == mine and gemv_mod.tile(gpu, *key) == code
    assert gemv_mod.rows_tile(gpu, *rows_key, tables=tables) == rows_mine
    assert gemv_mod.rows_tile(gpu, *rows_key) == rows_code
    untabled = (448, 320, True, False, False, True)
    assert gemv_mod.tile(gpu, *untabled, tables=tables) == gemv_mod.default_tile(320, 448 * 320 * 2)
    assert gemv_mod.tile(gpu, *untabled, tables=tables, autotune=True) is None
    assert gemv_mod.tile(gpu, *untabled, tables=({untabled: mine}, {}), autotune=True) == mine
    # off CUDA the code's tables hold nothing: the handed table alone
    assert gemv_mod.table_entry(gemv_mod.TILES, 0, tables, torch.device("cpu"), key) == mine
    assert gemv_mod.table_entry(gemv_mod.TILES, 0, None, torch.device("cpu"), key) is None


def test_tiles_file_is_read_and_a_bad_one_refused(tmp_path):
    """load_tables reads a tiles JSON (what bench/tiles.py writes, its other fields ignored) into
    (M = 1 entries, M > 1 entries) keyed as TILES / ROWS_TILES; anything else is a ValueError
    that names the file, the entry and the form."""
    import json

    from tinyloop.kernels.gemv import load_tables
    path = tmp_path / "tiles-default-cuda.json"
    path.write_text(json.dumps({"device_name": "X", "sweep": [],
                                "tiles": [[[6144, 2048, True, False, False, True], [16, 512, 4, 1]]],
                                "rows_tiles": [[[2048, 2048, False, False, True, 32], [16, 256, 4, 6, "wait"]]]}))
    assert load_tables(str(path)) == ({(6144, 2048, True, False, False, True): (16, 512, 4, 1)},
                                      {(2048, 2048, False, False, True, 32): (16, 256, 4, 6, "wait")})
    path.write_text(json.dumps({"tiles": []}))
    assert load_tables(str(path)) == ({}, {})
    for text, match in [
        ("not json", "not a readable JSON file"),
        ("[1, 2]", 'expected an object with "tiles" and / or "rows_tiles"'),
        ('{"tiles_entries": []}', 'expected an object with "tiles" and / or "rows_tiles"'),
        ('{"tiles": {"a": 1}}', '"tiles" must be a list of \\[key, tile\\] pairs'),
        ('{"tiles": [[1, 2]]}', r"tiles\[0\] = \[1, 2\]: not a \[key, tile\] pair of lists"),
        # an int4 sweep's key (N, K, G, bits, norm, swiglu, residual, pdl)
        ('{"tiles": [[[6144, 2048, 128, 4, true, false, false, true], ["pairs", 64, 1, 4, 1, 8]]]}',
         r"a key is \[N, K, norm, swiglu, residual, pdl\]"),
        ('{"tiles": [[[64, 64, true, false, false, 1], [2, 64, 4, 1]]]}', "an M = 1 key's pdl is a boolean"),
        ('{"tiles": [[[64, 64, true, false, false, true], [3, 64, 4, 1]]]}', "the first three powers of two"),
        ('{"tiles": [[[64, 64, true, false, false, true], [2, 64, 4]]]}', "a tile is \\[BLOCK_N, BLOCK_K"),
        ('{"rows_tiles": [[[64, 64, true, false, false, 8], [16, 64, 4, 1, "off"]]]}',
         "a rows key's BLOCK_M is 16, 32 or 64"),
        ('{"rows_tiles": [[[64, 64, true, false, false, 16], [16, 64, 4, 1, "soon"]]]}',
         r"rows_tiles\[0\].*PDL mode is one of"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=match) as e:
            load_tables(str(path))
        assert str(e.value).startswith(f"gemv tiles {str(path)!r}: "), e.value
    with pytest.raises(ValueError, match="not a readable JSON file"):
        load_tables(str(tmp_path / "missing.json"))


def test_gemv_argmax_key_rejects_bad_inputs():
    x = torch.randn(1, 16, device=DEVICE)
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"gemv: argmax_key takes one row of x \(M = 1\), got M = 2"):
        gemv(torch.randn(2, 16, device=DEVICE), w, argmax_key=new_key())
    with pytest.raises(ValueError, match=r"argmax_key must have shape \(1,\)"):
        gemv(x, w, argmax_key=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="argmax_key dtype must be one of"):
        gemv(x, w, argmax_key=torch.zeros(1, dtype=torch.int32, device=DEVICE))

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K,swiglu", GPU_SHAPES)
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_gemv_gpu_bf16_shapes(N, K, swiglu, pdl):
    torch.manual_seed(0)
    x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    out_n = N // 2 if swiglu else N
    r = torch.randn(1, 1, out_n, device="cuda", dtype=torch.bfloat16)
    for kw in ({}, {"norm_weight": nw}, {"residual": r}, {"norm_weight": nw, "residual": r}):
        assert_close(gemv(x, w, swiglu=swiglu, pdl=pdl, **kw), gemv_ref(x, w, swiglu=swiglu, **kw), "projection")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("N,K,swiglu", GPU_SHAPES)
def test_gemv_gpu_eviction_policies_are_bitwise_equal(N, K, swiglu, M):
    """Each L2 policy of the weight loads, on bench-285m's shapes with the decode step's fused
    options and its tiles (PDL on): the same bits as the call without one."""
    torch.manual_seed(2)
    x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    out_n = N // 2 if swiglu else N
    kw = ({"norm_weight": (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)} if K == 2048 and N != 2048
          else {"residual": torch.randn(M, 1, out_n, device="cuda", dtype=torch.bfloat16)})
    y = gemv(x, w, swiglu=swiglu, **kw)
    for policy in ("evict_first", "evict_last"):
        assert torch.equal(gemv(x, w, swiglu=swiglu, eviction_policy=policy, **kw), y), policy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_gemv_gpu_float32_logits(pdl):
    """The decode step's head (bench-285m's 32000 x 2048, final norm fused) with out_dtype
    float32: bitwise the default bf16 output widened, as Model.logits asks for it."""
    torch.manual_seed(1)
    x = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(32000, 2048, device="cuda") / 2048 ** 0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    y = gemv(x, w, norm_weight=nw, pdl=pdl, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (1, 1, 32000)
    assert torch.equal(y, gemv(x, w, norm_weight=nw, pdl=pdl).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("N", [32000, 49152])
def test_gemv_gpu_argmax_key_of_the_head(N, pdl):
    """The heads of bench-285m and Ouro-1.4B (final norm fused, float32 logits, the decode
    graph's call): the key names the argmax of the logits written, over repeated calls with a
    reset key, and the logits are those of a call without it. Logits of few distinct values
    (a near-constant weight) put ties across many programs' rows."""
    torch.manual_seed(2)
    x = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    for w in ((torch.randn(N, 2048, device="cuda") / 2048 ** 0.5).to(torch.bfloat16),
              torch.randint(0, 3, (N, 1), device="cuda").to(torch.bfloat16).expand(N, 2048).contiguous()):
        key = new_key("cuda")
        for _ in range(3):
            y = gemv(x, w, norm_weight=nw, pdl=pdl, out_dtype=torch.float32, argmax_key=key)
            assert argmax_of(key, N) == int(y.argmax())
            assert torch.equal(y, gemv(x, w, norm_weight=nw, pdl=pdl, out_dtype=torch.float32))
            key.fill_(ARGMAX_KEY_NONE)


# M > 1 rows: the batched kernel (tl.dot over a 16-row x tile). Under the interpreter it runs
# 16 x 64 tiles: N = 21 and K = 150 leave a partial last block of each (K: three chunks).
ROWS_N, ROWS_K = 21, 150
FUSIONS = {  # name -> (norm, swiglu, residual)
    "plain": (False, False, False), "norm": (True, False, False), "norm+swiglu": (True, True, False),
    "residual": (False, False, True),
}


def rows_case(lead, dtype, fusion, seed, N=ROWS_N, K=ROWS_K):
    """x (*lead, K), the weight and gemv's keyword arguments for one fusion."""
    norm, swiglu, residual = FUSIONS[fusion]
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*lead, K, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(2 * N if swiglu else N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    kw = {"swiglu": swiglu}
    if norm:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
        kw["eps"] = 1e-5
    if residual:
        kw["residual"] = torch.randn(*lead, N, generator=g).to(DEVICE, dtype)
    return x, w, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("lead", [(2,), (2, 1), (3,), (3, 1), (16,), (16, 1), (17, 1), (33,), (64, 1)], ids=str)
def test_gemv_rows_match_ref(lead, fusion, dtype):
    x, w, kw = rows_case(lead, dtype, fusion, seed=len(lead) * 100 + lead[0])
    y = gemv(x, w, pdl=False, **kw)
    assert y.shape == (*lead, ROWS_N)
    assert_close(y, gemv_ref(x, w, **kw), "projection")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("M", [3, 16])
def test_gemv_rows_prefetch_matches_ref(M, fusion, dtype):
    """pdl=True: under the interpreter, the PREFETCH path alone (first weight tile loaded ahead
    of the loop and applied after it)."""
    x, w, kw = rows_case((M, 1), dtype, fusion, seed=M)
    assert_close(gemv(x, w, pdl=True, **kw), gemv_ref(x, w, **kw), "projection")


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_gemv_rows_bf16(fusion, pdl):
    """bf16 on the interpreter, whose tl.dot gets bf16 operands upcast to fp32 by the kernel."""
    x, w, kw = rows_case((5, 1), torch.bfloat16, fusion, seed=5)
    assert_close(gemv(x, w, pdl=pdl, **kw), gemv_ref(x, w, **kw), "projection")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_gemv_rows_equal_one_row_calls(fusion, dtype):
    """Row m of an M-row call is the M = 1 kernel's answer for that row alone (within the
    projection tolerance: another kernel): each row keeps its own norm statistics, SwiGLU and
    residual."""
    M = 4
    x, w, kw = rows_case((M, 1), dtype, fusion, seed=7)
    y = gemv(x, w, **kw)
    for m in range(M):
        one = dict(kw, residual=kw["residual"][m:m + 1]) if "residual" in kw else kw
        assert_close(y[m:m + 1], gemv(x[m:m + 1], w, **one), "projection")


def test_gemv_rows_reject_bad_inputs():
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"1 <= M <= 64 rows, got shape \(65, 16\) \(M = 65\)"):
        gemv(torch.randn(65, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"1 <= M <= 64 rows, got shape \(3, 0, 16\) \(M = 0\)"):
        gemv(torch.randn(3, 0, 16, device=DEVICE), w)
    x = torch.randn(4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 1, 8\), got \(4, 8\)"):
        gemv(x, w, residual=torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 1, 8\), got \(1, 1, 8\)"):
        gemv(x, w, residual=torch.randn(1, 1, 8, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K,swiglu", GPU_SHAPES)
@pytest.mark.parametrize("M", [2, 4, 8, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_gemv_rows_gpu_bf16_shapes(N, K, swiglu, M, pdl):
    """Every row block (16, 32, 64 rows) at bench-285m's shapes, with each fusion: the tabled
    tiles where the key matches, the fitted defaults elsewhere."""
    torch.manual_seed(M)
    x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    out_n = N // 2 if swiglu else N
    r = torch.randn(M, 1, out_n, device="cuda", dtype=torch.bfloat16)
    for kw in ({}, {"norm_weight": nw}, {"residual": r}, {"norm_weight": nw, "residual": r}):
        assert_close(gemv(x, w, swiglu=swiglu, pdl=pdl, **kw), gemv_ref(x, w, swiglu=swiglu, **kw), "projection")


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("kw", [{}, {"norm": True}, {"residual": True}, {"norm": True, "swiglu": True}],
                         ids=["plain", "norm", "residual", "norm+swiglu"])
def test_gemv_float32_out_is_the_rounded_y(M, kw):
    """out_dtype=float32 stores the very values of the default bf16 y, widened (the decode
    step's logits need no conversion kernel)."""
    g = torch.Generator().manual_seed(M)
    N, K = 24, 96
    x = (3 * torch.randn(M, 1, K, generator=g)).to(DEVICE, torch.bfloat16)
    w = (torch.randn(2 * N if kw.get("swiglu") else N, K, generator=g) / K ** 0.5).to(DEVICE, torch.bfloat16)
    args = {"swiglu": kw.get("swiglu", False)}
    if kw.get("norm"):
        args["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, torch.bfloat16)
    if kw.get("residual"):
        args["residual"] = torch.randn(M, 1, N, generator=g).to(DEVICE, torch.bfloat16)
    y32 = gemv(x, w, out_dtype=torch.float32, **args)
    assert y32.dtype == torch.float32
    assert torch.equal(y32, gemv(x, w, **args).float())
    assert torch.equal(gemv_ref(x, w, out_dtype=torch.float32, **args), gemv_ref(x, w, **args).float())


def test_gemv_rejects_other_out_dtypes():
    x = torch.randn(1, 16, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(8, 16, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype must be x's dtype torch.bfloat16 or torch.float32, got torch.float16"):
        gemv(x, w, out_dtype=torch.float16)



# invariant=True: any M through the M = 1 kernel, a few rows a program, so each row is bit for
# bit the invariant M = 1 call's for that row alone. Under the interpreter the M = 1 tile is
# INTERPRET_TILE, 32 x 64: N = 13 leaves a partial row block and K = 100 two chunks, the last partial;
# K = 40 takes the one-chunk path. (Shapes this small: the interpreter runs ~100 programs a
# second, and M = 33 is 33 programs per row block.)
INV_N, INV_K = 13, 100
INVARIANT_MS = (1, 2, 3, 5, 17, 33)
INVARIANT_FUSIONS = [*FUSIONS, "out_f32"]  # out_f32: the plain projection with a float32 y


def invariant_case(M, dtype, fusion, seed, K=INV_K):
    """rows_case (N = INV_N) for one of INVARIANT_FUSIONS, x (M, 1, K)."""
    x, w, kw = rows_case((M, 1), dtype, "plain" if fusion == "out_f32" else fusion, seed, N=INV_N, K=K)
    if fusion == "out_f32":
        kw["out_dtype"] = torch.float32
    return x, w, kw


def first_rows(kw, rows):
    """gemv's keyword arguments for x[rows] (the same rows of the residual)."""
    return dict(kw, residual=kw["residual"][rows]) if "residual" in kw else kw


def assert_matches_ref(y, x, w, kw):
    """y, an invariant call's, within the projection tolerance of gemv_ref's invariant spec; a
    float32 y (out_f32) holds values of x's dtype, so it is compared in x's dtype, with that
    dtype's tolerance."""
    ref_kw = {k: v for k, v in kw.items() if k != "out_dtype"}
    assert_close(y.to(x.dtype), gemv_ref(x, w, invariant=True, **ref_kw), "projection")


@pytest.mark.parametrize("fusion,dtype,pdl,K", [
    *[(f, d, False, INV_K) for f in INVARIANT_FUSIONS for d in (torch.float32, torch.bfloat16)],
    ("norm+swiglu", torch.bfloat16, True, INV_K), ("residual", torch.float32, True, INV_K),  # prefetch loop
    ("norm", torch.bfloat16, False, 40), ("residual", torch.bfloat16, True, 40),  # one chunk
    ("norm+swiglu", torch.float32, False, 40),
], ids=str)
def test_gemv_invariant_rows_are_the_one_row_calls(fusion, dtype, pdl, K):
    """For each M of INVARIANT_MS, row m of gemv(x[:M], invariant=True) is torch.equal to the M = 1
    call on x[m:m + 1] (its norm statistics, SwiGLU, residual row and float32 y its own), and y
    matches the reference."""
    x, w, kw = invariant_case(max(INVARIANT_MS), dtype, fusion, seed=11, K=K)
    singles = [gemv(x[m:m + 1], w, pdl=pdl, invariant=True, **first_rows(kw, slice(m, m + 1)))
               for m in range(x.shape[0])]
    for M in INVARIANT_MS:
        kw_m = first_rows(kw, slice(0, M))
        y = gemv(x[:M], w, pdl=pdl, invariant=True, **kw_m)
        assert y.shape == (M, 1, INV_N) and y.dtype == (torch.float32 if fusion == "out_f32" else dtype)
        for m in range(M):
            assert torch.equal(y[m:m + 1], singles[m]), (M, m)
        assert_matches_ref(y, x[:M], w, kw_m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_invariant_row_does_not_depend_on_its_batch(dtype):
    """One row (x, residual) among 4 other rows and among 16 others, at other positions: the
    same bits each time (norm and residual fused, so its statistics and epilogue are its own)."""
    g = torch.Generator().manual_seed(3)
    K = INV_K
    w = (torch.randn(INV_N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
    row, res = torch.randn(1, K, generator=g), torch.randn(1, INV_N, generator=g)
    outs = []
    for M, at in ((5, 0), (5, 3), (17, 16), (17, 9)):
        x, r = 3 * torch.randn(M, K, generator=g), torch.randn(M, INV_N, generator=g)
        x[at], r[at] = row[0], res[0]
        x, r = x.to(DEVICE, dtype), r.to(DEVICE, dtype)
        y = gemv(x, w, norm_weight=nw, residual=r, invariant=True)
        assert_matches_ref(y, x, w, {"norm_weight": nw, "residual": r})
        outs.append(y[at])
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


def test_gemv_invariant_one_row_is_the_plain_call():
    """M = 1 with invariant runs the plain M = 1 launch's code with its row loop: the same sums
    in the same order, so (under the interpreter, which runs the code as written) the same y and
    argmax key."""
    x, w, kw = invariant_case(1, torch.bfloat16, "norm", seed=5)
    keys = new_key(), new_key()
    y = gemv(x, w, argmax_key=keys[0], **kw)
    assert torch.equal(gemv(x, w, argmax_key=keys[1], invariant=True, **kw), y)
    assert torch.equal(keys[0], keys[1]) and argmax_of(keys[0], INV_N) == int(y.argmax())


def test_gemv_invariant_rejects_bad_inputs():
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"gemv: x \(\.\.\., K\) must hold M >= 1 rows, got shape \(0, 16\) \(M = 0\)"):
        gemv(torch.randn(0, 16, device=DEVICE), w, invariant=True)
    with pytest.raises(ValueError, match=r"gemv: argmax_key takes one row of x \(M = 1\), got M = 3"):
        gemv(torch.randn(3, 1, 16, device=DEVICE), w, invariant=True, argmax_key=new_key())
    with pytest.raises(ValueError, match=r"residual must have shape \(17, 8\), got \(1, 8\)"):
        gemv(torch.randn(17, 16, device=DEVICE), w, invariant=True, residual=torch.randn(1, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"1 <= M <= 64 rows, got shape \(65, 16\) \(M = 65\); invariant=True"):
        gemv(torch.randn(65, 16, device=DEVICE), w)


# (name, N, K, fusion) of the decode step's projections with the options it fuses: bench-285m's
# (d 2048, 16 heads of 128, SwiGLU 5632, vocab 32000: the shapes of TILES) and the embedded
# default model's (d 320, 5 heads of 64 and 1 kv head, SwiGLU 704, vocab 256)
INVARIANT_GPU_SHAPES = [
    ("285m.wqkv", 6144, 2048, "norm"), ("285m.wo", 2048, 2048, "residual"),
    ("285m.w13", 11264, 2048, "norm+swiglu"), ("285m.w2", 2048, 5632, "residual"),
    ("285m.head", 32000, 2048, "norm"),
    ("default.wqkv", 448, 320, "norm"), ("default.wo", 320, 320, "residual"),
    ("default.w13", 1408, 320, "norm+swiglu"), ("default.w2", 320, 704, "residual"),
    ("default.head", 256, 320, "norm"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("M", [2, 5, 16, 64])
@pytest.mark.parametrize("name,N,K,fusion", INVARIANT_GPU_SHAPES, ids=[s[0] for s in INVARIANT_GPU_SHAPES])
def test_gemv_invariant_gpu_rows_are_the_one_row_calls(name, N, K, fusion, M, pdl):
    """bf16, the shapes' fixed invariant tiles (TILES with PDL, else default_tile; made one chunk
    by invariant_tile where those loop over K): row m of the invariant
    M-row call is torch.equal to the M = 1 call on row m alone (a tensor of its own, as the
    decode step's); the heads also with the float32 logits Model.logits asks for."""
    x, w, kw = gpu_case(M, N, K, fusion, pdl, seed=M)
    for out_dtype in (None, torch.float32) if name.endswith("head") else (None,):
        y = gemv(x, w, invariant=True, out_dtype=out_dtype, **kw)
        assert y.shape == (M, 1, N // 2 if kw["swiglu"] else N)
        for m in range(M):
            assert torch.equal(y[m:m + 1], one_row_call(x, w, kw, m, out_dtype=out_dtype)), (out_dtype, m)
        assert_matches_ref(y, x, w, {k: v for k, v in kw.items() if k != "pdl"})


def gpu_case(M, N, K, fusion, pdl, seed):
    """x (M, 1, K) bf16 on CUDA, a weight (N, K) and gemv's keyword arguments for `fusion`."""
    torch.manual_seed(seed)
    norm, swiglu, residual = FUSIONS[fusion]
    x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    kw = {"swiglu": swiglu, "pdl": pdl}
    if norm:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    if residual:
        kw["residual"] = torch.randn(M, 1, N // 2 if swiglu else N, device="cuda", dtype=torch.bfloat16)
    return x, w, kw


def one_row_call(x, w, kw, m, **extra):
    """The invariant M = 1 call on row m of x alone (its row and residual tensors of their own,
    as the invariant decode step's)."""
    one = first_rows(kw, slice(m, m + 1))
    if "residual" in one:
        one["residual"] = one["residual"].clone()
    return gemv(x[m:m + 1].clone(), w, invariant=True, **one, **extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fusion", ["norm", "residual"])
def test_gemv_invariant_gpu_autotuned_rows_take_the_one_row_tile(fusion):
    """autotune=True, a shape no table holds, the invariant call first: it runs the tile tuned
    for the plain M = 1 call (tuned on row 0 alone), so its rows are the invariant M = 1 calls' bits,
    float32 y included. (The autotuner's caches are emptied after: the other tests run fixed tiles.)"""
    import importlib
    gemv_mod = importlib.import_module("tinyloop.kernels.gemv")
    try:
        torch.manual_seed(4)
        M, N, K = 7, 400, 336  # in no table
        x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
        kw = ({"norm_weight": (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)} if fusion == "norm"
              else {"residual": torch.randn(M, 1, N, device="cuda", dtype=torch.bfloat16)})
        for out_dtype in (torch.float32, None):
            y = gemv(x, w, invariant=True, out_dtype=out_dtype, autotune=True, **kw)
            for m in range(M):
                one = first_rows(kw, slice(m, m + 1))
                assert torch.equal(y[m:m + 1], gemv(x[m:m + 1].clone(), w, out_dtype=out_dtype, autotune=True,
                                                    invariant=True, **one)), (out_dtype, m)
        assert gemv_mod._gemv_tuned.cache and gemv_mod._PLAIN_CONFIG
        assert_matches_ref(y, x, w, kw)
    finally:
        gemv_mod._gemv_tuned.cache.clear()
        gemv_mod._PLAIN_CONFIG.clear()


@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_gemv_rows_of_one_block_do_not_depend_on_the_others(fusion):
    """One BLOCK_M (`rows_block`) runs one tile: a row gives the same bits among 2, 9 or 16 rows
    (at any place), and among 17 or 32, whatever the other rows hold."""
    from tinyloop.kernels.gemv import rows_block
    g = torch.Generator().manual_seed(11)
    x, w, kw = rows_case((1,), torch.float32, fusion, seed=11)
    res = kw.pop("residual", None)
    for group in ((2, 9, 16), (17, 32)):
        assert len({rows_block(M) for M in group}) == 1, group
        outs = []
        for M in group:
            at = int(torch.randint(0, M, (1,), generator=g))
            xs = (3 * torch.randn(M, x.shape[-1], generator=g)).to(DEVICE)
            xs[at] = x[0]
            one = dict(kw)
            if res is not None:
                r = torch.randn(M, res.shape[-1], generator=g).to(DEVICE)
                r[at] = res[0]
                one["residual"] = r
            outs.append(gemv(xs, w, **one)[at])
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), group


def test_default_rows_tiles_fit_the_shared_memory():
    """A shape no table holds takes the default tile cut down to fit (`fit_rows_tile`): a
    float32 model's rows stage twice a bf16 model's bytes, SwiGLU two weight tiles, a wider
    BLOCK_M a wider x tile; the cut keeps the row block and the PDL mode."""
    from tinyloop.kernels.gemv import ROWS_SMEM_BYTES, default_rows_tile, fit_rows_tile
    for N, bm, swiglu, elem in itertools.product((448, 2048, 6144, 32000), (16, 32, 64), (False, True), (2, 4)):
        tile = default_rows_tile(N, bm)
        bn, bk, warps, stages, mode = fit_rows_tile(tile, bm, swiglu, elem)
        assert (bn, warps, mode) == (tile[0], tile[2], tile[4]) and bk <= tile[1] and stages <= tile[3]
        assert stages * bk * (bn * (1 + swiglu) + bm) * elem <= ROWS_SMEM_BYTES, (N, bm, swiglu, elem)
        assert _rows_launchable((bn, bk, warps, stages, mode), 2048)


def test_invariant_calls_take_one_chunk_tiles(monkeypatch):
    """An invariant call whose code tile loops over K takes a one-chunk tile of
    INVARIANT_ONE_CHUNK_WEIGHTS weights a program instead (bench-285m's q|k|v and gate|up, 2048
    columns: 4 rows a program, of each of gate|up's two tiles); a one-chunk tile, a K past that
    many weights or padded by over an eighth, and a tiles table's entry (a sweep's, run as it
    is) stay as they are."""
    import importlib
    gemv_mod = importlib.import_module("tinyloop.kernels.gemv")
    monkeypatch.setattr(gemv_mod, "_device_name", lambda device: "NVIDIA H200")
    gpu = torch.device("cuda", 0)
    qkv, gate_up, wo = (6144, 2048, True, False, False, True), (5632, 2048, True, True, False, True), \
        (2048, 2048, False, False, True, True)
    assert gemv_mod.tile(gpu, *qkv)[1] < 2048 and gemv_mod.tile(gpu, *gate_up)[1] < 2048  # loops over K
    assert gemv_mod.tile(gpu, *qkv, invariant=True) == (4, 2048, 4, 1)
    assert gemv_mod.tile(gpu, *gate_up, invariant=True) == (4, 2048, 4, 1)
    assert gemv_mod.tile(gpu, *wo, invariant=True) == gemv_mod.tile(gpu, *wo)  # one chunk already
    assert gemv_mod.invariant_tile((2, 1024, 4, 3), 3900) == (2, 4096, 4, 1)
    assert gemv_mod.invariant_tile((2, 1024, 4, 3), 3000) == (2, 1024, 4, 3)  # 4096 columns: over an eighth more
    assert gemv_mod.invariant_tile((2, 1024, 4, 3), 5632) == (2, 1024, 4, 3)  # bench-285m's w2 (8192 columns)
    assert gemv_mod.invariant_tile((2, 1024, 4, 3), 16000) == (2, 1024, 4, 3)  # 16384 padded columns: too many
    looping = ({qkv: (16, 512, 4, 1)}, {})
    assert gemv_mod.tile(gpu, *qkv, tables=looping, invariant=True) == (16, 512, 4, 1)


def test_settings_take_the_rows_the_kernel_takes():
    """worker/model/settings.py keeps its own copy of the batched kernel's row limit (the gateway
    imports settings without torch or triton): the two stay one number."""
    from tinyloop.kernels.gemv import MAX_FUSED_ROWS
    from tinyloop.worker.model import settings
    assert settings.MAX_FUSED_ROWS == MAX_FUSED_ROWS


@pytest.mark.parametrize("fusion,K", [("norm+swiglu", INV_K), ("residual", INV_K), ("norm", 40),
                                        ("norm+swiglu", 40), ("residual", 40)], ids=str)
def test_gemv_invariant_rows_per_program_change_no_bit(fusion, K):
    """rows_per_program sets how many rows of x a program computes in turn (1, 2, 5, all):
    every choice gives each row its M = 1 call's bits, with the prefetching loop (whose last
    chunk of a row loads the next row's first) and the one-chunk path (weights loaded once for
    all of a program's rows)."""
    M = 11
    x, w, kw = invariant_case(M, torch.bfloat16, fusion, seed=7, K=K)
    singles = [gemv(x[m:m + 1], w, pdl=True, invariant=True, **first_rows(kw, slice(m, m + 1))) for m in range(M)]
    for per in (1, 2, 5, M, 64):
        y = gemv(x, w, pdl=True, invariant=True, rows_per_program=per, **kw)
        for m in range(M):
            assert torch.equal(y[m:m + 1], singles[m]), (per, m)


def test_gemv_rows_per_program_must_be_positive():
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"gemv: rows_per_program must be >= 1, got 0"):
        gemv(torch.randn(3, 16, device=DEVICE), w, invariant=True, rows_per_program=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,N,K,fusion", INVARIANT_GPU_SHAPES[:5], ids=[s[0] for s in INVARIANT_GPU_SHAPES[:5]])
def test_gemv_invariant_gpu_rows_per_program_change_no_bit(name, N, K, fusion):
    """bf16, bench-285m's shapes and fixed tiles with PDL: 8 rows at 1, 3 and 8 rows per program
    (the prefetching loop carried across a program's rows, the one-chunk tile's registers reused
    by them) give each row its M = 1 call's bits."""
    x, w, kw = gpu_case(8, N, K, fusion, True, seed=1)
    singles = [one_row_call(x, w, kw, m) for m in range(8)]
    for per in (1, 3, 8):
        y = gemv(x, w, invariant=True, rows_per_program=per, **kw)
        for m in range(8):
            assert torch.equal(y[m:m + 1], singles[m]), (per, m)


def test_rows_per_program_keeps_the_gpu_busy_and_the_groups_even():
    """The default rows per program: one for an L2-resident weight, else capped by the tile kind,
    lowered until the call keeps PROGRAMS_PER_SM programs an SM, evened over its groups; an asked
    count is taken (within 1..M)."""
    from tinyloop.kernels.gemv import INVARIANT_ROWS, INVARIANT_ROWS_ONE_CHUNK, SMALL_WEIGHT_BYTES, rows_per_program_of
    assert rows_per_program_of(64, True) == INVARIANT_ROWS_ONE_CHUNK
    assert rows_per_program_of(64, False) == INVARIANT_ROWS
    assert rows_per_program_of(3, True) == 3
    assert rows_per_program_of(5, True, blocks=128, sms=132) == 1  # 128 row blocks: every row its own program
    assert rows_per_program_of(5, True, blocks=224, sms=132) == 2  # 3 groups of 2, 2 and 1 rows
    assert rows_per_program_of(8, True, blocks=512, sms=132) == 4  # 7 rows would make groups of 7 and 1
    assert rows_per_program_of(8, True, blocks=8000, sms=132) == 8
    assert rows_per_program_of(5, True, blocks=8000, sms=132, asked=9) == 5
    assert rows_per_program_of(5, False, asked=2) == 2
    assert rows_per_program_of(8, True, blocks=8000, sms=132, weight_bytes=SMALL_WEIGHT_BYTES - 1) == 1  # L2-resident
    assert rows_per_program_of(8, True, blocks=8000, sms=132, weight_bytes=SMALL_WEIGHT_BYTES) == 8
