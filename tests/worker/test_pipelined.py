"""The pipelined decode loop (generate.decode_steps): the step for a decided token is launched
before the host reads the token, and dropped when that token ends the stream. It must give
exactly what the plain loop gives: tokens, the logits of every decision, finish and stats,
and leave the state (position, count) as the plain loop leaves it."""
import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.api import drain
from tinyloop.worker.generation.decode import decode_steps

PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]]
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3, seed=11)


@pytest.fixture(scope="module")
def model(tiny_path):
    with Model(tiny_path, max_seq_len=64, n_slots=2) as m:
        yield m


def run(model, req, pipelined: bool, lane: int = 0):
    """-> (ids, finish, logits of every decision, the finished state, engine work)."""
    st = model.start(req, lane)
    seen: list[torch.Tensor] = []
    sample = st.sample

    def recording():
        seen.append(st.logits.clone())
        return sample()
    st.sample = recording
    before = model.counters.snapshot()
    gen = decode_steps(st, pipelined)
    ids = []
    try:
        while True:
            ids.extend(next(gen))
    except StopIteration as stop:
        return ids, stop.value, seen, st, model.counters.since(before)


def assert_same(a, b):
    (ids, fin, logits, st, _), (ids2, fin2, logits2, st2, _) = a, b
    assert ids == ids2
    assert (fin.reason, fin.stats) == (fin2.reason, fin2.stats)
    assert len(logits) == len(logits2) and all(torch.equal(x, y) for x, y in zip(logits, logits2))
    assert st.logits is None and st2.logits is None  # a finished stream lets go of its logits
    assert st.pos == st2.pos and st.generated == st2.generated
    assert (st.seen is None and st2.seen is None) or torch.equal(st.seen, st2.seen)


def stop_at(model, req_kw, index):
    """A stop id taken from the stream's own output, so it stops mid-way."""
    ids = model.generate(**req_kw)[len(req_kw["prompt"]):]
    return ids[index]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("extra", [{}, dict(cache_window=4), dict(max_tokens=1)], ids=["full", "window", "one"])
def test_pipelined_equals_plain(model, sampling, extra):
    for lane, prompt in enumerate(PROMPTS):
        kw = dict(prompt=prompt, loops=3, max_tokens=12, **sampling) | extra
        req = model.make_request(**kw)
        a, b = run(model, req, True, lane), run(model, req, False, lane)
        assert_same(a, b)
        assert a[1].reason == "length" and a[4] == b[4]  # nothing speculated past max_tokens


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("window", [0, 4])
def test_stop_token_discards_the_launched_step(model, sampling, window):
    kw = dict(prompt=PROMPTS[1], loops=5, max_tokens=12, cache_window=window, **sampling)
    stop = stop_at(model, kw, 4)
    req = model.make_request(**kw, stop_token_ids=[stop])
    a, b = run(model, req, True), run(model, req, False)
    assert_same(a, b)
    assert a[1].reason == "stop" and a[0][-1] == stop
    # the stream's stats count the steps it needed; the engine ran one more (discarded)
    assert a[1].stats["loop_iterations"] == 5 + b[4].loop_iterations  # prompt + decode steps
    assert a[4].loop_iterations == b[4].loop_iterations + 5


def test_first_token_stop(model):
    kw = dict(prompt=PROMPTS[0], loops=4, max_tokens=8)
    stop = stop_at(model, kw, 0)
    req = model.make_request(**kw, stop_token_ids=[stop])
    a, b = run(model, req, True), run(model, req, False)
    assert_same(a, b)
    assert a[0] == [stop] and a[1].stats["completion_tokens"] == 1


def test_host_bound_streams_step_plainly(model):
    """The safety check and L scheduling decide on the host: those streams are not pipelined."""
    for extra in (dict(safety_check=True, safety_norm_threshold=1e6), dict(l_warmup_tokens=3, l_warmup_L=1)):
        req = model.make_request(PROMPTS[0], loops=4, max_tokens=8, **extra)
        assert not model.start(req).pipelinable
        assert_same(run(model, req, True), run(model, req, False))


def test_resume_after_a_stop_finish(model):
    """A discarded step wrote K/V past the stream's end in lane 0: a handle built and resumed
    there afterwards, and a fresh generate, are unaffected."""
    p = PROMPTS[1]
    kw = dict(prompt=p, loops=3, max_tokens=10)
    want = model.generate(**kw)
    stop = stop_at(model, kw, 2)
    out = model.generate(**kw, stop_token_ids=[stop])
    assert out.finish_reason == "stop" and out == want[:len(p) + 3]
    h = model.build_resume_handle(p, L_used=2, max_loops=8)
    try:
        assert model.generate(**kw, stop_token_ids=[stop]) == out
        assert model.resume_generate(h, 3, max_tokens=10) == want
        sampled = dict(max_tokens=10, temperature=0.8, seed=5)
        assert model.resume_generate(h, 6, **sampled) == model.generate(p, loops=6, **sampled)
        # a resume that itself stops on a token, then another resume on the same lane
        rstop = model.resume_generate(h, 3, max_tokens=10, stop_token_ids=[stop])
        assert rstop == out
        assert model.resume_generate(h, 3, max_tokens=10) == want
    finally:
        model.free_resume_handle(h)


def test_stream_lane_reuse_after_stop(model):
    """A stream on the lane a stopped stream left (its discarded step's K/V still there)."""
    kw = dict(prompt=PROMPTS[0], loops=4, max_tokens=10)
    stop = stop_at(model, kw, 3)
    req = model.make_request(**kw, stop_token_ids=[stop])
    assert drain(req.prompt, model.stream(req, lane=1)).finish_reason == "stop"
    short = model.make_request(PROMPTS[0][:3], loops=4, max_tokens=10)
    assert drain(short.prompt, model.stream(short, lane=1)) == model.generate(PROMPTS[0][:3], loops=4, max_tokens=10)
