"""Speculative streams' rounds batched (generation/spec_batch.py, Runner.verify_many): every
stream of a SpecBatch emits the tokens of its standalone run, with the same Finish (reason and
stats), greedy (= generate at verify_loops) and sampled, whatever joins, leaves or ends beside
it; each draft step index is one decode over the members and each (k, draft_loops,
verify_loops) group one verify_many a round."""
import pytest
import torch

from model_zoo import CONFIGS, damped_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.spec_batch import SpecBatch
from tinyloop.worker.model.settings import Settings
from tinyloop.worker.runner.engine import Counters

PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128], [250, 11], [7, 7, 100, 3], [41, 5, 230, 18, 9, 2]]
# (draft_loops, verify_loops, draft_ahead, max_tokens) per stream
SPANS = [(2, 6, 4, 14), (1, 5, 3, 11), (3, 8, 6, 17), (2, 6, 4, 9), (2, 7, 2, 13)]


@pytest.fixture(scope="module")
def m(ckpt_dir):
    """tiny_spec's checkpoint (tests/worker/test_speculative.py): partial acceptance."""
    path = damped_checkpoint(ckpt_dir / "damped-spec-batch.tinyloop", CONFIGS["gqa-prelude-coda"], 3, 0.03)
    with Model(path, max_seq_len=160, n_slots=6) as model:
        yield model


def _spec(Ld, Lv, ahead):
    return {"draft_loops": Ld, "verify_loops": Lv, "draft_ahead": ahead}


def _request(m, prompt, Ld, Lv, ahead, n, **kw):
    return m.make_request(prompt, max_tokens=n, speculative=_spec(Ld, Lv, ahead), **kw)


def _alone(m, lane, req):
    """A stream run alone to its end: (tokens, Finish)."""
    st, toks = m.stream(req, lane), []
    try:
        while True:
            toks += next(st)
    except StopIteration as stop:
        return toks, stop.value


def _start(m, lane, req):
    """A stream with its prefill's token emitted: (stream, [that token])."""
    st = m.stream(req, lane)
    return st, next(st)


def _drive(batch, got, finish, rounds=None):
    """Step the batch (to its end, or `rounds` steps), gathering each lane's tokens and Finish."""
    n = 0
    while batch and (rounds is None or n < rounds):
        for lane, update in batch.step().items():
            assert not isinstance(update, Exception), update
            toks, fin = update
            got[lane] += toks
            if fin is not None:
                assert lane not in batch.lanes
                finish[lane] = fin
        n += 1


def _batched(m, reqs):
    """The requests started on lanes 0, 1, ... and stepped together to their ends."""
    batch, got, finish = SpecBatch(m.runner), {}, {}
    for lane, req in enumerate(reqs):
        st, first = _start(m, lane, req)
        batch.add(st)
        got[lane] = first
    assert len(batch) == len(reqs) and batch.lanes == list(range(len(reqs)))
    _drive(batch, got, finish)
    assert not batch and len(batch) == 0
    return got, finish


class _Calls:
    """Counts a runner method's calls on the instance (and records their lanes): it wraps, it
    does not replace."""

    def __init__(self, monkeypatch, runner, name):
        self.lanes = []
        real = getattr(runner, name)

        def spy(lanes, *args, **kw):
            self.lanes.append(list(lanes))
            return real(lanes, *args, **kw)
        monkeypatch.setattr(runner, name, spy)


# -- exactness ------------------------------------------------------------------------------
@pytest.mark.parametrize("n_streams", [2, 3, 5])
def test_greedy_streams_batched_equal_their_standalone_runs(m, n_streams, monkeypatch):
    """Different prompts, draft_loops, verify_loops, draft_ahead and max_tokens: each stream's
    tokens and Finish (reason and every stat: verify steps, drafts, acceptance, loop work)
    are its standalone run's, and its tokens generate's at verify_loops. Every round is one
    decode per draft step index over the members still drafting and one verify_many per
    (k, draft_loops, verify_loops) group."""
    reqs = [_request(m, PROMPTS[i], *SPANS[i]) for i in range(n_streams)]
    want = [_alone(m, lane, req) for lane, req in enumerate(reqs)]
    decode, verify = _Calls(monkeypatch, m.runner, "decode"), _Calls(monkeypatch, m.runner, "verify_many")
    batch, got, finish = SpecBatch(m.runner), {}, {}
    for lane, req in enumerate(reqs):
        st, got[lane] = _start(m, lane, req)
        batch.add(st)
    decode.lanes.clear()
    mixed_k = shared_verify = 0
    while batch:
        # each member's k, from what it emitted so far (its stream's rule)
        k = {lane: min(reqs[lane].speculative["draft_ahead"], reqs[lane].max_tokens - len(got[lane]) - 1)
             for lane in batch.lanes}
        span = {lane: (k[lane], reqs[lane].speculative["draft_loops"], reqs[lane].speculative["verify_loops"])
                for lane in batch.lanes}
        decode.lanes.clear()
        verify.lanes.clear()
        _drive(batch, got, finish, rounds=1)
        K = max(k.values())
        assert len(decode.lanes) == K + 1
        for i, lanes in enumerate(decode.lanes):
            assert sorted(lanes) == sorted(lane for lane in k if k[lane] >= i)
        groups = {}
        for lane, s in span.items():
            groups.setdefault(s, set()).add(lane)
        assert sorted(map(sorted, verify.lanes)) == sorted(map(sorted, groups.values()))
        # a member whose k max_tokens cut, beside others (its later steps run without it)
        mixed_k += len(k) > 1 and any(k[lane] < reqs[lane].speculative["draft_ahead"] for lane in k)
        shared_verify += any(len(lanes) > 1 for lanes in verify.lanes)
    for lane, req in enumerate(reqs):
        assert (got[lane], finish[lane]) == want[lane], lane
        Lv = req.speculative["verify_loops"]
        plain = m.generate(req.prompt, loops=Lv, max_tokens=req.max_tokens)
        assert req.prompt + got[lane] == plain and finish[lane].reason == plain.finish_reason
    stats = [f.stats for f in finish.values()]
    assert 0 < sum(s["accepted_tokens"] for s in stats) < sum(s["drafted_tokens"] for s in stats)
    assert len({tuple(t) for t in got.values()}) == n_streams  # rows mixed up would show
    assert mixed_k, "no batched round had a member whose k max_tokens cut"
    if n_streams == 5:
        assert shared_verify, "no verify_many ran two members"


def test_sampled_and_mixed_streams_batched_equal_their_standalone_runs(m):
    """Sampled chains (seeded) beside greedy ones in one batch: the same draws, so the same
    tokens and stats as each stream alone (a draft step's rows then take their tokens from
    the host and from the device in one call)."""
    kinds = [dict(temperature=0.9, seed=7), {}, dict(temperature=0.7, top_k=20, seed=3), dict(temperature=1.1, seed=9),
             {}]
    reqs = [_request(m, PROMPTS[i], *SPANS[i], **kinds[i]) for i in range(5)]
    want = [_alone(m, lane, req) for lane, req in enumerate(reqs)]
    got, finish = _batched(m, reqs)
    for lane in range(5):
        assert (got[lane], finish[lane]) == want[lane], lane
    assert got[0] != m.generate(PROMPTS[0], loops=6, max_tokens=14)[len(PROMPTS[0]):]  # sampled, not greedy
    assert 0 < sum(f.stats["accepted_tokens"] for f in finish.values()) < \
        sum(f.stats["drafted_tokens"] for f in finish.values())


def test_joining_and_leaving_midway(m):
    """A stream that ran rounds alone joins a batch that has run rounds; a member leaves
    (cancelled) midway: the others' tokens and Finish stay their standalone runs'."""
    reqs = [_request(m, PROMPTS[i], *SPANS[i]) for i in range(4)]
    reqs[3] = _request(m, PROMPTS[3], 2, 6, 4, 24, temperature=0.8, seed=5)
    want = [_alone(m, lane, req) for lane, req in enumerate(reqs)]
    batch, got, finish = SpecBatch(m.runner), {}, {}
    for lane in (0, 1):
        st, got[lane] = _start(m, lane, reqs[lane])
        batch.add(st)
    _drive(batch, got, finish, rounds=2)
    late, got[2] = _start(m, 2, reqs[2])
    got[2] += next(late) + next(late)  # two rounds of its own first
    batch.add(late)
    leaving, got[3] = _start(m, 3, reqs[3])
    batch.add(leaving)
    _drive(batch, got, finish, rounds=1)
    assert batch.lanes == [0, 1, 2, 3]
    batch.leave(3)
    assert 3 not in batch.lanes and len(batch) == 3
    assert next(leaving, None) is None  # closed: nothing more
    seen = len(got[3])
    _drive(batch, got, finish)
    assert len(got[3]) == seen and 3 not in finish  # no update after it left
    assert got[3] == want[3][0][:seen] and seen < len(want[3][0])
    for lane in range(3):
        assert (got[lane], finish[lane]) == want[lane], lane
    batch.leave(3)  # gone already: nothing to do


def test_stop_token_mid_chunk_and_max_tokens_inside_a_round(m):
    """A stop token inside a round's accepted chunk ends its stream there (the rest of the
    round's tokens dropped), and max_tokens cuts a round's drafts: both as alone, and the
    members beside them go on."""
    prompt, Lv = PROMPTS[0], 6
    full = m.generate(prompt, loops=Lv, max_tokens=24)[len(prompt):]
    reqs, stops = [], 0
    for i in (2, 5, 9):
        stop = full[i]
        reqs.append(_request(m, prompt, 2, Lv, 8, 24, stop_token_ids=[stop]))
    for n in (2, 3, 7):
        reqs.append(_request(m, prompt, 2, Lv, 4, n))
    want = [_alone(m, lane, req) for lane, req in enumerate(reqs)]
    got, finish = _batched(m, reqs)
    for lane, req in enumerate(reqs):
        assert (got[lane], finish[lane]) == want[lane], lane
        if req.stop_ids:
            cut = full.index(next(iter(req.stop_ids))) + 1
            assert got[lane] == full[:cut] and finish[lane].reason == "stop"
            # the stop came inside a round that accepted more: the emitted count is cut there
            stops += finish[lane].stats["accepted_tokens"] + finish[lane].stats["verify_steps"] + 1 > cut
        else:
            assert got[lane] == full[:req.max_tokens] and finish[lane].reason == "length"
            assert finish[lane].stats["completion_tokens"] == req.max_tokens
    assert stops, "no stop token fell inside a round's accepted chunk"


def test_a_member_failure_fails_it_alone_and_a_shared_call_its_rows(m, monkeypatch):
    """An error in one member's acceptance fails that member alone; an error in a verify_many
    fails the members of that call, and the other group goes on as alone."""
    reqs = [_request(m, PROMPTS[i], *SPANS[i]) for i in range(4)]
    want = [_alone(m, lane, req) for lane, req in enumerate(reqs)]
    batch, got, finish = SpecBatch(m.runner), {}, {}
    streams = {}
    for lane, req in enumerate(reqs):
        streams[lane], got[lane] = _start(m, lane, req)
        batch.add(streams[lane])
    boom = RuntimeError("acceptance failed")

    def bad_accept(*a, **kw):
        raise boom
    monkeypatch.setattr(streams[1], "accept", bad_accept)
    real = m.runner.verify_many
    shared = RuntimeError("verify failed")

    def verify_many(lanes, *a, **kw):
        if 2 in lanes:  # lanes 0 and 3 share a span (2, 6, 4): their group is another
            raise shared
        return real(lanes, *a, **kw)
    monkeypatch.setattr(m.runner, "verify_many", verify_many)
    updates = batch.step()
    assert updates[1] is boom and updates[2] is shared
    assert batch.lanes == [0, 3]
    for lane in (1, 2):
        assert next(streams[lane], None) is None  # closed
    monkeypatch.undo()
    for lane in (0, 3):
        toks, fin = updates[lane]
        got[lane] += toks
    _drive(batch, got, finish)
    for lane in (0, 3):
        assert (got[lane], finish[lane]) == want[lane], lane


def test_a_sampled_draft_failing_midway_leaves_the_rows_after_it_right(m, monkeypatch):
    """A sampled member whose draft fails at its second draft step leaves the steps after it
    while the members on either side of it go on drafting: their rows, device tokens and
    residuals are still their own (their tokens and stats are their standalone runs')."""
    reqs = [_request(m, PROMPTS[0], 2, 6, 4, 14), _request(m, PROMPTS[1], 2, 6, 4, 14, temperature=0.9, seed=4),
            _request(m, PROMPTS[2], 2, 6, 4, 14), _request(m, PROMPTS[3], 2, 6, 4, 14, temperature=0.8, seed=6)]
    want = [_alone(m, lane, req) for lane, req in enumerate(reqs)]
    batch, got, finish, streams = SpecBatch(m.runner), {}, {}, {}
    for lane, req in enumerate(reqs):
        streams[lane], got[lane] = _start(m, lane, req)
        batch.add(streams[lane])
    real, calls, boom = streams[1].draft, [], RuntimeError("draft failed")

    def draft(logits, pos):
        calls.append(pos)
        if len(calls) == 2:
            raise boom
        return real(logits, pos)
    monkeypatch.setattr(streams[1], "draft", draft)
    decode = _Calls(monkeypatch, m.runner, "decode")
    updates = batch.step()
    assert updates[1] is boom and batch.lanes == [0, 2, 3]
    assert decode.lanes == [[0, 1, 2, 3]] * 2 + [[0, 2, 3]] * 3  # the rows after it moved up
    for lane in (0, 2, 3):
        got[lane] += updates[lane][0]
    _drive(batch, got, finish)
    for lane in (0, 2, 3):
        assert (got[lane], finish[lane]) == want[lane], lane


def test_a_member_taken_out_hands_over_to_plain_decoding(m):
    """Between two steps a greedy member goes on as plain decoding at verify_loops
    (`take`, then `handoff`): generate's tokens; the one left in the batch keeps its own."""
    reqs = [_request(m, PROMPTS[1], 2, 6, 4, 16), _request(m, PROMPTS[0], 1, 5, 3, 12)]
    want = _alone(m, 1, reqs[1])
    batch, got, finish, streams = SpecBatch(m.runner), {}, {}, {}
    for lane, req in enumerate(reqs):
        streams[lane], got[lane] = _start(m, lane, req)
        batch.add(streams[lane])
    _drive(batch, got, finish, rounds=2)
    st = batch.take(0)
    assert st is streams[0] and batch.lanes == [1] and batch.take(0) is None
    plain = Batcher(m.runner)
    plain.add(st.handoff())
    while plain:
        for lane, (toks, fin) in plain.step().items():
            got[lane] += toks
            finish[lane] = fin
    _drive(batch, got, finish)
    assert reqs[0].prompt + got[0] == m.generate(reqs[0].prompt, loops=6, max_tokens=16)
    assert finish[0].reason == "length" and finish[0].stats["verify_steps"] == 2
    assert (got[1], finish[1]) == want


# -- verify_many ----------------------------------------------------------------------------
def test_verify_many_equals_verify_lane_by_lane(m):
    """Chunks on different lanes at different positions in one pass: each row's logits are
    its lane's `verify` (up to rounding: a masked chunk attention, not the tree pass), its
    work that verify's; a single-token chunk (the decode-step attention) too."""
    r = m.runner
    V, Ld, Lv = r.config.vocab_size, 2, 6
    lanes = [4, 1, 3]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[4]]
    for n in (4, 1):
        res, pos = [], []
        for lane, prompt in zip(lanes, prompts):
            r.prefill(lane, prompt, Lv)
            p = len(prompt) + 3 * lane  # positions apart, a gap of earlier decoded tokens before
            for j in range(len(prompt), p):
                r.decode([lane], [(j * 31 + lane) % V], [j], [Lv])
            chunk = [(lane * 17 + i * 5) % V for i in range(n)]
            res.append(torch.cat([r.decode([lane], [t], [p + i], [Ld]).residual.clone()
                                  for i, t in enumerate(chunk)], 1))
            pos.append(p)
        before = r.counters.snapshot()
        out = r.verify_many(lanes, torch.cat(res), pos, Ld, Lv)
        assert out.logits.shape == (3, n, V)
        assert out.works == [Counters(Lv - Ld, (Lv - Ld) * n)] * 3
        assert r.counters.since(before) == out.work == Counters(3 * (Lv - Ld), 3 * (Lv - Ld) * n)
        got = out.logits.clone()
        assert r.verify_many(lanes, res, pos, Ld, Lv).logits.equal(got)  # the rows as a list
        for b, lane in enumerate(lanes):
            want = r.verify(lane, res[b], pos[b], Ld, Lv).logits
            assert ((got[b] - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-5, (n, lane)
            others = [c for c in range(3) if c != b]
            assert all(((got[c] - want).norm(dim=-1) / want.norm(dim=-1)).max() > 1e-2 for c in others)


def test_verify_many_bad_input(m):
    r = m.runner
    D, S = r.config.residual_width, r.cache.max_seq_len
    x = torch.zeros(2, 3, D)
    before = r.counters.snapshot()
    cases = [
        (([0, 1], x, [5], 2, 6), r"as many lanes, positions and residual rows, at least one: 2, 1, 2"),
        (([0], x, [5], 2, 6), r"as many lanes, positions and residual rows, at least one: 1, 1, 2"),
        (([], x[:0], [], 2, 6), r"at least one: 0, 0, 0"),
        (([0, 1], [x[:1], x[:1, :2]], [5, 5], 2, 6), r"chunks of one length n, got \[3, 2\]"),
        (([0, 1], torch.zeros(2, 0, D), [5, 5], 2, 6), r"n >= 1 and D = "),
        (([0, 1], torch.zeros(2, 3, D + 1), [5, 5], 2, 6), r"n >= 1 and D = "),
        (([1, 1], x, [5, 9], 2, 6), r"each lane once, got \[1, 1\]"),
        (([0, 99], x, [5, 9], 2, 6), r"lane 99 outside"),
        (([0, 1], x, [5, 9], 6, 6), r"iterations \[start, stop\) inside"),
        (([0, 1], x, [5, S - 2], 2, 6), rf"a chunk of 3 tokens at {S - 2} \(lane 1\) passes the cache's {S} positions"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            r.verify_many(*args)
    assert r.counters.since(before) == Counters()


# -- what a SpecBatch takes -----------------------------------------------------------------
def test_add_refuses_what_it_cannot_run(m):
    batch = SpecBatch(m.runner)
    tree = m.stream(m.make_request(PROMPTS[0], max_tokens=8, speculative={**_spec(2, 6, 3), "k_branches": 2}), 0)
    next(tree)
    with pytest.raises(ValueError, match=r"lane 0: a tree stream \(k_branches=2\) steps alone"):
        batch.add(tree)
    tree.close()
    unstarted = m.stream(_request(m, PROMPTS[0], 2, 6, 4, 8), 1)
    with pytest.raises(ValueError, match=r"lane 1: the stream has not emitted its prefill's token yet"):
        batch.add(unstarted)
    ended, _ = _start(m, 2, _request(m, PROMPTS[0], 2, 6, 4, 1))  # max_tokens 1: its prefill's token ends it
    with pytest.raises(ValueError, match=r"lane 2: the stream has reached its end \(length\)"):
        batch.add(ended)
    st, _ = _start(m, 1, _request(m, PROMPTS[1], 2, 6, 4, 8))
    batch.add(st)
    with pytest.raises(ValueError, match="lane 1 already has a stream in the batch"):
        batch.add(st)
    other, _ = _start(m, 1, _request(m, PROMPTS[2], 2, 6, 4, 8))
    with pytest.raises(ValueError, match="lane 1 already has a stream in the batch"):
        batch.add(other)
    closed, _ = _start(m, 3, _request(m, PROMPTS[2], 2, 6, 4, 8))
    closed.close()
    with pytest.raises(ValueError, match=r"lane 3: the stream is over"):
        batch.add(closed)
    with pytest.raises(ValueError, match="takes SpeculativeStreams, got generator"):
        batch.add(m.stream(m.make_request(PROMPTS[0], loops=6, max_tokens=4), 4))
    assert batch.lanes == [1] and not batch.eligible(tree) and not batch.eligible(unstarted)
    batch.leave(1)
    assert not batch and batch.step() == {}


def test_add_refuses_a_stream_with_a_device_round_in_flight(ckpt_dir):
    """Device rounds (eager on the CPU): a stream that ran one has the next launched ahead,
    which a batch would leave unread; one added before its first round runs host rounds here,
    with the tokens of its device-round run alone."""
    path = damped_checkpoint(ckpt_dir / "damped-spec-batch-rounds.tinyloop", CONFIGS["gqa-prelude-coda"], 3, 0.03)
    with Model(path, max_seq_len=96, n_slots=2, settings=Settings(device_rounds=True)) as dm:
        req = _request(dm, PROMPTS[0], 2, 6, 4, 12)
        st, _ = _start(dm, 0, req)
        next(st)
        with pytest.raises(ValueError, match="lane 0: the stream has a device round in flight"):
            SpecBatch(dm.runner).add(st)
        st.close()
        want, fin = _alone(dm, 1, req)
        batch, got, finish = SpecBatch(dm.runner), {}, {}
        st, got[0] = _start(dm, 0, req)
        batch.add(st)
        _drive(batch, got, finish)
        assert got[0] == want and finish[0].reason == fin.reason
