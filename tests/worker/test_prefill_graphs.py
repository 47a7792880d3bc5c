"""The padded prefill by length bucket (stages.PaddedPrefill), what the CUDA prefill graphs
capture: the prompt padded to its bucket, pads writing K/V past it, the logits at the last
real token. On CPU the runner has no graphs: the tests drive PaddedPrefill itself, or give
the runner stand-in graphs that run the stages it would replay eagerly, on the same static
buffers (EagerGraphs)."""
import math

import pytest
import torch

from stage_graphs import with_stage_graphs

from tinyloop.worker import Model
from tinyloop.worker.api import drain
from tinyloop.worker.generation.decode import DecodeState, decode_steps
from tinyloop.worker.runner.engine import Counters
from tinyloop.worker.runner.stages import PaddedPrefill, TreeStages, prefill_buckets, prefill_buffers

MAX_SEQ = 96  # buckets 16, 32, 64, 96


def prompt(T: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def padded(m: Model, lane: int, toks: list[int], loops: int, bucket: int, buffers=None,
           pre: PaddedPrefill | None = None) -> torch.Tensor:
    """The prompt's last logits (1, V) through the padded prefill's stages (a fresh stage set
    for `bucket` unless `pre`), run eagerly in the order the GPU replays them."""
    pre = pre if pre is not None else PaddedPrefill(m.runner.engine, bucket, buffers)
    pre.load_tokens(lane, toks)
    for stage in PaddedPrefill.stages(loops):
        pre.run(stage)
    return pre.logits.clone()


def test_buckets():
    assert prefill_buckets(4096, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert prefill_buckets(2048, 4096)[-1] == 2048
    assert prefill_buckets(96, 2048) == [16, 32, 64, 96]
    assert prefill_buckets(16, 2048) == [16] and prefill_buckets(12, 2048) == [] and prefill_buckets(96, 0) == []


def decode_logits(m: Model, first: torch.Tensor, toks: list[int], T0: int, loops: int) -> torch.Tensor:
    """The prefill's logits, then each decode step's over the rest of `toks`, on lane 0."""
    r = m.runner
    steps = [first[0]]
    for pos in range(T0, len(toks)):
        steps.append(r.decode([0], [toks[pos]], [pos], [loops]).logits[0].clone())
    return torch.stack(steps)


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_padded_prefill_equals_prefill(config_path, loops):
    """Around bucket edges: the last logits equal the unpadded prefill's (fp32, different GEMM
    shapes), every later decode step equals a full recompute (the pads' K/V are never read),
    and greedy generation is the same."""
    with Model(config_path, max_seq_len=MAX_SEQ, n_slots=1) as m:
        r = m.runner
        for T in (1, 15, 16, 17, 33, 64, 80):
            b = next(b for b in prefill_buckets(MAX_SEQ, 2048) if b >= T)
            toks = prompt(T, T)
            want = r.prefill(0, toks, loops).logits
            got = padded(m, 0, toks, loops, b)
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
            floor = err(r.prefill(0, toks, loops).logits)
            assert err(padded(m, 0, toks, loops, b)) < max(1e-3, 4 * floor), T
            # greedy generation from the padded prefill's state
            req = m.make_request(toks, loops=loops, max_tokens=8)
            st = DecodeState(r, 0, req, padded(m, 0, toks, loops, b), None, Counters())
            ids = [t for new in decode_steps(st) for t in new]
            assert toks + ids == m.generate(toks, loops=loops, max_tokens=8), T


@pytest.mark.parametrize("T", [3, 17, 40])
def test_pad_kv_is_never_read(config_path, T):
    """Whatever the pads wrote at positions T..bucket-1, the decode steps after the prefill
    are bitwise the same: each step writes its position before it attends to it."""
    with Model(config_path, max_seq_len=MAX_SEQ, n_slots=1) as m:
        cache, b, L = m.runner.cache, next(b for b in (16, 32, 64) if b >= T), 3
        toks = prompt(T, T)
        cont = toks + prompt(6, T + 1)
        clean = decode_logits(m, padded(m, 0, toks, L, b), cont, T, L)
        first = padded(m, 0, toks, L, b)
        cache.k[:, 0, :, T:b] = 1e6  # finite: attention weighs masked-out V by an exact zero
        cache.v[:, 0, :, T:b] = -1e6
        assert torch.equal(decode_logits(m, first, cont, T, L), clean)


def test_shared_buffers_and_reuse_are_bitwise(tiny_path):
    """Graph replays reuse one set of static buffers for every lane, bucket and prompt: the
    result never depends on what ran before (stale residual rows, another bucket's tokens,
    another lane)."""
    with Model(tiny_path, max_seq_len=MAX_SEQ, n_slots=2) as m:
        e = m.runner.engine
        shared = prefill_buffers(e, MAX_SEQ)
        for buf in shared:
            buf.fill_(7)
        big = PaddedPrefill(e, 64, shared)
        small = PaddedPrefill(e, 16, shared)
        for toks in (prompt(50, 1), prompt(3, 2), prompt(16, 3)):
            pre = big if len(toks) > 16 else small
            padded(m, 1, toks, 4, pre.bucket, pre=pre)
            fresh = padded(m, 0, toks, 4, pre.bucket)
            again = padded(m, 1, toks, 4, pre.bucket, pre=pre)
            assert torch.equal(fresh, again)


def test_counts_and_touches_what_prefill_does(tiny_path):
    """Through the runner's bucket stages: the counters count the prompt's work (loops,
    loops * T), as the eager prefill does, not the bucket's pads'; no layer past L is
    written."""
    with Model(tiny_path, max_seq_len=MAX_SEQ, n_slots=1) as ref, Model(tiny_path, max_seq_len=MAX_SEQ,
                                                                          n_slots=1) as m:
        graphs = with_stage_graphs(m, [3], 64)
        cfg, cache = m.config, m.runner.cache
        toks, L = prompt(20), 3
        before = ref.counters.snapshot()
        want_logits = ref.runner.prefill(0, toks, L).logits
        want = ref.counters.since(before)
        assert want == Counters(L, L * len(toks))
        first_unused = cfg.n_prelude + L * cfg.n_loop_layers
        coda0 = cache.coda_layer(0)
        cache.k[first_unused:coda0] = math.nan
        before = m.counters.snapshot()
        out = m.runner.prefill(0, toks, L)
        assert graphs.replayed("prefill") == [(32, s) for s in PaddedPrefill.stages(L)]
        assert m.counters.since(before) == out.work == want  # the prompt's work, not the pads'
        assert torch.isnan(cache.k[first_unused:coda0]).all(), "a layer past L was written"
        assert ((out.logits - want_logits).norm() / want_logits.norm()) < 1e-3


@pytest.fixture(scope="module")
def pair(tiny_path):
    """The same checkpoint through a runner with prefill, verify and batch stage graphs
    (EagerGraphs: prefill buckets 16..64, depths 1..8) and through a plain eager runner."""
    with Model(tiny_path, max_seq_len=MAX_SEQ, n_slots=3) as g, Model(tiny_path, max_seq_len=MAX_SEQ, n_slots=3) as ref:
        with_stage_graphs(g, range(1, 9), 64)
        yield g, ref


def test_prefill_takes_the_bucket_path_when_covered(pair):
    """The smallest bucket that holds the prompt, on any lane, when its stages for the depth
    are captured, with the full cache and no norm tracking; else eager. Either way the same
    logits and the same counts."""
    g, ref = pair
    graphs = g.runner.graphs
    for T, L, lane, window, track, bucket in ((20, 8, 1, 0, False, 32), (64, 2, 2, 0, False, 64),
                                              (16, 2, 0, 0, False, 16), (17, 2, 0, 0, False, 32),
                                              (65, 2, 0, 0, False, None), (20, 9, 0, 0, False, None),
                                              (20, 4, 0, 4, False, None), (20, 4, 0, 0, True, None)):
        graphs.log.clear()
        toks = prompt(T)
        before = g.counters.snapshot()
        out = g.runner.prefill(lane, toks, L, window, track)
        assert g.counters.since(before) == out.work == Counters(L, L * T)
        want = [] if bucket is None else [(bucket, s) for s in PaddedPrefill.stages(L)]
        assert graphs.replayed("prefill") == want, (T, L, window, track)
        ref_logits = ref.runner.prefill(lane, toks, L, window, track).logits
        assert ((out.logits - ref_logits).norm() / ref_logits.norm()) < 1e-3, (T, L, window, track)


@pytest.mark.parametrize("T", [5, 16, 17, 70])
def test_generation_through_bucket_prefill(pair, T):
    """Tokens, finish and stats through the bucket prefill equal the eager model's: greedy,
    sampled, with a stop token, on other lanes, resume after it, speculation through the
    verify stages and a batch through the batch stages."""
    g, ref = pair
    graphs = g.runner.graphs
    p = prompt(T, 7)
    for kw in (dict(loops=4), dict(loops=8, temperature=0.9, top_k=40, seed=3, repetition_penalty=1.2)):
        graphs.log.clear()
        a, b = g.generate(p, max_tokens=10, **kw), ref.generate(p, max_tokens=10, **kw)
        assert a == b and (a.finish_reason, a.stats) == (b.finish_reason, b.stats)
        assert bool(graphs.replayed("prefill")) == (T <= 64)  # 70 has no bucket: eager
        stop = [b[T + 3]]
        assert g.generate(p, max_tokens=10, stop_token_ids=stop, **kw) == ref.generate(
            p, max_tokens=10, stop_token_ids=stop, **kw)
    req = g.make_request(p, loops=3, max_tokens=8)
    assert drain(p, g.stream(req, lane=2)) == ref.generate(p, loops=3, max_tokens=8)
    h = g.build_resume_handle(p, L_used=2, max_loops=8)
    try:
        assert g.resume_generate(h, 5, max_tokens=8) == ref.generate(p, loops=5, max_tokens=8)
    finally:
        g.free_resume_handle(h)
    spec = dict(max_tokens=8, draft_loops=2, verify_loops=5)
    graphs.log.clear()
    a, b = g.generate_speculative(p, **spec), ref.generate_speculative(p, **spec)
    assert a == b == ref.generate(p, loops=5, max_tokens=8) and a.stats == b.stats
    # its chunks (draft_ahead 4: 5 tokens, fewer in the last round) went through the verify
    # stages of bucket 5, pads and all, one verify per round
    verify = graphs.replayed("verify")
    assert verify and {b for b, _ in verify} == {5}
    assert verify.count((5, "coda")) == a.stats["verify_steps"]
    assert [s for _, s in verify] == TreeStages.span(2, 5) * a.stats["verify_steps"]
    graphs.log.clear()
    batch = g.generate_batch([p, prompt(3, 9)], per_lane_loops=[6, 2], max_tokens=6)
    assert batch == [ref.generate(p, loops=6, max_tokens=6), ref.generate(prompt(3, 9), loops=2, max_tokens=6)]
    # the two lanes at depths 6 and 2: their steps went through the interleaved stages
    assert graphs.replayed("interleaved")


@pytest.mark.parametrize("T", [5, 16, 33])
def test_resume_handles_through_bucket_stages(pair, T):
    """build_resume_handle and resume_generate replay the bucket's stages (prelude and the
    first L_used iterations; then iterations [L_used, new_L) and the coda from the handle's
    residual): the handle, the tokens, the stats and the counters equal the eager path's."""
    g, ref = pair
    graphs = g.runner.graphs
    b = next(b for b in (16, 32, 64) if b >= T)
    p = prompt(T, 11)
    graphs.log.clear()
    hg, hr = g.build_resume_handle(p, L_used=2, max_loops=8), ref.build_resume_handle(p, L_used=2, max_loops=8)
    assert graphs.replayed("prefill") == [(b, "prelude"), (b, 0), (b, 1)]
    try:
        torch.testing.assert_close(hg.residual, hr.residual, atol=1e-4, rtol=1e-3)  # padded GEMM shapes
        used = g.config.n_prelude + 2 * g.config.n_loop_layers
        torch.testing.assert_close(hg.state["k"][:used], hr.state["k"][:used], atol=1e-4, rtol=1e-3)
        for new_L in (2, 5, 8):
            graphs.log.clear()
            bg, br = g.counters.snapshot(), ref.counters.snapshot()
            x, y = g.resume_generate(hg, new_L, max_tokens=8), ref.resume_generate(hr, new_L, max_tokens=8)
            assert graphs.replayed("prefill") == [(b, s) for s in [*range(2, new_L), "coda"]]
            assert x.stats == y.stats and g.counters.since(bg) == ref.counters.since(br)
            assert x == y == ref.generate(p, loops=new_L, max_tokens=8)
    finally:
        g.free_resume_handle(hg)
        ref.free_resume_handle(hr)


def test_prompts_prefilled_together_replay_multi_row_graphs(config_path):
    """Runner.prefill_many on a graphed runner: prompts grouped by depth, then length, into the
    4- and 2-row prefill graphs (rows × bucket <= 512), each row at its own depth, the rest
    through their own bucket graphs; every prompt's last logits equal its own prefill's, and
    the lanes decode on from there as after their own prefill."""
    with Model(config_path, max_seq_len=MAX_SEQ, n_slots=7) as m:
        g = with_stage_graphs(m, [8], prefill_graph_len=MAX_SEQ)
        r = m.runner
        lengths, depths = [5, 17, 30, 9, 12, 40, 3], [3, 8, 3, 5, 8, 2, 8]
        prompts = [prompt(T, T) for T in lengths]
        want = [r.prefill(i, p, L).logits.clone() for i, (p, L) in enumerate(zip(prompts, depths))]
        after = [r.decode([i], [7], [len(p)], [L]).logits.clone() for i, (p, L) in enumerate(zip(prompts, depths))]
        g.log.clear()
        got = r.prefill_many(list(range(7)), prompts, depths)
        # 7 prompts: one group of 4 (the deepest: depths 8, 8, 8, 5), one of 2, one alone
        assert [b for b, s in g.replayed("prefill4") if s == "coda"] == [32]
        assert len(g.replayed("prefill4")) == 8 + 2 and len(g.replayed("prefill2")) == 3 + 2
        assert len([s for _, s in g.replayed("prefill") if s == "coda"]) == 1
        for i, (p, L) in enumerate(zip(prompts, depths)):
            assert ((got[i].logits - want[i]).norm() / want[i].norm()) < 1e-3, i
            step = r.decode([i], [7], [len(p)], [L]).logits
            assert ((step - after[i]).norm() / after[i].norm()) < 1e-3, i


def test_a_burst_of_prompts_shares_one_replay_per_stage(config_path):
    """Row counts up to the lane count: 19 fresh prompts are one 16-row group, one 2-row group
    and one prompt alone (the 32- and 64-row graphs exceed the 19 lanes and are not built);
    every row count's stage set is a view of one set of buffers, and each prompt's last logits
    and next step equal its own prefill's."""
    with Model(config_path, max_seq_len=MAX_SEQ, n_slots=19) as m:
        g = with_stage_graphs(m, [4], prefill_graph_len=MAX_SEQ)
        r = m.runner
        assert sorted({rows for rows, _ in r._rows_buckets}) == [2, 4, 8, 16]
        lengths = [3 + (7 * i) % 29 for i in range(19)]
        depths = [4 - i % 3 for i in range(19)]
        prompts = [prompt(T, i) for i, T in enumerate(lengths)]
        want = [r.prefill(i, p, L).logits.clone() for i, (p, L) in enumerate(zip(prompts, depths))]
        after = [r.decode([i], [7], [len(p)], [L]).logits.clone() for i, (p, L) in enumerate(zip(prompts, depths))]
        g.log.clear()
        got = r.prefill_many(list(range(19)), prompts, depths)
        codas = {kind: len([s for _, s in g.replayed(kind) if s == "coda"])
                 for kind in ("prefill16", "prefill2", "prefill")}
        assert codas == {"prefill16": 1, "prefill2": 1, "prefill": 1}, codas
        assert not g.replayed("prefill4") and not g.replayed("prefill8")
        ptrs = {pre.x.data_ptr() for pre in r._prefill_rows.values()}
        assert len(r._prefill_rows) > 1 and len(ptrs) == 1
        for i, (p, L) in enumerate(zip(prompts, depths)):
            assert ((got[i].logits - want[i]).norm() / want[i].norm()) < 1e-3, i
            step = r.decode([i], [7], [len(p)], [L]).logits
            assert ((step - after[i]).norm() / after[i].norm()) < 1e-3, i
