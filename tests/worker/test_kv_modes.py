"""KV cache modes (kv_mode): store-h rebuilds the K/V of `kv` exactly, every mode's paths agree
with each other (resume, batch, ring, speculative, scoring), the memory is measured, and a bad
mode is refused with its reason."""
import dataclasses
import math

import pytest
import torch

from model_zoo import CONFIGS, write_checkpoint
from test_parity import recompute_greedy
from tinyloop.kernels.hcache import dequantize_ref, quantize_ref, rebuild_kv_ref
from tinyloop.worker import Model
from tinyloop.worker.model.cache import make_cache
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.model.settings import KV_MODES, Settings

PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]]
COMPRESSED = ("h-int8", "h-int4", "delta-int8")


@pytest.fixture(scope="module")
def models(tiny_path):
    """One Model per mode on the tiny checkpoint (GQA, prelude and coda)."""
    ms = {mode: Model(tiny_path, max_seq_len=48, n_slots=3, kv_mode=mode) for mode in KV_MODES}
    yield ms
    for m in ms.values():
        m.close()


# -- h: bit-exact K/V ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gqa-prelude-coda", "untied-2-layer-block"])
def test_h_mode_greedy_equals_kv(ckpt_dir, name):
    path = write_checkpoint(ckpt_dir / f"kvmode-{name}.tinyloop", CONFIGS[name], seed=2)
    with Model(path, max_seq_len=48, n_slots=2) as kv, Model(path, max_seq_len=48, n_slots=2, kv_mode="h") as h:
        for p in PROMPTS:
            assert h.generate(p, loops=4, max_tokens=8) == kv.generate(p, loops=4, max_tokens=8)


def test_h_mode_rebuilds_kv_within_1e6(models):
    """After the same generate on lane 0, every used layer's K (rotated) and V rebuilt from the
    h cache equal the kv cache's, relative to their norm."""
    kv, h = models["kv"], models["h"]
    p = PROMPTS[1]
    for m in (kv, h):
        m.generate(p, loops=5, max_tokens=6)  # on lane 0, the lowest free one
    n = len(p) + 5  # the last token is sampled, never written
    cfg, cache = h.config, h.runner.cache
    module = h._module
    for layer in cache.layers_for(5):
        if layer < cfg.n_prelude:
            att = module.prelude[layer].attention
        elif layer >= cache.coda_layer(0):
            att = module.coda[layer - cache.coda_layer(0)].attention
        else:
            att = module.loop[(layer - cfg.n_prelude) % cfg.n_loop_layers].attention
        hh = cache.h[layer, 0, :n][None]
        K, V = rebuild_kv_ref(hh, att.wk.weight, att.wv.weight, None, module.rope_cos[:n][None],
                              module.rope_sin[:n][None], cfg.n_kv_heads)
        Kw, Vw = kv.runner.cache.k[layer, 0, :, :n], kv.runner.cache.v[layer, 0, :, :n]
        assert (K[0] - Kw).norm() <= 1e-6 * Kw.norm(), layer
        assert (V[0] - Vw).norm() <= 1e-6 * Vw.norm(), layer


# -- every mode: the paths agree -------------------------------------------------------------------
@pytest.mark.parametrize("mode", KV_MODES)
def test_resume_handle_equals_fresh_generate(models, mode):
    m, p = models[mode], PROMPTS[1]
    handle = m.build_resume_handle(p, L_used=2, max_loops=8)
    assert handle.kv_mode == mode and handle.nbytes() == m.handle_nbytes(len(p), 8)
    for new_L in (2, 5):
        assert m.resume_generate(handle, new_L, max_tokens=8) == m.generate(p, loops=new_L, max_tokens=8)
    m.free_resume_handle(handle)


def test_handle_bytes_follow_the_mode(models):
    n = {mode: models[mode].handle_nbytes(11, 8) for mode in KV_MODES}
    # tiny: D 64, Hkv·hd 32: K+V is 64 values per token, as h; int8 and int4 take a quarter / an eighth
    assert n["h"] == n["kv"]
    assert n["h-int4"] < n["h-int8"] < n["delta-int8"] < n["kv"]


@pytest.mark.parametrize("mode", KV_MODES[1:])  # kv: tests/worker/test_batcher.py
def test_batch_lanes_equal_standalone(models, mode):
    m = models[mode]
    loops = [5, 2, 3]
    got = m.generate_batch([PROMPTS[1], PROMPTS[0], PROMPTS[0][:3]], per_lane_loops=loops, max_tokens=7)
    for g, p, L in zip(got, [PROMPTS[1], PROMPTS[0], PROMPTS[0][:3]], loops):
        assert g == m.generate(p, loops=L, max_tokens=7)


@pytest.mark.parametrize("mode", COMPRESSED)
def test_chunked_prefill_equals_whole(models, mode):
    """The scheduler's chunked prefill: a chunk reads the earlier chunks' ĥ from the cache, as
    the whole prompt's prefill reads its own."""
    from tinyloop.worker.api import drain
    from tinyloop.worker.generation.decode import decode_steps
    m, p = models[mode], PROMPTS[1]
    req = m.make_request(p, loops=3, max_tokens=6)
    with m.runner.lanes.hold() as lane:
        pre = m.start_chunked(req, lane)
        while (st := pre.run(4)) is None:
            pass
        got = drain(p, decode_steps(st))
    assert got == m.generate(p, loops=3, max_tokens=6)


def test_h_ring_window_equals_sliding_window_reference(models):
    m = models["h"]
    for W in (1, 4):
        assert m.generate(PROMPTS[1], loops=3, max_tokens=9, cache_window=W) == \
            recompute_greedy(m, PROMPTS[1], 3, 9, window=W)


@pytest.mark.parametrize("mode", COMPRESSED)
def test_compressed_ring_window(models, mode):
    """A window no prompt fills reads what the full cache reads; a wrapping one resumes as it
    generates (the ring paths of prefill, resume and decode)."""
    m = models[mode]
    p = PROMPTS[1]
    assert m.generate(p, loops=3, max_tokens=8, cache_window=40) == m.generate(p, loops=3, max_tokens=8)
    handle = m.build_resume_handle(p, L_used=1, max_loops=8, cache_window=4)
    assert m.resume_generate(handle, 3, max_tokens=8) == m.generate(p, loops=3, max_tokens=8, cache_window=4)


@pytest.mark.parametrize("mode", ["h", "h-int4", "delta-int8"])  # kv: tests/worker/test_speculative.py
def test_speculative_chain_and_tree_equal_generate(models, mode):
    m, p = models[mode], PROMPTS[1]
    want = m.generate(p, loops=5, max_tokens=8)
    assert m.generate_speculative(p, max_tokens=8, draft_loops=2, verify_loops=5, draft_ahead=3) == want
    assert m.generate_tree_speculative(p, max_tokens=8, draft_loops=2, verify_loops=5, draft_ahead=3,
                                       K_branches=2) == want


def test_scoring_and_trajectory_in_a_mode(models):
    kv, h, q = models["kv"], models["h"], models["h-int4"]
    a, b = kv.score_trajectory(PROMPTS[1], 4), h.score_trajectory(PROMPTS[1], 4)
    assert a["labels"] == b["labels"]
    assert torch.allclose(torch.from_numpy(a["hidden"]), torch.from_numpy(b["hidden"]), rtol=1e-5, atol=1e-5)
    s = q.score_with_consistency(PROMPTS[0], 2, 5, max_tokens=6)
    assert s["answer_a"] == q.generate(PROMPTS[0], loops=2, max_tokens=6)[len(PROMPTS[0]):]
    assert s["answer_b"] == q.generate(PROMPTS[0], loops=5, max_tokens=6)[len(PROMPTS[0]):]
    logits, kl = q.score_with_uncertainty(PROMPTS[0], 2, 5)
    assert logits.shape == (q.config.vocab_size,) and math.isfinite(kl)


def test_delta_int8_is_closer_to_kv_than_h_int8(models):
    """The reference runtime's central claim, on one prompt: KL(kv || mode) of the next-token
    distribution orders delta-int8 < h-int8 < h-int4 (h: exactly kv). bench/kv_quality.py
    measures it over held-out prompts and decode steps."""
    ref = torch.log_softmax(torch.from_numpy(models["kv"].score_with_uncertainty(PROMPTS[1], 4, 4)[0]), -1)
    kls = {}
    for mode in KV_MODES:
        lp = torch.log_softmax(torch.from_numpy(models[mode].score_with_uncertainty(PROMPTS[1], 4, 4)[0]), -1)
        kls[mode] = float((ref.exp() * (ref - lp)).sum())
    assert kls["h"] < 1e-9
    assert kls["delta-int8"] < kls["h-int8"] < kls["h-int4"]


# -- encodings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding, rel", [("int8", 0.01), ("int4", 0.2)])
def test_quantize_round_trip(encoding, rel):
    h = torch.randn(3, 7, 40) * torch.linspace(0.1, 10, 40)
    q, s = quantize_ref(h, 5, encoding)
    assert q.shape[-1] == (40 if encoding == "int8" else 20) and s.shape == (3, 7, 5) and s.dtype == torch.float16
    back = dequantize_ref(q, s, encoding)
    assert (back - h).norm() <= rel * h.norm()
    assert torch.equal(dequantize_ref(*quantize_ref(torch.zeros(2, 40), 5, encoding), encoding), torch.zeros(2, 40))


# -- memory -----------------------------------------------------------------------------------------
def test_h_int4_takes_a_quarter_of_kv_on_bench_285m():
    """Measured from the allocated tensors (2 lanes x 16 positions, every layer of max_loops)."""
    cfg = PRESETS["bench-285m"]
    got = {mode: make_cache(mode, cfg, 2, 16, cfg.max_loops, torch.device("cpu"), torch.bfloat16)
           for mode in ("kv", "h", "h-int4")}
    nbytes = {mode: c.nbytes for mode, c in got.items()}
    assert nbytes["h-int4"] <= 0.25 * nbytes["kv"]
    assert nbytes["h"] == nbytes["kv"] // 2  # MHA: K+V is 2·D per token, h is D
    assert got["kv"].bytes_per_token_layer() == 2 * cfg.n_kv_heads * cfg.head_dim * 2


def test_lane_count_within_a_budget_follows_the_mode(tiny_path):
    kw = dict(max_seq_len=32, cache_budget_bytes=1 << 20)
    with Model(tiny_path, **kw) as kv, Model(tiny_path, kv_mode="h-int4", **kw) as h4:
        # tiny at 32 positions: a kv lane takes 272 KiB (3 fit), an h-int4 lane 42.5 KiB (the CPU's 8)
        assert (kv.n_slots, h4.n_slots) == (3, 8)
        assert h4.runner.cache.nbytes < kv.runner.cache.nbytes


# -- bad input ----------------------------------------------------------------------------------------
def test_bad_modes_are_refused(tiny_path, ckpt_dir, models):
    with pytest.raises(ValueError, match=r"kv_mode must be one of kv, h, h-int8, h-int4, delta-int8, got 'int3'"):
        Model(tiny_path, max_seq_len=16, kv_mode="int3")
    one = write_checkpoint(ckpt_dir / "one-loop.tinyloop", dataclasses.replace(CONFIGS["gqa-prelude-coda"],
                                                                              max_loops=1, default_loops=1))
    with pytest.raises(ValueError, match="max_loops=1 runs one iteration"):
        Model(one, max_seq_len=16, kv_mode="delta-int8")
    m = models["h-int8"]
    with pytest.raises(ValueError, match="kv_mode='h' differs from this model's kv_mode 'h-int8'"):
        m.generate(PROMPTS[0], kv_mode="h")
    with pytest.raises(ValueError, match="kv_mode must be one of"):
        m.build_resume_handle(PROMPTS[0], kv_mode="fp8")
    assert m.generate(PROMPTS[0], loops=2, max_tokens=2, kv_mode="h-int8")


@pytest.mark.parametrize("env, mode", [
    ({}, None), ({"TINYLOOP_KV_H_MODE": "1"}, "h"),
    ({"TINYLOOP_KV_H_MODE": "1", "TINYLOOP_KV_INT8": "1"}, "h-int8"),
    ({"TINYLOOP_KV_H_MODE": "1", "TINYLOOP_KV_INT4": "1"}, "h-int4"),
    ({"TINYLOOP_KV_DELTA": "1"}, "delta-int8"),
])
def test_env_switches(env, mode):
    assert Settings.from_env(env).kv_mode == mode


@pytest.mark.parametrize("env, match", [
    ({"TINYLOOP_KV_INT8": "1"}, "needs TINYLOOP_KV_H_MODE=1"),
    ({"TINYLOOP_KV_H_MODE": "1", "TINYLOOP_KV_INT8": "1", "TINYLOOP_KV_INT4": "1"}, "exclude each other"),
    ({"TINYLOOP_KV_DELTA": "1", "TINYLOOP_KV_H_MODE": "1"}, "combines with no other"),
    ({"TINYLOOP_KV_DELTA": "yes"}, "expected 0 or 1"),
])
def test_env_switches_refuse_bad_combinations(env, match):
    with pytest.raises(ValueError, match=match):
        Settings.from_env(env)


# -- the Triton kernels on the engine's real paths (interpreter on CPU) -------------------------------
def test_triton_store_h_kernels_in_the_engine(tiny_path, models):
    """TritonOps' store-h write and fused decode read on the engine's CPU path (the kernels run
    under the interpreter; delta-int8 takes every branch but int4's unpacking, which the kernel
    tests cover): a batched decode gives the torch reference's tokens."""
    from tinyloop.kernels.hcache import h_cache_write, h_decode_attention
    mode = "delta-int8"
    with Model(tiny_path, max_seq_len=48, n_slots=3, kv_mode=mode) as m:
        ops = m.runner.engine.ops
        ops.h_cache_write, ops.h_decode_attention = h_cache_write, h_decode_attention
        prompts = [PROMPTS[0], PROMPTS[1][:4]]
        want = models[mode].generate_batch(prompts, per_lane_loops=[3, 2], max_tokens=3)
        assert m.generate_batch(prompts, per_lane_loops=[3, 2], max_tokens=3) == want


def test_stage_sets_in_a_compressed_mode(tiny_path, models):
    """The GPU's bucketed stage sets in delta-int8, run eagerly on the CPU (tests/stage_graphs.py):
    a padded prefill (pads write their h past the prompt), a batched step with an idle row
    (position S: no write), verify trees with pads; the tokens of the unbucketed paths."""
    from stage_graphs import with_stage_graphs
    mode = "delta-int8"
    ref, p = models[mode], PROMPTS[1]
    with Model(tiny_path, max_seq_len=48, n_slots=3, kv_mode=mode) as m:
        graphs = with_stage_graphs(m, range(1, 6), prefill_graph_len=16)
        assert m.generate(p, loops=3, max_tokens=6) == ref.generate(p, loops=3, max_tokens=6)
        handle = m.build_resume_handle(p, L_used=2, max_loops=8)
        assert m.resume_generate(handle, 5, max_tokens=6) == ref.generate(p, loops=5, max_tokens=6)
        assert m.generate_tree_speculative(p, max_tokens=6, draft_loops=2, verify_loops=5, draft_ahead=3,
                                           K_branches=2) == ref.generate(p, loops=5, max_tokens=6)
        prompts, loops = [p, PROMPTS[0], PROMPTS[0][:3]], [5, 2, 3]
        assert m.generate_batch(prompts, per_lane_loops=loops, max_tokens=4) == \
            ref.generate_batch(prompts, per_lane_loops=loops, max_tokens=4)
        kinds = {k for k, _, _ in graphs.log}
        assert {"prefill", "verify", "batch"} <= kinds, kinds
