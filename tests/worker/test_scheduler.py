"""The worker's scheduler on its own (no Ray, no asyncio): admission by free lanes and a bounded
queue, deadlines while queued, chunked prefill under a token budget, every stream kind stepped
beside the batch, fairness while a long prompt (or a resume's extension) prefills, cancellation
anywhere. Every stream's
tokens equal its standalone `Model.generate` (fp32, CPU: exactly)."""
from __future__ import annotations

import pytest

from tinyloop.worker import Model
from tinyloop.worker.serving.scheduler import (DeadlineExceeded, Failed, Job, QueueFull, Result, Scheduler,
                                               SchedulerOptions, Tokens)

LONG = [(7 * i + 3) % 256 for i in range(45)]


@pytest.fixture
def model(tiny_path):
    with Model(tiny_path, max_seq_len=128, n_slots=3) as m:
        yield m


def job(model, key, prompt, chunked=True, **kw):
    req = model.make_request(prompt, **kw)
    if req.speculative is not None:
        return Job(key, lambda lane: model.stream(req, lane), tokens=len(prompt))
    if chunked:
        return Job(key, lambda lane: model.start_chunked(req, lane), tokens=len(prompt))
    return Job(key, lambda lane: model.start(req, lane), tokens=len(prompt))


def run(s: Scheduler, limit: int = 10_000, on_step=None) -> tuple[dict, dict, list]:
    """Step until idle: {key: tokens}, {key: Finish / Result value / exception}, per-step stats."""
    tokens, ends, steps = {}, {}, []
    for i in range(limit):
        if not s.has_work():
            return tokens, ends, steps
        if on_step:
            on_step(i, s)
        for key, ev in s.step():
            if isinstance(ev, Tokens):
                tokens.setdefault(key, []).extend(ev.ids)
                if ev.finish is not None:
                    ends[key] = ev.finish
            elif isinstance(ev, Result):
                ends[key] = ev.value
            else:
                assert isinstance(ev, Failed)
                ends[key] = ev.error
        steps.append(s.last)
    raise AssertionError("the scheduler never went idle")


def alone(model, prompt, **kw):
    return model.generate(prompt, **kw)[len(prompt):]


def test_every_kind_of_stream_beside_the_batch_equals_its_standalone_run(model):
    kinds = {
        "plain": (LONG[:9], dict(loops=3, max_tokens=12)),
        "deep": (LONG[:20], dict(loops=8, max_tokens=10)),
        "sampled": (LONG[3:14], dict(loops=2, max_tokens=15, temperature=0.9, top_k=30, seed=11)),
        "warmup": (LONG[:7], dict(loops=6, max_tokens=12, l_warmup_tokens=4, l_warmup_L=2)),
        "safety": (LONG[:8], dict(loops=4, max_tokens=9, safety_check=True, safety_norm_threshold=1e9)),
        "window": (LONG[:30], dict(loops=3, max_tokens=14, cache_window=8)),
        "long": (LONG, dict(loops=4, max_tokens=8)),
    }
    s = Scheduler(model.runner, SchedulerOptions(step_tokens=6))
    for key, (prompt, kw) in kinds.items():
        s.submit(job(model, key, prompt, **kw))
    s.submit(job(model, "spec", LONG[:10], speculative=dict(draft_loops=2, verify_loops=5, draft_ahead=3),
                 max_tokens=11))
    stepping_alone, batched = set(), set()

    def seen(i, s):
        stepping_alone.update(s._alone)
        batched.update(s._batched.values())
    tokens, ends, steps = run(s, on_step=seen)
    for key, (prompt, kw) in kinds.items():
        assert tokens[key] == alone(model, prompt, **kw), key
        assert ends[key].reason == "length"
    # every kind but speculation (on an idle worker) decodes in the batcher
    assert {"plain", "deep", "sampled", "warmup", "safety", "window", "long"} <= batched and "spec" not in batched
    assert stepping_alone == {"spec"}
    assert tokens["spec"] == alone(model, LONG[:10], loops=5, max_tokens=11)
    # the budget held, but for the speculative stream (10 tokens), which starts whole in a step of its own
    assert sorted(st.prefill_tokens for st in steps)[-2:] == [6, 10]
    assert model.runner.lanes.free == 3


@pytest.mark.parametrize("step_tokens", [1, 7, 16, 45])
def test_a_chunked_prompt_equals_its_unchunked_run(model, step_tokens):
    s = Scheduler(model.runner, SchedulerOptions(step_tokens=step_tokens))
    s.submit(job(model, "a", LONG, loops=5, max_tokens=10, safety_check=True, safety_norm_threshold=1e9))
    tokens, _, steps = run(s)
    assert tokens["a"] == alone(model, LONG, loops=5, max_tokens=10)
    assert sum(st.prefill_tokens for st in steps) == len(LONG)
    assert sum(1 for st in steps if st.prefill_tokens) == -(-len(LONG) // step_tokens)


def test_streams_decoding_get_a_token_every_step_while_a_long_prompt_prefills(model):
    s = Scheduler(model.runner, SchedulerOptions(step_tokens=5))
    s.submit(job(model, "short", [1, 2, 3], loops=2, max_tokens=30))
    first = s.step()  # its first token as it joins the batcher, its second from the batched step
    assert [(k, len(ev.ids)) for k, ev in first] == [("short", 1), ("short", 1)]
    s.submit(job(model, "long", LONG, loops=2, max_tokens=4))
    got = []
    while True:
        events = dict(s.step())
        if "long" in events:
            break
        got.append(len(events["short"].ids))
    # 45 prompt tokens in chunks of 5 (the short stream's decode rows are beside the budget)
    assert len(got) == 8 and got == [1] * 8
    tokens, _, _ = run(s)
    assert s.runner.lanes.free == 3


def test_a_resume_extension_is_chunked_under_the_step_budget(model):
    """A resume of a 45-token handle rides along with a running stream: its extension runs in
    chunks of the step's budget (5 positions a step), the stream gets a token every step
    meanwhile, and the resume's tokens are `resume_generate`'s (and so a fresh generate's)."""
    h = model.build_resume_handle(LONG, L_used=2, max_loops=8)
    want = model.resume_generate(h, 6, max_tokens=8)[len(LONG):]
    assert want == alone(model, LONG, loops=6, max_tokens=8)
    s = Scheduler(model.runner, SchedulerOptions(step_tokens=5))
    s.submit(job(model, "short", [1, 2, 3], loops=2, max_tokens=40))
    s.step()
    rr = model.make_resume_request(h, 6, max_tokens=8)
    s.submit(Job("resume", lambda lane: model.start_resume_chunked(rr, lane), tokens=len(LONG)))
    got, budgets = [], []
    while True:
        events = dict(s.step())
        budgets.append(s.last.prefill_tokens)
        if "resume" in events:
            break
        got.append(len(events["short"].ids))
    assert got == [1] * 8 and budgets == [5] * 9  # 45 positions in chunks of 5, a token a step beside
    tokens, ends, _ = run(s)
    assert [events["resume"].ids[0], *tokens["resume"]] == want and ends["resume"].reason == "length"
    assert model.runner.lanes.free == 3


def test_admission_is_by_free_lanes_then_a_bounded_queue(model):
    s = Scheduler(model.runner, SchedulerOptions(max_queue=2))
    for i in range(5):
        s.submit(job(model, f"j{i}", [5, i + 1], loops=1, max_tokens=12))
    with pytest.raises(QueueFull, match="2 requests already wait"):
        s.submit(job(model, "j5", [5], loops=1, max_tokens=4))
    seen = []
    tokens, ends, _ = run(s, on_step=lambda i, s: seen.append((s.running, s.queued)))
    assert seen[1] == (3, 2)  # after the first step: three lanes busy, two waiting
    assert sorted(tokens) == [f"j{i}" for i in range(5)]
    assert all(tokens[f"j{i}"] == alone(model, [5, i + 1], loops=1, max_tokens=12) for i in range(5))


def test_a_deadline_passed_while_queued_ends_the_job_and_nothing_else(model):
    now = [0.0]
    s = Scheduler(model.runner, SchedulerOptions(), clock=lambda: now[0])
    for i in range(3):
        s.submit(job(model, f"busy{i}", [9, i], loops=1, max_tokens=20))
    s.submit(Job("late", lambda lane: pytest.fail("a job past its deadline must not start"), deadline=1.0))
    s.submit(job(model, "patient", [4, 4], loops=2, max_tokens=3))
    s.step()
    now[0] = 2.0
    tokens, ends, _ = run(s)
    assert isinstance(ends["late"], DeadlineExceeded) and "late" not in tokens
    assert tokens["patient"] == alone(model, [4, 4], loops=2, max_tokens=3)
    assert model.runner.lanes.free == 3


def test_cancel_anywhere_frees_the_lane_and_reports_nothing_more(model):
    s = Scheduler(model.runner, SchedulerOptions(step_tokens=4))
    s.submit(job(model, "prefilling", LONG, loops=3, max_tokens=5))
    s.submit(job(model, "batched", [1, 2, 3], loops=2, max_tokens=50))
    s.submit(job(model, "alone", [1, 2, 3], loops=4, max_tokens=50, cache_window=4))
    s.submit(job(model, "queued", [8], loops=1, max_tokens=5))
    s.submit(job(model, "kept", [6, 6], loops=2, max_tokens=6))
    def cancel_at_the_third_step(i, s):
        if i == 2:
            for key in ("prefilling", "batched", "alone", "queued"):
                s.cancel(key)
    tokens, ends, _ = run(s, on_step=cancel_at_the_third_step)
    assert set(ends) == {"kept"} and tokens["kept"] == alone(model, [6, 6], loops=2, max_tokens=6)
    assert model.runner.lanes.free == 3 and not s.batcher


def test_a_failing_job_ends_alone(model):
    s = Scheduler(model.runner)

    def boom(lane):
        raise ValueError("bad job")
    s.submit(Job("bad", boom, tokens=3))
    s.submit(job(model, "good", [3, 1, 4], loops=2, max_tokens=7))
    s.submit(Job("task", lambda lane: ("ran on", lane), task=True))
    tokens, ends, _ = run(s)
    assert isinstance(ends["bad"], ValueError) and ends["task"][0] == "ran on"
    assert tokens["good"] == alone(model, [3, 1, 4], loops=2, max_tokens=7)
    assert model.runner.lanes.free == 3


def test_options_are_checked():
    with pytest.raises(ValueError, match="step_tokens must be >= 1"):
        SchedulerOptions(step_tokens=0)
    with pytest.raises(ValueError, match="max_queue must be >= 0"):
        SchedulerOptions(max_queue=-1)
    with pytest.raises(ValueError, match="speculative_share_from must be >= 0"):
        SchedulerOptions(speculative_share_from=-1)
    with pytest.raises(ValueError, match="prefill_order must be one of"):
        SchedulerOptions(prefill_order="shortest")


@pytest.mark.parametrize("order", ["arrival", "longest"])
def test_prefill_order_longest_takes_the_most_decode_work_first_within_an_admission(tiny_path, order):
    # One prompt a step (an 8-token budget). a, b and c are admitted in the first step; d, the
    # deepest, in the second. "longest" prefills b (depth 8), then c (4), then a (2), and d only
    # after them: a prompt is never passed by one admitted later. Every stream's tokens are its
    # standalone run's whatever the order.
    streams = {"a": (LONG[:8], 2), "b": (LONG[8:16], 8), "c": (LONG[16:24], 4), "d": (LONG[24:32], 8)}
    with Model(tiny_path, max_seq_len=128, n_slots=4) as m:
        s = Scheduler(m.runner, SchedulerOptions(step_tokens=8, prefill_together=False, prefill_order=order))

        def submit(key):
            prompt, loops = streams[key]
            j = job(m, key, prompt, loops=loops, max_tokens=6)
            j.work = loops * 6
            s.submit(j)
        for key in "abc":
            submit(key)
        first: dict[str, int] = {}
        tokens, steps = {}, 0
        while s.has_work():
            if steps == 1:
                submit("d")
            for key, ev in s.step():
                assert isinstance(ev, Tokens)
                if ev.ids:
                    first.setdefault(key, steps)
                tokens.setdefault(key, []).extend(ev.ids)
            steps += 1
        assert sorted(first, key=first.get) == (["a", "b", "c", "d"] if order == "arrival" else ["b", "c", "a", "d"])
        assert sorted(first.values()) == [0, 1, 2, 3]  # one prompt a step
        for key, (prompt, loops) in streams.items():
            assert tokens[key] == alone(m, prompt, loops=loops, max_tokens=6), key


@pytest.mark.parametrize("together", [True, False])
def test_fresh_prompts_of_one_step_prefill_together_and_equal_their_standalone_runs(tiny_path, together):
    # Three lanes, three prompts of different lengths and depths arriving in one step: with
    # prefill_together they take one padded pass (deepest row first), and each stream's tokens
    # are still its standalone run's.
    prompts = {"a": (LONG[:5], 2), "b": (LONG[3:17], 6), "c": (LONG[10:19], 4)}
    with Model(tiny_path, max_seq_len=128, n_slots=3) as m:
        s = Scheduler(m.runner, SchedulerOptions(step_tokens=64, prefill_together=together))
        for key, (prompt, loops) in prompts.items():
            s.submit(job(m, key, prompt, loops=loops, max_tokens=9))
        tokens, ends, steps = run(s)
        assert max(st.prefilled_together for st in steps) == (3 if together else 0)
        for key, (prompt, loops) in prompts.items():
            assert tokens[key] == alone(m, prompt, loops=loops, max_tokens=9), key


def test_prompts_past_the_padding_cap_prefill_apart(tiny_path):
    # 2·step_tokens padded tokens at most: a long prompt beside a short one would pad the short
    # one to the long one's length, so it takes its own pass.
    with Model(tiny_path, max_seq_len=128, n_slots=3) as m:
        s = Scheduler(m.runner, SchedulerOptions(step_tokens=40))
        s.submit(job(m, "long", LONG[:40], loops=3, max_tokens=4))
        s.submit(job(m, "short", LONG[:3], loops=3, max_tokens=4))
        s.submit(job(m, "short2", LONG[5:8], loops=3, max_tokens=4))
        tokens, _, steps = run(s)
        assert steps[0].prefilled_together == 0 and steps[1].prefilled_together == 2
        for key, prompt in (("long", LONG[:40]), ("short", LONG[:3]), ("short2", LONG[5:8])):
            assert tokens[key] == alone(m, prompt, loops=3, max_tokens=4), key


@pytest.mark.parametrize("limit", [0, 1])
def test_a_busy_worker_decodes_greedy_speculative_streams_in_the_batch(tiny_path, limit):
    # With one stream already running and speculative_max_running = 1, a greedy speculative job
    # starts through its batched alternative and joins the batched step; with 0 it speculates
    # alone. Either way its tokens are the standalone speculative run's (= generate at
    # verify_loops).
    import dataclasses
    spec = dict(draft_loops=1, verify_loops=4, draft_ahead=3)
    with Model(tiny_path, max_seq_len=128, n_slots=3) as m:
        s = Scheduler(m.runner, SchedulerOptions(speculative_max_running=limit))
        s.submit(job(m, "plain", LONG[:6], loops=3, max_tokens=20))
        first = [s.step(), s.step()]  # the plain stream holds a lane and decodes
        assert all(key == "plain" for evs in first for key, _ in evs)
        req = m.make_request(LONG[8:15], max_tokens=10, speculative=spec)
        plain = dataclasses.replace(req, speculative=None)
        s.submit(Job("spec", lambda lane: m.stream(req, lane), tokens=7,
                     batched=lambda lane: m.start_chunked(plain, lane)))
        tokens, _, steps = run(s)
        assert sum(st.batched_not_speculative for st in steps) == (1 if limit else 0)
        assert max(st.batch_rows for st in steps) == (2 if limit else 1)
        want = list(m.generate_speculative(LONG[8:15], max_tokens=10, **spec))[7:]
        assert tokens["spec"] == want == alone(m, LONG[8:15], loops=4, max_tokens=10)


@pytest.mark.parametrize("together", [False, True])
def test_streams_that_arrive_together_make_the_worker_busy(tiny_path, together):
    # A greedy speculative job submitted in the same step as a plain one sees a busy worker
    # (speculative_max_running = 1: one other stream holds a lane) and decodes in the batch;
    # alone on an idle worker it speculates. Its tokens are the same either way.
    import dataclasses
    spec = dict(draft_loops=1, verify_loops=4, draft_ahead=3)
    with Model(tiny_path, max_seq_len=128, n_slots=3) as m:
        s = Scheduler(m.runner, SchedulerOptions(speculative_max_running=1))
        req = m.make_request(LONG[8:15], max_tokens=10, speculative=spec)
        plain = dataclasses.replace(req, speculative=None)
        s.submit(Job("spec", lambda lane: m.stream(req, lane), tokens=7,
                     batched=lambda lane: m.start_chunked(plain, lane)))
        if together:
            s.submit(job(m, "plain", LONG[:6], loops=3, max_tokens=12))
        tokens, _, steps = run(s)
        assert sum(st.batched_not_speculative for st in steps) == (1 if together else 0)
        assert tokens["spec"] == alone(m, LONG[8:15], loops=4, max_tokens=10)
        if together:
            assert tokens["plain"] == alone(m, LONG[:6], loops=3, max_tokens=12)


@pytest.fixture(scope="module")
def spec_path(ckpt_dir):
    # drafts the verifier accepts in part: rounds emit several tokens, so the handoff happens past
    # accepted drafts (a plain random model accepts ~1/vocab of them)
    from model_zoo import CONFIGS, damped_checkpoint
    return damped_checkpoint(ckpt_dir / "damped-scheduler.tinyloop", CONFIGS["gqa-prelude-coda"], 3, 0.03)


def spec_job(m, key, prompt, spec, **kw):
    """A speculative job as the actor makes it: greedy ones carry their batched alternative."""
    import dataclasses
    req = m.make_request(prompt, speculative=spec, **kw)
    plain = dataclasses.replace(req, speculative=None)
    return Job(key, lambda lane: m.stream(req, lane), tokens=len(prompt),
               batched=(lambda lane: m.start_chunked(plain, lane)) if req.sampling.greedy else None)


@pytest.mark.parametrize("limit", [0, 1])
@pytest.mark.parametrize("stop", [False, True])
def test_a_speculative_stream_alone_goes_into_the_batch_once_the_worker_is_busy(spec_path, limit, stop):
    # A greedy speculative stream starts alone on an idle worker and runs two rounds; then a
    # plain stream arrives, which (speculative_max_running = 1) makes the worker busy: between
    # two rounds the speculative stream goes on in the batched step at verify_loops, from where
    # its rounds left it. Its tokens (a stop token after the handoff, or max_tokens) are the
    # standalone speculative run's, = generate at verify_loops; its usage keeps the rounds'
    # figures. With 0 it speculates to its end.
    spec = dict(draft_loops=1, verify_loops=4, draft_ahead=3)
    prompt = LONG[8:15]
    with Model(spec_path, max_seq_len=128, n_slots=3) as m:
        full = alone(m, prompt, loops=4, max_tokens=24)
        kw = dict(max_tokens=24, stop_token_ids=[full[15]] if stop else None)
        want = alone(m, prompt, loops=4, **kw)
        assert len(want) == (full.index(full[15]) + 1 if stop else 24) and len(want) > 12
        s = Scheduler(m.runner, SchedulerOptions(speculative_max_running=limit))
        s.submit(spec_job(m, "spec", prompt, spec, **kw))
        chunks = [ev.ids for _ in range(3) for key, ev in s.step()]
        assert sum(map(len, chunks)) > 3, "no round accepted a draft: the handoff's position is not tested"
        assert sum(map(len, chunks)) < len(want)
        s.submit(job(m, "plain", LONG[:6], loops=3, max_tokens=20))
        after, steps, ends = [], [], {}
        while s.has_work():
            for key, ev in s.step():
                if key == "spec":
                    after.append(ev.ids)
                    if ev.finish is not None:
                        ends[key] = ev.finish
            steps.append(s.last)
        assert sum(st.handed_to_batch for st in steps) == (1 if limit else 0)
        assert steps[0].handed_to_batch == (1 if limit else 0)  # at once, at the next round boundary
        assert sum(st.batched_not_speculative for st in steps) == 0
        assert max(st.batch_rows for st in steps) == (2 if limit else 1)
        tokens = [t for c in chunks + after for t in c]
        assert tokens == want
        assert tokens == list(m.generate_speculative(prompt, stop_token_ids=kw["stop_token_ids"],
                                                     max_tokens=24, **spec))[len(prompt):]
        finish = ends["spec"]
        assert finish.reason == ("stop" if stop else "length") and finish.stats["completion_tokens"] == len(want)
        if limit:
            assert all(len(ids) <= 1 for ids in after)  # one token per batched step
            assert finish.stats["verify_steps"] == 2 and finish.stats["drafted_tokens"] == 6
            assert finish.stats["accepted_per_verify"] == pytest.approx(finish.stats["accepted_tokens"] / 2)
        else:
            assert finish.stats["verify_steps"] > 2
        assert m.runner.lanes.free == 3 and not s.batcher


def test_a_sampled_speculative_stream_is_never_handed_over(spec_path):
    spec = dict(draft_loops=1, verify_loops=4, draft_ahead=3)
    prompt, kw = LONG[8:15], dict(max_tokens=16, temperature=0.9, seed=5)
    with Model(spec_path, max_seq_len=128, n_slots=3) as m:
        s = Scheduler(m.runner, SchedulerOptions(speculative_max_running=1))
        s.submit(spec_job(m, "spec", prompt, spec, **kw))
        first = [t for _ in range(2) for key, ev in s.step() for t in ev.ids]
        s.submit(job(m, "plain", LONG[:6], loops=3, max_tokens=20))
        s.submit(job(m, "plain2", LONG[2:9], loops=2, max_tokens=20))
        tokens, ends, steps = run(s)
        assert sum(st.handed_to_batch for st in steps) == 0
        assert max(st.batch_rows for st in steps) == 2  # the two plain streams only
        assert first + tokens["spec"] == list(m.generate_speculative(prompt, **kw, **spec))[len(prompt):]
        assert ends["spec"].stats["verify_steps"] >= 1


def _spec_alone(m, prompt, spec, **kw) -> list[int]:
    """A speculative stream's tokens run alone (its own rounds) from its prompt."""
    return list(m.generate_speculative(prompt, **kw, **spec))[len(prompt):]


def test_speculative_streams_share_their_rounds(spec_path):
    # Three chain streams on an idle worker (speculative_max_running = 0: always speculative),
    # two greedy at different depths and draft counts and one sampled, run their rounds together
    # (draft steps batched, verifies one pass): each one's tokens and usage are those of its run
    # alone; a tree stream beside them steps alone. A cancelled member leaves at once.
    specs = {"a": dict(draft_loops=1, verify_loops=4, draft_ahead=3),
             "b": dict(draft_loops=2, verify_loops=5, draft_ahead=2),
             "c": dict(draft_loops=1, verify_loops=4, draft_ahead=3)}
    kws = {"a": dict(max_tokens=20), "b": dict(max_tokens=14), "c": dict(max_tokens=18, temperature=0.9, seed=5)}
    prompts = {"a": LONG[8:15], "b": LONG[:9], "c": LONG[20:26]}
    with Model(spec_path, max_seq_len=128, n_slots=4) as m:
        want = {k: _spec_alone(m, prompts[k], specs[k], **kws[k]) for k in specs}
        stats = {k: m.generate_speculative(prompts[k], **kws[k], **specs[k]).stats for k in specs}
        s = Scheduler(m.runner, SchedulerOptions(speculative_max_running=0))
        for k in specs:
            s.submit(spec_job(m, k, prompts[k], specs[k], **kws[k]))
        tree = dict(draft_loops=1, verify_loops=4, draft_ahead=2, k_branches=2)
        s.submit(spec_job(m, "tree", LONG[30:36], tree, max_tokens=10))
        members = []
        tokens, ends, steps = run(s, on_step=lambda i, s: members.append(set(s._spec.values())))
        assert max(st.speculative_rows for st in steps) == 3
        assert {"a", "b", "c"} in [mm for mm in members] and all("tree" not in mm for mm in members)
        for k in specs:
            assert tokens[k] == want[k], k
            got = {x: ends[k].stats[x] for x in ("completion_tokens", "verify_steps", "drafted_tokens",
                                                  "accepted_tokens", "loop_token_iterations")}
            assert got == {x: stats[k][x] for x in got}, k
        assert tokens["a"] == alone(m, prompts["a"], loops=4, max_tokens=20)
        assert tokens["tree"] == list(m.generate_tree_speculative(LONG[30:36], max_tokens=10, K_branches=2, draft_loops=1,
                                                                  verify_loops=4, draft_ahead=2))[6:]
        assert m.runner.lanes.free == 4 and not s.spec_batch


@pytest.mark.parametrize("share_from", [0, 3, 4])
def test_rounds_are_shared_from_the_configured_count(spec_path, share_from):
    # speculative_share_from: three chain streams share their rounds from 3 (not from 4, nor
    # with 0); their tokens are their runs alone either way
    spec = dict(draft_loops=1, verify_loops=4, draft_ahead=3)
    prompts = [LONG[:9], LONG[10:17], LONG[20:26]]
    with Model(spec_path, max_seq_len=128, n_slots=3) as m:
        want = [_spec_alone(m, p, spec, max_tokens=12) for p in prompts]
        s = Scheduler(m.runner, SchedulerOptions(speculative_max_running=0, speculative_share_from=share_from))
        for i, p in enumerate(prompts):
            s.submit(spec_job(m, f"s{i}", p, spec, max_tokens=12))
        tokens, _, steps = run(s)
        assert max(st.speculative_rows for st in steps) == (3 if share_from == 3 else 0)
        assert [tokens[f"s{i}"] for i in range(3)] == want


def test_a_cancelled_member_of_the_shared_rounds_leaves_at_once(spec_path):
    spec = dict(draft_loops=1, verify_loops=4, draft_ahead=3)
    with Model(spec_path, max_seq_len=128, n_slots=3) as m:
        want = _spec_alone(m, LONG[:9], spec, max_tokens=24)
        s = Scheduler(m.runner, SchedulerOptions(speculative_max_running=0))
        s.submit(spec_job(m, "keep", LONG[:9], spec, max_tokens=24))
        s.submit(spec_job(m, "gone", LONG[10:17], spec, max_tokens=40))
        got = {"keep": [], "gone": []}
        for _ in range(3):
            for key, ev in s.step():
                got[key].extend(ev.ids)
        assert set(s._spec.values()) == {"keep", "gone"}
        s.cancel("gone")
        tokens, ends, _ = run(s)
        assert "gone" not in tokens and "gone" not in ends
        assert got["keep"] + tokens["keep"] == want
        assert got["gone"] == _spec_alone(m, LONG[10:17], spec, max_tokens=40)[:len(got["gone"])]
        assert m.runner.lanes.free == 3


def test_greedy_members_of_the_shared_rounds_go_into_the_batch_once_the_worker_is_busy(spec_path):
    # Two greedy and one sampled chain stream share their rounds; a plain stream arrives and
    # (speculative_max_running = 3) makes the worker busy: between two rounds the greedy members
    # go on in the batched step, the sampled one goes on with its rounds. Every stream's tokens
    # are its run's alone.
    specs = [dict(draft_loops=1, verify_loops=4, draft_ahead=3), dict(draft_loops=2, verify_loops=4, draft_ahead=2),
             dict(draft_loops=1, verify_loops=3, draft_ahead=3)]
    kws = [dict(max_tokens=22), dict(max_tokens=18), dict(max_tokens=16, temperature=0.8, seed=3)]
    prompts = [LONG[8:15], LONG[:9], LONG[20:26]]
    with Model(spec_path, max_seq_len=128, n_slots=4) as m:
        want = [_spec_alone(m, p, sp, **kw) for p, sp, kw in zip(prompts, specs, kws)]
        s = Scheduler(m.runner, SchedulerOptions(speculative_max_running=3))
        for i in range(3):
            s.submit(spec_job(m, f"s{i}", prompts[i], specs[i], **kws[i]))
        got = {f"s{i}": [] for i in range(3)}
        for _ in range(3):
            for key, ev in s.step():
                got[key].extend(ev.ids)
        assert len(s._spec) == 3
        s.submit(job(m, "plain", LONG[:6], loops=3, max_tokens=20))
        tokens, _, steps = run(s)
        assert sum(st.handed_to_batch for st in steps) == 2 and set(s._spec.values()) <= {"s2"}
        for i in range(3):
            assert got[f"s{i}"] + tokens[f"s{i}"] == want[i], i
        assert tokens["plain"] == alone(m, LONG[:6], loops=3, max_tokens=20)
        assert m.runner.lanes.free == 4
