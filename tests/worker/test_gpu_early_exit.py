"""Early exit on CUDA: the exit step on the captured batch graphs (and its captured checks)
against the torch reference path with the same rules, and a Ouro-shaped gated model's gate
rule. Run on a GPU host: `pytest -m gpu tests/worker/test_gpu_early_exit.py`."""
import dataclasses

import pytest
import torch

from tinyloop.worker import Model

from model_zoo import TINY, write_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [[3, 17, 42, 99, 7], [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12], [9] * 6, [1, 2]]
RULES = [{"criterion": "latent", "threshold": 0.3}, {"criterion": "kl", "threshold": 0.05},
         {"criterion": "argmax", "patience": 1, "cache": "recompute"}, None]


def _spy(monkeypatch, graphs) -> list:
    from tinyloop.worker.runner.graphs import Graphs
    calls = []
    replay = Graphs.replay

    def spy(self, kind, bucket, stage):
        if self is graphs:
            calls.append((kind, bucket, stage))
        replay(self, kind, bucket, stage)
    monkeypatch.setattr(Graphs, "replay", spy)
    return calls


def _fast(path) -> Model:
    """fp32 on the Triton kernels and captured graphs."""
    return Model(path, max_seq_len=128, device="cuda", dtype="float32", n_slots=4)


def _reference(path) -> Model:
    """The same on the torch reference ops, eagerly."""
    return Model(path, max_seq_len=128, device="cuda", dtype="float32", backend="torch", cuda_graphs=False,
                 n_slots=4)


def test_graphed_exit_equals_the_reference_path(tiny_path, monkeypatch):
    with _fast(tiny_path) as fast, _reference(tiny_path) as ref:
        calls = _spy(monkeypatch, fast.runner.graphs)
        a = fast.generate_batch(PROMPTS, per_lane_loops=[8, 8, 6, 7], max_tokens=16, early_exit=RULES)
        b = ref.generate_batch(PROMPTS, per_lane_loops=[8, 8, 6, 7], max_tokens=16, early_exit=RULES)
        one = fast.generate(PROMPTS[0], loops=8, max_tokens=16, early_exit=RULES[0])
    # fp32 on both paths: the GEMMs round differently, so a near tie may flip; most tokens agree
    agree = sum(x == y for p, g, h in zip(PROMPTS, a, b) for x, y in zip(g[len(p):], h[len(p):]))
    assert agree >= 0.9 * 16 * len(PROMPTS)
    assert list(one)[:len(PROMPTS[0]) + 4] == list(a[0])[:len(PROMPTS[0]) + 4]
    checks = {s for k, _, s in calls if k == "exit"}
    assert {"check0", "check1", "check+logits0", "check+logits1"} <= checks
    assert min(bk for k, bk, s in calls if k == "batch" and isinstance(s, int)) < 4  # rows left the bucket


def test_interleaved_exit_on_graphs_equals_the_reference_path(tiny_path, monkeypatch):
    """Latent rules checked inside interleaved passes (captured stages, Triton check and fill)
    against the torch reference path without graphs, fp32: the same tokens up to near ties,
    the same exits, and the exit stages replayed."""
    rules = [{"criterion": "latent", "threshold": 0.3}, None, {"criterion": "latent", "threshold": 0.5,
                                                               "min_loops": 2}, {"criterion": "latent", "threshold": 0.2}]
    with _fast(tiny_path) as fast, _reference(tiny_path) as ref:
        calls = _spy(monkeypatch, fast.runner.graphs)
        fast.runner.graphs.fuse_after = 2  # a short run: its sequences fuse from their second launch
        a = fast.generate_batch(PROMPTS, per_lane_loops=[8, 6, 8, 7], max_tokens=16, early_exit=rules)
        b = ref.generate_batch(PROMPTS, per_lane_loops=[8, 6, 8, 7], max_tokens=16, early_exit=rules)
        fused = [key for key in fast.runner.graphs.fused if key[0] == "interleaved"]
    agree = sum(x == y for p, g, h in zip(PROMPTS, a, b) for x, y in zip(g[len(p):], h[len(p):]))
    assert agree >= 0.9 * 16 * len(PROMPTS)
    for g, h, r in zip(a, b, rules):
        if r is not None:
            assert sum(g.stats["iterations_histogram"][:-1]) > 0  # tokens exited early
            assert abs(g.stats["iterations_per_token"] - h.stats["iterations_per_token"]) < 1.0
    assert {"exit_start", "iter_exit", "exit_end"} <= {s for k, _, s in calls if k == "interleaved"}
    assert fused  # the launches of a sequence seen before ran as its one graph


def test_gate_rule_on_cuda(tmp_path):
    cfg = dataclasses.replace(TINY, n_prelude=0, n_coda=0, n_loop_layers=2, norm="sandwich",
                              loop_final_norm=True, final_norm=False, exit_gate=True, max_loops=12)
    path = write_checkpoint(tmp_path / "ouro.tinyloop", cfg, seed=5, std=0.4)
    rule = {"criterion": "gate", "threshold": 0.6}
    with Model(path, max_seq_len=64, device="cuda", dtype="float32", n_slots=2) as fast, \
            Model(path, max_seq_len=64, device="cpu", n_slots=2) as cpu:
        g = fast.generate(PROMPTS[0], loops=8, max_tokens=12, early_exit=rule)
        h = cpu.generate(PROMPTS[0], loops=8, max_tokens=12, early_exit=rule)
    assert min(d for d, n in enumerate(h.stats["iterations_histogram"], 1) if n) < 8
    assert list(g)[:len(PROMPTS[0]) + 4] == list(h)[:len(PROMPTS[0]) + 4]


@pytest.mark.parametrize("span", [None, "min", "max"])
@pytest.mark.parametrize("rule", RULES[:3])
def test_one_stream_exit_on_its_graphs_equals_the_reference_path(tiny_path, rule, span):
    """A stream alone (solo_exit.py: a span graph per token, one graph per later iteration,
    the check kernel, the span's device-indexed copy fill) against the torch reference path,
    fp32: the same tokens and iterations over its first steps, whatever the span."""
    from tinyloop.worker.runner.solo_exit import SoloExit
    with Model(tiny_path, max_seq_len=128, device="cuda", dtype="float32", n_slots=2) as fast, \
            Model(tiny_path, max_seq_len=128, device="cuda", dtype="float32", backend="torch",
                  cuda_graphs=False, n_slots=2) as ref:
        r = fast.runner
        r._solo = solo = SoloExit(r.engine, r.graphs, r.ops.exit_check, span=span)
        g = fast.generate(PROMPTS[1], loops=8, max_tokens=24, early_exit=rule)
        h = ref.generate(PROMPTS[1], loops=8, max_tokens=24, early_exit=rule)
        assert solo.spans and solo.counts["steps"] > 0, "the solo graphs never ran"
        if span == "min":
            assert solo.counts["went_on"] > 0
    n = len(PROMPTS[1]) + 8
    assert list(g)[:n] == list(h)[:n]
    assert h.stats["iterations_per_token"] < 8, "no token exited: the case tests little"
