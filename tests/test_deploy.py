"""The deployment files agree with the code: the image holds every package, and every
`tinyloop` command line in the manifests parses with the real CLI. (No Docker engine or
cluster runs in CI; this is what can be checked without one.)"""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from tinyloop.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def test_image_copies_every_package_folder():
    pkg_dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (DEPLOY / "Dockerfile").read_text(), re.M))
    assert pkg_dirs <= copied, f"Dockerfile misses {sorted(pkg_dirs - copied)}"


def _tinyloop_commands():
    cmd = re.search(r"^CMD (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.M)
    yield "Dockerfile CMD", json.loads(cmd.group(1))
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for c in _containers(doc):
                args = c.get("args") or c.get("command") or []
                if args[:1] == ["tinyloop"]:
                    yield f"{path.name}:{c['name']}", args


def _containers(node):
    if isinstance(node, dict):
        if "containers" in node:
            yield from node["containers"]
        for v in node.values():
            yield from _containers(v)
    elif isinstance(node, list):
        for v in node:
            yield from _containers(v)


@pytest.mark.parametrize("where, argv", list(_tinyloop_commands()))
def test_manifest_command_lines_parse(where, argv):
    build_parser().parse_args(argv[1:])


def test_manifests_and_chart_are_valid_yaml():
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")) + [DEPLOY / "helm/tinyloop/values.yaml",
                                                            DEPLOY / "helm/tinyloop/Chart.yaml"]:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, path


def test_gateway_probes_wait_for_the_workers_start_up():
    """The gateway listens only after its workers captured their graphs (Gateway.start awaits
    their info), which takes minutes on a large model: a startup probe on the gRPC port gives
    it 10 minutes or more, and liveness (which it gates) has no start-up delay of its own
    that could be shorter. Both the manifest and the chart."""
    for doc in yaml.safe_load_all((DEPLOY / "k8s/gateway.yaml").read_text()):
        for c in _containers(doc):
            if c["name"] == "gateway":
                start = c["startupProbe"]
                assert start["grpc"]["port"] == 50051
                assert start["periodSeconds"] * start["failureThreshold"] >= 600
                assert "initialDelaySeconds" not in c["livenessProbe"]
    chart = (DEPLOY / "helm/tinyloop/templates/gateway.yaml").read_text()
    assert "startupProbe:" in chart and "failureThreshold: {{ div .Values.gateway.startupTimeoutS 10 }}" in chart
    assert "initialDelaySeconds" not in chart
    values = yaml.safe_load((DEPLOY / "helm/tinyloop/values.yaml").read_text())
    assert values["gateway"]["startupTimeoutS"] >= 600


@pytest.mark.parametrize("flag, value, message", [
    ("--coalesce-ms", "-1", "coalesce_s must be >= 0 (tinyloop serve --coalesce-ms)"),
    ("--first-token-wait-ms", "-0.5", "first_token_wait_s must be >= 0 (tinyloop serve --first-token-wait-ms)"),
    ("--gil-switch-ms", "0", "gil_switch_s must be > 0 (tinyloop serve --gil-switch-ms)"),
    ("--max-hops-per-s", "0", "max_hops_per_s must be > 0 (tinyloop serve --max-hops-per-s)"),
    ("--step-tokens", "0", "step_tokens must be >= 1 (tinyloop serve --step-tokens)"),
    ("--max-queue", "-1", "max_queue must be >= 0 (tinyloop serve --max-queue)"),
    ("--speculative-max-running", "-1", "(tinyloop serve --speculative-max-running)"),
    ("--speculative-share-from", "-1", "speculative_share_from must be >= 0 (tinyloop serve --speculative-share-from)"),
    ("--worker-channel-port", "70000", "(tinyloop serve --worker-channel-port), got 70000"),
])
def test_serve_rejects_bad_worker_settings(capsys, flag, value, message):
    """Checked before Ray starts (WorkerOptions' checks): the error names the option and its flag."""
    from tinyloop.cli import main
    assert main(["serve", flag, value]) == 2
    assert message in capsys.readouterr().err


def test_serve_rejects_an_unknown_prefill_order(capsys):
    from tinyloop.cli import main
    with pytest.raises(SystemExit):
        main(["serve", "--prefill-order", "shortest"])
    assert "--prefill-order: invalid choice: 'shortest'" in capsys.readouterr().err


def test_the_flags_defaults_are_the_worker_options(capsys):
    """One place for every default: `tinyloop serve`'s flags parse to WorkerOptions' and
    SchedulerOptions' own defaults."""
    from tinyloop.cli import build_parser
    from tinyloop.worker.serving.options import ChannelOptions, SchedulerOptions, WorkerOptions
    a = build_parser().parse_args(["serve"])
    w, s, c = WorkerOptions(), SchedulerOptions(), ChannelOptions()
    assert (a.max_seq_len, a.init_scale, a.handle_ttl_s, int(a.handle_budget_mb * (1 << 20)), a.max_hops_per_s) == \
        (w.max_seq_len, w.init_scale, w.handle_ttl_s, w.handle_budget_bytes, w.max_hops_per_s)
    assert (a.coalesce_ms / 1e3, a.gil_switch_ms / 1e3, a.first_token_wait_ms / 1e3) == pytest.approx(
        (w.coalesce_s, w.gil_switch_s, w.first_token_wait_s))
    assert (a.max_queue, a.step_tokens, a.prefill_together, a.speculative_max_running, a.speculative_share_from,
            a.prefill_order) == (s.max_queue, s.step_tokens, s.prefill_together, s.speculative_max_running,
                                 s.speculative_share_from, s.prefill_order)
    assert (a.worker_channel, a.worker_channel_port) == (c.enabled, c.port)


def test_serve_rejects_batch_invariance_on_cpu_workers(capsys):
    from tinyloop.cli import main
    assert main(["serve", "--device", "cpu", "--batch-invariant"]) == 2
    assert "--batch-invariant runs the Triton kernels" in capsys.readouterr().err
