"""The Kubernetes manifests and the Helm chart, validated offline: every core object in
deploy/k8s and in the chart's renderings against the Kubernetes JSON schemas that
kubernetes-validate ships (strict: an unknown field is an error, as kubectl's default
server-side field validation makes it), the RayCluster against KubeRay's ray.io/v1 CRD schema
(deploy/schemas, see its README), and the chart through the real Helm binary (`helm lint
--strict`, `helm template`; deploy/tools/fetch_helm.py installs it beside the venv's python),
which enforces values.schema.json. The GPU worker group asks one nvidia.com/gpu per pod and
its pod count is the gateway's --workers.

What no test here can check without a cluster: that the KubeRay operator accepts the object
(its webhook and reconciler run semantic checks beyond the schema), that the image exists,
and the scheduling itself."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from tinyloop.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm/tinyloop"
RAYCLUSTER_SCHEMA = DEPLOY / "schemas/raycluster-ray.io-v1.schema.json"

# The oldest Kubernetes the deployment claims (gRPC probes are GA from 1.27 on) and the newest
# minor the pinned Helm's client is built for; kubernetes-validate ships both schema sets.
K8S_VERSIONS = ("1.29", "1.35")

# Renderings of the chart that reach every template branch: the defaults, TLS with client
# certificates plus auth and a model path, and a larger worker group.
CHART_CASES = {
    "defaults": [],
    "tls-auth-model": ["--set", "gateway.tlsSecret=tinyloop-tls", "--set", "gateway.tlsClientCA=true",
                       "--set", "gateway.authSecret=tinyloop-auth", "--set", "workers.model=/models/ouro"],
    "four-workers": ["--set", "workers.replicas=4"],
}


def _helm() -> str:
    # the Makefile installs it into the venv's bin; a helm on PATH serves as well
    found = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
    if found is None:
        pytest.fail("no helm binary beside the venv's python or on PATH: "
                    f"run `{sys.executable} deploy/tools/fetch_helm.py {Path(sys.executable).parent}` "
                    "(the Makefile does this when it builds the venv)")
    return found


def _run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=60)


@lru_cache(maxsize=None)
def _render(case: str, k8s_version: str = K8S_VERSIONS[-1]) -> tuple[dict, ...]:
    # --kube-version: what the chart's kubeVersion is checked against, as a cluster's would be
    p = _run_helm("template", "rel", str(CHART), "--kube-version", f"{k8s_version}.0", *CHART_CASES[case])
    assert p.returncode == 0, f"helm template ({case}, Kubernetes {k8s_version}) failed:\n{p.stderr}"
    return tuple(d for d in yaml.safe_load_all(p.stdout) if d)


def _manifest_objects() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"deploy/k8s/{path.name}", doc))
    return out


def _all_objects(k8s_version: str = K8S_VERSIONS[-1]) -> list[tuple[str, dict]]:
    objs = _manifest_objects()
    for case in CHART_CASES:
        objs += [(f"chart[{case}]", d) for d in _render(case, k8s_version)]
    return objs


def _name(where: str, obj: dict) -> str:
    return f"{where}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def _path(err: jsonschema.ValidationError) -> str:
    return "." + ".".join(str(p) for p in err.absolute_path) if err.absolute_path else "(root)"


@lru_cache(maxsize=None)
def _raycluster_validator(k8s_version: str) -> jsonschema.Draft202012Validator:
    # The CRD's embedded pod templates, head Service, env and security context are controller-gen
    # copies of the core types: the schema refers to the core definitions of the version checked.
    defs_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    (match,) = [d for d in defs_dir.iterdir() if d.name == f"v{k8s_version}.0-local-strict"]
    defs = Resource.from_contents(json.loads((match / "_definitions.json").read_text()))
    schema = json.loads(RAYCLUSTER_SCHEMA.read_text())
    registry = defs @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_its_schema(version):
    kinds, failures = set(), []
    for where, obj in _all_objects(version):
        kinds.add(obj["kind"])
        if obj["apiVersion"] == "ray.io/v1":
            errors = sorted(_raycluster_validator(version).iter_errors(obj), key=lambda e: list(e.absolute_path))
            failures += [f"{_name(where, obj)} fails KubeRay's RayCluster schema (core types of Kubernetes "
                         f"{version}) at {_path(e)}: {e.message}" for e in errors]
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.append(f"{_name(where, obj)} fails the Kubernetes {version} schema at {_path(e)}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            failures.append(f"{_name(where, obj)}: {e.message}")
    assert not failures, "\n".join(failures)
    # the set this deployment is made of: a new kind needs a schema here, not a silent pass
    assert kinds == {"Deployment", "Service", "RayCluster"}, kinds


def _resource_quantities(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "resources" and isinstance(v, dict):
                for kind in ("requests", "limits"):
                    for res, q in (v.get(kind) or {}).items():
                        yield f"{path}.resources.{kind}.{res}", q
            else:
                yield from _resource_quantities(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _resource_quantities(v, f"{path}[{i}]")


def test_resource_quantities_are_kubernetes_quantities():
    """kubernetes-validate's Quantity is any string; the CRD (and the API server) accept only
    the quantity grammar, e.g. `64Gi`, never `64GB`: checked with the CRD's own pattern."""
    pattern = re.compile(json.loads(RAYCLUSTER_SCHEMA.read_text())["$defs"]["quantity"]["pattern"])
    bad = [f"{_name(w, o)} {p} = {q!r}" for w, o in _all_objects() for p, q in _resource_quantities(o)
           if isinstance(q, str) and not pattern.match(q)]
    assert not bad, "not Kubernetes quantities:\n  " + "\n  ".join(bad)


def _raycluster_and_gateway(objs: list[dict]) -> tuple[dict, list[str]]:
    (rc,) = [o for o in objs if o["kind"] == "RayCluster"]
    gateways = [c for o in objs if o["kind"] == "Deployment"
                for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    assert len(gateways) == 1, f"expected one gateway container, found {len(gateways)}"
    return rc, gateways[0]["args"]


def _gpus(pod_spec: dict, kind: str) -> int:
    return sum(int(c.get("resources", {}).get(kind, {}).get("nvidia.com/gpu", 0)) for c in pod_spec["containers"])


SOURCES = ["deploy/k8s", *(f"chart[{c}]" for c in CHART_CASES)]


def _objects_of(source: str) -> list[dict]:
    if source == "deploy/k8s":
        return [o for _, o in _manifest_objects()]
    return list(_render(source[len("chart["):-1]))


@pytest.mark.parametrize("source", SOURCES)
def test_gpu_workers_match_the_gateways_workers(source):
    """One TinyLoop worker actor per GPU (num_gpus=1): each worker pod requests and limits
    exactly one nvidia.com/gpu, the head none, and the gateway's --workers is the number of
    worker pods, so every actor finds a GPU and no GPU idles. The worker group's replicas is
    that number only with KubeRay's autoscaler off, so that is checked too; and the gateway's
    --ray-address is the head Service KubeRay creates (`<cluster>-head-svc`)."""
    rc, args = _raycluster_and_gateway(_objects_of(source))
    ns = build_parser().parse_args(args[1:])
    assert not rc["spec"].get("enableInTreeAutoscaling"), \
        f"{source}: the RayCluster autoscales, so its worker count is not the gateway's --workers {ns.workers}"
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    assert _gpus(head, "requests") == _gpus(head, "limits") == 0, f"{source}: the Ray head requests GPUs"
    pods = 0
    for group in rc["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        for kind in ("requests", "limits"):
            assert _gpus(spec, kind) == 1, \
                f"{source}: worker group {group['groupName']!r} {kind} {_gpus(spec, kind)} nvidia.com/gpu per pod, not 1"
        counts = [group.get(k) for k in ("minReplicas", "replicas", "maxReplicas")]
        assert all(type(c) is int for c in counts), f"{source}: worker group replica counts {counts} not integers"
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], \
            f"{source}: worker group {group['groupName']!r} replicas {group['replicas']} outside " \
            f"[{group['minReplicas']}, {group['maxReplicas']}]"
        pods += group["replicas"]
    assert ns.workers == pods, f"{source}: the gateway runs --workers {ns.workers} but the RayCluster has " \
                               f"{pods} GPU worker pods of one GPU each"
    head_svc = urlparse(ns.ray_address).hostname
    assert head_svc == f"{rc['metadata']['name']}-head-svc", \
        f"{source}: --ray-address {ns.ray_address} is not the head Service of RayCluster {rc['metadata']['name']}"


@pytest.mark.parametrize("source", SOURCES)
def test_gateway_places_gpu_workers_before_the_gpu_pods_join(source):
    """The gateway pod can start while the GPU worker pods are still pulling the image: the
    cluster then has no GPU yet. With --device cuda every worker still asks num_gpus=1 (Ray
    holds it until a GPU pod joins); without it the gateway would start CPU workers."""
    from tinyloop.gateway.workers import placement
    _, args = _raycluster_and_gateway(_objects_of(source))
    ns = build_parser().parse_args(args[1:])
    assert ns.device == "cuda", f"{source}: the gateway runs without --device cuda"
    assert placement(ns.workers, 0, ns.device) == (ns.workers, True)


def test_placement_without_a_device_counts_the_gpus():
    from tinyloop.gateway.workers import placement
    assert placement(None, 0, None) == (1, False)     # a CPU machine: one CPU worker
    assert placement(None, 4, None) == (4, True)      # one per GPU
    assert placement(2, 1, None) == (2, False)        # fewer GPUs than workers: CPU workers
    assert placement(2, 2, "cpu") == (2, False)


def test_chart_worker_count_follows_its_values():
    """The four-workers rendering really has four (the defaults two): --workers is computed
    from workers.replicas, not written down twice."""
    for case, want in (("defaults", 2), ("four-workers", 4)):
        rc, args = _raycluster_and_gateway(list(_render(case)))
        assert build_parser().parse_args(args[1:]).workers == want, case
        assert [g["replicas"] for g in rc["spec"]["workerGroupSpecs"]] == [want], case


@pytest.mark.parametrize("case", list(CHART_CASES))
def test_chart_command_lines_parse(case):
    """Every `tinyloop` command line the chart renders parses with the real CLI."""
    _, args = _raycluster_and_gateway(list(_render(case)))
    assert args[0] == "tinyloop"
    build_parser().parse_args(args[1:])


def _schema_paths(schema: dict, prefix: str = "") -> dict[str, dict]:
    out = {}
    for key, sub in schema.get("properties", {}).items():
        out[prefix + key] = sub
        out.update(_schema_paths(sub, f"{prefix}{key}."))
    return out


VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def test_templates_use_only_values_the_schema_defines():
    """Every `.Values.x.y` in the templates is a property of values.schema.json, and every leaf
    the schema defines is used (no dead values). References the regex could not see (`$.Values`,
    `index .Values ...`, `.Values | toYaml`) are refused, so the scan stays complete."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    paths = _schema_paths(schema)
    leaves = {p for p, s in paths.items() if s.get("type") != "object"}
    used = set()
    for tpl in sorted((CHART / "templates").iterdir()):
        text = tpl.read_text()
        refs = [m.group(1)[1:] for m in VALUES_REF.finditer(text)]
        assert text.count("Values") == len(refs), \
            f"{tpl.name}: a .Values reference not of the form .Values.a.b (the scan cannot follow it)"
        unknown = sorted(set(refs) - set(paths))
        assert not unknown, f"{tpl.name} uses values values.schema.json does not define: {unknown}"
        used |= set(refs)
    # a leaf used through its parent object would count as used; the chart passes none that way
    assert leaves <= used, f"values.schema.json defines values no template uses: {sorted(leaves - used)}"


def test_values_yaml_validates_against_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)  # the draft Helm 3 and Helm 4 both read
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(values))
    assert not errors, "values.yaml fails values.schema.json:\n" + "\n".join(f"  {_path(e)}: {e.message}" for e in errors)


def test_chart_refuses_kubernetes_older_than_validated():
    p = _run_helm("template", "rel", str(CHART), "--kube-version", "1.28.0")
    assert p.returncode != 0 and "kubeVersion" in p.stderr, \
        f"the chart renders for Kubernetes 1.28, older than the {K8S_VERSIONS[0]} it is validated against"


def test_helm_lint_strict_passes():
    p = _run_helm("lint", "--strict", str(CHART))
    assert p.returncode == 0, f"helm lint --strict failed:\n{p.stdout}{p.stderr}"


@pytest.mark.parametrize("override, complaint", [
    ("gateway.bogus=1", "additional properties 'bogus' not allowed"),
    ("workers.replicas=0", "/workers/replicas"),
    ("workers.memory=64GB", "/workers/memory"),
])
def test_helm_enforces_the_values_schema(override, complaint):
    """Helm itself refuses values the schema does not allow, before anything is rendered."""
    p = _run_helm("template", "rel", str(CHART), "--set", override)
    assert p.returncode != 0 and complaint in p.stderr, \
        f"helm template --set {override} was not refused by values.schema.json:\n{p.stderr}"
