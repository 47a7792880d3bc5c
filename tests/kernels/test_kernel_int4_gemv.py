"""The INT4 kernels against their references: odd row counts, group sizes that are not powers
of two, every fused option, decode (M = 1), batched rows and prefill-sized GEMMs."""
import pytest
import torch
from kernel_tolerances import DEVICE, assert_close

from tinyloop.kernels.gemv import ARGMAX_KEY_NONE, argmax_key_ref, gemv_ref
from tinyloop.kernels.int4_gemv import (int4_dequantize_ref, int4_gemv, int4_gemv_ref, int4_matmul,
                                        int4_matmul_ref)

CASES = [  # (N, K, G): a group of 32 (two a step), 48 (bytes a group not a power of two), one group a row
    (8, 64, 32), (13, 96, 48), (24, 192, 64), (7, 128, 128),
]
# (N, K, swiglu) of bench-285m's projections at G = 128 (wqkv, wo, w13, w2, head)
GPU_SHAPES = [(6144, 2048, False), (2048, 2048, False), (5632, 2048, True), (2048, 5632, False),
              (32000, 2048, False)]


def quantized(N, K, G, g, bits=4):
    qweight = torch.randint(0, 256, (N, K * bits // 8), generator=g, dtype=torch.uint8)
    scales = (torch.rand(N, K // G, generator=g) * 0.02 + 0.001).to(torch.float16)
    zeros = torch.randint(0, 1 << bits, (N, K // G), generator=g, dtype=torch.uint8)
    return qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,G", CASES)
@pytest.mark.parametrize("norm,swiglu,residual", [
    (False, False, False), (True, False, False), (False, False, True), (True, True, False),
])
def test_int4_gemv_matches_ref(N, K, G, dtype, norm, swiglu, residual, pdl):
    g = torch.Generator().manual_seed(N * 1000 + K)
    x = (3 * torch.randn(1, 1, K, generator=g)).to(DEVICE, dtype)
    q = quantized(2 * N if swiglu else N, K, G, g)
    kw = {}
    if norm:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
        kw["eps"] = 1e-5
    if residual:
        kw["residual"] = torch.randn(1, 1, N, generator=g).to(DEVICE, dtype)
    y = int4_gemv(x, *q, G, swiglu=swiglu, pdl=pdl, **kw)
    assert y.shape == (1, 1, N)
    assert_close(y, int4_gemv_ref(x, *q, G, swiglu=swiglu, **kw), "projection")


@pytest.mark.parametrize("rows", [2, 5, 16])
@pytest.mark.parametrize("norm,swiglu,residual", [(True, True, False), (False, False, True)])
def test_int4_gemv_rows_match_ref(rows, norm, swiglu, residual):
    """A batched decode step's fused projection (M > 1: the GEMM kernel with gemv's epilogues)."""
    N, K, G = 13, 96, 48
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, K, generator=g).to(DEVICE)
    q = quantized(2 * N if swiglu else N, K, G, g)
    kw = {"norm_weight": torch.rand(K, generator=g).to(DEVICE)} if norm else {}
    if residual:
        kw["residual"] = torch.randn(rows, 1, N, generator=g).to(DEVICE)
    assert_close(int4_gemv(x, *q, G, swiglu=swiglu, **kw), int4_gemv_ref(x, *q, G, swiglu=swiglu, **kw),
                 "projection")


def test_int4_gemv_argmax_and_float32_logits():
    g = torch.Generator().manual_seed(3)
    N, K, G = 70, 64, 32
    x = torch.randn(1, 1, K, generator=g).to(DEVICE, torch.bfloat16)
    q = quantized(N, K, G, g)
    key = torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.int64, device=DEVICE)
    y = int4_gemv(x, *q, G, out_dtype=torch.float32, argmax_key=key)
    assert y.dtype == torch.float32
    plain = int4_gemv(x, *q, G)
    assert torch.equal(y, plain.float())  # the plain call's values, widened
    assert key.item() == argmax_key_ref(plain).item()
    assert_close(plain, int4_gemv_ref(x, *q, G), "projection")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 5, 37])
@pytest.mark.parametrize("N,K,G", [(13, 96, 48), (40, 256, 128)])
def test_int4_matmul_matches_ref(M, N, K, G, dtype):
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(1, M, K, generator=g).to(DEVICE, dtype)
    q = quantized(N, K, G, g)
    y = int4_matmul(x, *q, G)
    assert y.shape == (1, M, N)
    assert_close(y, int4_matmul_ref(x, *q, G), "projection")


@pytest.mark.parametrize("M", [1, 3, 20])
@pytest.mark.parametrize("N,K,G", [(13, 96, 48), (8, 64, 32)])
def test_int2_matches_ref(M, N, K, G):
    """Dual-bit's INT2 copy (four codes a byte) through both kernels, with the decode options."""
    g = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, 1, K, generator=g).to(DEVICE)
    q = quantized(2 * N, K, G, g, bits=2)
    kw = {"norm_weight": torch.rand(K, generator=g).to(DEVICE), "swiglu": True}
    if M <= 16:
        assert_close(int4_gemv(x, *q, G, bits=2, **kw), int4_gemv_ref(x, *q, G, bits=2, **kw), "projection")
        assert_close(int4_gemv(x, *q, G, bits=2, pdl=True), int4_gemv_ref(x, *q, G, bits=2), "projection")
    assert_close(int4_matmul(x, *q, G, bits=2), int4_matmul_ref(x, *q, G, bits=2), "projection")


def test_int4_ref_is_the_float_gemv_of_the_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    q = quantized(8, 64, 32, g)
    x = torch.randn(1, 1, 64, generator=g).to(DEVICE)
    w = int4_dequantize_ref(*q, 32)
    assert_close(int4_gemv(x, *q, 32), gemv_ref(x, w), "projection")
    assert_close(int4_matmul(x, *q, 32), x @ w.t(), "projection")


def test_int4_rejects_bad_inputs():
    g = torch.Generator().manual_seed(0)
    q = quantized(8, 64, 32, g)
    x = torch.randn(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="group_size must be a multiple of 2 dividing K = 64, got 24"):
        int4_gemv(x, *q, 24)
    with pytest.raises(ValueError, match="bits must be one of"):
        int4_gemv(x, *q, 32, bits=3)
    with pytest.raises(ValueError, match=r"qweight must be \(N, K/2\) = \(N, 48\) uint8"):
        int4_gemv(torch.randn(1, 96, device=DEVICE), *q, 32)
    with pytest.raises(ValueError, match="scales dtype"):
        int4_matmul(x, q[0], q[1].float(), q[2], 32)
    with pytest.raises(ValueError, match=r"1 <= M <= 16 rows"):
        int4_gemv(torch.randn(17, 64, device=DEVICE), *q, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K,swiglu", GPU_SHAPES)
def test_int4_bench_285m_shapes(N, K, swiglu):
    g = torch.Generator().manual_seed(N)
    q = quantized(2 * N if swiglu else N, K, 128, g)
    x = torch.randn(1, 1, K, generator=g).to(DEVICE, torch.bfloat16)
    nw = torch.rand(K, generator=g).to(DEVICE, torch.bfloat16)
    for pdl in (False, True):
        assert_close(int4_gemv(x, *q, 128, norm_weight=nw, swiglu=swiglu, pdl=pdl, eviction_policy="evict_last"),
                     int4_gemv_ref(x, *q, 128, norm_weight=nw, swiglu=swiglu), "projection")
    for M in (4, 16, 300):
        xm = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
        assert_close(int4_matmul(xm, q[0][:N], q[1][:N], q[2][:N], 128), int4_matmul_ref(xm, q[0][:N], q[1][:N],
                                                                                          q[2][:N], 128), "projection")


# -- the mma kernel (int32 words, tensor-core products) and the exact dequantization ---------------
MMA_CASES = [  # (N, K, G, tile): rows not a multiple of BLOCK_N, a group of 48 (6 words, padded to 8),
    (24, 192, 64, ("mma", 16, 2, 4, 1)),  # groups a step beyond the row's (masked), one group a row;
    (40, 96, 48, ("mma", 32, 1, 4, 1)),  # then K split into slices (SPLIT_K): even, uneven (the last
    (16, 256, 32, ("mma", 16, 4, 4, 1)),  # slice short), one slice left empty, groups of 48
    (20, 128, 128, ("mma", 16, 2, 4, 1)),
    (40, 256, 32, ("mma", 16, 2, 4, 1, 4)),
    (24, 160, 32, ("mma", 16, 1, 4, 1, 2)),
    (16, 192, 32, ("mma", 16, 2, 4, 1, 4)),
    (24, 192, 48, ("mma", 16, 1, 4, 1, 2)),
]


@pytest.mark.parametrize("kernel,dtype", [("mma", torch.bfloat16), ("mma", torch.float16), ("pairs", torch.bfloat16)])
@pytest.mark.parametrize("N,K,G,tile", MMA_CASES)
@pytest.mark.parametrize("norm,swiglu,residual,pdl", [
    (False, False, False, False), (True, False, False, True), (False, False, True, True), (True, True, False, False),
])
def test_int4_gemv_mma_matches_ref(N, K, G, tile, kernel, dtype, norm, swiglu, residual, pdl):
    """The word kernels (mma: tensor-core products; pairs: packed-pair weights, fp32 FMAs) on the
    same tiles."""
    tile = (kernel, *tile[1:])
    g = torch.Generator().manual_seed(N * 7 + K)
    x = (3 * torch.randn(1, 1, K, generator=g)).to(DEVICE, dtype)
    q = quantized(2 * N if swiglu else N, K, G, g)
    kw = {}
    if norm:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
    if residual:
        kw["residual"] = torch.randn(1, 1, N, generator=g).to(DEVICE, dtype)
    y = int4_gemv(x, *q, G, swiglu=swiglu, pdl=pdl, tile=tile, **kw)
    assert y.shape == (1, 1, N)
    assert_close(y, int4_gemv_ref(x, *q, G, swiglu=swiglu, tile=tile, **kw), "projection")


def one_hot_columns(q, G, dtype, cols, tile):
    """Each column c of the kernel's weight, read back as the projection of the one-hot x e_c
    (every other product is an exact zero, so y is that weight exactly)."""
    K = q[0].shape[1] * 2
    out = []
    for c in cols:
        e = torch.zeros(1, K, dtype=dtype, device=DEVICE)
        e[0, c] = 1
        out.append(int4_gemv(e, *q, G, tile=tile)[0])
    return torch.stack(out, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tile", [("bytes", 16, 2, 4, 1), ("mma", 16, 2, 4, 1), ("pairs", 64, 2, 4, 1)],
                         ids=["bytes", "mma", "pairs"])
def test_int4_weights_are_the_reference_dequantization_exactly(dtype, tile):
    check_exact_weights(dtype, tile)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [("bytes", 16, 2, 4, 1), ("mma", 16, 2, 4, 1), ("mma", 64, 1, 8, 1),
                                  ("pairs", 16, 2, 4, 1), ("pairs", 64, 1, 8, 1, 4)])
def test_int4_weights_exact_on_gpu(dtype, tile):
    """The same on the GPU, whose bf16 path is the packed fma (the interpreter's bf16 arithmetic
    is not, so there it takes integer rounding instead; the pairs kernel's inline PTX runs only
    here)."""
    check_exact_weights(dtype, tile)


def check_exact_weights(dtype, tile):
    """The kernels' weight is RN_dtype((q - z) · s) bit for bit (the magic-exponent codes and the
    split-scale fma): every code against every zero (one row per (q, z) pair), with random fp16
    scales over most of its binades, subnormal ones included."""
    if tile[0] == "mma" and dtype == torch.float32:
        pytest.skip("the mma kernel takes bf16 / fp16 x")
    if tile[0] == "pairs" and dtype != torch.bfloat16:
        pytest.skip("the pairs kernel takes bf16 x")
    G, K = 32, 64
    q_, z_ = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    N = 256
    codes = q_.reshape(N, 1).expand(N, K).to(torch.uint8)
    qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    zeros = z_.reshape(N, 1).expand(N, K // G).to(torch.uint8).contiguous()
    g = torch.Generator().manual_seed(5)
    # fp16 patterns below 4096 (15 · s stays finite in fp16: a one-hot x times an inf weight
    # elsewhere in the row would make the row NaN), subnormals included
    bits = torch.randint(0, 0x6C00, (N, K // G), generator=g, dtype=torch.int32).to(torch.int16)
    scales = bits.view(torch.float16)
    scales[:8] = torch.tensor([6e-8, 1e-5, 0.25, 1.0, 3.0, 0.0123, 7.5e-3, 4000.0], dtype=torch.float16)[:, None]
    q = (qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE))
    w = int4_dequantize_ref(*q, G).to(dtype)
    cols = [0, 1, 7, 33, 62]
    got = one_hot_columns(q, G, dtype, cols, tile)
    assert torch.equal(got, w[:, cols])


def test_int4_gemv_tile_refusals():
    g = torch.Generator().manual_seed(0)
    q = quantized(16, 64, 32, g)
    x = torch.randn(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="the mma kernel takes INT4 codes"):
        int4_gemv(x, *q, 32, tile=("mma", 16, 1, 4, 1))  # fp32 x
    q2 = quantized(16, 64, 32, g, bits=2)
    with pytest.raises(ValueError, match="the mma kernel takes INT4 codes"):
        int4_gemv(x.bfloat16(), *q2, 32, bits=2, tile=("mma", 16, 1, 4, 1))
    with pytest.raises(ValueError, match="the pairs kernel takes INT4 codes.*bf16 x"):
        int4_gemv(x.half(), *q, 32, tile=("pairs", 16, 1, 4, 1))
    with pytest.raises(ValueError, match="BLOCK_N must be >= 16"):
        int4_gemv(x.bfloat16(), *q, 32, tile=("mma", 8, 1, 4, 1))
    with pytest.raises(ValueError, match="powers of two"):
        int4_gemv(x, *q, 32, tile=("bytes", 3, 1, 4, 1))
    with pytest.raises(ValueError, match="does not split K"):
        int4_gemv(x, *q, 32, tile=("bytes", 4, 1, 4, 1, 2))
    with pytest.raises(ValueError, match="a tile is"):
        int4_gemv(x, *q, 32, tile=("warp", 4, 1, 4, 1))
    with pytest.raises(ValueError, match="a tile is"):
        int4_matmul(torch.randn(3, 64, device=DEVICE), *q, 32, tile=(16, 8, 64, 4, 1))
    with pytest.raises(ValueError, match="a dot's K"):
        int4_matmul(torch.randn(3, 64, device=DEVICE), *q, 32, tile=(16, 16, 16, 4, 1))


def test_int4_gemv_split_k_is_one_order():
    """A split launch sums each row in slice order whichever slice finishes last: repeated calls
    are bit-identical, the float32 logits are the bf16 ones widened, and the argmax key is theirs
    (the counters set back after every launch)."""
    g = torch.Generator().manual_seed(4)
    N, K, G = 40, 256, 32
    q = quantized(N, K, G, g)
    x = torch.randn(1, 1, K, generator=g).to(DEVICE, torch.bfloat16)
    tile = ("mma", 16, 1, 4, 1, 4)
    first = int4_gemv(x, *q, G, tile=tile)
    for _ in range(3):
        assert torch.equal(int4_gemv(x, *q, G, tile=tile), first)
    key = torch.full((1,), ARGMAX_KEY_NONE, dtype=torch.int64, device=DEVICE)
    y = int4_gemv(x, *q, G, tile=tile, out_dtype=torch.float32, argmax_key=key)
    assert torch.equal(y, first.float()) and key.item() == argmax_key_ref(first).item()
    assert_close(first, int4_gemv_ref(x, *q, G), "projection")


@pytest.mark.parametrize("tile", [(16, 16, 64, 4, 1), (16, 32, 128, 4, 2)])
def test_int4_matmul_explicit_tiles(tile):
    g = torch.Generator().manual_seed(9)
    q = quantized(40, 256, 64, g)
    x = torch.randn(5, 256, generator=g).to(DEVICE)
    assert_close(int4_matmul(x, *q, 64, tile=tile), int4_matmul_ref(x, *q, 64), "projection")
    nw = torch.rand(256, generator=g).to(DEVICE)
    assert_close(int4_gemv(x, *q, 64, norm_weight=nw, tile=tile), int4_gemv_ref(x, *q, 64, norm_weight=nw, tile=tile),
                 "projection")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K,swiglu", GPU_SHAPES[:4])
@pytest.mark.parametrize("tile", [("mma", 16, 2, 4, 1), ("mma", 64, 2, 4, 1, 8), ("bytes", 4, 8, 4, 2),
                                  ("pairs", 16, 1, 4, 1), ("pairs", 32, 2, 4, 1, 4)])
def test_int4_mma_bench_285m_shapes(N, K, swiglu, tile):
    """The sweep's kernels at bench-285m's shapes: parity with the options the step passes (the
    norm with PDL, the residual without), and the weight exact (one-hot columns)."""
    g = torch.Generator().manual_seed(N + K)
    q = quantized(2 * N if swiglu else N, K, 128, g)
    x = torch.randn(1, 1, K, generator=g).to(DEVICE, torch.bfloat16)
    nw = torch.rand(K, generator=g).to(DEVICE, torch.bfloat16)
    res = torch.randn(1, 1, N, generator=g).to(DEVICE, torch.bfloat16)
    assert_close(int4_gemv(x, *q, 128, norm_weight=nw, swiglu=swiglu, pdl=True, eviction_policy="evict_last",
                           tile=tile),
                 int4_gemv_ref(x, *q, 128, norm_weight=nw, swiglu=swiglu, tile=tile), "projection")
    assert_close(int4_gemv(x, *q, 128, residual=res, swiglu=swiglu, pdl=False, tile=tile),
                 int4_gemv_ref(x, *q, 128, residual=res, swiglu=swiglu), "projection")
    if not swiglu:
        w = int4_dequantize_ref(*q, 128).to(torch.bfloat16)
        cols = [0, 1, 5, 8, K // 2 + 3, K - 1]
        assert torch.equal(one_hot_columns(q, 128, torch.bfloat16, cols, tile), w[:, cols])


@pytest.mark.parametrize("rows", [2, 5])
@pytest.mark.parametrize("norm,swiglu,residual", [(True, True, False), (False, False, True), (True, False, False)])
@pytest.mark.parametrize("tile", [("pairs", 16, 2, 4, 1), ("pairs", 16, 1, 4, 1, 2)], ids=["whole-K", "split-K"])
def test_int4_pairs_rows_are_each_the_one_row_call(rows, norm, swiglu, residual, tile):
    """M > 1 on a pairs tile: every row of x runs the M = 1 launch's programs, so each row of y is
    bit for bit that row's M = 1 call (the batch-invariant rule), and all are near the reference."""
    N, K, G = 24, 192, 64
    g = torch.Generator().manual_seed(rows * 3 + norm)
    x = torch.randn(rows, 1, K, generator=g).to(DEVICE, torch.bfloat16)
    q = quantized(2 * N if swiglu else N, K, G, g)
    kw = {"norm_weight": (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, torch.bfloat16)} if norm else {}
    res = torch.randn(rows, 1, N, generator=g).to(DEVICE, torch.bfloat16) if residual else None
    y = int4_gemv(x, *q, G, swiglu=swiglu, tile=tile, residual=res, **kw)
    assert y.shape == (rows, 1, N)
    for m in range(rows):
        one = int4_gemv(x[m:m + 1], *q, G, swiglu=swiglu, tile=tile, residual=None if res is None else res[m:m + 1],
                        **kw)
        assert torch.equal(y[m:m + 1], one), m
    assert_close(y, int4_gemv_ref(x, *q, G, swiglu=swiglu, residual=res, tile=tile, **kw), "projection")


def test_int4_rows_tile_refusals():
    g = torch.Generator().manual_seed(1)
    q = quantized(16, 64, 32, g)
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"M > 1 rows take a GEMM tile or the pairs kernel's"):
        int4_gemv(x.bfloat16(), *q, 32, tile=("mma", 16, 1, 4, 1))
    with pytest.raises(ValueError, match=r"M > 1 rows take a GEMM tile or the pairs kernel's.*torch.float32"):
        int4_gemv(x, *q, 32, tile=("pairs", 16, 1, 4, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K,swiglu", GPU_SHAPES[:4])
@pytest.mark.parametrize("M", [3, 8, 16])
def test_int4_tabled_rows_at_bench_285m_shapes(N, K, swiglu, M):
    """A batched decode step's projections as the device's tables run them: near the reference,
    and where the table runs the rows on a pairs tile, each row bit for bit its one-row call on
    that tile."""
    from tinyloop.kernels.int4_gemv import _rows_tile
    g = torch.Generator().manual_seed(N + M)
    q = quantized(2 * N if swiglu else N, K, 128, g)
    x = torch.randn(M, 1, K, generator=g).to(DEVICE, torch.bfloat16)
    nw = torch.rand(K, generator=g).to(DEVICE, torch.bfloat16)
    res = torch.randn(M, 1, N, generator=g).to(DEVICE, torch.bfloat16)
    kw = dict(norm_weight=nw) if K == 2048 and N != 2048 else dict(residual=res)
    y = int4_gemv(x, *q, 128, swiglu=swiglu, eviction_policy="evict_last", **kw)
    assert_close(y, int4_gemv_ref(x, *q, 128, swiglu=swiglu, **kw), "projection")
    flags = dict(NORM="norm_weight" in kw, SWIGLU=swiglu, RESIDUAL="residual" in kw)
    t = _rows_tile("int4_gemv", x, q[0], 128, 4, flags, N, K, M, None)
    if torch.cuda.get_device_name() == "NVIDIA H200":  # its table: pairs rows but for two GEMMs at 16 rows
        assert t is not None or M == 16
    if t is not None:
        for m in range(M):
            one = {k: (v[m:m + 1] if k == "residual" else v) for k, v in kw.items()}
            assert torch.equal(y[m:m + 1], int4_gemv(x[m:m + 1], *q, 128, swiglu=swiglu, tile=t,
                                                     eviction_policy="evict_last", **one)), m
