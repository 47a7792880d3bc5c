"""Early exit (runner/early_exit.py): a rule that never fires is plain decoding bit for bit; a rule
that fires gives the tokens of an independent plain-torch loop that checks the criterion after
every iteration, stops, and fills the skipped iterations' cache entries by the same policy; a
batched lane exits as it does alone, and the exited rows really leave the step's iterations."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tinyloop.kernels.rope import apply_rope_ref
from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.runner.early_exit import ExitRule, ExitState

from model_zoo import CONFIGS, TINY, write_checkpoint

# Ouro's shape, tiny: the whole stack looped, sandwich norms, a norm after every iteration and
# the early-exit gate (random weights: the gate's λ vary from token to token)
OURO_TINY = dataclasses.replace(TINY, n_prelude=0, n_coda=0, n_loop_layers=2, norm="sandwich",
                                loop_final_norm=True, final_norm=False, exit_gate=True, max_loops=12)
PROMPT = [3, 17, 42, 99, 7, 250, 1, 64]


@pytest.fixture(scope="module")
def ouro_path(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("exit") / "ouro.tinyloop", OURO_TINY, seed=5, std=0.4)


@pytest.fixture(scope="module")
def two_layer_path(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("exit") / "two.tinyloop", CONFIGS["untied-2-layer-block"], seed=3)


# -- the reference: a plain torch loop, one token at a time, its own cache ---------------------
class RefDecoder:
    """Decodes with the model's modules and a dict cache {layer: {position: (k, v)}}, checking
    the exit rule after every iteration in plain torch, written from the rule's definition."""

    def __init__(self, model: Model):
        self.m = model._module
        self.cfg = self.m.config
        self.cache: dict[int, dict[int, tuple]] = {}

    def attend(self, layer: int, pos: int):
        m = self.m

        def attend(q, k, v):  # q (1, 1, H, hd), k / v (1, 1, Hkv, hd)
            cos, sin = m.rope_cos[pos][None, None], m.rope_sin[pos][None, None]
            q, k = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
            self.cache.setdefault(layer, {})[pos] = (k[0, 0], v[0, 0])
            ks = torch.stack([self.cache[layer][p][0] for p in range(pos + 1)], 1)[None]  # (1, Hkv, T, hd)
            vs = torch.stack([self.cache[layer][p][1] for p in range(pos + 1)], 1)[None]
            return F.scaled_dot_product_attention(q.transpose(1, 2), ks, vs, enable_gqa=ks.shape[1] != q.shape[2])
        return attend

    def head(self, x, pos):
        m = self.m
        h = m.exit_loop(x)
        for j, layer in enumerate(m.coda):
            h = layer(h, self.attend(self.cfg.coda_layer_index(j), pos))
        return m.logits(h)[0, -1].float()

    @torch.no_grad()
    def step(self, tok: int, pos: int, L: int, rule: ExitRule | None):
        """-> (logits (V,), iterations run)."""
        m, cfg = self.m, self.cfg
        x = m.embedded(m.tok_embeddings(torch.tensor([[tok]])))
        for j, layer in enumerate(m.prelude):
            x = layer(x, self.attend(j, pos))
        x = m.loop_input(x, None, torch.tensor([[pos]]))
        remaining, cum, prev_n, prev_logp, prev_arg, streak = 1.0, 0.0, None, None, None, 0
        ran = L
        for i in range(L):
            x = m.iteration(x, [self.attend(cfg.loop_layer_index(i, j), pos) for j in range(cfg.n_loop_layers)], i)
            d = i + 1
            if rule is None or d == L:
                continue
            s = m.state(x)[0, 0].float()
            hit = False
            if rule.criterion == "gate":
                lam = torch.sigmoid(s @ m.exit_gate.weight[0].float() + m.exit_gate.bias[0].float()).item()
                cum += lam * remaining
                remaining *= 1 - lam
                hit = cum >= rule.threshold
            elif rule.criterion == "latent":
                n = s / torch.sqrt(s.pow(2).mean() + cfg.norm_eps)
                if prev_n is not None:
                    hit = ((n - prev_n).norm() / n.norm()).item() < rule.threshold
                prev_n = n
            elif rule.criterion == "kl" and d >= max(1, rule.earliest() - 1):
                logp = torch.log_softmax(self.head(x, pos), -1)
                if prev_logp is not None:
                    hit = (logp.exp() * (logp - prev_logp)).sum().item() < rule.threshold
                prev_logp = logp
            elif rule.criterion == "argmax" and d >= max(1, rule.earliest() - rule.patience):
                a = int(self.head(x, pos).argmax())
                streak = streak + 1 if a == prev_arg else 0
                prev_arg = a
                hit = streak >= rule.patience
            if hit and d >= rule.earliest():
                ran = d
                break
        if ran < L:
            self.fill(x, pos, ran, L, rule.cache)
        return self.head(x, pos), ran

    def fill(self, x, pos, e, L, policy):
        m, cfg = self.m, self.cfg
        for j in range(cfg.n_loop_layers):
            if policy == "copy":
                kv = self.cache[cfg.loop_layer_index(e - 1, j)][pos]
            else:
                att = m.loop[j].attention
                h = m.loop[j].attention_norm(x)
                k = (h @ att.wk.weight.T).view(1, 1, att.n_kv_heads, att.head_dim)
                v = (h @ att.wv.weight.T).view(1, 1, att.n_kv_heads, att.head_dim)
                k = apply_rope_ref(k, m.rope_cos[pos][None, None], m.rope_sin[pos][None, None])
                kv = (k[0, 0], v[0, 0])
            for i in range(e, L):
                self.cache.setdefault(cfg.loop_layer_index(i, j), {})[pos] = kv

    def generate(self, prompt, L, max_tokens, rule):
        for pos, t in enumerate(prompt[:-1]):
            self.step(t, pos, L, None)
        logits, _ = self.step(prompt[-1], len(prompt) - 1, L, None)
        out, depths = [], []
        while True:
            t = int(logits.argmax())
            out.append(t)
            if len(out) == max_tokens:
                return out, depths
            logits, d = self.step(t, len(prompt) + len(out) - 1, L, rule)
            depths.append(d)


# -- a rule that never fires is plain decoding ---------------------------------------------------
NEVER = [{"criterion": "latent", "threshold": 1e-9}, {"criterion": "argmax", "patience": 12},
         {"criterion": "latent", "threshold": 1e-9, "cache": "copy"}]


@pytest.mark.parametrize("rule", NEVER)
def test_rule_that_never_fires_is_plain_decode_bitwise(config_path, rule):
    with Model(config_path, max_seq_len=64, n_slots=4) as m:
        L = 5
        with m.runner.lanes.hold() as lane:
            r = m.runner
            plain_pre = r.prefill(lane, PROMPT, L).logits
            plain = [r.decode([lane], [t], [len(PROMPT) + i], [L]).logits.clone() for i, t in enumerate([5, 9, 200])]
            r.prefill(lane, PROMPT, L)
            rr = m.make_request(PROMPT, loops=L, max_tokens=8, early_exit=rule).early_exit
            outs = [r.decode([lane], [t], [len(PROMPT) + i], [L], exits=[rr]) for i, t in enumerate([5, 9, 200])]
        for a, out in zip(plain, outs):
            assert out.depths == [L]
            assert torch.equal(a, out.logits)
        assert plain_pre is not None
        g0 = m.generate(PROMPT, loops=L, max_tokens=12, seed=1)
        g1 = m.generate(PROMPT, loops=L, max_tokens=12, seed=1, early_exit=rule)
        assert list(g0) == list(g1)
        assert g1.stats["iterations_histogram"] == [0] * (L - 1) + [11]
        assert g1.stats["loop_token_iterations"] == g0.stats["loop_token_iterations"]


def test_batched_rule_that_never_fires_is_plain_batch(tiny_path):
    with Model(tiny_path, max_seq_len=64, n_slots=4) as m:
        prompts = [PROMPT, [1, 2, 3], [9] * 6]
        a = m.generate_batch(prompts, per_lane_loops=[3, 6, 4], max_tokens=10)
        b = m.generate_batch(prompts, per_lane_loops=[3, 6, 4], max_tokens=10, early_exit=NEVER[0])
        assert [list(x) for x in a] == [list(x) for x in b]


# -- a rule that fires equals the reference loop ---------------------------------------------------
CASES = [
    ("tiny", {"criterion": "latent", "threshold": 0.3}),
    ("tiny", {"criterion": "latent", "threshold": 0.3, "cache": "copy", "min_loops": 3}),
    ("tiny", {"criterion": "kl", "threshold": 0.05}),
    ("tiny", {"criterion": "argmax", "patience": 1, "min_loops": 2}),
    ("two", {"criterion": "latent", "threshold": 0.3}),
    ("two", {"criterion": "argmax", "patience": 2, "cache": "copy"}),
    ("ouro", {"criterion": "gate", "threshold": 0.6}),
    ("ouro", {"criterion": "gate", "threshold": 0.9, "cache": "copy", "min_loops": 2}),
]


@pytest.mark.parametrize("which, rule", CASES)
def test_exit_equals_reference_loop(which, rule, tiny_path, two_layer_path, ouro_path):
    path = {"tiny": tiny_path, "two": two_layer_path, "ouro": ouro_path}[which]
    L, n = 8, 14
    with Model(path, max_seq_len=64, n_slots=2) as m:
        g = m.generate(PROMPT, loops=L, max_tokens=n, early_exit=rule)
        req = m.make_request(PROMPT, loops=L, max_tokens=8, early_exit=rule)
        ref_tokens, ref_depths = RefDecoder(m).generate(PROMPT, L, n, req.early_exit)
    assert g[len(PROMPT):] == ref_tokens
    hist = [0] * L
    for d in ref_depths:
        hist[d - 1] += 1
    assert g.stats["iterations_histogram"] == hist
    assert min(ref_depths) < L, "the rule never fired: the case tests nothing"


def test_gate_formula():
    """ExitState's gate decisions against the formula on random λ: p_i = λ_i ∏_{j<i}(1 − λ_j),
    exit at the first d whose Σ_{i≤d} p_i ≥ threshold (the last iteration takes what is left)."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(OURO_TINY, d_model=8, n_heads=2, n_kv_heads=1, d_ff=16)
    from tinyloop.worker.model.modules import LoopedTransformer
    model = LoopedTransformer(cfg)
    B, L = 16, 6
    states = torch.randn(L, B, cfg.d_model) * 2
    rules = [ExitRule("gate", float(t), min_loops=int(mn)) for t, mn in
             zip(torch.rand(B) * 0.99 + 0.01, torch.randint(1, 4, (B,)))]
    st = ExitState(model, B, torch.device("cpu"))
    st.reset(rules, [L] * B)
    got = [L] * B
    alive = list(range(B))
    for i in range(L):
        if not alive:
            break
        st.set_order(alive)
        st.check(len(alive), states[i, alive], None, torch.full((len(alive),), L), slot=i % 2)
        st.mark(i % 2)
        stop = st.read(i % 2, len(alive))
        for r, s in zip(alive, stop):
            if s and got[r] == L:
                got[r] = i + 1
        alive = [r for r, s in zip(alive, stop) if not s]
    for r in range(B):
        lam = torch.sigmoid(states[:, r] @ model.exit_gate.weight[0] + model.exit_gate.bias[0])
        cum, rem, want = 0.0, 1.0, L
        for i in range(L):
            p = rem if i == L - 1 else lam[i].item() * rem
            cum, rem = cum + p, rem * (1 - lam[i].item())
            if i + 1 >= rules[r].min_loops and cum >= rules[r].threshold:
                want = i + 1
                break
        assert got[r] == want, r
    assert len(set(got)) > 2


# -- batched: a lane exits as alone, and exited rows leave the step -------------------------------
def test_batched_exit_lane_equals_alone_and_saves(tiny_path):
    rules = [{"criterion": "latent", "threshold": 0.3}, None, {"criterion": "kl", "threshold": 0.05},
             {"criterion": "argmax", "patience": 1, "cache": "copy"}]
    prompts = [PROMPT, [1, 2, 3], [9] * 6, [200, 100, 50]]
    loops = [8, 6, 8, 7]
    with Model(tiny_path, max_seq_len=64, n_slots=4) as m:
        alone = [m.generate(p, loops=L, max_tokens=12, early_exit=r) for p, L, r in zip(prompts, loops, rules)]
        before = m.counters.snapshot()
        batch = m.generate_batch(prompts, per_lane_loops=loops, max_tokens=12, early_exit=rules)
        spent = m.counters.since(before)
    for a, b in zip(alone, batch):
        assert list(a) == list(b)
        assert a.stats == b.stats
    # the runner counted the iterations the rows ran, and they are fewer than the depths asked
    assert spent.loop_token_iterations == sum(b.stats["loop_token_iterations"] for b in batch)
    assert sum(b.stats["loop_token_iterations"] for b in batch) < sum(
        L * (len(p) + 11) for p, L in zip(prompts, loops))


def test_exited_rows_run_fewer_block_applications(tiny_path):
    """Real saving: the shared block runs over fewer rows once rows exit (counted at the
    iteration itself, not from the decisions)."""
    with Model(tiny_path, max_seq_len=64, n_slots=4) as m:
        rows = []
        it = m._module.iteration

        def counted(x, attends, index=0):
            rows.append(x.shape[0])
            return it(x, attends, index)
        m._module.iteration = counted
        rule = m.make_request(PROMPT, loops=8, max_tokens=8,
                              early_exit={"criterion": "latent", "threshold": 0.3}).early_exit
        with m.runner.lanes.hold() as a, m.runner.lanes.hold() as b:
            for lane in (a, b):
                m.runner.prefill(lane, PROMPT, 8)
            rows.clear()
            out = m.runner.decode([a, b], [5, 6], [len(PROMPT)] * 2, [8, 8], exits=[rule, rule])
        assert sum(rows) == sum(out.depths) < 16


def test_cache_policies_fill_skipped_layers(tiny_path):
    """copy: the skipped iterations' entries are the exit iteration's; recompute: the K/V
    projection of the exit state (RoPE'd), the same in every skipped layer."""
    with Model(tiny_path, max_seq_len=64, n_slots=2) as m:
        cfg, cache = m.config, m.runner.cache
        pos = len(PROMPT)
        for policy in ("copy", "recompute"):
            rule = m.make_request(PROMPT, loops=8, max_tokens=8, early_exit={"criterion": "latent", "threshold": 0.5,
                                                               "cache": policy}).early_exit
            with m.runner.lanes.hold() as lane:
                m.runner.prefill(lane, PROMPT, 8)
                out = m.runner.decode([lane], [5], [pos], [8], exits=[rule])
                e = out.depths[0]
                assert e < 8
                layers = [cfg.loop_layer_index(i, 0) for i in range(e, 8)]
                k = cache.k[layers, lane, :, pos]
                want = cache.k[cfg.loop_layer_index(e - 1, 0), lane, :, pos] if policy == "copy" else None
                if policy == "recompute":
                    blk = m._module.loop[0]
                    kk = (blk.attention_norm(out.residual) @ blk.attention.wk.weight.T).view(1, 1, cfg.n_kv_heads, -1)
                    cos, sin = m._module.rope_cos[pos][None, None], m._module.rope_sin[pos][None, None]
                    want = apply_rope_ref(kk, cos, sin)[0, 0]
                for row in k:
                    torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-6)


# -- bad input ---------------------------------------------------------------------------------
BAD = [
    ({"criterion": "latent", "threshold": 0.0}, "early_exit.threshold"),
    ({"criterion": "latent", "threshold": 1.5}, "early_exit.threshold"),
    ({"criterion": "kl", "threshold": -0.1}, "early_exit.threshold"),
    ({"criterion": "entropy"}, "early_exit.criterion"),
    ({"criterion": "gate"}, "early_exit.criterion 'gate' needs a model with an early-exit gate"),
    ({"criterion": "latent", "min_loops": 0}, "early_exit.min_loops"),
    ({"criterion": "argmax", "patience": 0}, "early_exit.patience"),
    ({"criterion": "latent", "cache": "zero"}, "early_exit.cache"),
    ({"criterion": "latent", "speed": 1}, "unknown keys"),
    ({"criterion": "latent", "min_loops": 6}, "exceeds loops"),
]


@pytest.mark.parametrize("rule, msg", BAD)
def test_bad_rules_raise_naming_the_field(tiny_model, rule, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        tiny_model.generate(PROMPT, loops=4, max_tokens=2, early_exit=rule)


def test_exit_refuses_what_it_does_not_combine_with(tiny_model):
    rule = {"criterion": "latent"}
    for kw, what in ((dict(cache_window=8), "cache_window"), (dict(safety_check=True), "safety_check"),
                     (dict(l_warmup_tokens=2, l_warmup_L=2), "l_warmup_tokens")):
        with pytest.raises(ValueError, match=what):
            tiny_model.generate(PROMPT, loops=4, max_tokens=2, early_exit=rule, **kw)
    with pytest.raises(ValueError, match="speculative"):
        tiny_model.make_request(PROMPT, max_tokens=8, speculative={"draft_loops": 1, "verify_loops": 4},
                                early_exit=rule)


def test_gate_rule_accepted_on_a_gated_model(ouro_path):
    with Model(ouro_path, max_seq_len=64, n_slots=1) as m:
        req = m.make_request(PROMPT, loops=4, max_tokens=8, early_exit={})
        assert req.early_exit.criterion == "gate"  # the model's own rule when none is named


def test_graphed_exit_step_shrinks_buckets_and_equals_eager(tiny_path):
    """The runner's graph path (batch buckets' stage graphs, stand-ins on CPU): the rows still
    iterating run in the smallest bucket holding them, and the step equals the eager one."""
    from stage_graphs import with_stage_graphs
    rule = {"criterion": "latent", "threshold": 0.3}
    rules = [rule, {"criterion": "kl", "threshold": 0.05}, None, {"criterion": "argmax", "patience": 1},
             {**rule, "cache": "recompute"}]
    prompts = [PROMPT, [1, 2, 3], [9] * 6, [200, 100, 50], [7, 7]]
    with Model(tiny_path, max_seq_len=64, n_slots=8) as m:
        eager = m.generate_batch(prompts, per_lane_loops=[8, 8, 6, 8, 7], max_tokens=10, early_exit=rules)
        graphs = with_stage_graphs(m, range(1, 9))
        graphed = m.generate_batch(prompts, per_lane_loops=[8, 8, 6, 8, 7], max_tokens=10, early_exit=rules)
        one = m.generate(PROMPT, loops=8, max_tokens=10, early_exit=rule)
    assert [list(g) for g in graphed] == [list(g) for g in eager]
    assert [g.stats for g in graphed] == [g.stats for g in eager]
    assert list(one) == list(eager[0]) and one.stats == eager[0].stats
    iters = [b for b, s in graphs.replayed("batch") if isinstance(s, int)]
    assert 8 in iters and min(iters) < 8, iters  # rows that exited left the bucket
    checks = graphs.replayed("exit")  # the checks ran as the buckets' captured graphs
    assert {s for _, s in checks} == {"check0", "check1", "check+logits0", "check+logits1"}


@pytest.mark.parametrize("span", [None, "min", "max", 4])
@pytest.mark.parametrize("rule", [{"criterion": "latent", "threshold": 0.3},
                                  {"criterion": "kl", "threshold": 0.05, "min_loops": 3},
                                  {"criterion": "argmax", "patience": 1, "cache": "recompute"},
                                  {"criterion": "latent", "threshold": 0.2, "cache": "recompute"}])
def test_one_stream_exit_on_its_own_graphs_equals_eager(tiny_path, rule, span):
    """A stream alone on a graphed runner (stand-ins on CPU) runs its exit steps on the one-row
    graphs (solo_exit.py: a span graph per token, then one per iteration where the token goes
    on past it; none of the batch buckets') and gets the tokens and usage of the eager exit
    step, greedy and sampled, whatever the span (its later tokens read the layers its exited
    tokens skipped: the fill is checked too). "min" makes tokens go on past their span, "max"
    makes every token end inside it."""
    from stage_graphs import with_stage_graphs
    from tinyloop.worker.runner.solo_exit import SoloExit
    kw = dict(loops=8, max_tokens=12, early_exit=rule)
    with Model(tiny_path, max_seq_len=64, n_slots=2) as m:
        eager = [m.generate(PROMPT, **kw), m.generate(PROMPT, temperature=0.9, seed=5, **kw)]
        graphs = with_stage_graphs(m, range(1, 9))
        r = m.runner
        r._solo = solo_exit = SoloExit(r.engine, r.graphs, r.ops.exit_check, span=span)
        graphs.log.clear()
        solo = [m.generate(PROMPT, **kw), m.generate(PROMPT, temperature=0.9, seed=5, **kw)]
        batch_iters = [s for b, s in graphs.replayed("batch") if isinstance(s, int)]
    for a, b in zip(solo, eager):
        assert list(a) == list(b) and a.stats == b.stats
    assert all(s.stats["iterations_per_token"] < 8 for s in eager), "no token exited: the case tests little"
    assert not batch_iters, "a lone stream's exit steps replayed batch buckets"
    counts = solo_exit.counts
    assert counts["steps"] == sum(sum(s.stats["iterations_histogram"]) for s in solo)
    # the greedy stream's steps are launched before the step before them ends (its sampled
    # twin's wait for the sampler): every one but the first, a capture's and the last's
    if rule.get("cache", "copy") == "copy":
        assert counts["ahead"] >= kw["max_tokens"] - 4, counts
    else:
        assert counts["ahead"] == 0, counts  # recompute fills after the step has ended
    if span == "min":
        assert counts["went_on"] > 0
        assert counts["relaunched"] > 0 or rule.get("cache") == "recompute"
    if span == "max":
        assert counts["went_on"] == counts["relaunched"] == 0


def test_choose_span_weighs_the_recent_depths():
    from tinyloop.worker.runner.solo_exit import choose_span
    assert choose_span(2, 16, []) == 2  # nothing known: the earliest decision
    assert choose_span(2, 16, [3] * 10) == 3  # every token ran 3: a span of 3 never goes on
    assert choose_span(2, 16, [16] * 10) == 16  # tokens that run their depth: one graph for all
    assert choose_span(2, 16, [2] * 9 + [16]) == 2  # one deep token in ten is not worth 14 iterations each
    assert choose_span(1, 1, [1]) == 1


def test_graphed_exit_step_keeps_stopped_rows_until_a_smaller_bucket(tiny_path):
    """Rows that stop while the rows going still need the same bucket stay in place (frozen by
    their depth) and move behind only when a smaller bucket holds the rest: with rows stopping
    one by one over many iterations, the step still equals the eager one, row by row. (With
    interleaving off: latent rules are otherwise checked inside interleaved passes.)"""
    from stage_graphs import with_stage_graphs
    from tinyloop.worker.model.settings import Settings
    rules = [{"criterion": "latent", "threshold": t} for t in (0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)]
    prompts = [PROMPT, [1, 2, 3], [9] * 6, [200, 100, 50], [7, 7], [3, 1, 4, 1, 5], [42] * 3]
    depths = [8] * len(prompts)
    with Model(tiny_path, max_seq_len=64, n_slots=16, settings=Settings(interleave=False)) as m:
        eager = m.generate_batch(prompts, per_lane_loops=depths, max_tokens=10, early_exit=rules)
        graphs = with_stage_graphs(m, range(1, 9), interleave=False)
        graphed = m.generate_batch(prompts, per_lane_loops=depths, max_tokens=10, early_exit=rules)
    assert [list(g) for g in graphed] == [list(g) for g in eager]
    assert [g.stats for g in graphed] == [g.stats for g in eager]
    hists = [g.stats["iterations_histogram"] for g in eager]
    assert len({tuple(h) for h in hists}) > 3, "the rows stop alike: the case tests little"
    buckets = {b for b, s in graphs.replayed("batch") if isinstance(s, int)}
    assert 8 in buckets and min(buckets) < 8, buckets


def test_solo_exit_keeps_a_bounded_history(tiny_path):
    """The span's guess keeps the depths of the latest rules only: a client sending a new
    threshold per request does not grow the runner's memory."""
    from stage_graphs import with_stage_graphs
    from tinyloop.worker.runner import solo_exit
    with Model(tiny_path, max_seq_len=64, n_slots=2) as m:
        with_stage_graphs(m, range(1, 5))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(solo_exit, "RULES_KEPT", 3)
            for t in (0.5, 0.4, 0.3, 0.2, 0.1):
                m.generate(PROMPT, loops=4, max_tokens=3, early_exit={"criterion": "latent", "threshold": t})
            kept = m.runner._solo._plans
            assert [r.threshold for r, _ in kept] == [0.3, 0.2, 0.1]
            assert all(len(h) == 2 for _, h, _ in kept.values())  # 3 tokens: 2 exit steps each


def test_interleaved_gate_exit_equals_standalone(ouro_path):
    """Ouro's gate criterion, checked inside interleaved passes: each stream as alone."""
    gate = {"criterion": "gate", "threshold": 0.6}
    jobs = [([3, 17, 42], 8, gate), ([9, 8, 7, 6], 6, {"criterion": "gate", "threshold": 0.9, "min_loops": 2}),
            ([5] * 6, 4, None), ([1, 2], 8, gate)]
    with Model(ouro_path, max_seq_len=64, n_slots=4) as m:
        want = [(list(m.generate(p, loops=L, max_tokens=8, early_exit=r)[len(p):]),
                 m.generate(p, loops=L, max_tokens=8, early_exit=r).stats) for p, L, r in jobs]
        b = Batcher(m.runner, interleave_exits=True)
        got = {}
        for lane, (p, L, rule) in enumerate(jobs):
            ids, _ = b.join(m.start(m.make_request(p, loops=L, max_tokens=8, early_exit=rule), lane))
            got[lane] = [list(ids), None]
        while b:
            for lane, (ids, f) in b.step().items():
                got[lane][0].extend(ids)
                got[lane][1] = f and f.stats
        got = [tuple(got[i]) for i in range(len(jobs))]
    assert got == want
    assert any(sum(st["iterations_histogram"][:-1]) for (_, st), j in zip(want, jobs) if j[2] is not None)
