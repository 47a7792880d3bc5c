"""The CUDA path (Triton ops + captured graphs) against the torch reference path.
Run on a GPU host: `pytest -m gpu tests/worker/test_gpu_engine.py`."""
import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.runner.stages import BatchStep, PaddedPrefill, TreeStages, batch_buckets

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]]


@pytest.fixture(scope="module")
def pair(tiny_path):
    fast = Model(tiny_path, max_seq_len=256, device="cuda", dtype="float32", n_slots=2)
    ref = Model(tiny_path, max_seq_len=256, device="cuda", dtype="float32", backend="torch", cuda_graphs=False)
    yield fast, ref
    fast.close()
    ref.close()


def _replays(monkeypatch, graphs) -> list:
    """Every stage-graph replay of `graphs` from now to the test's end: (kind, bucket, stage).
    The class is patched, not the object: an object holding a bound method of its own is a
    reference cycle, which only a collection frees (and a collection must never free a graph
    during another model's capture)."""
    from tinyloop.worker.runner.graphs import Graphs
    calls = []
    replay = Graphs.replay

    def spy(self, kind, bucket, stage):
        if self is graphs:
            calls.append((kind, bucket, stage))
        replay(self, kind, bucket, stage)
    monkeypatch.setattr(Graphs, "replay", spy)
    return calls


def _lanes_replayed(monkeypatch, graph) -> list:
    """The lane of every replay of one decode graph from now to the test's end (the class
    patched, as in `_replays`)."""
    from tinyloop.worker.runner.graphs import DecodeGraph
    lanes = []
    replay = DecodeGraph.replay

    def spy(self, lane, position):
        if self is graph:
            lanes.append(lane)
        replay(self, lane, position)
    monkeypatch.setattr(DecodeGraph, "replay", spy)
    return lanes


def _captured(graphs, kind: str) -> dict:
    """{bucket: the set of stages captured} of one kind of stage graph."""
    out: dict = {}
    for k, bucket, stage in graphs.stages:
        if k == kind:
            out.setdefault(bucket, set()).add(stage)
    return out


def _run_batched(model, jobs: dict, interleave: bool = False):
    """{lane: (prompt, depth, max_tokens)} joined on their lanes and stepped by one Batcher to
    their ends: (the batcher, {lane: the tokens after the prompt})."""
    from tinyloop.worker.generation.batcher import Batcher
    b = Batcher(model.runner, interleave=interleave)
    got = {}
    for lane, (p, L, n) in jobs.items():
        ids, _ = b.join(model.start(model.make_request(p, loops=L, max_tokens=n), lane))
        got[lane] = list(ids)
    while b:
        for lane, (ids, _) in b.step().items():
            got[lane].extend(ids)
    return b, got


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_graphs_and_triton_equal_torch_reference(pair, loops):
    """One decode graph per depth, replayed for every decode step of a stream."""
    fast, ref = pair
    graph = fast.runner.graphs.decode[loops]
    for p in PROMPTS:
        graph.next_position = -1
        assert fast.generate(p, loops=loops, max_tokens=24) == ref.generate(p, loops=loops, max_tokens=24)
        assert graph.next_position == len(p) + 23  # the last of its 23 decode steps replayed it


def test_graph_replay_counts_iterations(pair):
    fast, _ = pair
    before = fast.counters.snapshot()
    fast.generate(PROMPTS[0], loops=4, max_tokens=5)
    assert fast.counters.since(before).loop_iterations == 4 * 5  # prefill + 4 decode steps


def test_resume_and_sampling_on_gpu(pair):
    fast, ref = pair
    h = fast.build_resume_handle(PROMPTS[1], L_used=2, max_loops=16)
    assert fast.resume_generate(h, 6, max_tokens=16) == ref.generate(PROMPTS[1], loops=6, max_tokens=16)
    kw = dict(loops=5, max_tokens=16, temperature=0.9, seed=3)
    assert fast.generate(PROMPTS[0], **kw) == ref.generate(PROMPTS[0], **kw)


def test_speculative_replays_its_drafts_and_verifies(pair, monkeypatch):
    """Chain speculation drafts by replaying the decode graph at draft_loops (greedy and
    sampled alike: the runner replays every batch-1 step at a captured depth) and verifies by
    replaying the captured verify stages [draft_loops, verify_loops) and the coda of bucket 5
    (draft_ahead 4: chunks of 5): the tokens of plain generate at verify_loops, and the
    acceptance and loop work of the eager drafts and verify (the torch reference has no
    graphs)."""
    fast, ref = pair
    spec = dict(max_tokens=20, draft_loops=2, verify_loops=6, draft_ahead=4)
    graph = fast.runner.graphs.decode[2]
    run = fast.runner.tree(0, 5, 0, TreeStages.span(2, 6))
    assert run.graphed and run.ts.bucket == 5
    verify = run.ts  # the bucket's stage buffers: every chain verify of up to 5 tokens loads them
    calls = _replays(monkeypatch, fast.runner.graphs)
    for p, extra in ((PROMPTS[0], {}), (PROMPTS[1], {}), (PROMPTS[0], dict(temperature=0.8, seed=5))):
        graph.next_position = -1
        verify.prefix.zero_()
        calls.clear()
        a, b = fast.generate_speculative(p, **spec, **extra), ref.generate_speculative(p, **spec, **extra)
        assert a == b
        if not extra:
            assert a == ref.generate(p, loops=6, max_tokens=20)
            assert a.stats == b.stats
        assert graph.next_position > len(p) and verify.prefix.item() >= len(p)  # both replayed
        assert {c for c in calls if c[0] == "verify"} == {("verify", 5, s) for s in TreeStages.span(2, 6)}


def test_tree_speculation_replays_the_stages(pair, monkeypatch):
    """Tree rounds (K = 2, 3, 4 at draft_ahead 4: trees of 9, 13 and 17 nodes, buckets 9, 17
    and 17) replay the captured stages for every draft depth and the verify: the tokens of plain
    generate at verify_loops and the eager tree rounds' acceptance and loop work (the torch
    reference has no graphs), greedy and sampled."""
    fast, ref = pair
    calls = _replays(monkeypatch, fast.runner.graphs)
    for p in PROMPTS:
        for K, extra in ((2, {}), (4, {}), (3, dict(temperature=0.8, seed=5))):
            run = fast.runner.tree(0, 1 + 4 * K, 0, TreeStages.span(0, 6, prelude=True))
            assert run.graphed and run.ts.bucket == (9 if K == 2 else 17)
            stages = run.ts
            kw = dict(max_tokens=20, draft_loops=2, verify_loops=6, draft_ahead=4, K_branches=K, **extra)
            stages.prefix.zero_()
            calls.clear()
            a, b = fast.generate_tree_speculative(p, **kw), ref.generate_tree_speculative(p, **kw)
            assert a == b == ref.generate(p, loops=6, max_tokens=20, **extra)
            assert a.stats == b.stats
            assert stages.prefix.item() >= len(p)  # replayed
            # the drafts' prelude and iterations [0, 2), then the verify's [2, 6) and the coda, on
            # the smallest bucket holding the tree's 1 + K * 4 nodes
            bucket = 9 if K == 2 else 17
            assert {("verify", bucket, s) for s in TreeStages.span(0, 6, prelude=True)} <= set(calls)


def test_one_decode_graph_serves_every_lane(pair, monkeypatch):
    """The decode graph of a depth reads its cache lane from a buffer: the same graph replays
    every step of a stream on lane 1, then of one on lane 0, each the reference stream."""
    from tinyloop.worker.api import drain
    fast, ref = pair
    graph = fast.runner.graphs.decode[4]
    lanes = _lanes_replayed(monkeypatch, graph)
    want = ref.generate(PROMPTS[1], loops=4, max_tokens=16)
    for lane in (1, 0):
        lanes.clear()
        req = fast.make_request(PROMPTS[1], loops=4, max_tokens=16)
        assert drain(req.prompt, fast.stream(req, lane=lane)) == want, lane
        assert lanes == [lane] * 15 and int(graph.slot) == lane


def _decode(model, req, pipelined):
    from tinyloop.worker.api import drain
    from tinyloop.worker.generation.decode import decode_steps
    st = model.start(req)
    return drain(req.prompt, decode_steps(st, pipelined)), st


def test_pipelined_decode_equals_plain_on_gpu(pair):
    """Graph steps launched ahead of the host (the token on the host through the graph's
    pinned ring, or a pinned copy, and an event), dropped on a stop token: the same tokens,
    finish, stats and final position as the plain loop."""
    fast, _ = pair
    n = len(PROMPTS[1])
    for kw in (dict(loops=4), dict(loops=5, temperature=0.9, seed=3, repetition_penalty=1.2),
               dict(loops=3, cache_window=8)):
        req = fast.make_request(PROMPTS[1], max_tokens=16, **kw)
        plain, _ = _decode(fast, req, False)
        stop = fast.make_request(PROMPTS[1], max_tokens=16, stop_token_ids=[plain[n + 5]], **kw)
        for r in (req, stop):
            (a, sa), (b, sb) = _decode(fast, r, True), _decode(fast, r, False)
            assert a == b and (a.finish_reason, a.stats) == (b.finish_reason, b.stats), kw
            assert sa.pos == sb.pos and sa.logits is None and sb.logits is None, kw
        assert _decode(fast, stop, True)[0].finish_reason == "stop"


# -- prefill graphs (one per length bucket and stage, any lane) -------------------------------

def _prompt(T, seed=0):
    return torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def prefill_pair(tiny_path):
    """Decode graphs on both; prefill graphs (buckets 16..128) on the first only."""
    kw = dict(max_seq_len=256, device="cuda", n_slots=2)
    g = Model(tiny_path, dtype="float32", prefill_graph_len=128, **kw)
    e = Model(tiny_path, dtype="float32", prefill_graph_len=0, **kw)
    yield g, e
    g.close()
    e.close()


def test_prefill_graphs_are_captured_outside_the_counters(prefill_pair):
    """Every stage of every length bucket up to prefill_graph_len (none at 0), for any lane;
    a Model fresh from its capture (64 lanes by default on CUDA) has counted no work."""
    g, e = prefill_pair
    pre = _captured(g.runner.graphs, "prefill")
    assert sorted(pre) == [16, 32, 64, 128] and not _captured(e.runner.graphs, "prefill")
    assert all(stages == set(PaddedPrefill.stages(g.config.max_loops)) for stages in pre.values())
    fresh = Model(g.path, max_seq_len=64, device="cuda", dtype="float32")
    try:
        assert fresh.n_slots == 64 and len(fresh.runner.graphs) == fresh.startup["graphs"] > 0
        assert (fresh.counters.loop_iterations, fresh.counters.loop_token_iterations) == (0, 0)
    finally:
        fresh.close()


@pytest.mark.parametrize("loops", [1, 4, 8])
def test_graph_prefill_equals_eager_prefill(prefill_pair, loops, monkeypatch):
    """A prompt replays the stages of the smallest bucket that holds it, on either lane (past
    the largest bucket: eager), counts its own tokens' work, not the pads', and gives the
    eager prefill's logits."""
    g, e = prefill_pair
    calls = _replays(monkeypatch, g.runner.graphs)
    for T in (1, 15, 16, 17, 64, 100, 128, 129, 200):
        toks = _prompt(T, T)
        bucket = next((b for b in (16, 32, 64, 128) if b >= T), None)
        for lane in (0, 1):
            calls.clear()
            before = g.counters.snapshot()
            got = g.runner.prefill(lane, toks, loops).logits
            assert g.counters.since(before).loop_token_iterations == loops * T  # the prompt's work
            assert calls == ([("prefill", bucket, s) for s in PaddedPrefill.stages(loops)] if bucket else []), T
            want = e.runner.prefill(lane, toks, loops).logits
            assert ((got - want).norm() / want.norm()) < 1e-3, (T, lane)


def test_graph_prefill_in_bf16(tiny_path):
    """bf16 graph prefill against the bf16 eager prefill, both measured from the fp32 one."""
    kw = dict(max_seq_len=128, device="cuda", n_slots=1)
    with Model(tiny_path, dtype="bfloat16", prefill_graph_len=128, **kw) as g, \
            Model(tiny_path, dtype="bfloat16", prefill_graph_len=0, **kw) as e, \
            Model(tiny_path, dtype="float32", cuda_graphs=False, **kw) as ref:
        for T in (5, 16, 40, 128):
            toks = _prompt(T, T)
            want = ref.runner.prefill(0, toks, 3).logits
            err = [((m.runner.prefill(0, toks, 3).logits - want).norm() / want.norm()).item() for m in (g, e)]
            assert err[0] < max(2e-2, 2 * err[1]), (T, err)


def test_generate_with_and_without_prefill_graphs(prefill_pair):
    """Greedy and seeded-sampled streams, stop tokens, lane 1, batches, speculative and resume
    after a graph prefill: the same tokens as with the eager prefill."""
    from tinyloop.worker.api import drain
    g, e = prefill_pair
    for T in (5, 16, 17, 90):
        p = _prompt(T, 7 + T)
        for kw in (dict(loops=4), dict(loops=8, temperature=0.9, top_k=40, seed=3, repetition_penalty=1.2)):
            a, b = g.generate(p, max_tokens=12, **kw), e.generate(p, max_tokens=12, **kw)
            assert a == b and (a.finish_reason, a.stats) == (b.finish_reason, b.stats), (T, kw)
            stop = [b[T + 4]]
            assert g.generate(p, max_tokens=12, stop_token_ids=stop, **kw) == e.generate(
                p, max_tokens=12, stop_token_ids=stop, **kw)
        req = g.make_request(p, loops=3, max_tokens=10)
        assert drain(p, g.stream(req, lane=1)) == e.generate(p, loops=3, max_tokens=10)
        h = g.build_resume_handle(p, L_used=2, max_loops=16)
        try:
            assert g.resume_generate(h, 6, max_tokens=10) == e.generate(p, loops=6, max_tokens=10)
        finally:
            g.free_resume_handle(h)
        spec = dict(max_tokens=10, draft_loops=2, verify_loops=5)
        assert g.generate_speculative(p, **spec) == e.generate_speculative(p, **spec)
        q = _prompt(3, T)
        assert g.generate_batch([p, q], per_lane_loops=[6, 2], max_tokens=8) == \
            e.generate_batch([p, q], per_lane_loops=[6, 2], max_tokens=8)


# -- batched decode graphs (one per lane-count bucket and stage, any lanes) --------------------
@pytest.fixture(scope="module")
def batch_pair(tiny_path):
    """Five lanes (buckets 2, 4, 5) on the graph engine; the torch reference beside it."""
    fast = Model(tiny_path, max_seq_len=128, device="cuda", dtype="float32", n_slots=5, prefill_graph_len=0)
    ref = Model(tiny_path, max_seq_len=128, device="cuda", dtype="float32", backend="torch", cuda_graphs=False)
    yield fast, ref
    fast.close()
    ref.close()


def test_batch_graphs_are_captured_at_load(batch_pair):
    fast = batch_pair[0]
    bg = _captured(fast.runner.graphs, "batch")
    assert sorted(bg) == batch_buckets(5) == [2, 4, 5]
    assert all(stages == set(BatchStep.stages(fast.config.max_loops)) for stages in bg.values())


def test_batcher_on_graphs_equals_reference(batch_pair, monkeypatch):
    """Streams at mixed depths on lanes 1, 2 and 4 (a hole at 3), finishing at different
    steps, replayed through the bucket graphs (3 streams: bucket 4, one row idle; then 2:
    bucket 2; then one alone: its decode graph): each stream's greedy tokens are its reference
    stream's."""
    fast, ref = batch_pair
    calls = _replays(monkeypatch, fast.runner.graphs)
    jobs = {1: (PROMPTS[0], 3, 12), 2: (PROMPTS[1], 8, 20), 4: ([9, 8, 7, 6], 5, 16)}
    b, got = _run_batched(fast, jobs)  # whole-token steps (interleaved: the next test)
    steps = [len(ids) - 1 for ids in got.values()]  # the first token comes from the prefill
    assert b.steps == max(steps) and b.lane_steps == sum(steps)
    assert {bucket for kind, bucket, _ in calls if kind == "batch"} == {4, 2}
    for lane, (p, L, n) in jobs.items():
        assert p + got[lane] == ref.generate(p, loops=L, max_tokens=n), lane


def test_interleaved_batcher_on_graphs_equals_reference(batch_pair, monkeypatch):
    """The same streams interleaved (every row at its own iteration, `Runner.interleave`) through
    the interleaved stage graphs of buckets 4 and 2: each stream's greedy tokens and stats are its
    reference stream's; the depth-3 stream decodes ahead of the depth-8 one."""
    from tinyloop.worker.generation.batcher import Batcher
    fast, ref = batch_pair
    assert sorted(_captured(fast.runner.graphs, "interleaved")) == [2, 4, 5]
    calls = _replays(monkeypatch, fast.runner.graphs)
    b = Batcher(fast.runner)
    jobs = {1: (PROMPTS[0], 3, 12), 2: (PROMPTS[1], 8, 20), 4: ([9, 8, 7, 6], 5, 16)}
    got, finishes, order = {}, {}, []
    for lane, (p, L, n) in jobs.items():
        ids, finish = b.join(fast.start(fast.make_request(p, loops=L, max_tokens=n), lane))
        got[lane] = list(ids)
    # lanes 0 and 3 hold K/V that no row of the passes (idle rows included) may touch
    cache, held = fast.runner.cache, [0, 3]
    cache.k[:, held] = torch.randn_like(cache.k[:, held])
    cache.v[:, held] = torch.randn_like(cache.v[:, held])
    before = cache.k[:, held].clone(), cache.v[:, held].clone()
    while b:
        for lane, (ids, finish) in b.step().items():
            got[lane].extend(ids)
            order.append(lane)
            if finish is not None:
                finishes[lane] = finish
    assert {bucket for kind, bucket, _ in calls if kind == "interleaved"} >= {4}
    assert order.index(2) > 1  # lane 1 (depth 3) and lane 4 (depth 5) had tokens before lane 2 (depth 8)
    assert torch.equal(cache.k[:, held], before[0]) and torch.equal(cache.v[:, held], before[1])
    for lane, (p, L, n) in jobs.items():
        want = ref.generate(p, loops=L, max_tokens=n)
        assert p + got[lane] == want, lane
        assert finishes[lane].stats["loop_iterations"] == want.stats["loop_iterations"], lane


def test_a_speculative_stream_handed_to_the_batcher_on_graphs(batch_pair, monkeypatch):
    """A greedy speculative stream on lane 1 runs two rounds (its draft decode graph, the
    verify), is handed over between rounds and goes on in the batcher beside a plain stream on
    lane 2 (the bucket-2 graphs), then alone (its decode graph at verify_loops): its tokens are
    the reference's generate at verify_loops, the plain stream's its own."""
    from tinyloop.worker.generation.batcher import Batcher
    fast, ref = batch_pair
    calls = _replays(monkeypatch, fast.runner.graphs)
    spec = dict(draft_loops=2, verify_loops=6, draft_ahead=3)
    p, n = PROMPTS[1], 20
    gen = fast.stream(fast.make_request(p, max_tokens=n, speculative=spec), 1)
    got = next(gen) + next(gen) + next(gen)
    b = Batcher(fast.runner)
    b.add(gen.handoff())
    plain = list(b.join(fast.start(fast.make_request(PROMPTS[0], loops=3, max_tokens=8), 2))[0])
    finishes = {}
    while b:
        for lane, (ids, finish) in b.step().items():
            (got if lane == 1 else plain).extend(ids)
            if finish is not None:
                finishes[lane] = finish
    # the two streams run at depths 6 and 3: interleaved launches of bucket 2
    assert {bucket for kind, bucket, _ in calls if kind in ("batch", "interleaved")} == {2}
    assert p + got == ref.generate(p, loops=6, max_tokens=n)
    assert PROMPTS[0] + plain == ref.generate(PROMPTS[0], loops=3, max_tokens=8)
    assert finishes[1].stats["verify_steps"] == 2 and finishes[1].stats["completion_tokens"] == n


def test_checked_streams_batched_on_gpu_equal_reference(batch_pair):
    """Streams with the safety check and windows batched on the CUDA engine (one eager step per
    window, rows at their own depths and positions, L scheduling's warm-up on one), beside a
    plain stream on the graphs: each one's greedy tokens and finish are the torch reference's
    generate; a threshold under the prompt's norm stops a stream with no token there too."""
    from tinyloop.worker.generation.batcher import Batcher
    fast, ref = batch_pair
    jobs = {
        0: (PROMPTS[0], dict(loops=3, max_tokens=14, safety_check=True, safety_norm_threshold=1e9)),
        1: (PROMPTS[1], dict(loops=6, max_tokens=18, cache_window=6)),
        2: ([9, 8, 7, 6], dict(loops=5, max_tokens=16, cache_window=6, safety_check=True, safety_norm_threshold=1e9,
                               l_warmup_tokens=3, l_warmup_L=2)),
        3: ([4, 4, 2], dict(loops=2, max_tokens=10, safety_check=True, safety_norm_threshold=1e-6)),
        4: ([7, 1], dict(loops=4, max_tokens=12)),
    }
    b = Batcher(fast.runner)
    got, finishes = {}, {}
    for lane, (p, kw) in jobs.items():
        ids, finish = b.join(fast.start(fast.make_request(p, **kw), lane))
        got[lane] = list(ids)
        if finish is not None:
            finishes[lane] = finish
    assert sorted(b.checked) == [0, 1, 2] and sorted(b.states) == [4]
    while b:
        for lane, (ids, finish) in b.step().items():
            got[lane].extend(ids)
            if finish is not None:
                finishes[lane] = finish
    assert b.lane_steps > b.steps  # rows shared steps
    for lane, (p, kw) in jobs.items():
        want = ref.generate(p, **kw)
        assert p + got[lane] == want, lane
        assert finishes[lane].reason == want.finish_reason, lane
    assert finishes[3].reason == "safety" and got[3] == []


def test_speculative_rounds_shared_on_gpu_equal_reference(batch_pair):
    """Three chain speculative streams (other draft and verify depths, one sampled) stepped
    together in a SpecBatch on the CUDA engine (draft steps on the batched graphs, verifies in
    one eager pass): each one's tokens are the torch reference's run alone (greedy: generate at
    verify_loops), its usage its own."""
    from tinyloop.worker.generation.spec_batch import SpecBatch
    fast, ref = batch_pair
    jobs = {1: (PROMPTS[0], dict(max_tokens=20), dict(draft_loops=2, verify_loops=6, draft_ahead=3)),
            2: (PROMPTS[1], dict(max_tokens=16), dict(draft_loops=1, verify_loops=4, draft_ahead=2)),
            4: ([9, 8, 7, 6], dict(max_tokens=18, temperature=0.8, seed=7),
                dict(draft_loops=2, verify_loops=5, draft_ahead=3))}
    sb, got, finishes = SpecBatch(fast.runner), {}, {}
    for lane, (p, kw, spec) in jobs.items():
        gen = fast.stream(fast.make_request(p, speculative=spec, **kw), lane)
        got[lane] = next(gen)
        sb.add(gen)
    while sb:
        for lane, update in sb.step().items():
            assert not isinstance(update, Exception), update
            ids, finish = update
            got[lane].extend(ids)
            if finish is not None:
                finishes[lane] = finish
    for lane, (p, kw, spec) in jobs.items():
        want = ref.generate_speculative(p, **kw, **spec)
        assert p + got[lane] == want, lane
        assert finishes[lane].stats["verify_steps"] == want.stats["verify_steps"], lane
    assert PROMPTS[0] + got[1] == ref.generate(PROMPTS[0], loops=6, max_tokens=20)


def test_generate_batch_on_graphs_equals_reference(batch_pair):
    fast, ref = batch_pair
    prompts = [PROMPTS[1], PROMPTS[0], [4, 4, 2], [7]]
    loops = [8, 6, 2, 1]
    kw = dict(max_tokens=14, temperature=0.9, seed=5, top_k=30)
    got = fast.generate_batch(prompts, per_lane_loops=loops, **kw)
    assert got == [ref.generate(p, loops=L, **kw) for p, L in zip(prompts, loops)]


def test_idle_lanes_keep_their_cache_on_gpu(batch_pair, monkeypatch):
    """Replayed idle rows write and read nothing: lanes 0 and 3 hold random K/V that streams
    on lanes 1, 2 and 4 step beside without changing them, through bucket 4 (its idle row:
    slot 0 at position max_seq_len), then bucket 2, then the decode graph; the streams are
    their reference streams."""
    from tinyloop.worker.generation.batcher import Batcher
    fast, ref = batch_pair
    cache = fast.runner.cache
    calls = _replays(monkeypatch, fast.runner.graphs)
    b = Batcher(fast.runner)
    jobs = {1: 6, 2: 4, 4: 8}
    got = {}
    for lane, n in jobs.items():
        ids, _ = b.join(fast.start(fast.make_request(PROMPTS[0], loops=4, max_tokens=n), lane))
        got[lane] = list(ids)
    held = [0, 3]
    cache.k[:, held] = torch.randn_like(cache.k[:, held])
    cache.v[:, held] = torch.randn_like(cache.v[:, held])
    before = cache.k[:, held].clone(), cache.v[:, held].clone()
    while b:
        for lane, (ids, _) in b.step().items():
            got[lane].extend(ids)
    assert {bucket for kind, bucket, _ in calls if kind == "batch"} == {4, 2}
    assert torch.equal(cache.k[:, held], before[0]) and torch.equal(cache.v[:, held], before[1])
    for lane, n in jobs.items():
        assert PROMPTS[0] + got[lane] == ref.generate(PROMPTS[0], loops=4, max_tokens=n), lane


def test_the_decode_loop_never_waits_for_the_gpu(pair):
    """Starting a stream and each step's host calls but the token read (sample, the copy to
    the host, the step launched ahead, accept) only queue work: behind a long kernel, the
    stream is still busy after all of them. One hidden sync (a pageable host-to-device copy,
    `t[i] = True` on a device tensor) serialises the host with every step (on the H200 it
    cost 0.48 ms of host time per token, the whole step)."""
    fast, _ = pair
    stream = torch.cuda.current_stream()
    # the sampler's graph for this parameter shape is captured on its first use (one sync, once)
    fast.generate(PROMPTS[1], loops=4, max_tokens=3, repetition_penalty=1.3)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning: far longer than anything below
    st = fast.start(fast.make_request(PROMPTS[1], loops=4, max_tokens=8, repetition_penalty=1.3))
    st.copy_to_host(st.sample())
    st.speculate()
    st.accept(5)
    assert not stream.query(), "a host call waited for the GPU"
    torch.cuda.synchronize()


def test_graph_count_does_not_depend_on_the_lanes(tiny_path, pair, monkeypatch):
    """Cache slots are device inputs, so no graph belongs to a lane: a model of 2 lanes and one
    of 8 capture the same decode (one per depth), prefill and verify graphs (one per bucket and
    stage); only the batch buckets grow, one per power of two up to the lane count (each with
    its stages and the greedy tokens' stage). One decode
    graph serves two streams on lanes 3 and 5 interleaved step by step (every replay reloads
    the lane and the position), greedy and sampled, each its stream alone and the reference."""
    from tinyloop.worker.generation.decode import decode_steps
    _, ref = pair
    counts = {}
    for n in (2, 8):
        m = Model(tiny_path, max_seq_len=64, device="cuda", dtype="float32", n_slots=n, prefill_graph_len=32)
        try:
            g, L = m.runner.graphs, m.config.max_loops
            kinds = {kind: _captured(g, kind) for kind in ("prefill", "verify", "batch")}
            assert sorted(g.decode) == list(range(1, L + 1))
            assert sorted(kinds["prefill"]) == [16, 32] and sorted(kinds["verify"]) == [5, 9, 17]
            assert sorted(kinds["batch"]) == batch_buckets(n) == ([2] if n == 2 else [2, 4, 8])
            # prelude, each iteration, coda: alike for every kind; a batched step's greedy tokens after
            every = {kind: set((BatchStep if kind == "batch" else PaddedPrefill).stages(L)) for kind in kinds}
            assert all(stages == every[kind] for kind, k in kinds.items() for stages in k.values())
            assert m.startup["graphs"] == len(g) == len(g.decode) + len(g.stages)
            counts[n] = [len(g.decode)] + [sum(map(len, kinds[k].values())) for k in ("prefill", "verify", "batch")]
            if n == 8:
                lanes = _lanes_replayed(monkeypatch, g.decode[4])
                jobs = {3: (PROMPTS[1], {}), 5: (PROMPTS[0], dict(temperature=0.9, seed=3))}
                gens, got = {}, {}
                for lane, (p, extra) in jobs.items():
                    gens[lane] = decode_steps(m.start(m.make_request(p, loops=4, max_tokens=12, **extra), lane))
                    got[lane] = list(p)
                while gens:
                    for lane in list(gens):
                        try:
                            got[lane].extend(next(gens[lane]))
                        except StopIteration:
                            del gens[lane]
                assert lanes == [3, 5] * 11  # 11 decode steps each, alternating on the one graph
                for lane, (p, extra) in jobs.items():
                    assert got[lane] == m.generate(p, loops=4, max_tokens=12, **extra) == \
                        ref.generate(p, loops=4, max_tokens=12, **extra), lane
        finally:
            m.close()
    stages = len(PaddedPrefill.stages(L))  # prelude, L iterations, coda
    assert counts[2][:3] == counts[8][:3] == [L, 2 * stages, 3 * stages]
    batch = len(BatchStep.stages(L))  # and the greedy tokens' stage after the coda
    assert (counts[2][3], counts[8][3]) == (batch, 3 * batch)


def test_close_frees_the_graphs_without_a_collection(tiny_path):
    """Closing a model drops its runner, engine and graphs at once, after it served streams and
    a batch, with the collector off: nothing refers back to the runner (left to the collector,
    graphs could go during another model's capture)."""
    import gc
    import weakref
    gc.disable()
    try:
        m = Model(tiny_path, max_seq_len=64, device="cuda", dtype="float32", n_slots=2, prefill_graph_len=16)
        m.generate(PROMPTS[0], loops=4, max_tokens=4)
        m.generate_batch(PROMPTS, per_lane_loops=[4, 2], max_tokens=4)
        r = m.runner
        refs = [weakref.ref(x) for x in (r, r.engine, r.graphs, r.graphs.decode[4])]
        del r
        m.close()
        assert [r() for r in refs] == [None] * 4
    finally:
        gc.enable()


def test_two_processes_give_bitwise_equal_logits(tmp_path):
    """Every projection runs a fixed tile (kernels/gemv.py TILES, else its default; the
    autotuner only with Settings.autotune, TINYLOOP_AUTOTUNE=1), so two worker processes of the embedded default
    model (bf16) give bitwise-equal logits and tokens: replicas round near ties alike."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from tinyloop.worker import Model\n"
            "m = Model(None, max_seq_len=256, device='cuda', n_slots=1)\n"
            "prompt = list(range(3, 200, 3))\n"
            "logits = m.runner.prefill(0, prompt, 8).logits\n"
            "g = m.generate(prompt, loops=8, max_tokens=24)\n"
            "torch.save({'logits': logits.cpu(), 'tokens': list(g)}, sys.argv[1])\n")
    outs = []
    for i in range(2):
        path = tmp_path / f"run{i}.pt"
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(torch.load(path))
    assert torch.equal(outs[0]["logits"], outs[1]["logits"]) and outs[0]["tokens"] == outs[1]["tokens"]


def test_startup_records_the_capture(pair):
    """Model.startup (what the worker logs and reports in its info): the load and each part of
    the capture timed, the graph count equal to the graphs held, the graph pool's bytes and
    the lanes."""
    fast, ref = pair
    s, g = fast.startup, fast.runner.graphs
    assert s["graphs"] == len(g) == len(g.decode) + len(g.stages) > 0
    assert all(s[k] > 0 for k in ("load_s", "decode_graphs_s", "prefill_graphs_s", "verify_graphs_s", "batch_graphs_s"))
    assert s["graph_bytes"] > 0 and s["lanes"] == 2
    assert ref.startup["graphs"] == 0 and ref.startup["load_s"] > 0


def test_prompts_prefilled_together_equal_their_own_prefills_on_gpu(pair):
    # Runner.prefill_many (one padded pass, Triton ops, fp32) against each prompt's own
    # prefill on the same model: the same last logits, and the next greedy step's from each lane.
    fast, _ = pair
    prompts, depths = [PROMPTS[1], PROMPTS[0]], [2, 5]
    r = fast.runner
    together = r.prefill_many([0, 1], prompts, depths)
    for lane, (prompt, L) in enumerate(zip(prompts, depths)):
        alone = r.prefill(lane, prompt, L)
        assert torch.allclose(together[lane].logits, alone.logits, rtol=1e-4, atol=1e-4), lane


def test_a_captured_call_keeps_what_it_closes_over(tiny_path):
    """Graphs.capture_call keeps the closure alive with the graph: a replay reads the tensors
    it closes over (here an index table made for the capture alone), and freed memory would
    go to the next allocations."""
    with Model(tiny_path, max_seq_len=64, device="cuda", dtype="float32", n_slots=1) as m:
        out = torch.zeros(4, device="cuda")

        def make():
            idx = torch.tensor([3, 2, 1, 0], device="cuda")
            src = torch.arange(4.0, device="cuda")
            return lambda: out.copy_(src.index_select(0, idx))
        graph = m.runner.graphs.capture_call(make())
        junk = [torch.full((4,), 99, dtype=torch.long, device="cuda") for _ in range(256)]  # noqa: F841
        out.zero_()
        graph.replay()
        assert out.tolist() == [3.0, 2.0, 1.0, 0.0]


def test_a_batched_step_fuses_on_a_thread_that_never_ran_a_matmul(tiny_path):
    """A worker steps its batches on a thread of its own, not the one that loaded the model and
    captured its stages: the first fused capture of a batched step past Settings.fused_rows
    (projections through cuBLAS) is that thread's first matmul. It fuses (no failed capture)
    and its streams equal the reference's."""
    import threading

    from tinyloop.worker.model.settings import Settings
    fast = Model(tiny_path, max_seq_len=128, device="cuda", dtype="float32", n_slots=4,
                 settings=Settings(fused_rows=2))  # prompts prefill by replays: no matmul of the thread's own
    ref = Model(tiny_path, max_seq_len=128, device="cuda", dtype="float32", backend="torch", cuda_graphs=False)
    jobs = {0: (PROMPTS[0], 4, 24), 1: (PROMPTS[1], 4, 24), 2: ([9, 8, 7, 6], 4, 24)}
    got, failed = {}, []

    def serve():
        try:
            got.update(_run_batched(fast, jobs)[1])
        except BaseException as e:  # the test thread asserts on it
            failed.append(e)
    try:
        t = threading.Thread(target=serve)
        t.start()
        t.join(120)
        assert not failed, failed
        graphs = fast.runner.graphs
        assert graphs.capture_failures == 0
        assert [key[:2] for key in graphs.fused] == [("batch", 4)]
        for lane, (p, L, n) in jobs.items():
            assert p + got[lane] == ref.generate(p, loops=L, max_tokens=n), lane
    finally:
        fast.close()
        ref.close()
