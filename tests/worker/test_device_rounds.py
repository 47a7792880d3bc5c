"""Speculative chains as whole rounds on the device (runner/rounds.py), run eagerly here (the
GPU replays the same round as one graph): greedy tokens equal generate(loops=verify_loops)
with the next round launched before the host reads this one; sampled rounds decide exactly as
the host-driven sampled rounds do (the same draws at the same positions); each round's work
is every chunk token's verify_loops iterations once, a stream that ends leaves its launched
round harmless, and interleaved lanes keep their own state and parameters."""
import dataclasses

import pytest

from model_zoo import CONFIGS, damped_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.settings import Settings
from tinyloop.worker.runner.engine import Counters
from tinyloop.worker.runner.sampler import RowSampling, SamplingParams

PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128], [250, 11]]
ON = Settings(device_rounds=True)


def interleaved(m: Model, reqs: list) -> list[list[int]]:
    """The requests' streams on lanes 0, 1, ... stepped in turn, one item each: every stream's
    prompt and tokens."""
    streams = [m.stream(req, lane) for lane, req in enumerate(reqs)]
    got = [list(req.prompt) for req in reqs]
    live = [True] * len(reqs)
    while any(live):
        for i, s in enumerate(streams):
            if live[i]:
                try:
                    got[i] += next(s)
                except StopIteration:
                    live[i] = False
    return got


@pytest.fixture(scope="module")
def rounds_model(ckpt_dir):
    path = damped_checkpoint(ckpt_dir / "damped-rounds.tinyloop", CONFIGS["gqa-prelude-coda"], 3, 0.03)
    with Model(path, max_seq_len=96, n_slots=2, settings=ON) as m:
        yield m


def test_rounds_equal_generate(rounds_model):
    m = rounds_model
    assert m.runner.settings.device_rounds
    accepted = drafted = 0
    for prompt, (Ld, Lv, ahead) in zip(PROMPTS, [(2, 6, 4), (1, 5, 3), (3, 8, 6)]):
        want = m.generate(prompt, loops=Lv, max_tokens=20)
        for n in (1, 2, 5, 20):
            out = m.generate_speculative(prompt, max_tokens=n, draft_loops=Ld, verify_loops=Lv, draft_ahead=ahead)
            assert out == want[:len(prompt) + n] and out.stats["completion_tokens"] == n
        accepted += out.stats["accepted_tokens"]
        drafted += out.stats["drafted_tokens"]
    assert 0 < accepted < drafted, "acceptance must be partial for the test to cover both branches"


def test_stop_token_and_the_round_left_running(rounds_model):
    """A stop token inside a round ends the stream; the round launched ahead of it runs
    unread, and the next request on the lane is unaffected."""
    m, prompt = rounds_model, PROMPTS[0]
    full = m.generate(prompt, loops=6, max_tokens=24)[len(prompt):]
    for i in (1, 6, 13):
        stop = full[i]
        want = m.generate(prompt, loops=6, max_tokens=24, stop_token_ids=[stop])
        out = m.generate_speculative(prompt, max_tokens=24, draft_loops=2, verify_loops=6, draft_ahead=4,
                                     stop_token_ids=[stop])
        assert out == want and out.finish_reason == "stop"
    assert m.generate_speculative(PROMPTS[1], max_tokens=12, draft_loops=2, verify_loops=6) == \
        m.generate(PROMPTS[1], loops=6, max_tokens=12)


def test_each_round_runs_every_chunk_token_verify_loops_once(rounds_model):
    m, prompt = rounds_model, PROMPTS[1]
    r = m.runner
    lane = r.lanes.acquire()
    try:
        r.prefill(lane, prompt, 6)
        before = r.counters.snapshot()
        out = r.chain_round(lane, 2, 6, 4, state=(5, len(prompt)))
        assert r.counters.since(before) == out.work == Counters(5 * 2 + 4, 5 * 6)
        n, toks = out.result()
        assert 0 <= n <= 4 and len(toks) == n + 1
    finally:
        r.lanes.release(lane)


def test_lanes_keep_their_own_round_state(rounds_model):
    """Two streams' rounds interleaved, each launched ahead of the other's read: each lane's
    rounds start where its own last round left it."""
    m = rounds_model
    spec = {"draft_loops": 2, "verify_loops": 6, "draft_ahead": 3}
    reqs = [m.make_request(p, max_tokens=16, speculative=spec) for p in PROMPTS[:2]]
    got = interleaved(m, reqs)
    for p, g in zip(PROMPTS[:2], got):
        assert g == m.generate(p, loops=6, max_tokens=16)


def test_a_round_past_the_cache_is_refused_and_streams_near_the_end_fall_back(rounds_model):
    m = rounds_model
    with pytest.raises(ValueError, match="passes the cache"):
        m.runner.chain_round(0, 2, 6, 4, state=(1, m.max_seq_len - 3))
    prompt = [7] * (m.max_seq_len - 12)
    out = m.generate_speculative(prompt, max_tokens=10, draft_loops=2, verify_loops=6, draft_ahead=4)
    assert out == m.generate(prompt, loops=6, max_tokens=10)


def test_settings_and_refusals(tiny_path):
    env = Settings.from_env({"TINYLOOP_BATCH_INVARIANT": "1", "TINYLOOP_DEVICE_ROUNDS": "0"})
    assert env.batch_invariant is True and env.device_rounds is False
    assert Settings.from_env({}).batch_invariant is False and Settings.from_env({}).device_rounds is None
    with pytest.raises(ValueError, match="needs the triton backend"):
        Model(tiny_path, max_seq_len=32, batch_invariant=True)
    with Model(tiny_path, max_seq_len=32) as m:  # CPU: no graphs, so no device rounds unless asked
        assert not m.runner.settings.device_rounds


SAMPLED = [dict(temperature=0.8, top_k=50, top_p=0.95), dict(temperature=1.0, top_k=0),
           dict(temperature=0.6, top_k=5), dict(temperature=1.3, top_k=0, top_p=0.8)]


def host_rounds(m: Model, fn, *args, **kw):
    """fn(*args, **kw) with the sampled chain's rounds driven by the host (device_rounds off)."""
    r = m.runner
    r.settings = dataclasses.replace(r.settings, device_rounds=False)
    try:
        return fn(*args, **kw)
    finally:
        r.settings = dataclasses.replace(r.settings, device_rounds=True)


@pytest.mark.parametrize("sampling", SAMPLED, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_sampled_rounds_decide_as_the_host_driven_rounds(rounds_model, sampling):
    """Every draft, acceptance, residual draw and bonus of a sampled round on the device is the
    host-driven round's: the same tokens and the same acceptance figures, for any max_tokens
    (the round launched ahead of the last read runs unread)."""
    m = rounds_model
    keys = set(m.runner._rounds)
    accepted = drafted = 0
    for prompt, (Ld, Lv, ahead), seed in zip(PROMPTS, [(2, 6, 4), (1, 5, 3), (3, 8, 6)], (7, 1234, 99)):
        spec = dict(draft_loops=Ld, verify_loops=Lv, draft_ahead=ahead, seed=seed, **sampling)
        for n in (1, 5, 24):
            want = host_rounds(m, m.generate_speculative, prompt, max_tokens=n, **spec)
            out = m.generate_speculative(prompt, max_tokens=n, **spec)
            assert out == want, (n, prompt)
            for stat in ("completion_tokens", "accepted_tokens", "drafted_tokens", "verify_steps"):
                assert out.stats[stat] == want.stats[stat], stat
        accepted += out.stats["accepted_tokens"]
        drafted += out.stats["drafted_tokens"]
    assert 0 < accepted < drafted, "acceptance must be partial for the test to cover both branches"
    new = set(m.runner._rounds) - keys
    assert new and all(key[3] is not None for key in new), "the sampled streams must have run device rounds"


def test_sampled_lanes_keep_their_own_parameters(rounds_model):
    """Two sampled streams with other temperatures and seeds on one round (their flags agree:
    one graph), interleaved, each launched ahead of the other's read: each decides with its
    own parameters, as its stream does alone on the host-driven rounds."""
    m = rounds_model
    params = [dict(temperature=0.7, top_k=40, top_p=0.95, seed=3), dict(temperature=1.2, top_k=50, top_p=0.9, seed=11)]
    flags = {RowSampling.flags([SamplingParams(**{k: v for k, v in kw.items() if k != "seed"})], 256)[:2]
             for kw in params}
    assert len(flags) == 1, "the two streams must share one round (and its graph)"
    spec = {"draft_loops": 2, "verify_loops": 6, "draft_ahead": 3}
    reqs = [m.make_request(p, max_tokens=16, speculative=spec, **kw) for p, kw in zip(PROMPTS[:2], params)]
    got = interleaved(m, reqs)
    for p, kw, g in zip(PROMPTS[:2], params, got):
        assert g == host_rounds(m, m.generate_speculative, p, max_tokens=16, **spec, **kw)


def test_a_round_refuses_a_repetition_penalty(rounds_model):
    """A penalty reads the tokens so far, which a round on the device does not have (the API
    refuses it for any speculative request)."""
    with pytest.raises(ValueError, match="no repetition penalty"):
        rounds_model.runner.chain_round(0, 2, 6, 4, state=(1, 5),
                                        sampling=SamplingParams(temperature=0.8, repetition_penalty=1.2))


def test_fused_sampled_rounds_decide_as_the_host_driven_rounds(ckpt_dir, monkeypatch):
    """With Settings.fused_sampler the rounds on the device and the host-driven ones both draw
    through the fused launches (counted on the real functions) and still decide alike."""
    from tinyloop.worker.runner import rounds as rounds_mod
    calls = []

    def counted(fn):
        def run(*args, **kw):
            calls.append(kw.get("fused", args[2] if len(args) > 2 else False))
            return fn(*args, **kw)
        return run
    monkeypatch.setattr(rounds_mod, "draw", counted(rounds_mod.draw))
    path = damped_checkpoint(ckpt_dir / "damped-fused-rounds.tinyloop", CONFIGS["gqa-prelude-coda"], 3, 0.03)
    with Model(path, max_seq_len=96, n_slots=2, settings=ON.replace(fused_sampler=True)) as m:
        spec = dict(draft_loops=2, verify_loops=6, draft_ahead=4, seed=7, **SAMPLED[0])
        want = host_rounds(m, m.generate_speculative, PROMPTS[0], max_tokens=12, **spec)
        out = m.generate_speculative(PROMPTS[0], max_tokens=12, **spec)
        assert out == want and out.stats["accepted_tokens"] == want.stats["accepted_tokens"]
        assert any(key[3] is not None for key in m.runner._rounds), "the stream must have run device rounds"
    assert calls and all(calls), "every draft of a device round draws through the fused launch"
