"""The README's set-up commands, from a clean clone of this repository in a new virtual
environment. `make test` is what CI itself runs on a clean clone (`.ci/run`); this test runs
`make run` the same way: the service must come up on the embedded model and answer a client."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_names_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout to clone")
def test_make_run_from_a_clean_clone(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    log_path = tmp_path / "make-run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["make", "run"], cwd=clone, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 900  # a fresh venv: torch, ray, grpc, triton
        while "listening on 127.0.0.1:50051" not in log_path.read_text():
            assert proc.poll() is None, f"make run exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(1)
        out = subprocess.run([str(clone / ".venv/bin/tinyloop"), "generate", "--server", "127.0.0.1:50051",
                              "--prompt", "def fibonacci(n):", "--loops", "8", "--max-tokens", "16"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("def fibonacci(n):") and len(out.stdout) > len("def fibonacci(n):")
        assert "finish: length, 16 tokens" in out.stderr
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
