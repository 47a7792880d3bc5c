"""Continuous batching (generation/batcher.py): a stream stepped with others in one runner step
gets exactly the tokens, logits and stats it gets alone, whatever joins, leaves or idles beside
it."""
import dataclasses

import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher, chunk_passes, expected_remaining
from tinyloop.worker.generation.decode import DecodeState, decode_steps
from tinyloop.worker.runner.stages import BatchStep

from stage_graphs import with_stage_graphs

GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3)

# (lane, join before step, leave (cancel) before step or None, request kwargs)
SCHEDULE = [
    (1, 0, None, dict(prompt=[3, 17, 42, 99, 7], loops=2, max_tokens=14, seed=1)),
    (2, 0, None, dict(prompt=[200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12], loops=8, max_tokens=9, seed=2)),
    (4, 0, 5, dict(prompt=[9, 8, 7], loops=5, max_tokens=30, seed=3)),          # cancelled mid-way
    (6, 2, None, dict(prompt=[5] * 10, loops=3, max_tokens=12, seed=4)),         # joins late; a hole at 5
    (3, 4, None, dict(prompt=[1, 2], loops=6, max_tokens=1, seed=5)),            # done at its first token
    (5, 6, None, dict(prompt=[77, 78, 79, 80], loops=1, max_tokens=10, seed=6)),
    (4, 9, None, dict(prompt=[42] * 7, loops=7, max_tokens=8, seed=7)),          # reuses a freed lane
]


@pytest.fixture
def model(tiny_path):
    with Model(tiny_path, max_seq_len=64, n_slots=8) as m:
        yield m


def _request(model, sampling, stop=(), **kw):
    return model.make_request(kw.pop("prompt"), stop_token_ids=list(stop), **kw, **sampling)


def _record_logits(st: DecodeState, into: list) -> DecodeState:
    """Keep every logits row the state is handed (alone or batched)."""
    for name in ("advance", "advanced"):
        method = getattr(st, name)

        def wrapped(*a, _m=method, **k):
            _m(*a, **k)
            into.append(st.logits.clone())
        setattr(st, name, wrapped)
    discard = st.discard

    def discarded():  # a pipelined step launched ahead and dropped: never handed to the stream
        discard()
        into.pop()
    st.discard = discarded
    return st


def _alone(model, req, lane):
    logits: list = []
    gen = decode_steps(_record_logits(model.start(req, lane), logits))
    ids = []
    try:
        while True:
            ids.extend(next(gen))
    except StopIteration as stop:
        return ids, stop.value, logits


def _batched(model, reqs, schedule, poison: bool, interleave: bool = True, interleave_exits: bool | None = None):
    """Drive a Batcher the way the actor does: joins and cancels between steps."""
    b = Batcher(model.runner, interleave=interleave, interleave_exits=interleave_exits)
    if poison:
        # Every layer and position of every stream lane: whatever a stream reads it must have
        # written itself, or its logits would not be bitwise those it gets alone. (Finite, not
        # NaN: attention multiplies the masked-out slots' V by a zero weight.)
        model.runner.cache.k[:, 1:] = 1e6
        model.runner.cache.v[:, 1:] = -1e6
    out = {i: ([], None, []) for i in range(len(schedule))}
    on_lane: dict[int, int] = {}
    step = 0
    while step < 40:
        for i, (lane, join, leave) in enumerate(schedule):
            if leave == step and on_lane.get(lane) == i:
                b.leave(lane)
                del on_lane[lane]
            if join == step:
                assert lane not in on_lane
                st = _record_logits(model.start(reqs[i], lane), out[i][2])
                ids, finish = b.join(st)
                out[i][0].extend(ids)
                if finish is None:
                    on_lane[lane] = i
                else:
                    out[i] = (out[i][0], finish, out[i][2])
        for lane, (ids, finish) in b.step().items():
            i = on_lane[lane]
            out[i][0].extend(ids)
            if finish is not None:
                out[i] = (out[i][0], finish, out[i][2])
                del on_lane[lane]
        step += 1
    assert not b and not on_lane
    return out


# every stream on its own parameters: greedy, greedy with a penalty, and samplers that differ in
# temperature, top-k, top-p and penalty (one batched sampling call over all of them)
MIXED = [SAMPLED, GREEDY, dict(temperature=0.7, top_k=5), dict(temperature=1.2, top_k=0, top_p=0.8),
         dict(temperature=0.0, repetition_penalty=1.5), dict(temperature=0.5, top_k=100, top_p=0.9),
         dict(temperature=1.0, top_k=12, repetition_penalty=1.1)]


def test_join_many_decides_each_first_token_as_join_does(model):
    """Streams prefilled together join in one sampling call: each on its own parameters (MIXED:
    greedy, penalties, samplers), key and prompt penalty, its first token the one its own
    `join` decides; a stream whose first token ends it (max_tokens 1) finishes there, and the
    others then batch on to their standalone streams."""
    kws = [kw for *_, kw in SCHEDULE]
    reqs = [_request(model, MIXED[i % len(MIXED)], **dict(kws[i])) for i in range(len(kws) - 1)]
    lanes = list(range(len(reqs)))
    alone = [_alone(model, r, 0) for r in reqs]
    b = Batcher(model.runner)
    got = [list(ids) for ids, _ in b.join_many([model.start(r, lane) for r, lane in zip(reqs, lanes)])]
    assert [g[0] for g in got] == [ids[0] for ids, _, _ in alone]
    assert 4 not in b.states  # SCHEDULE's fifth request ends at its first token
    while b:
        for lane, (ids, _) in b.step().items():
            got[lane].extend(ids)
    assert got == [ids for ids, _, _ in alone]


def _assert_each_is_its_stream_alone(alone: list, batched: dict, schedule: list) -> None:
    """Every batched stream's tokens, finish, stats and logits are those it gets alone (a
    cancelled one: a prefix of its tokens, no finish)."""
    for i, ((ids, finish, logits), (b_ids, b_finish, b_logits)) in enumerate(zip(alone, batched.values())):
        if schedule[i][2] is not None:  # cancelled: a prefix of its stream, no finish
            assert b_finish is None and 0 < len(b_ids) < len(ids) and b_ids == ids[:len(b_ids)]
            continue
        assert b_ids == ids, i
        assert (b_finish.reason, b_finish.stats) == (finish.reason, finish.stats), i
        # bitwise: a lane of a batched step is the step it takes alone
        assert len(b_logits) == len(logits) and all(torch.equal(a, b) for a, b in zip(logits, b_logits)), i


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, MIXED], ids=["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("poison", [False, True], ids=["clean", "poisoned"])
def test_batched_streams_equal_standalone(model, sampling, poison):
    of = (lambda i: sampling[i]) if isinstance(sampling, list) else (lambda i: sampling)
    reqs = [_request(model, of(i), **kw) for i, (*_, kw) in enumerate(SCHEDULE)]
    # a stop token taken from lane 1's own greedy/sampled stream, so it does stop mid-way
    first_ids, _, _ = _alone(model, reqs[0], 0)
    reqs[0] = _request(model, of(0), stop=[first_ids[5]], **SCHEDULE[0][3])
    alone = [_alone(model, r, 0) for r in reqs]
    batched = _batched(model, reqs, [s[:3] for s in SCHEDULE], poison)
    _assert_each_is_its_stream_alone(alone, batched, SCHEDULE)
    assert alone[0][1].reason == "stop" and alone[4][1].stats["completion_tokens"] == 1


def test_mask_form_mixed_depth_equals_prefix_form(model):
    """run_loops(depth=...) over lanes in any order equals each lane's own run at its depth."""
    e = model.runner.engine
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    depths = [3, 8, 1]
    x_alone = []
    for lane, (p, L) in enumerate(zip(prompts, depths), start=1):
        req = model.make_request(p, loops=L, max_tokens=2)
        st = model.start(req, lane)
        st.accept(st.decide())
        x_alone.append((st.tok_id, st.pos))
    pos = torch.tensor([[q] for _, q in x_alone])
    p = e.make_pass(torch.tensor([1, 2, 3]), pos, int(pos.max()) + 1)
    x = e.embed_prelude(torch.tensor([[t] for t, _ in x_alone]), p)
    got = e.run_loops(x.clone(), p, 0, max(depths), depth=torch.tensor(depths))
    for b, L in enumerate(depths):
        q = e.make_pass(torch.tensor([1 + b]), pos[b:b + 1], int(pos[b]) + 1)
        assert torch.equal(got[b:b + 1], e.run_loops(x[b:b + 1].clone(), q, 0, L))
    # out=: the result selected into a buffer (the residual itself, as a stage set passes it), an
    # iteration at a time, and with no depth (a copy into it)
    into = x.clone()
    for i in range(max(depths)):
        assert e.run_loops(into, p, i, i + 1, depth=torch.tensor(depths), out=into) is into
    assert torch.equal(into, got)
    into = torch.empty_like(x)
    assert e.run_loops(x.clone(), p, 0, 2, out=into) is into
    assert torch.equal(into, e.run_loops(x.clone(), p, 0, 2))


def test_decode_on_the_full_cache_without_the_safety_check_is_batched(model):
    """Plain streams (L scheduling included) take the pipelined batched step; the safety check
    and a window the checked step; a decided stream handed over joins as plain decode only."""
    b = Batcher(model.runner)
    for lane, kw in enumerate((dict(), dict(l_warmup_tokens=2, l_warmup_L=1)), start=1):
        b.join(model.start(model.make_request([1, 2, 3], loops=2, max_tokens=4, **kw), lane))
        assert lane in b.states and lane not in b.checked, kw
    for lane, kw in enumerate((dict(safety_check=True, safety_norm_threshold=1e9), dict(cache_window=8)), start=3):
        st = model.start(model.make_request([1, 2, 3], loops=2, max_tokens=4, **kw), lane)
        assert st.checked
        b.join(st)
        assert lane in b.checked and lane not in b.states, kw
    assert sorted(b.lanes) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="lane 3 already has a stream"):
        b.join(model.start(model.make_request([1, 2], loops=2, max_tokens=4), 3))
    st = DecodeState.decided(model.runner, 5, model.make_request([1, 2], loops=2, max_tokens=4, cache_window=8),
                             7, 2, 1, model.runner.counters.snapshot())
    with pytest.raises(ValueError, match="plain decode on the full cache only"):
        b.add(st)


def _norms(model, req, lane) -> list[float]:
    """The residual norm the safety check reads before each token of req's stream alone: the
    prefill's, then each decode step's (the threshold set out of reach)."""
    req = dataclasses.replace(req, safety_threshold=1e30)
    st = model.start(req, lane)
    norms = [float(st.norm)]
    advance = st.advance

    def advanced(*a, **k):
        advance(*a, **k)
        norms.append(float(st.norm))
    st.advance = advanced
    for _ in decode_steps(st):
        pass
    return norms


def _tripping(model, req, lane, first: int) -> "Request":
    """req with a safety threshold its stream passes at a decode step after `first` tokens
    (and not at the prompt): the largest norm seen up to there, which a later step exceeds."""
    norms = _norms(model, req, lane)
    for k in range(first, len(norms) - 1):
        limit = max(norms[:k + 1])
        if any(n > limit for n in norms[k + 1:]):
            return dataclasses.replace(req, safety_threshold=limit)
    raise AssertionError(f"no step's norm exceeds the ones before it: {norms}")


# the safety check and sliding windows (the checked step) beside plain streams: two windows, mixed
# depths, L scheduling, a threshold passed mid-way and one passed by the prompt itself
CHECKED_SCHEDULE = [
    (1, 0, None, dict(prompt=[3, 17, 42, 99, 7], loops=3, max_tokens=12, seed=1, safety_check=True,
                      safety_norm_threshold=1e9)),
    (2, 0, None, dict(prompt=[200], loops=5, max_tokens=16, seed=2, safety_check=True)),  # trips mid-way
    (3, 0, None, dict(prompt=[9, 8, 7, 6, 5], loops=2, max_tokens=14, seed=3, cache_window=4)),
    (4, 2, None, dict(prompt=[5] * 6, loops=6, max_tokens=10, seed=4, cache_window=4, safety_check=True,
                      safety_norm_threshold=1e9)),  # joins late
    (5, 0, None, dict(prompt=[1, 2], loops=4, max_tokens=3, seed=5, cache_window=6)),  # another window
    (6, 1, None, dict(prompt=[77, 78, 79], loops=3, max_tokens=9, seed=6)),  # plain, beside them
    (7, 0, None, dict(prompt=[42] * 7, loops=4, max_tokens=11, seed=7, safety_check=True, safety_norm_threshold=1e9,
                      cache_window=5, l_warmup_tokens=3, l_warmup_L=1)),
    (0, 0, 4, dict(prompt=[8, 6, 4, 2], loops=5, max_tokens=20, seed=8, cache_window=4)),  # cancelled
    (5, 6, None, dict(prompt=[11, 12, 13], loops=2, max_tokens=8, seed=9, safety_check=True,
                      safety_norm_threshold=1e-6)),  # its prompt passes the threshold: no token at all
]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_checked_streams_in_the_batch_equal_standalone(model, sampling, monkeypatch):
    """Streams with the safety check or a window, batched with each other (one decode per
    window a step) beside plain streams, joining, leaving and ending in any step: each gets its
    standalone tokens, finish (a safety stop where alone it stops, with no token), stats and
    logits bitwise, over a poisoned cache."""
    reqs = [_request(model, sampling, **dict(kw)) for *_, kw in CHECKED_SCHEDULE]
    reqs[1] = _tripping(model, reqs[1], 0, first=3)
    alone = [_alone(model, r, 0) for r in reqs]
    assert alone[1][1].reason == "safety" and 3 <= len(alone[1][0]) < 16
    assert alone[8][1].reason == "safety" and alone[8][0] == []
    runner = model.runner
    calls = []
    decode = runner.decode

    def counted(lanes, *a, **k):  # the real step; noted: which lanes shared it, under which window
        window = a[3] if len(a) > 3 else k.get("window", 0)
        calls.append((len(lanes), window))
        return decode(lanes, *a, **k)
    monkeypatch.setattr(runner, "decode", counted)
    batched = _batched(model, reqs, [s[:3] for s in CHECKED_SCHEDULE], poison=True)
    _assert_each_is_its_stream_alone(alone, batched, CHECKED_SCHEDULE)
    # the checked streams shared steps: several rows under window 4, and the safety rows together
    assert max(n for n, w in calls if w == 4) >= 3
    assert any(n >= 2 for n, w in calls if w == 0)


# L scheduling in the batch: a stream's first l_warmup_tokens decode steps at l_warmup_L, then the
# extension of those positions to its depth, then its depth, beside plain streams of other depths
WARM_SCHEDULE = [
    (1, 0, None, dict(prompt=[3, 17, 42, 99, 7], loops=6, max_tokens=14, seed=1, l_warmup_tokens=4, l_warmup_L=2)),
    (2, 0, None, dict(prompt=[200, 1, 1, 5, 9, 31, 64], loops=8, max_tokens=9, seed=2)),
    (3, 1, None, dict(prompt=[9, 8, 7], loops=5, max_tokens=12, seed=3, l_warmup_tokens=3, l_warmup_L=5)),  # = loops
    (4, 2, None, dict(prompt=[5] * 10, loops=4, max_tokens=12, seed=4, l_warmup_tokens=6, l_warmup_L=1)),  # joins late
    (5, 3, 6, dict(prompt=[1, 2], loops=7, max_tokens=20, seed=5, l_warmup_tokens=5, l_warmup_L=3)),  # cancelled warming
    (6, 0, None, dict(prompt=[77, 78], loops=3, max_tokens=2, seed=6, l_warmup_tokens=8, l_warmup_L=1)),  # ends warming
    (7, 5, None, dict(prompt=[42] * 7, loops=2, max_tokens=10, seed=7)),
    (0, 1, None, dict(prompt=[8, 6, 4, 2], loops=6, max_tokens=11, seed=8,
                      early_exit=dict(criterion="latent", threshold=0.5))),  # an exit rule beside them
]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "whole-token"])
def test_l_scheduled_streams_in_the_batch_equal_standalone(model, sampling, interleave):
    """Streams with L scheduling batched beside plain ones (joining early and late, one left
    mid-warm-up, one ended inside it): each gets its standalone tokens, finish, stats (the
    extension's work included) and logits bitwise, over a poisoned cache, so every position
    a later step reads at a depth the warm-up skipped was written by the extension."""
    reqs = [_request(model, sampling, **dict(kw)) for *_, kw in WARM_SCHEDULE]
    alone = [_alone(model, r, 0) for r in reqs]
    # exit rules interleave where the batch allows it (forced here: eagerly the runner would not)
    batched = _batched(model, reqs, [s[:3] for s in WARM_SCHEDULE], poison=True, interleave=interleave,
                       interleave_exits=interleave)
    _assert_each_is_its_stream_alone(alone, batched, WARM_SCHEDULE)
    # the extension ran: a warmed stream's work is more than its steps at their depths alone
    warmed = alone[0][1].stats["loop_token_iterations"]
    assert warmed > 5 * 6 + 4 * 2 + (14 - 1 - 4) * 6


def test_idle_lanes_keep_their_cache(model):
    """The lanes no waiting stream holds (lane 0, a hole at 3, the lanes past the streams')
    take no part in a step: not a value of their cache changes, whatever they hold."""
    cache = model.runner.cache
    b = Batcher(model.runner)
    for lane, p in ((4, [9, 9]), (2, [5, 6, 7])):
        ids, finish = b.join(model.start(model.make_request(p, loops=3, max_tokens=6), lane))
        assert finish is None
    held = [0, 1, 3, 5, 6, 7]
    cache.k[:, held] = torch.randn_like(cache.k[:, held])
    cache.v[:, held] = torch.randn_like(cache.v[:, held])
    before = (cache.k[:, held].clone(), cache.v[:, held].clone())
    while b:
        b.step()
    assert b.steps == 5 and b.lane_steps == 10
    assert torch.equal(cache.k[:, held], before[0]) and torch.equal(cache.v[:, held], before[1])


def test_idle_rows_of_a_bucket_touch_nothing(model):
    """A batched step padded to a bucket (what the batch graphs replay on CUDA): the idle rows
    (token 0, position max_seq_len, depth 0, slot 0) write no cache value of any lane, lane 0
    included, and leave the live rows, on lanes in any order, bitwise the step of the live
    rows alone (the runner's eager step of exactly those rows)."""
    runner = model.runner
    cache = runner.cache
    lanes, depths = [4, 2], [7, 3]
    sts = []
    for lane, p, L in zip(lanes, ([9, 9], [5, 6, 7]), depths):
        st = model.start(model.make_request(p, loops=L, max_tokens=6), lane)
        st.accept(st.decide())
        sts.append(st)
    others = [lane for lane in range(model.n_slots) if lane not in lanes]
    cache.k[:, others] = torch.randn_like(cache.k[:, others])
    cache.v[:, others] = torch.randn_like(cache.v[:, others])
    tokens, positions = [st.tok_id for st in sts], [st.pos for st in sts]
    want = runner.decode(lanes, tokens, positions, depths)
    after = cache.k.clone(), cache.v.clone()
    step = BatchStep(runner.engine, 8)
    step.load(lanes, tokens, positions, depths)
    assert step.ctl[:, 2:].tolist() == [[0] * 6, [cache.max_seq_len] * 6, [0] * 6, [0] * 6]  # idle rows
    for stage in BatchStep.stages(max(depths)):
        step.run(stage)
    assert torch.equal(step.logits[:2], want.logits) and torch.equal(step.x[:2], want.residual)
    assert torch.equal(step.greedy[:2], want.logits.argmax(-1))  # the coda's argmax, in the step
    # a second load through the other staging slot: the rows as asked, the rest idle again
    step.load(lanes[:1], tokens[:1], positions[:1], depths[:1])
    assert step.ctl[:, :2].tolist() == [[tokens[0], 0], [positions[0], cache.max_seq_len], [depths[0], 0],
                                        [lanes[0], 0]]
    # the live rows rewrote their own position with the same values; nothing else moved
    assert torch.equal(cache.k, after[0]) and torch.equal(cache.v, after[1])


def test_lane_reused_between_two_steps(model):
    """A stream cancelled and a new one joined on the same lane between two steps: the step
    launched ahead for the old stream is dropped, the new stream gets exactly its own tokens."""
    old = _request(model, GREEDY, prompt=[3, 17, 42], loops=4, max_tokens=20, seed=1)
    new = _request(model, SAMPLED, prompt=[9, 9, 8, 1, 2], loops=2, max_tokens=7, seed=2)
    other = _request(model, GREEDY, prompt=[5, 6], loops=3, max_tokens=9, seed=3)
    want_new, want_other = _alone(model, new, 0)[0], _alone(model, other, 0)[0]
    b = Batcher(model.runner)
    got_other, _ = b.join(model.start(other, 1))
    b.join(model.start(old, 2))
    for _ in range(3):
        got_other.extend(b.step()[1][0])
    b.leave(2)
    got_new, _ = b.join(model.start(new, 2))
    while b:
        for lane, (ids, _) in b.step().items():
            (got_new if lane == 2 else got_other).extend(ids)
    assert got_new == want_new and got_other == want_other


def _same(got, want):
    assert list(got) == list(want) and (got.finish_reason, got.stats) == (want.finish_reason, want.stats)


def test_generate_batch_on_the_default_model():
    """Model() as a worker builds it by default (the embedded model, default lanes): lanes at
    depths up to the model's deepest in one batch, each equal to its generate alone."""
    with Model() as m:
        assert m.n_slots == m.runner.lanes.n == 8  # the CPU default, well inside the 2 GiB budget
        L = m.config.max_loops
        loops = [4, min(16, L), min(32, L)]
        prompts = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12], [5, 6]]
        got = m.generate_batch(prompts, per_lane_loops=loops, max_tokens=3)
        assert m.runner.lanes.free == 8
        for g, p, depth in zip(got, prompts, loops):
            _same(g, m.generate(p, loops=depth, max_tokens=3))


def test_generate_batch_runs_in_waves(tiny_path, model, monkeypatch):
    """More prompts than lanes: the batch runs in waves of as many streams as there are lanes,
    batched within a wave (its prompts prefilled in one pass), with the results of one wave on
    enough lanes and of each prompt alone."""
    from tinyloop.worker.runner.runner import Runner
    prompts = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31], [9, 8, 7], [5] * 10, [77, 78]]
    kw = dict(per_lane_loops=[2, 8, 5, 3, 1], max_tokens=7, temperature=0.9, top_k=40, seed=[1, 2, 3, 4, 5])
    with Model(tiny_path, max_seq_len=64, n_slots=2) as two:
        prefills, steps = [], []
        prefill, many = Runner.prefill, Runner.prefill_many
        decode, interleave = Runner.decode, Runner.interleave
        monkeypatch.setattr(Runner, "prefill", lambda self, lane, *a, **k: (
            prefills.append(lane) if self is two.runner else None) or prefill(self, lane, *a, **k))
        monkeypatch.setattr(Runner, "prefill_many", lambda self, lanes, *a, **k: (
            prefills.append(tuple(lanes)) if self is two.runner else None) or many(self, lanes, *a, **k))
        monkeypatch.setattr(Runner, "decode", lambda self, lanes, *a, **k: (
            steps.append(list(lanes)) if self is two.runner else None) or decode(self, lanes, *a, **k))
        # a wave's two streams run at different depths: interleaved launches
        monkeypatch.setattr(Runner, "interleave", lambda self, lanes, *a, **k: (
            steps.append(list(lanes)) if self is two.runner else None) or interleave(self, lanes, *a, **k))
        got = two.generate_batch(prompts, **kw)
        monkeypatch.undo()
        assert prefills == [(0, 1), (0, 1), 0]  # three waves, the last of one prompt
        assert max(map(len, steps)) == 2 and all(set(s) <= {0, 1} for s in steps)
        assert two.runner.lanes.free == 2
        one_wave = model.generate_batch(prompts, **kw)
        for i, (g, w) in enumerate(zip(got, one_wave)):
            _same(g, w)
            _same(g, two.generate(prompts[i], loops=kw["per_lane_loops"][i], max_tokens=7, temperature=0.9,
                                  top_k=40, seed=kw["seed"][i]))


def test_a_closed_model_frees_its_runner_at_once(tiny_path):
    """After streams and batches (waves included), nothing refers back to the runner: close
    frees it with the collector off (on CUDA its graphs go with it, never in a collection that
    could run during another model's capture: tests/worker/test_gpu_engine.py)."""
    import gc
    import weakref
    gc.disable()
    try:
        m = Model(tiny_path, max_seq_len=64, n_slots=2)
        m.generate([3, 17, 42], loops=3, max_tokens=4)
        m.generate_batch([[1, 2], [3, 4, 5], [6]], per_lane_loops=[2, 4, 1], max_tokens=4)
        refs = [weakref.ref(m.runner), weakref.ref(m.runner.engine)]
        m.close()
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_mixed_depths_replay_each_iteration_over_the_rows_that_need_it(tiny_path):
    """Through the runner's batch stage graphs (EagerGraphs): the batcher orders rows deepest
    first, and iteration i replays the smallest bucket holding the rows deeper than i; every
    stream still gets exactly its standalone tokens."""
    jobs = [([3, 17, 42], 1), ([9, 8, 7, 6], 8), ([5] * 6, 2), ([1, 2], 8), ([77, 78, 79], 3), ([4, 4], 1)]
    with Model(tiny_path, max_seq_len=64, n_slots=8) as m:
        want = [m.generate(p, loops=L, max_tokens=6)[len(p):] for p, L in jobs]
        graphs = with_stage_graphs(m, range(1, 9))
        b = Batcher(m.runner, interleave=False)  # the whole-token steps (interleaving: below)
        got = {}
        for lane, (p, L) in enumerate(jobs):
            ids, _ = b.join(m.start(m.make_request(p, loops=L, max_tokens=6), lane))
            got[lane] = list(ids)
        while b:
            for lane, (ids, _) in b.step().items():
                got[lane].extend(ids)
        assert [got[i] for i in range(len(jobs))] == want
        first = [(bk, s) for bk, s in graphs.replayed("batch")][:10]
    # six rows in the 8 bucket: iteration 0 all six, 1 four (bucket 4), 2 three (4), 3..7 two (2)
    assert first == [(8, "prelude"), (8, 0), (4, 1), (4, 2), (2, 3), (2, 4), (2, 5), (2, 6), (2, 7), (8, "coda")]


def _run_batcher(m, jobs, max_tokens, interleave=True, sizes=None):
    """Every job joined at once, the batcher stepped to its end: each job's tokens (sizes: each
    step's (rows of its launch, streams with a token))."""
    b = Batcher(m.runner, interleave=interleave)
    got = {}
    for lane, (p, L) in enumerate(jobs):
        ids, _ = b.join(m.start(m.make_request(p, loops=L, max_tokens=max_tokens), lane))
        got[lane] = list(ids)
    while b:
        updates = b.step()
        for lane, (ids, _) in updates.items():
            got[lane].extend(ids)
        if sizes is not None:
            sizes.append((b.rows_stepped, len(updates)))
    return [got[i] for i in range(len(jobs))]


def test_interleaved_rows_each_run_their_own_iterations(tiny_path):
    """Through the interleaved stage graphs (EagerGraphs): one launch is a number of passes
    over every row, each at its own iteration, and only the rows whose token ends get the
    coda; a shallow stream decodes several tokens while a deep one decodes one, and every
    stream gets exactly its standalone tokens."""
    jobs = [([3, 17, 42], 1), ([9, 8, 7, 6], 8), ([5] * 6, 2), ([1, 2], 8), ([77, 78, 79], 3), ([4, 4], 1)]
    with Model(tiny_path, max_seq_len=64, n_slots=8) as m:
        want = [m.generate(p, loops=L, max_tokens=6)[len(p):] for p, L in jobs]
        graphs = with_stage_graphs(m, range(1, 9))
        calls = []
        interleave = m.runner.interleave
        m.runner.interleave = lambda lanes, tokens, positions, depths, starts, passes, **k: (
            calls.append((list(depths), list(starts), passes)) or interleave(lanes, tokens, positions, depths,
                                                                              starts, passes, **k))
        sizes = []
        assert _run_batcher(m, jobs, 6, sizes=sizes) == want
        replays = graphs.replayed("interleaved")
        # once only the two depth-8 streams are left, at a token boundary: whole-token steps
        assert {bk for bk, _ in graphs.replayed("batch")} <= {2}
        overhead = m.runner.pass_overhead
    depths, starts, passes = calls[0]
    assert starts == [0] * 6 and passes == chunk_passes(depths, overhead)
    # the first launch: every row embeds its token, `passes` passes, the coda for the rows done
    first = replays[:passes + 3]
    assert first == [(8, s) for s in ["prelude", *["iter"] * passes, "save", "coda"]]
    assert sum(s == "iter" for _, s in replays) == sum(c[2] for c in calls)  # every pass replayed
    # the shallow streams decoded while the deep ones were mid-token: some launch had rows midway
    assert any(any(starts) for _, starts, _ in calls)
    # a step's batch is its launch's rows, whether or not each row's token ended in it
    assert sizes[0][0] == 6 and any(rows > tokens for rows, tokens in sizes)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_interleaved_equals_whole_token_steps(model, sampling):
    """The same streams, interleaved and in whole-token steps: the same tokens and stats."""
    reqs = [_request(model, sampling, **kw) for *_, kw in SCHEDULE]
    schedule = [s[:3] for s in SCHEDULE]
    got = [_batched(model, reqs, schedule, poison=False, interleave=mode) for mode in (True, False)]
    for i in got[0]:
        (a_ids, a_fin, _), (b_ids, b_fin, _) = got[0][i], got[1][i]
        if SCHEDULE[i][2] is not None:  # cancelled at a step count, which the two modes reach apart
            continue
        assert a_ids == b_ids and (a_fin.reason, a_fin.stats) == (b_fin.reason, b_fin.stats), i


def test_chunk_passes():
    # a quarter each at 4, 8, 16, 32 with the bench-285m's overhead (two prelude layers and
    # the head, 3.3 passes): 8 passes, the depth-4 rows waiting half of them
    assert chunk_passes([4] * 16 + [8] * 16 + [16] * 16 + [32] * 16, 3.3) == 8
    assert chunk_passes([5], 3.3) == 5 and chunk_passes([3, 3, 3], 0.0) == 3
    assert chunk_passes([1, 32], 0.0) == 1      # no overhead: nothing is worth waiting for
    assert chunk_passes([1, 32], 10.0) == 32    # a costly launch: the short row waits
    for bad in ([], [0, 3]):
        with pytest.raises(ValueError, match="at least one iteration left"):
            chunk_passes(bad, 1.0)


def test_host_cost_turns_into_passes():
    """An exit launch's host preparation in passes of device time: the running mean of host
    time over the device time of one pass, which lets the launches run every row to its
    token's end where the host, not the device, bounds them."""
    from tinyloop.worker.generation.batcher import HostCost
    c = HostCost()
    assert c.passes == 0.0
    for _ in range(40):
        c.update(1e-3, 1e-3, 4.0)  # 1 ms of host work against 4 passes in 1 ms
    assert c.passes == pytest.approx(4.0, rel=1e-3)
    c.update(-1.0, 1e-3, 4.0)
    c.update(1e-3, 0.0, 4.0)
    assert c.passes == pytest.approx(4.0, rel=1e-3)  # unmeasured launches change nothing
    c.update(10.0, 1e-6, 1.0)
    assert c.passes <= HostCost.CAP
    # tokens exiting after 3 or 4 iterations, and rows carried over with 1 left: the device
    # alone is cheapest at 3 passes; with the host's 5 passes every token ends in the launch
    rows = [3] * 30 + [4] * 20 + [1] * 14
    assert chunk_passes(rows, 1.04) == 3
    assert chunk_passes(rows, 1.04 + 5.0) == 4


def test_expected_remaining():
    assert expected_remaining([], 16, 0) == 16          # a first token: its depth
    assert expected_remaining([3, 7, 2, 4, 5], 16, 0) == 7  # the deepest of the latest four
    assert expected_remaining([9, 3, 2, 4, 5], 16, 2) == 3  # (9 is older than the latest four)
    assert expected_remaining([3, 4], 16, 4) == 12       # past every guess: up to its depth


def test_an_exit_stream_waits_for_the_rows_midway(model):
    """A stream with an early-exit rule that the passes cannot check (kl reads the next-token
    distribution) runs the whole-token (exit) step: it joins a batch of interleaved rows, those
    midway finish their token first (one draining launch), and every stream still gets its
    standalone tokens."""
    # five shallow streams and a deep one: a launch runs the shallow rows' two passes
    jobs = [([3, 17, 42], 2), ([9, 8, 7, 6], 7), ([1, 2], 2), ([4] * 5, 2), ([8, 9], 2), ([6, 6, 1], 2)]
    want = [model.generate(p, loops=L, max_tokens=8)[len(p):] for p, L in jobs]
    rule = dict(early_exit={"criterion": "kl", "threshold": 1e-30})  # exits at no iteration
    ex_prompt = [5, 6, 7]
    ex_want = model.generate(ex_prompt, loops=4, max_tokens=5, **rule)[len(ex_prompt):]
    b = Batcher(model.runner)
    got = {}
    for lane, (p, L) in enumerate(jobs):
        ids, _ = b.join(model.start(model.make_request(p, loops=L, max_tokens=8), lane))
        got[lane] = list(ids)
    for lane, (ids, _) in b.step().items():
        got[lane].extend(ids)
    assert b._iters  # the deep row is midway through a token
    drains = []
    launch = b._launch_interleaved
    b._launch_interleaved = lambda lanes, *a, drain=False: drains.append((lanes, drain)) or launch(lanes, *a, drain=drain)
    ids, _ = b.join(model.start(model.make_request(ex_prompt, loops=4, max_tokens=5, **rule), 6))
    got[6] = list(ids)
    while b:
        for lane, (ids, _) in b.step().items():
            got[lane].extend(ids)
    assert [got[i] for i in range(len(jobs))] == want and got[6] == ex_want
    assert ([1], True) in drains  # the deep row alone finished its token before the exit step


def test_interleave_refuses_bad_rows(model):
    r = model.runner
    for kw, match in [(dict(starts=[0, 2], depths=[2, 2]), "starts inside its depth"),
                      (dict(starts=[0, 0], depths=[2, 99]), "starts inside its depth"),
                      (dict(passes=0), "at least one pass"),
                      (dict(lanes=[1, 1]), "each lane once"),
                      (dict(starts=[0]), "as many tokens")]:
        args = dict(lanes=[0, 1], tokens=[3, 4], positions=[5, 5], depths=[2, 3], starts=[0, 0], passes=1) | kw
        with pytest.raises(ValueError, match=match):
            r.interleave(**args)


def test_interleaved_on_every_model_option(config_path):
    """Every model option (prelude and coda or none, GQA, sandwich norms, the loop's final norm,
    a two-layer block): streams at four depths interleaved, each with its tokens alone."""
    jobs = [([3, 17, 42], 1), ([9, 8, 7, 6], 4), ([5] * 6, 2), ([1, 2], 3)]
    with Model(config_path, max_seq_len=64, n_slots=4) as m:
        want = [m.generate(p, loops=L, max_tokens=7)[len(p):] for p, L in jobs]
        calls = []
        interleave = m.runner.interleave
        m.runner.interleave = lambda *a, **k: calls.append(a[5]) or interleave(*a, **k)
        assert _run_batcher(m, jobs, 7) == want
        assert calls  # the streams did interleave


def _run_exit_batcher(m, jobs, max_tokens, interleave=True):
    """Every job (prompt, loops, exit rule or None) joined at once, stepped to its end: each
    job's (tokens, finish stats)."""
    b = Batcher(m.runner, interleave=interleave, interleave_exits=True)
    got, fin = {}, {}
    for lane, (p, L, rule) in enumerate(jobs):
        ids, f = b.join(m.start(m.make_request(p, loops=L, max_tokens=max_tokens, early_exit=rule), lane))
        got[lane], fin[lane] = list(ids), f
    while b:
        for lane, (ids, f) in b.step().items():
            got[lane].extend(ids)
            fin[lane] = f
    return [(got[i], fin[i].stats) for i in range(len(jobs))]


LATENT = {"criterion": "latent", "threshold": 0.3}
EXIT_JOBS = [([3, 17, 42], 8, LATENT), ([9, 8, 7, 6], 8, None), ([5] * 6, 6, {**LATENT, "min_loops": 3}),
             ([1, 2], 3, None), ([77, 78, 79], 8, {"criterion": "latent", "threshold": 0.5}), ([4, 4], 5, LATENT)]


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "stage-graphs"])
def test_interleaved_exit_streams_equal_standalone(tiny_path, graphed):
    """Streams with latent exit rules beside streams without, at mixed depths, in interleaved
    launches that check the rules inside the passes (eagerly, asked for: a runner without graphs
    runs the whole-token exit step by default; and through the interleaved stage graphs): each
    stream's tokens and stats (iterations histogram included) are those of its run alone, and
    the launches really end tokens early."""
    with Model(tiny_path, max_seq_len=64, n_slots=8) as m:
        want = [(list(m.generate(p, loops=L, max_tokens=9, early_exit=r)[len(p):]),
                 m.generate(p, loops=L, max_tokens=9, early_exit=r).stats) for p, L, r in EXIT_JOBS]
        if graphed:
            graphs = with_stage_graphs(m, range(1, 9))
            graphs.fuse_after = 2  # a short run: its sequences fuse from their second launch
        calls = []
        interleave = m.runner.interleave

        def logged(*a, exits=None, **k):
            out = interleave(*a, exits=exits, **k)
            calls.append((exits is not None, out))  # its ends are read by the batcher's next step
            return out
        m.runner.interleave = logged
        got = _run_exit_batcher(m, EXIT_JOBS, 9)
        if graphed:
            stages = {s for _, s in graphs.replayed("interleaved")}
            assert {"exit_start", "iter_exit", "exit_end"} <= stages
            assert graphs.fused  # launches of a sequence seen before ran as its one graph (its stages' kernels)
    for (g_ids, g_stats), (w_ids, w_stats) in zip(got, want):
        assert g_ids == w_ids
        assert g_stats == w_stats
    hist = [st["iterations_histogram"] for (_, st), (_, _, r) in zip(want, EXIT_JOBS) if r is not None]
    assert any(sum(h[:-1]) for h in hist), "no token exited: the case tests little"
    assert calls[0][0]  # while exit streams run, their launches check the rules
    assert all(out.pending is None for _, out in calls)  # every launch's ends were read
    # some launch ended a token by its rule, short of its depth
    assert any(f and d < 8 for ex, out in calls if ex for d, f in zip(out.depths, out.finished))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_exit_rows_that_all_end_each_launch_move_on_on_the_device(tiny_path, monkeypatch, sampled):
    """Streams whose every token stops at its rule's earliest decision (latent < 1: two
    iterations) end all their rows in each interleaved launch: the batcher launches the same
    rows again at once, one token on (`Batcher._step_steady`), and the runner moves them on on
    the device instead of loading them again (the interleaved "next" stage), until a stream
    ends (its max_tokens, or a stop token read after the next launch went out) and the rows
    change. Sampled streams take the general step, and their sampled tokens move in before the
    launch (`InterleavedStep.reload_next`). Each stream's tokens, finish and stats are those of
    its run alone."""
    from tinyloop.worker.runner.stages import InterleavedStep
    rule = {"criterion": "latent", "threshold": 1.0}
    jobs = [([3, 17, 42], 8, 12), ([9, 8, 7, 6], 8, 16), ([5] * 6, 6, 7), ([77, 78, 79], 7, 14)]
    with Model(tiny_path, max_seq_len=64, n_slots=8) as m:
        kw = [dict(temperature=0.9, top_k=40, seed=i) if sampled else {} for i in range(len(jobs))]
        stop = list(m.generate(jobs[1][0], loops=8, max_tokens=16, early_exit=rule, **kw[1]))[len(jobs[1][0]) + 9]
        reqs = [m.make_request(p, loops=L, max_tokens=n, early_exit=rule, stop_token_ids=[stop] if i == 1 else [],
                               **kw[i]) for i, (p, L, n) in enumerate(jobs)]
        want = [m.generate(p, loops=L, max_tokens=n, early_exit=rule, stop_token_ids=[stop] if i == 1 else [],
                           **kw[i]) for i, (p, L, n) in enumerate(jobs)]
        assert want[1].finish_reason == "stop" and len(want[1]) < len(jobs[1][0]) + 16
        graphs = with_stage_graphs(m, range(1, 9))
        moved, loads, steady = [], [], []
        reload_next, load = InterleavedStep.reload_next, InterleavedStep.load
        monkeypatch.setattr(InterleavedStep, "reload_next", lambda self, t: moved.append(1) or reload_next(self, t))
        monkeypatch.setattr(InterleavedStep, "load", lambda self, *a, **k: loads.append(1) or load(self, *a, **k))
        b = Batcher(m.runner, interleave_exits=True)
        step_steady = b._step_steady
        b._step_steady = lambda st: steady.append(len(st.lanes)) or step_steady(st)
        got, fin = {}, {}
        for lane, req in enumerate(reqs):
            ids, _ = b.join(m.start(req, lane))
            got[lane] = list(ids)
        while b:
            for lane, (ids, f) in b.step().items():
                got[lane].extend(ids)
                fin[lane] = f
        # the launch's own "next" stage moves the rows on (its tokens: the launch before's greedy)
        moved += [s for _, s in graphs.replayed("interleaved") if s == "next"]
    for lane, w in enumerate(want):
        assert jobs[lane][0] + got[lane] == list(w), lane
        assert (fin[lane].reason, fin[lane].stats) == (w.finish_reason, w.stats), lane
    assert all(w.stats["iterations_histogram"][1] == w.stats["completion_tokens"] - 1 for w in want)  # every token: 2
    assert set(steady) >= ({4, 3} if not sampled else set()) and (not sampled or not steady), steady
    assert len(moved) >= 8 and len(moved) > len(loads), (len(moved), len(loads))


@pytest.mark.parametrize("threshold", [0.1, 0.05])
def test_exit_rows_that_end_apart_move_on_on_the_device(tiny_path, monkeypatch, threshold):
    """Streams whose tokens stop at different depths (latent < 0.3 or < 0.05), in launches of
    fewer passes than some rows need: each launch ends some rows' tokens and not others', and
    the next launch is the same rows made on the device (`Batcher._step_steady`, the "next"
    stage), each ended row one token on and each other going on from where it stopped, with
    no load from the host. Each stream's tokens, finish and stats are those of its run alone."""
    from tinyloop.worker.runner.stages import InterleavedStep
    rule = {"criterion": "latent", "threshold": threshold}
    jobs = [([3, 17, 42], 8, 14), ([9, 8, 7, 6], 8, 16), ([5] * 6, 6, 11), ([77, 78, 79], 7, 15)]
    with Model(tiny_path, max_seq_len=64, n_slots=8) as m:
        want = [m.generate(p, loops=L, max_tokens=n, early_exit=rule) for p, L, n in jobs]
        graphs = with_stage_graphs(m, range(1, 9))
        graphs.fuse_after = 2
        loads, partial = [], []
        load = InterleavedStep.load
        monkeypatch.setattr(InterleavedStep, "load", lambda self, *a, **k: loads.append(1) or load(self, *a, **k))
        b = Batcher(m.runner, interleave_exits=True)
        step_steady = b._step_steady
        b._step_steady = lambda st: partial.append(not all(st.out.finished)) or step_steady(st)
        got, fin = {}, {}
        for lane, (p, L, n) in enumerate(jobs):
            ids, _ = b.join(m.start(m.make_request(p, loops=L, max_tokens=n, early_exit=rule), lane))
            got[lane] = list(ids)
        while b:
            for lane, (ids, f) in b.step().items():
                got[lane].extend(ids)
                fin[lane] = f
        nexts = [s for _, s in graphs.replayed("interleaved") if s == "next"]
    for lane, w in enumerate(want):
        assert jobs[lane][0] + got[lane] == list(w), lane
        assert (fin[lane].reason, fin[lane].stats) == (w.finish_reason, w.stats), lane
    depths = {d for w in want for d, n in enumerate(w.stats["iterations_histogram"], 1) if n}
    assert len(depths) > 1, depths  # the tokens stop apart
    assert sum(partial) >= 4, partial  # launches on the device after one that ended some rows only
    assert len(nexts) > 2 * len(loads), (len(nexts), len(loads))


@pytest.mark.parametrize("span", [None, "min"])
def test_lone_exit_stream_runs_ahead_on_its_graphs_and_equals_standalone(tiny_path, span):
    """One exit stream in the batcher on a graphed runner (stand-ins on CPU) steps on the
    one-row graphs, each step launched before the one before it has ended (solo_exit.py); a
    second stream joining midway makes the runner end the pending step before the two run
    together. Both streams' tokens and stats are those of their runs alone, with the span
    guessed and with every token going on past it (each launched-ahead step then runs again)."""
    from tinyloop.worker.runner.solo_exit import SoloExit
    rule = {"criterion": "latent", "threshold": 0.3}
    jobs = [([3, 17, 42], 8, rule, 14), ([9, 8, 7, 6], 8, rule, 5)]
    with Model(tiny_path, max_seq_len=64, n_slots=4) as m:
        runs = [(p, m.generate(p, loops=L, max_tokens=n, early_exit=rl)) for p, L, rl, n in jobs]
        want = [(list(g[len(p):]), g.stats) for p, g in runs]
        with_stage_graphs(m, range(1, 9))
        r = m.runner
        r._solo = solo = SoloExit(r.engine, r.graphs, r.ops.exit_check, span=span)
        b = Batcher(r, interleave_exits=True)
        got, fin = {}, {}
        for lane, (p, L, rl, n) in enumerate(jobs[:1]):
            ids, f = b.join(m.start(m.make_request(p, loops=L, max_tokens=n, early_exit=rl), lane))
            got[lane], fin[lane] = list(ids), f
        steps = 0
        while b:
            for lane, (ids, f) in b.step().items():
                got[lane].extend(ids)
                fin[lane] = f
            steps += 1
            if steps == 6:  # the lone stream's step is pending now: the join must not see it so
                assert r._solo_last is not None
                p, L, rl, n = jobs[1]
                ids, f = b.join(m.start(m.make_request(p, loops=L, max_tokens=n, early_exit=rl), 1))
                got[1], fin[1] = list(ids), f
        assert r._solo_last is None
    for lane, (w_ids, w_stats) in enumerate(want):
        assert got[lane] == w_ids
        assert fin[lane].stats == w_stats
    assert solo.counts["ahead"] >= 3, solo.counts
    if span == "min":
        assert solo.counts["relaunched"] > 0, solo.counts


def test_interleave_refuses_rules_it_cannot_check(model):
    r = model.runner
    kl = model.make_request([1, 2], loops=4, max_tokens=2, early_exit={"criterion": "kl", "threshold": 0.1}).early_exit
    rc = model.make_request([1, 2], loops=4, max_tokens=2,
                            early_exit={"criterion": "latent", "threshold": 0.1, "cache": "recompute"}).early_exit
    args = dict(lanes=[0, 1], tokens=[3, 4], positions=[5, 5], depths=[4, 4], starts=[0, 0], passes=1)
    for exits, match in (([kl, None], "kl / copy"), ([None, rc], "latent / recompute"), ([None], "one exit rule")):
        with pytest.raises(ValueError, match=match):
            r.interleave(**args, exits=exits)


def test_exit_streams_interleave_by_default_only_with_graphs(tiny_path):
    with Model(tiny_path, max_seq_len=64, n_slots=4) as m:
        assert not Batcher(m.runner).interleave_exits and Batcher(m.runner, interleave_exits=True).interleave_exits
        with_stage_graphs(m, range(1, 5))
        assert Batcher(m.runner).interleave_exits
        assert not Batcher(m.runner, interleave=False, interleave_exits=True).interleave_exits
