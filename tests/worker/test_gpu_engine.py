"""The CUDA path (Triton ops + captured decode graphs) against the torch reference path.
Run on a GPU host: `pytest -m gpu tests/worker/test_gpu_engine.py`."""
import pytest
import torch

from tinyloop.worker import Model

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


@pytest.mark.parametrize("loops", [1, 3, 8])
def test_graphs_and_triton_equal_torch_reference(pair, loops):
    fast, ref = pair
    assert fast.engine.graphs.get(loops) is not None
    for p in PROMPTS:
        assert fast.generate(p, loops=loops, max_tokens=24) == ref.generate(p, loops=loops, max_tokens=24)


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


def test_speculative_replays_its_drafts_and_verifies(pair):
    """Greedy chain speculation drafts by replaying the decode graph at draft_loops and
    verifies by replaying the captured verify stages: the tokens of plain generate at
    verify_loops, and the acceptance and loop work of the eager drafts and verify (the torch
    reference has no graphs); sampled speculation drafts eagerly and verifies by replay."""
    fast, ref = pair
    spec = dict(max_tokens=20, draft_loops=2, verify_loops=6, draft_ahead=4)
    graph = fast.engine.graphs.get(2, 0)
    verify = fast.engine.graphs.verify.chunks[(0, 5)]  # draft_ahead 4: chunks of 5
    for p in PROMPTS:
        graph.next_position = -1
        verify.prefix.zero_()
        a, b = fast.generate_speculative(p, **spec), ref.generate_speculative(p, **spec)
        assert a == b == ref.generate(p, loops=6, max_tokens=20)
        assert a.stats == b.stats
        assert graph.next_position > len(p) and verify.prefix.item() >= len(p)  # both replayed
    graph.next_position = -1
    verify.prefix.zero_()
    kw = dict(spec, temperature=0.8, seed=5)
    assert fast.generate_speculative(PROMPTS[0], **kw) == ref.generate_speculative(PROMPTS[0], **kw)
    assert graph.next_position == -1 and verify.prefix.item() >= len(PROMPTS[0])


def test_tree_speculation_replays_the_stages(pair):
    """Tree rounds (K = 2, 4 at draft_ahead 4: trees of 9 and 17 nodes, bucket 17) replay the
    captured stages for every draft depth and the verify: the tokens of plain generate at
    verify_loops and the eager tree rounds' acceptance and loop work (the torch reference has
    no graphs), greedy and sampled."""
    fast, ref = pair
    stages = fast.engine.graphs.verify.chunks[(0, 17)]
    for p in PROMPTS:
        for K, extra in ((2, {}), (4, {}), (3, dict(temperature=0.8, seed=5))):
            kw = dict(max_tokens=20, draft_loops=2, verify_loops=6, draft_ahead=4, K_branches=K, **extra)
            stages.prefix.zero_()
            a, b = fast.generate_tree_speculative(p, **kw), ref.generate_tree_speculative(p, **kw)
            assert a == b == ref.generate(p, loops=6, max_tokens=20, **extra)
            assert a.stats == b.stats
            assert stages.prefix.item() >= len(p)  # replayed


def test_every_lane_replays_its_own_graph(pair):
    from tinyloop.worker.api import drain
    fast, ref = pair
    assert fast.engine.graphs.get(4, 1) is not None
    req = fast.make_request(PROMPTS[1], loops=4, max_tokens=16)
    assert drain(req.prompt, fast.stream(req, lane=1)) == ref.generate(PROMPTS[1], loops=4, max_tokens=16)


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


# -- prefill graphs (one per lane, length bucket and stage) ----------------------------------

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
    g, e = prefill_pair
    pg = g.engine.graphs.prefill
    assert pg.buckets == [16, 32, 64, 128] and not e.engine.graphs.prefill.graphs
    assert all((lane, b, s) in pg.graphs and pg.graphs[(lane, b, s)] is not None
               for lane in (0, 1) for b in pg.buckets for s in ("prelude", 0, g.config.max_loops - 1, "coda"))
    fresh = Model(g.path, max_seq_len=64, device="cuda", dtype="float32")
    try:
        assert (fresh.counters.loop_iterations, fresh.counters.loop_token_iterations) == (0, 0)
    finally:
        fresh.close()


@pytest.mark.parametrize("loops", [1, 4, 8])
def test_graph_prefill_equals_eager_prefill(prefill_pair, loops):
    from tinyloop.worker.generation.decode import prefill
    g, e = prefill_pair
    for T in (1, 15, 16, 17, 64, 100, 128, 129, 200):
        toks = _prompt(T, T)
        for lane in (0, 1):
            before = g.counters.snapshot()
            got, _ = prefill(g.engine, lane, toks, loops, 0)
            assert g.counters.since(before).loop_token_iterations == loops * T  # the prompt's work
            want, _ = prefill(e.engine, lane, toks, loops, 0)
            assert ((got - want).norm() / want.norm()) < 1e-3, (T, lane)
    assert g.engine.graphs.prefill.run(0, _prompt(129), 4) is None  # past the largest bucket: eager


def test_graph_prefill_in_bf16(tiny_path):
    """bf16 graph prefill against the bf16 eager prefill, both measured from the fp32 one."""
    from tinyloop.worker.generation.decode import prefill
    kw = dict(max_seq_len=128, device="cuda", n_slots=1)
    with Model(tiny_path, dtype="bfloat16", prefill_graph_len=128, **kw) as g, \
            Model(tiny_path, dtype="bfloat16", prefill_graph_len=0, **kw) as e, \
            Model(tiny_path, dtype="float32", cuda_graphs=False, **kw) as ref:
        for T in (5, 16, 40, 128):
            toks = _prompt(T, T)
            want = prefill(ref.engine, 0, toks, 3, 0)[0]
            err = [((prefill(m.engine, 0, toks, 3, 0)[0] - want).norm() / want.norm()).item() for m in (g, e)]
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


# -- batched decode graphs (one per lane-count bucket and stage) ------------------------------
@pytest.fixture(scope="module")
def batch_pair(tiny_path):
    """Five lanes (buckets 2, 4, 5) on the graph engine; the torch reference beside it."""
    fast = Model(tiny_path, max_seq_len=128, device="cuda", dtype="float32", n_slots=5, prefill_graph_len=0)
    ref = Model(tiny_path, max_seq_len=128, device="cuda", dtype="float32", backend="torch", cuda_graphs=False)
    yield fast, ref
    fast.close()
    ref.close()


def test_batch_graphs_are_captured_at_load(batch_pair):
    from tinyloop.worker.generation.decode import BatchStep
    bg = batch_pair[0].engine.graphs.batch
    L = batch_pair[0].config.max_loops
    assert bg.buckets == [2, 4, 5]
    assert all(bg.graphs.get((b, s)) is not None for b in bg.buckets for s in BatchStep.stages(L))


def test_batcher_on_graphs_equals_reference(batch_pair):
    """Streams at mixed depths on lanes 1, 2 and 4 (a hole at 3), joining and finishing at
    different steps, replayed through the bucket graphs: each stream's greedy tokens are its
    reference stream's; the logits match to fp32 GEMM rounding."""
    from tinyloop.worker.generation.batcher import Batcher
    fast, ref = batch_pair
    b = Batcher(fast.engine)
    jobs = {1: (PROMPTS[0], 3, 12), 2: (PROMPTS[1], 8, 20), 4: ([9, 8, 7, 6], 5, 16)}
    got = {}
    for lane, (p, L, n) in jobs.items():
        ids, finish = b.join(fast.start(fast.make_request(p, loops=L, max_tokens=n), lane))
        got[lane] = list(ids)
    while b:
        for lane, (ids, _) in b.step().items():
            got[lane].extend(ids)
    steps = [len(ids) - 1 for ids in got.values()]  # the first token comes from the prefill
    assert b.steps == max(steps) and b.lane_steps == sum(steps)
    for lane, (p, L, n) in jobs.items():
        assert p + got[lane] == ref.generate(p, loops=L, max_tokens=n), lane


def test_generate_batch_on_graphs_equals_reference(batch_pair):
    fast, ref = batch_pair
    prompts = [PROMPTS[1], PROMPTS[0], [4, 4, 2], [7]]
    loops = [8, 6, 2, 1]
    kw = dict(max_tokens=14, temperature=0.9, seed=5, top_k=30)
    got = fast.generate_batch(prompts, per_lane_loops=loops, **kw)
    assert got == [ref.generate(p, loops=L, **kw) for p, L in zip(prompts, loops)]


def test_idle_lanes_keep_their_cache_on_gpu(batch_pair):
    """Replayed idle lanes write and read nothing: lanes 0 and 3 hold random K/V that one
    stream on lane 4 and one on lane 1 step beside (bucket 5) without changing."""
    from tinyloop.worker.generation.batcher import Batcher
    fast, _ = batch_pair
    e = fast.engine
    b = Batcher(e)
    for lane in (1, 4):
        b.join(fast.start(fast.make_request(PROMPTS[0], loops=4, max_tokens=6), lane))
    held = [0, 2, 3]
    e.cache.k[:, held] = torch.randn_like(e.cache.k[:, held])
    before = e.cache.k[:, held].clone(), e.cache.v[:, held].clone()
    while b:
        b.step()
    assert torch.equal(e.cache.k[:, held], before[0]) and torch.equal(e.cache.v[:, held], before[1])


def test_the_decode_loop_never_waits_for_the_gpu(pair):
    """Starting a stream and each step's host calls but the token read (sample, the copy to
    the host, the step launched ahead, accept) only queue work: behind a long kernel, the
    stream is still busy after all of them. One hidden sync (a pageable host-to-device copy,
    `t[i] = True` on a device tensor) serialises the host with every step (on the H200 it
    cost 0.48 ms of host time per token, the whole step)."""
    fast, _ = pair
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning: far longer than anything below
    st = fast.start(fast.make_request(PROMPTS[1], loops=4, max_tokens=8, repetition_penalty=1.3))
    st.copy_to_host(st.sample())
    st.speculate()
    st.accept(5)
    assert not stream.query(), "a host call waited for the GPU"
    torch.cuda.synchronize()


def test_a_capture_runs_with_the_collector_paused(pair):
    """A collection inside a capture window can destroy another graph, which invalidates the
    capture (graphs._gc_paused): the captured function sees the collector off, and it is back
    on (as it was) afterwards; a capture that raises leaves it on too."""
    import gc

    from tinyloop.worker.runner.graphs import _capture
    fast, _ = pair
    e = fast.engine
    x = torch.zeros(4, device="cuda")
    seen = []
    g = _capture(e, e.graphs.pool, lambda: (seen.append(gc.isenabled()), x.add_(1)), warm=False)
    assert seen == [False] and gc.isenabled()
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4  # the capture itself runs nothing
    with pytest.raises(ZeroDivisionError):
        _capture(e, e.graphs.pool, lambda: (x.add_(1), 1 / 0), warm=False)
    assert gc.isenabled()


def test_close_frees_the_graphs_without_a_collection(tiny_path):
    """Closing a model drops its engine and graphs at once (graphs and engine refer to each
    other: left to the collector, they could go during another model's capture)."""
    import gc
    import weakref
    gc.disable()
    try:
        m = Model(tiny_path, max_seq_len=64, device="cuda", dtype="float32", n_slots=1, prefill_graph_len=0)
        refs = [weakref.ref(m.engine), weakref.ref(m.engine.graphs), weakref.ref(m.engine.graphs.get(4))]
        m.close()
        assert [r() for r in refs] == [None] * 3
    finally:
        gc.enable()


def test_two_processes_give_bitwise_equal_logits(tmp_path):
    """Every projection runs a fixed tile (kernels/gemv.py TILES, else its default; the
    autotuner only with TINYLOOP_AUTOTUNE=1), so two worker processes of the embedded default
    model (bf16) give bitwise-equal logits and tokens: replicas round near ties alike."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from tinyloop.worker import Model\n"
            "from tinyloop.worker.generation.decode import prefill\n"
            "m = Model(None, max_seq_len=256, device='cuda', n_slots=1)\n"
            "prompt = list(range(3, 200, 3))\n"
            "logits, _ = prefill(m.engine, 0, prompt, 8, 0)\n"
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
    the capture timed, and the graph count equal to the graphs held."""
    fast, ref = pair
    s, g = fast.startup, fast.engine.graphs
    assert s["graphs"] == len(g.graphs) + len(g.prefill.graphs) + len(g.verify.graphs) + len(g.batch.graphs) > 0
    assert all(s[k] > 0 for k in ("load_s", "decode_graphs_s", "prefill_graphs_s", "verify_graphs_s", "batch_graphs_s"))
    assert ref.startup["graphs"] == 0 and ref.startup["load_s"] > 0
