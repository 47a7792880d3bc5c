"""The layout of worker/ is a stack: serving -> api -> generation -> runner -> model. Nothing
imports from a layer above it, and the generation layer never knows whether a graph runs."""
import ast
import pathlib

import pytest

WORKER = pathlib.Path(__file__).resolve().parents[2] / "worker"
KERNELS = WORKER.parent / "kernels"
ORDER = ["model", "runner", "generation", "api", "serving"]  # low to high


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["tinyloop", "worker"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ORDER else None


@pytest.mark.parametrize("layer", ["model", "runner", "generation", "serving"])
def test_no_layer_imports_from_above(layer):
    files = sorted((WORKER / layer).glob("*.py"))
    assert files, f"worker/{layer}/ is empty"
    above = set(ORDER[ORDER.index(layer) + 1:])
    for f in files:
        bad = {m for m in _imports(f) if _layer(m) in above}
        assert not bad, f"{f.relative_to(WORKER)} imports from a layer above it: {sorted(bad)}"


def test_api_imports_no_serving():
    assert not {m for m in _imports(WORKER / "api.py") if _layer(m) == "serving"}


def test_the_generation_layer_never_mentions_graphs():
    for f in sorted((WORKER / "generation").glob("*.py")):
        assert "graphs" not in f.read_text(), f"worker/generation/{f.name} mentions graphs"


def test_the_worker_reads_the_environment_in_settings_only():
    for f in sorted(WORKER.rglob("*.py")):
        if f.name == "settings.py":
            continue
        text = f.read_text()
        assert "os.environ" not in text and "getenv" not in text, f"{f.relative_to(WORKER)} reads the environment"


def test_the_kernels_read_the_environment_for_triton_alone():
    """How a launch runs (pdl, autotune, tiles) is an argument the ops pass from Settings: the
    one variable the kernels read is Triton's own TRITON_INTERPRET (kernels/_checks.py)."""
    triton_own = 'os.environ.get("TRITON_INTERPRET", "0")'
    for f in sorted(KERNELS.glob("*.py")):
        reads = [line.strip() for line in f.read_text().splitlines()
                 if ("os.environ" in line or "getenv" in line) and triton_own not in line]
        assert not reads, f"kernels/{f.name} reads the environment: {reads}"
    assert triton_own in (KERNELS / "_checks.py").read_text()
