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
    ("--coalesce-ms", "-1", "--coalesce-ms must be >= 0"),
    ("--first-token-wait-ms", "-0.5", "--first-token-wait-ms must be >= 0"),
    ("--gil-switch-ms", "0", "--gil-switch-ms must be > 0"),
    ("--step-tokens", "0", "--step-tokens must be >= 1"),
    ("--speculative-share-from", "-1", "--speculative-share-from must be >= 0"),
])
def test_serve_rejects_bad_worker_settings(capsys, flag, value, message):
    """Checked before Ray starts: the error names the flag."""
    from tinyloop.cli import main
    assert main(["serve", flag, value]) == 2
    assert message in capsys.readouterr().err


def test_serve_rejects_an_unknown_prefill_order(capsys):
    from tinyloop.cli import main
    with pytest.raises(SystemExit):
        main(["serve", "--prefill-order", "shortest"])
    assert "--prefill-order: invalid choice: 'shortest'" in capsys.readouterr().err


def test_serve_rejects_batch_invariance_on_cpu_workers(capsys):
    from tinyloop.cli import main
    assert main(["serve", "--device", "cpu", "--batch-invariant"]) == 2
    assert "--batch-invariant runs the Triton kernels" in capsys.readouterr().err
