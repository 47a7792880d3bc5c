"""Early exit over real gRPC and a real local Ray cluster: a stream with an exit rule gets the
in-process Model's tokens and usage; a bad rule is INVALID_ARGUMENT naming the field; the
worker's iterations-per-token histogram counts the stream's tokens (what Prometheus exports)."""
from __future__ import annotations

import grpc
import pytest

from tinyloop.client import TinyLoopError

from service_helpers import wait_idle, worker_stats

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42]
RULE = {"criterion": "latent", "threshold": 0.3, "min_loops": 2}


def test_exit_stream_equals_in_process_and_reports_usage(client, local_model, actors):
    before = sum(sum(s["steps"]["iterations_counts"]) for s in worker_stats(actors))
    ids, c = client.generate(PROMPT, loops=6, max_tokens=16, early_exit=RULE).collect()
    want = local_model.generate(PROMPT, loops=6, max_tokens=16, early_exit=RULE)
    assert ids == want[len(PROMPT):]
    assert c.usage["iterations_histogram"] == want.stats["iterations_histogram"]
    assert c.usage["iterations_per_token"] == pytest.approx(want.stats["iterations_per_token"], rel=1e-6)
    assert c.usage["loop_token_iterations"] == want.stats["loop_token_iterations"]
    assert min(d for d, n in enumerate(c.usage["iterations_histogram"], 1) if n) < 6, "no token exited"
    stats = wait_idle(actors)
    after = sum(sum(s["steps"]["iterations_counts"]) for s in stats)
    assert after - before == sum(want.stats["iterations_histogram"])
    plain = client.generate(PROMPT, loops=6, max_tokens=4).collect()[1]
    assert "iterations_histogram" not in plain.usage  # exit off: the usage is as before


@pytest.mark.parametrize("rule, field", [
    ({"criterion": "latent", "threshold": 0.0}, "early_exit.threshold"),
    ({"criterion": "latent", "threshold": 2.0}, "early_exit.threshold"),
    ({"criterion": "entropy"}, "early_exit.criterion"),
    ({"criterion": "gate"}, "early_exit.criterion"),  # the tiny model has no gate
    ({"criterion": "argmax", "patience": 0}, "early_exit.patience"),
    ({"criterion": "latent", "cache": "zero"}, "early_exit.cache"),
])
def test_bad_exit_rule_is_invalid_argument(client, rule, field):
    with pytest.raises(TinyLoopError) as e:
        client.generate(PROMPT, loops=4, max_tokens=4, early_exit=rule).collect()
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.message


def test_iterations_histogram_is_exported_as_a_prometheus_histogram():
    """The worker's cumulative counts (its step metrics) as the gateway exports them."""
    from tinyloop.gateway.metrics import WorkerSteps
    from tinyloop.worker.serving.actor import _StepMetrics
    m = _StepMetrics(max_loops=4)
    m.observe_iterations([1, 0, 2, 3])   # a stream: 1 token at 1 iteration, 2 at 3, 3 at 4
    m.observe_iterations([0, 2, 0, 0])
    steps = WorkerSteps()
    steps.update("worker-0", m.snapshot())
    fam, = [f for f in steps.collect() if f.name == "tinyloop_worker_iterations_per_token"]
    got = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert got[("tinyloop_worker_iterations_per_token_bucket", "1.0")] == 1
    assert got[("tinyloop_worker_iterations_per_token_bucket", "2.0")] == 3
    assert got[("tinyloop_worker_iterations_per_token_bucket", "3.0")] == 5
    assert got[("tinyloop_worker_iterations_per_token_bucket", "+Inf")] == 8
    assert got[("tinyloop_worker_iterations_per_token_sum", None)] == 1 + 4 + 6 + 12
