"""The padded prefill by length bucket (generate.PaddedPrefill), what the CUDA prefill graphs
capture: the prompt padded to its bucket, pads writing K/V past it, the logits at the last
real token. On CPU the same stages run eagerly (graphs.PrefillGraphs without a GPU)."""
import math

import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.generation.decode import (DecodeState, PaddedPrefill, decode_steps, prefill, prefill_buckets,
                                      prefill_buffers, prefill_padded)
from tinyloop.worker.runner.graphs import BatchGraphs, PrefillGraphs, VerifyGraphs

MAX_SEQ = 96  # buckets 16, 32, 64, 96


def prompt(T: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


class CpuGraphs:
    """engine.graphs on CPU: no decode graphs; the prefill, speculative verify and batched
    decode stages run eagerly."""

    def __init__(self, engine, max_len: int, lanes, loops: int):
        self.prefill = PrefillGraphs(engine, None, max_len)
        self.batch = BatchGraphs(engine)
        self.verify = VerifyGraphs(engine)
        for lane in lanes:
            self.prefill.capture(lane, loops)
            self.verify.capture(lane, loops)

    def get(self, loops, lane=0):
        return None


def test_buckets():
    assert prefill_buckets(4096, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert prefill_buckets(2048, 4096)[-1] == 2048
    assert prefill_buckets(96, 2048) == [16, 32, 64, 96]
    assert prefill_buckets(16, 2048) == [16] and prefill_buckets(12, 2048) == [] and prefill_buckets(96, 0) == []


def decode_logits(m: Model, first: torch.Tensor, toks: list[int], T0: int, loops: int) -> torch.Tensor:
    """The prefill's logits, then each decode step's over the rest of `toks`, on lane 0."""
    e = m.engine
    steps = [first[0]]
    for pos in range(T0, len(toks)):
        p = e.make_pass(slice(0, 1), torch.tensor([[pos]]), pos + 1)
        steps.append(e.forward(torch.tensor([[toks[pos]]]), p, loops)[0, -1])
    return torch.stack(steps)


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_padded_prefill_equals_prefill(config_path, loops):
    """Around bucket edges: the last logits equal the unpadded prefill's (fp32, different GEMM
    shapes), every later decode step equals a full recompute (the pads' K/V are never read),
    and greedy generation is the same."""
    with Model(config_path, max_seq_len=MAX_SEQ) as m:
        e = m.engine
        for T in (1, 15, 16, 17, 33, 64, 80):
            b = next(b for b in prefill_buckets(MAX_SEQ, 2048) if b >= T)
            toks = prompt(T, T)
            want, _ = prefill(e, 0, toks, loops, 0)
            got = prefill_padded(e, 0, toks, loops, b)
            if T == b:  # the same computation: bitwise
                assert torch.equal(got, want)
            # other GEMM shapes: last-bit differences that grow through the iterations of a
            # random block (about 1e-6 after one, 1e-4 after eight)
            assert ((got - want).norm() / want.norm()) < 1e-3, T
            # decode after the padded prefill, against the no-cache forward. The floor is the
            # unpadded path's own distance to it: a random block's eight iterations amplify
            # last-bit differences past 1e-3 on long prompts. A pad read would be O(1).
            cont = toks + prompt(5, 100 + T)
            with torch.no_grad():
                full = m._module(torch.tensor([cont]), loops)[0, T - 1:]

            def err(first):
                steps = decode_logits(m, first, cont, T, loops)
                return ((steps - full).norm(dim=-1) / full.norm(dim=-1)).max()
            floor = err(prefill(e, 0, toks, loops, 0)[0])
            assert err(prefill_padded(e, 0, toks, loops, b)) < max(1e-3, 4 * floor), T
            # greedy generation from the padded prefill's state
            req = m.make_request(toks, loops=loops, max_tokens=8)
            st = DecodeState(e, 0, req, prefill_padded(e, 0, toks, loops, b), None, e.counters.snapshot())
            ids = [t for new in decode_steps(st) for t in new]
            assert toks + ids == m.generate(toks, loops=loops, max_tokens=8), T


@pytest.mark.parametrize("T", [3, 17, 40])
def test_pad_kv_is_never_read(config_path, T):
    """Whatever the pads wrote at positions T..bucket-1, the decode steps after the prefill
    are bitwise the same: each step writes its position before it attends to it."""
    with Model(config_path, max_seq_len=MAX_SEQ) as m:
        e, b, L = m.engine, next(b for b in (16, 32, 64) if b >= T), 3
        toks = prompt(T, T)
        cont = toks + prompt(6, T + 1)
        clean = decode_logits(m, prefill_padded(e, 0, toks, L, b), cont, T, L)
        first = prefill_padded(e, 0, toks, L, b)
        e.cache.k[:, 0, :, T:b] = 1e6  # finite: attention weighs masked-out V by an exact zero
        e.cache.v[:, 0, :, T:b] = -1e6
        assert torch.equal(decode_logits(m, first, cont, T, L), clean)


def test_shared_buffers_and_reuse_are_bitwise(tiny_path):
    """Graph replays reuse one set of static buffers for every lane, bucket and prompt: the
    result never depends on what ran before (stale residual rows, another bucket's tokens)."""
    with Model(tiny_path, max_seq_len=MAX_SEQ, n_slots=2) as m:
        e = m.engine
        shared = prefill_buffers(e, MAX_SEQ)
        for buf in shared:
            buf.fill_(7)
        big = PaddedPrefill(e, 1, 64, shared)
        small = PaddedPrefill(e, 0, 16, shared)
        for toks in (prompt(50, 1), prompt(3, 2), prompt(16, 3)):
            (big if len(toks) > 16 else small)(toks, 4)
            pre = PaddedPrefill(e, 0, 16 if len(toks) <= 16 else 64)
            fresh = pre(toks, 4)
            again = (big if len(toks) > 16 else small)(toks, 4)
            assert torch.equal(fresh, again)


def test_counts_and_touches_what_prefill_does(tiny_path):
    with Model(tiny_path, max_seq_len=MAX_SEQ) as m:
        e, cfg, cache = m.engine, m.config, m.engine.cache
        toks, L = prompt(20), 3
        before = m.counters.snapshot()
        prefill(e, 0, toks, L, 0)
        want = m.counters.since(before)
        before = m.counters.snapshot()
        first_unused = cfg.n_prelude + L * cfg.n_loop_layers
        coda0 = cache.coda_layer(0)
        cache.k[first_unused:coda0] = math.nan
        prefill_padded(e, 0, toks, L, 32)
        assert m.counters.since(before) == want  # the prompt's work, not the pads'
        assert torch.isnan(cache.k[first_unused:coda0]).all(), "a layer past L was written"


@pytest.fixture(scope="module")
def pair(tiny_path):
    """The same checkpoint with its prefill through PrefillGraphs (eager on CPU) and without."""
    with Model(tiny_path, max_seq_len=MAX_SEQ, n_slots=3) as g, Model(tiny_path, max_seq_len=MAX_SEQ, n_slots=3) as ref:
        g.engine.graphs = CpuGraphs(g.engine, 64, range(3), 8)  # buckets 16..64, depths 1..8
        yield g, ref


def test_prefill_takes_the_bucket_path_when_covered(pair):
    g, _ = pair
    pg = g.engine.graphs.prefill
    calls = []
    run = PaddedPrefill.run
    PaddedPrefill.run = lambda self, stage: (calls.append(stage), run(self, stage))[1]
    try:
        for T, L, lane, window, track, used in ((20, 8, 1, 0, False, True), (64, 2, 2, 0, False, True),
                                                (65, 2, 0, 0, False, False), (20, 9, 0, 0, False, False),
                                                (20, 4, 0, 4, False, False), (20, 4, 0, 0, True, False)):
            calls.clear()
            prefill(g.engine, lane, prompt(T), L, window, track)
            assert (calls == PaddedPrefill.stages(L)) == used, (T, L, window, track)
    finally:
        PaddedPrefill.run = run
    assert pg.buckets == [16, 32, 64] and pg.run(0, prompt(70), 2) is None


@pytest.mark.parametrize("T", [5, 16, 17, 70])
def test_generation_through_bucket_prefill(pair, T):
    """Tokens, finish and stats through the bucket prefill equal the eager model's: greedy,
    sampled, with a stop token, on other lanes, resume after it, and speculation through the
    verify stages."""
    g, ref = pair
    p = prompt(T, 7)
    for kw in (dict(loops=4), dict(loops=8, temperature=0.9, top_k=40, seed=3, repetition_penalty=1.2)):
        a, b = g.generate(p, max_tokens=10, **kw), ref.generate(p, max_tokens=10, **kw)
        assert a == b and (a.finish_reason, a.stats) == (b.finish_reason, b.stats)
        stop = [b[T + 3]]
        assert g.generate(p, max_tokens=10, stop_token_ids=stop, **kw) == ref.generate(
            p, max_tokens=10, stop_token_ids=stop, **kw)
    from tinyloop.worker.api import drain
    req = g.make_request(p, loops=3, max_tokens=8)
    assert drain(p, g.stream(req, lane=2)) == ref.generate(p, loops=3, max_tokens=8)
    h = g.build_resume_handle(p, L_used=2, max_loops=8)
    try:
        assert g.resume_generate(h, 5, max_tokens=8) == ref.generate(p, loops=5, max_tokens=8)
    finally:
        g.free_resume_handle(h)
    spec = dict(max_tokens=8, draft_loops=2, verify_loops=5)
    verify = g.engine.graphs.verify.chunks[(0, 5)]
    verify.prefix.zero_()
    a, b = g.generate_speculative(p, **spec), ref.generate_speculative(p, **spec)
    assert a == b == ref.generate(p, loops=5, max_tokens=8) and a.stats == b.stats
    assert verify.prefix.item() >= T  # its chunks went through the verify stages (pads and all)
    batch = g.generate_batch([p, prompt(3, 9)], per_lane_loops=[6, 2], max_tokens=6)
    assert batch == [ref.generate(p, loops=6, max_tokens=6), ref.generate(prompt(3, 9), loops=2, max_tokens=6)]


@pytest.mark.parametrize("T", [5, 16, 33])
def test_resume_handles_through_bucket_stages(pair, T):
    """build_resume_handle and resume_generate replay the bucket's stages (prelude and the
    first L_used iterations; then iterations [L_used, new_L) and the coda from the handle's
    residual): the handle, the tokens, the stats and the counters equal the eager path's."""
    g, ref = pair
    p = prompt(T, 11)
    calls = []
    run = PaddedPrefill.run
    PaddedPrefill.run = lambda self, stage: (calls.append(stage), run(self, stage))[1]
    try:
        hg, hr = g.build_resume_handle(p, L_used=2, max_loops=8), ref.build_resume_handle(p, L_used=2, max_loops=8)
        assert calls == ["prelude", 0, 1]
        try:
            torch.testing.assert_close(hg.residual, hr.residual, atol=1e-4, rtol=1e-3)  # padded GEMM shapes
            used = g.config.n_prelude + 2 * g.config.n_loop_layers
            torch.testing.assert_close(hg.k[:used], hr.k[:used], atol=1e-4, rtol=1e-3)
            for new_L in (2, 5, 8):
                calls.clear()
                bg, br = g.counters.snapshot(), ref.counters.snapshot()
                a, b = g.resume_generate(hg, new_L, max_tokens=8), ref.resume_generate(hr, new_L, max_tokens=8)
                assert calls[:new_L - 2 + 1] == [*range(2, new_L), "coda"]
                assert a.stats == b.stats and g.counters.since(bg) == ref.counters.since(br)
                assert a == b == ref.generate(p, loops=new_L, max_tokens=8)
        finally:
            g.free_resume_handle(hg)
            ref.free_resume_handle(hr)
    finally:
        PaddedPrefill.run = run
