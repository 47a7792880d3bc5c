"""Invariant 4: chain and tree self-speculative decoding under greedy equal
generate(loops=verify_loops); warm-start verification runs each token's iterations once;
rejected slots are never read; speculative sampling preserves the target distribution."""
import pytest
import torch

from stage_graphs import with_stage_graphs

from model_zoo import CONFIGS, damped_checkpoint
from tinyloop.kernels.tree_attention import ancestors_from_parents
from tinyloop.worker import Model
from tinyloop.worker.generation import speculative as spec_mod
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.decode import DecodeState, decode_steps
from tinyloop.worker.runner import sampler as sampler_mod
from tinyloop.worker.runner.sampler import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TOKEN, draw, uniform
from tinyloop.worker.runner.engine import Counters, Tree
from tinyloop.worker.runner.stages import TreeStages, ancestor_table, tree_layout

PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128], [250, 11]]
N_TOKENS = 14


# per config: partial acceptance and varied greedy output (without a prelude or coda a block
# damped to 0.03 leaves the embedding alone to decide, and the output repeats)
DAMP = {"no-prelude-no-coda": 0.1}


@pytest.fixture(scope="module", params=list(CONFIGS))
def spec_model(request, ckpt_dir):
    path = damped_checkpoint(ckpt_dir / f"damped-{request.param}.tinyloop", CONFIGS[request.param], 2,
                             DAMP.get(request.param, 0.03))
    with Model(path, max_seq_len=160, n_slots=2) as m:
        yield m


@pytest.fixture(scope="module")
def tiny_spec(ckpt_dir):
    path = damped_checkpoint(ckpt_dir / "damped-tiny.tinyloop", CONFIGS["gqa-prelude-coda"], 3, 0.03)
    with Model(path, max_seq_len=160) as m:
        yield m


@pytest.fixture(scope="module")
def staged_spec(tiny_spec):
    """tiny_spec's checkpoint with its tree rounds and chain verifies on the verify buckets'
    TreeStages (5 and 17 nodes, pads and all; what the GPU replays), depths 1..8; no decode
    graphs, eager prefill."""
    with Model(tiny_spec.path, max_seq_len=160) as m:
        with_stage_graphs(m, range(1, 9))
        yield m


def _want(m, prompt, Lv, n=N_TOKENS, **kw):
    return m.generate(prompt, loops=Lv, max_tokens=n, **kw)


# -- exactness ------------------------------------------------------------------------------
def test_chain_and_tree_equal_generate(spec_model):
    """Every config, several prompts, draft_ahead 1..8, K_branches 1..4."""
    m = spec_model
    runs = [(2, 6, 1, 1), (1, 5, 3, 2), (3, 8, 8, 4), (2, 7, 5, 3)]
    total = accepted = 0
    produced = set()
    for i, prompt in enumerate(PROMPTS):
        Ld, Lv, ahead, K = runs[i % len(runs)]
        want = _want(m, prompt, Lv)
        produced |= set(want[len(prompt):])
        chain = m.generate_speculative(prompt, max_tokens=N_TOKENS, draft_loops=Ld, verify_loops=Lv,
                                       draft_ahead=ahead)
        tree = m.generate_tree_speculative(prompt, max_tokens=N_TOKENS, draft_loops=Ld, verify_loops=Lv,
                                           draft_ahead=ahead + 1, K_branches=K)
        assert chain == want and tree == want
        assert chain.finish_reason == tree.finish_reason == want.finish_reason
        total += chain.stats["drafted_tokens"]
        accepted += chain.stats["accepted_tokens"]
    assert len(produced) > 3, "degenerate model: the test could not fail"
    assert 0 < accepted < total, "acceptance must be partial for the test to cover both branches"


@pytest.mark.parametrize("draft_ahead", range(1, 9))
def test_chain_every_draft_ahead(tiny_spec, draft_ahead):
    for prompt in PROMPTS[:2]:
        assert tiny_spec.generate_speculative(prompt, max_tokens=N_TOKENS, draft_loops=2, verify_loops=6,
                                              draft_ahead=draft_ahead) == _want(tiny_spec, prompt, 6)


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_tree_every_branch_count(tiny_spec, K):
    for prompt, ahead in zip(PROMPTS[:2], (2, 5)):
        out = tiny_spec.generate_tree_speculative(prompt, max_tokens=N_TOKENS, draft_loops=2, verify_loops=6,
                                                  draft_ahead=ahead, K_branches=K)
        assert out == _want(tiny_spec, prompt, 6)


def test_side_branches_get_accepted(tiny_spec):
    """The accepted path must sometimes run through a branch other than the first, so the
    move from node slots to linear slots is exercised (and then proved by exactness)."""
    seen = []
    real = spec_mod._move_path

    def spy(runner, lane, pos, path, loops):
        seen.append([n > d for d, n in enumerate(path, 1)])
        return real(runner, lane, pos, path, loops)

    spec_mod._move_path = spy
    try:
        for prompt in PROMPTS:
            out = tiny_spec.generate_tree_speculative(prompt, max_tokens=24, draft_loops=1, verify_loops=6,
                                                      draft_ahead=3, K_branches=4)
            assert out == _want(tiny_spec, prompt, 6, 24)
    finally:
        spec_mod._move_path = real
    assert any(any(moved) for moved in seen), "no side branch was ever accepted"


def test_max_tokens_and_stop_token_mid_draft(tiny_spec):
    m, prompt = tiny_spec, PROMPTS[0]
    full = _want(m, prompt, 6, 20)[len(prompt):]
    for n in (1, 2, 3, 7, 11):
        for out in (m.generate_speculative(prompt, max_tokens=n, draft_loops=2, verify_loops=6, draft_ahead=4),
                    m.generate_tree_speculative(prompt, max_tokens=n, draft_loops=2, verify_loops=6,
                                                draft_ahead=4, K_branches=2)):
            assert out == prompt + full[:n] and out.finish_reason == "length"
            assert out.stats["completion_tokens"] == n
    for i in (2, 5, 9):
        stop = full[i]
        cut = full.index(stop) + 1
        want = _want(m, prompt, 6, 20, stop_token_ids=[stop])
        assert want == prompt + full[:cut] and want.finish_reason == "stop"
        for out in (m.generate_speculative(prompt, max_tokens=20, draft_loops=2, verify_loops=6, draft_ahead=8,
                                           stop_token_ids=[stop]),
                    m.generate_tree_speculative(prompt, max_tokens=20, draft_loops=2, verify_loops=6,
                                                draft_ahead=8, K_branches=3, stop_token_ids=[stop])):
            assert out == want and out.finish_reason == "stop"


# -- warm start and rollback ----------------------------------------------------------------
@pytest.mark.parametrize("tree,staged", [(False, False), (True, False), (False, True), (True, True)])
def test_warm_start_runs_each_iteration_once(tiny_spec, staged_spec, tree, staged):
    """Each chunk token runs exactly verify_loops iterations in total (draft + verify), so the
    verifier never re-runs [0, draft_loops); and verify passes start at draft_loops. The
    counters (the stats) count what the engine ran, iteration by iteration, and on the verify
    buckets' stages (staged) the nodes, not the bucket's pads."""
    m, prompt, Ld, Lv, K = (staged_spec if staged else tiny_spec), PROMPTS[1], 2, 7, 3
    e = m.runner.engine
    calls = []
    real = e.run_loops

    def spy(x, p, start, stop, lane_loops=None, depth=None, out=None):
        calls.append((start, stop, x.shape[1]))
        return real(x, p, start, stop, lane_loops, depth, out)

    e.run_loops = spy
    try:
        if tree:
            out = m.generate_tree_speculative(prompt, max_tokens=N_TOKENS, draft_loops=Ld, verify_loops=Lv,
                                              draft_ahead=4, K_branches=K)
        else:
            out = m.generate_speculative(prompt, max_tokens=N_TOKENS, draft_loops=Ld, verify_loops=Lv,
                                         draft_ahead=4)
    finally:
        del e.run_loops
    s, T = out.stats, len(prompt)
    width = K if tree else 1   # tokens per drafted depth
    assert s["loop_token_iterations"] == Lv * (T + s["verify_steps"] + width * s["drafted_tokens"])
    assert s["loop_iterations"] == Lv + Ld * s["drafted_tokens"] + Lv * s["verify_steps"]
    assert calls[0] == (0, Lv, T)                         # prefill
    rounds = calls[1:]
    # the engine ran what the stats count: every draft step or stage below Ld, every verify
    # stage at or above it, none across
    assert sum(stop - start for start, stop, _ in rounds) == s["loop_iterations"] - Lv
    assert all(0 <= start < stop <= Ld or Ld <= start < stop <= Lv for start, stop, _ in rounds)
    # iteration i < Ld runs once per chunk token (chain) or tree depth (tree), i >= Ld once per verify
    for i in range(Lv):
        runs = sum(start <= i < stop for start, stop, _ in rounds)
        assert runs == (s["drafted_tokens"] + s["verify_steps"] if i < Ld else s["verify_steps"]), i
    if not tree and not staged:  # chain verifies of exactly the chunk: the engine's token work too
        assert sum((stop - start) * n for start, stop, n in calls) == s["loop_token_iterations"]
    if staged:
        assert any(kind == "verify" for kind, _, _ in m.runner.graphs.log)
    plain = _want(m, prompt, Lv)
    assert out == plain and s["loop_token_iterations"] >= plain.stats["loop_token_iterations"]


@pytest.mark.parametrize("tree,staged", [(False, False), (True, False), (False, True), (True, True)])
def test_rejected_slots_are_never_read(tiny_spec, staged_spec, tree, staged):
    """After every verify, poison every cache slot at or past the first undecided position in
    every layer (rejected drafts, side branches, stale nodes, and on the verify buckets'
    TreeStages the pads and the nodes a draft depth ran before they were drafted): the output
    must not change. K = 0 keeps a poisoned key in the softmax if read, V = 1e3 then dominates
    the output."""
    m, prompt = (staged_spec if staged else tiny_spec), PROMPTS[0]
    cache = m.runner.cache
    name = "_tree_round" if tree else "_chain_round"
    real = getattr(spec_mod, name)

    def run(margin):
        def poisoned(runner, lane, spec, chooser, t, pos, k, *rest):
            out = real(runner, lane, spec, chooser, t, pos, k, *rest)  # (tokens decided, ...)
            first = pos + len(out[0]) - margin  # pos + len(tokens): the next round's unfed token
            cache.k[:, lane, :, first:] = 0.0
            cache.v[:, lane, :, first:] = 1e3
            return out

        setattr(spec_mod, name, poisoned)
        try:
            kw = dict(max_tokens=16, draft_loops=2, verify_loops=6, draft_ahead=4)
            return (m.generate_tree_speculative(prompt, K_branches=3, **kw) if tree
                    else m.generate_speculative(prompt, **kw))
        finally:
            setattr(spec_mod, name, real)

    want = _want(m, prompt, 6, 16)
    if staged:
        m.runner.graphs.log.clear()
    assert run(0) == want
    if staged:  # the rounds ran on the buckets: 13 tree nodes in 17 (4 pads), chains in 5
        buckets = {b for kind, b, _ in m.runner.graphs.log if kind == "verify"}
        assert 17 in buckets and buckets <= {5, 9, 17} if tree else buckets == {5}
    assert run(2) != want, "poisoning a decided slot must show: the test could not fail"


# -- the tree mask ---------------------------------------------------------------------------
def test_tree_mask_of_a_chain_equals_the_causal_chunk(tiny_spec):
    """Engine level: a chunk verified through tree mode with chain parents gives the logits of
    the ordinary causal chunk pass; and K_branches=1 through the tree path equals the chain."""
    m, e = tiny_spec, tiny_spec.runner.engine
    prompt, chunk = PROMPTS[1], torch.tensor([[9, 250, 3, 77, 31]])
    T, n = len(prompt), chunk.shape[1]
    pos = torch.arange(T, T + n)[None]
    lane = torch.tensor([0])

    def logits(tree: bool):
        e.forward(torch.tensor([prompt]), e.make_pass(lane, torch.arange(T)[None], T), 6)
        p = e.make_pass(lane, pos, T + n)
        if tree:
            parents = torch.arange(-1, n - 1)[None]
            p.tree = Tree(pos, torch.tensor([T]), ancestors_from_parents(parents))
        return e.forward(chunk, p, 6, last_only=False)[0]

    a, b = logits(False), logits(True)
    assert ((a - b).norm(dim=-1) / a.norm(dim=-1)).max() < 1e-4
    for prompt in PROMPTS:
        kw = dict(max_tokens=N_TOKENS, draft_loops=2, verify_loops=6, draft_ahead=3)
        chain, tree = m.generate_speculative(prompt, **kw), m.generate_tree_speculative(prompt, K_branches=1, **kw)
        assert chain == tree
        assert {k: v for k, v in chain.stats.items()} == {k: v for k, v in tree.stats.items()}


@pytest.mark.parametrize("staged", [False, True])
def test_chain_verify_equals_the_causal_chunk(tiny_spec, staged_spec, staged):
    """runner.verify (a chain through the tree stages: on the verify buckets' stages, padded
    to the bucket, when staged; eager stages of exactly the chunk otherwise): a chunk of
    drafted residuals at any position gives the logits of the causal chunk pass over
    iterations [L_d, L_v) at every chunk position and counts the chunk's iterations, not the
    pads'. On the stages: one bucket's stage set serves two positions (it reads its position
    from the buffers `load_chain` sets), a chunk takes the smallest bucket that holds it, and
    a chunk whose bucket would pass the cache's end, or that no bucket holds, runs eagerly; a
    chunk past the cache's end is refused."""
    m = staged_spec if staged else tiny_spec
    r = m.runner
    e, S, V = r.engine, r.cache.max_seq_len, r.config.vocab_size
    Ld, Lv, lane = 2, 6, 1
    prompt = PROMPTS[1]
    T = len(prompt)
    r.prefill(lane, prompt, Lv)

    def drafts(chunk, pos):  # the chain round's draft steps: iterations [0, Ld) and their K/V
        return torch.cat([r.decode([lane], [t], [pos + i], [Ld]).residual.clone() for i, t in enumerate(chunk)], 1)

    x = None
    for pos, chunk, bucket in ((T, [9, 250, 3], 5), (T + 3, [77, 31, 4, 4, 120], 5),
                               (T + 8, [5, 6, 7, 8, 9, 10], 9), (T + 14, list(range(60, 70)), 17),
                               (S - 4, [1, 2, 3], None), (T + 24, list(range(40, 58)), None)):
        x = drafts(chunk, pos)
        n = len(chunk)
        if staged:
            r.graphs.log.clear()
        before = r.counters.snapshot()
        out = r.verify(lane, x, pos, Ld, Lv)
        got = out.logits.clone()
        work = r.counters.since(before)
        assert got.shape == (n, V)
        assert work == out.work == Counters(Lv - Ld, (Lv - Ld) * n)
        if staged:
            want_log = [] if bucket is None else [("verify", bucket, s) for s in TreeStages.span(Ld, Lv)]
            assert r.graphs.log == want_log, (pos, n)
        p = e.make_pass(torch.tensor([lane]), torch.arange(pos, pos + n)[None], pos + n)
        want = e.logits(e.coda(e.run_loops(x.clone(), p, Ld, Lv), p))[0]
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-4, pos
    before = r.counters.snapshot()
    with pytest.raises(ValueError, match="passes the cache"):
        r.verify(lane, x[:, :3], S - 2, Ld, Lv)
    assert r.counters.since(before) == Counters()


def test_tree_rounds_on_the_stages_equal_the_eager_rounds(tiny_spec, staged_spec, monkeypatch):
    """Tree rounds on the verify buckets' TreeStages (what the GPU replays; eager here): each
    draft depth runs the whole bucket, pads and undrafted nodes included, and the verify
    continues from the last depth's residuals. Tokens, acceptance and loop counters equal the
    rounds on eager stages of exactly the tree's nodes, greedy and sampled, for trees of
    several shapes (the last rounds' shorter trees too); a tree past the largest bucket
    (4 x 5 + 1 = 21 nodes) runs eagerly, the shorter trees of its last rounds on the stages."""
    ref, m = tiny_spec, staged_spec
    trees = []  # (nodes, replayed) per round on the staged model
    real = m.runner.tree

    def spy(lane, nodes, pos, stages=None):
        tr = real(lane, nodes, pos, stages)
        trees.append((nodes, tr.graphed))
        return tr

    monkeypatch.setattr(m.runner, "tree", spy)
    accepted = 0
    for prompt in PROMPTS:
        for sampled in ({}, dict(temperature=0.9, seed=11)):
            want = _want(ref, prompt, 6, **sampled)
            for K, k in ((2, 4), (3, 5), (1, 3), (4, 5)):
                kw = dict(max_tokens=N_TOKENS, draft_loops=2, verify_loops=6, draft_ahead=k, K_branches=K, **sampled)
                trees.clear()
                a, b = m.generate_tree_speculative(prompt, **kw), ref.generate_tree_speculative(prompt, **kw)
                assert a == b and a.stats == b.stats, (prompt, K, k, sampled)
                assert a == want
                staged = [nodes for nodes, graphed in trees if graphed]
                assert all(nodes <= 17 for nodes in staged)
                assert all(graphed for nodes, graphed in trees if nodes <= 17)
                rounds = a.stats["verify_steps"]
                assert len(trees) == rounds
                assert len(staged) == rounds if 1 + K * k <= 17 else len(staged) < rounds
                accepted += a.stats["accepted_tokens"]
    assert accepted > 20  # accepted paths moved their K / V: the walk ran past the root


@pytest.mark.parametrize("K, k", [(1, 4), (2, 3), (4, 2), (3, 5)])
def test_ancestor_table_is_the_bitmask_by_depth(K, k):
    """The batch-invariant tree read's table (each node's depth and its ancestors root first)
    names exactly the ancestors of the tree mask, in increasing depth."""
    parents, depths = tree_layout(K, k)
    width = K * k
    depth, anc = ancestor_table(parents, width)
    masks = ancestors_from_parents(parents[None])[0].tolist()
    assert depth.tolist() == depths.tolist()
    for u, m in enumerate(masks):
        chain = anc[u, :depth[u]].tolist()
        assert set(chain) | {u} == {b for b in range(len(masks)) if m >> b & 1}
        assert [int(depths[a]) for a in chain] == list(range(int(depth[u])))
        assert (anc[u, depth[u]:] == 0).all()


def test_tree_layout():
    parents, depths = tree_layout(3, 2)
    assert parents.tolist() == [-1, 0, 0, 0, 1, 2, 3]
    assert depths.tolist() == [0, 1, 1, 1, 2, 2, 2]
    parents, _ = tree_layout(1, 4)
    assert parents.tolist() == [-1, 0, 1, 2, 3]   # K = 1 is the chain


# -- sampling --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["overlap", "disjoint-support", "equal"])
def test_accept_or_resample_emits_p(case):
    """Draft d ~ q, then the accept / resample rule, over many positions of one seed: the
    emitted tokens follow p (chi-square, df = 5, far below the 0.1 % critical value 20.5)."""
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03], dtype=torch.float64)
    q = {"overlap": torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10]),
         "disjoint-support": torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.5]),
         "equal": p.clone()}[case].double()
    n = 120_000
    seed, pos = torch.full((n,), 1234), torch.arange(n)
    draft = draw(q.expand(n, -1), uniform(seed, pos, STREAM_TOKEN))
    accepted, tok = sampler_mod.accept_or_resample(p.expand(n, -1), q.expand(n, -1), draft,
                                                   uniform(seed, pos, STREAM_ACCEPT), uniform(seed, pos, STREAM_RESIDUAL))
    counts = torch.bincount(tok, minlength=6).double()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    assert chi2 < 20.5, (counts / n, chi2)
    expected_accept = torch.minimum(p, q).sum()   # Leviathan et al. 2023, eq. for alpha
    assert abs(accepted.double().mean() - expected_accept) < 0.01


@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_chain_verdict_is_the_position_by_position_rule(k):
    """The round's decision in one device call equals speculative sampling taken one position
    at a time (accept draft i with its STREAM_ACCEPT number, else emit its STREAM_RESIDUAL draw
    and stop; the bonus STREAM_TOKEN draw from p_k after a whole chunk), over many chunks."""
    g = torch.Generator().manual_seed(k)
    V, stops = 11, set()
    for trial in range(60):
        p = torch.softmax(torch.randn(k + 1, V, generator=g) * 2, -1)
        q = torch.softmax(p[:k].log() + torch.randn(k, V, generator=g) * (trial % 3) * 0.7, -1)
        seed, pos = torch.tensor([trial * 7919]), 100 + trial
        positions = torch.arange(pos + 1, pos + k + 2)
        drafts = draw(q, uniform(seed.expand(k), positions[:k], STREAM_TOKEN)) if k else torch.zeros(0, dtype=torch.long)
        want = []
        for i in range(k):
            ok, tok = sampler_mod.accept_or_resample(p[i:i + 1], q[i:i + 1], drafts[i:i + 1],
                                                     uniform(seed, positions[i:i + 1], STREAM_ACCEPT),
                                                     uniform(seed, positions[i:i + 1], STREAM_RESIDUAL))
            want.append(int(tok))
            if not ok:
                break
        else:
            want.append(int(draw(p[k:], uniform(seed, positions[k:], STREAM_TOKEN))))
        n, targets = sampler_mod.chain_verdict(p, q, drafts, seed, positions)
        assert int(n) == len(want) - 1 and targets[:int(n) + 1].tolist() == want
        stops.add(int(n))
    assert len(stops) > 1 or k == 0, "the chunks must stop at different drafts"


def test_sampled_speculative_is_reproducible_and_tree_matches_plain(tiny_spec):
    m, prompt = tiny_spec, PROMPTS[0]
    kw = dict(max_tokens=N_TOKENS, draft_loops=2, verify_loops=6, draft_ahead=4, temperature=0.9, seed=7)
    a, b = m.generate_speculative(prompt, **kw), m.generate_speculative(prompt, **kw)
    assert a == b and a.stats == b.stats
    assert len(set(a[len(prompt):])) > 3
    # tree drafts are point masses, so its rule is a draw from p with the plain sampler's number
    plain = m.generate(prompt, loops=6, max_tokens=N_TOKENS, temperature=0.9, seed=7)
    assert m.generate_tree_speculative(prompt, K_branches=3, **kw) == plain


def test_a_sampled_tree_round_decides_on_the_device(tiny_spec, monkeypatch):
    """Every node's sampled verdict is drawn on the device and read with the tree's tokens in
    one transfer: after the prefill's token no single-position draw runs on the host, and the
    tokens are still the plain sampler's."""
    m, prompt = tiny_spec, PROMPTS[1]
    kw = dict(max_tokens=N_TOKENS, draft_loops=2, verify_loops=6, draft_ahead=3, temperature=0.8, top_p=0.9, seed=3)
    real, calls = spec_mod._Chooser.target, []

    def counted(self, logits, pos):
        calls.append(pos)
        return real(self, logits, pos)
    monkeypatch.setattr(spec_mod._Chooser, "target", counted)
    out = m.generate_tree_speculative(prompt, K_branches=2, **kw)
    assert calls == [len(prompt)], "only the prefill's token is drawn on the host"
    assert out.stats["verify_steps"] > 1
    assert out == m.generate(prompt, loops=6, max_tokens=N_TOKENS, temperature=0.8, top_p=0.9, seed=3)


# -- API -------------------------------------------------------------------------------------
def test_stream_protocol_and_stats(tiny_spec):
    m, prompt = tiny_spec, PROMPTS[1]
    req = m.make_request(prompt, max_tokens=N_TOKENS,
                         speculative={"draft_loops": 2, "verify_loops": 6, "draft_ahead": 4, "k_branches": 2})
    assert req.loops == 6
    gen, chunks = m.stream(req), []
    while True:
        try:
            chunks.append(next(gen))
        except StopIteration as stop:
            finish = stop.value
            break
    assert prompt + [t for c in chunks for t in c] == _want(m, prompt, 6)
    s = finish.stats
    assert len(chunks) == 1 + s["verify_steps"] and all(1 <= len(c) <= 5 for c in chunks)
    assert s["accepted_per_verify"] == pytest.approx(s["accepted_tokens"] / s["verify_steps"])
    assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["drafted_tokens"])
    assert s["completion_tokens"] == N_TOKENS and s["loop_iterations"] > 0


# -- handoff to plain decoding --------------------------------------------------------------
def _batched_to_end(runner, st):
    """A handed-over state decoded to its end in a batcher of its own: (ids, Finish)."""
    b, ids, finish = Batcher(runner), [], None
    b.add(st)
    while b:
        for update in b.step().values():
            new, finish = update
            ids += new
    return ids, finish


def _alone_to_end(st):
    st.advance()  # its decided token runs first: it has no logits to decide from
    try:
        gen, ids = decode_steps(st), []
        while True:
            ids += next(gen)
    except StopIteration as stop:
        return ids, stop.value


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("via", ["batcher", "alone"])
def test_handoff_between_rounds_continues_as_generate_at_verify_loops(tiny_spec, tree, via):
    """Hand a greedy stream over after its prefill's token or after some rounds: plain decoding
    at verify_loops from its decided token, with nothing recomputed, gives generate's tokens;
    the stats count the rounds that ran and every token's work once."""
    m, Ld, Lv, K = tiny_spec, 2, 6, (3 if tree else 1)
    spec = {"draft_loops": Ld, "verify_loops": Lv, "draft_ahead": 4, "k_branches": K, "tree": tree}
    multi = 0
    for prompt in PROMPTS[:2]:
        want = _want(m, prompt, Lv)
        for items in (1, 2, 4):
            req = m.make_request(prompt, max_tokens=N_TOKENS, speculative=spec)
            gen, got = m.stream(req), []
            for _ in range(items):
                got += next(gen)
            multi += len(got) > items  # a round emitted accepted drafts before the handoff
            assert gen.can_handoff
            st = gen.handoff()
            assert not gen.can_handoff and next(gen, None) is None  # the speculative stream is over
            assert (st.req.loops, st.req.speculative, st.tok_id, st.generated) == (Lv, None, got[-1], len(got))
            assert st.pos == len(prompt) + len(got) - 1 and st.batchable  # the position of got[-1]
            rest, finish = _batched_to_end(m.runner, st) if via == "batcher" else _alone_to_end(st)
            assert prompt + got + rest == want and finish.reason == want.finish_reason
            s, T = finish.stats, len(prompt)
            assert s["verify_steps"] == items - 1 and s["completion_tokens"] == N_TOKENS
            assert s["k_branches"] == K and s["accepted_per_verify"] == pytest.approx(
                s["accepted_tokens"] / s["verify_steps"] if items > 1 else 0.0)
            plain_steps = N_TOKENS - len(got)  # each runs one decided token at verify_loops
            assert s["loop_token_iterations"] == Lv * (T + s["verify_steps"] + K * s["drafted_tokens"] + plain_steps)
            assert s["loop_iterations"] == Lv + Ld * s["drafted_tokens"] + Lv * (s["verify_steps"] + plain_steps)
    assert multi, "no round accepted a draft before a handoff: the test could not tell positions apart"


def test_handoff_near_max_tokens_and_before_a_stop_token(tiny_spec):
    m, prompt, Lv = tiny_spec, PROMPTS[0], 6
    spec = {"draft_loops": 2, "verify_loops": Lv, "draft_ahead": 4}
    full = _want(m, prompt, Lv, 20)[len(prompt):]
    last_token_left = 0
    for n in range(2, 9):
        req = m.make_request(prompt, max_tokens=n, speculative=spec)
        gen = m.stream(req)
        got = next(gen) + next(gen)
        if not gen.can_handoff:  # the second chunk reached max_tokens: nothing to hand over
            assert len(got) == n
            continue
        st = gen.handoff()
        last_token_left += st.generated == n - 1
        rest, finish = _batched_to_end(m.runner, st)
        assert got + rest == full[:n] and finish.reason == "length" and finish.stats["completion_tokens"] == n
    assert last_token_left, "no handoff with one token left to decode"
    stopped = 0
    for i in (3, 6, 9):
        stop = full[i]
        cut = full.index(stop) + 1
        req = m.make_request(prompt, max_tokens=20, stop_token_ids=[stop], speculative=spec)
        gen = m.stream(req)
        got = next(gen) + next(gen)
        if len(got) >= cut:
            continue  # the stop token came before the handoff
        st = gen.handoff()
        rest, finish = _batched_to_end(m.runner, st)
        assert got + rest == full[:cut] and finish.reason == "stop"
        stopped += 1
    assert stopped, "no stop token after a handoff"


def test_a_sampled_or_unstarted_or_finished_stream_is_not_handed_over(tiny_spec):
    m, prompt = tiny_spec, PROMPTS[0]
    spec = {"draft_loops": 2, "verify_loops": 6, "draft_ahead": 4}
    sampled = m.stream(m.make_request(prompt, max_tokens=8, temperature=0.9, seed=3, speculative=spec))
    next(sampled)
    greedy = m.stream(m.make_request(prompt, max_tokens=2, speculative=spec))
    assert not greedy.can_handoff  # nothing decided yet: its prefill is its first step
    assert len(next(greedy) + next(greedy)) == 2  # max_tokens reached
    for gen in (sampled, greedy):
        assert not gen.can_handoff
        with pytest.raises(ValueError, match="only a started, unfinished greedy"):
            gen.handoff()
    sampled.close()
    req = m.make_request(prompt, loops=6, max_tokens=8, temperature=0.9, seed=3)
    with pytest.raises(ValueError, match="plain greedy"):
        DecodeState.decided(m.runner, 0, req, 5, len(prompt), 1, Counters())


@pytest.mark.parametrize("kw, match", [
    (dict(draft_loops=0), "draft_loops"),
    (dict(draft_loops=6, verify_loops=6), "draft_loops=6 must be < verify_loops=6"),
    (dict(verify_loops=33), "max_loops"),
    (dict(draft_ahead=0), "draft_ahead"),
    (dict(draft_ahead=17), "draft_ahead"),
    (dict(K_branches=0), "K_branches"),
    (dict(K_branches=9), "K_branches"),
    (dict(K_branches=4, draft_ahead=16), "nodes exceeds"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
])
def test_argument_errors(tiny_spec, kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_spec.generate_tree_speculative(PROMPTS[0], **kw)
    if "K_branches" not in kw:
        with pytest.raises(ValueError, match=match):
            tiny_spec.generate_speculative(PROMPTS[0], **kw)
    with pytest.raises(ValueError, match="k_branches=1"):
        spec_mod.SpecParams(2, 6, 4, 2, tree=False).check(32)
