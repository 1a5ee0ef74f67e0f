"""CI runs the README's test command the way a user does (issue 32): `.ci/run` makes a fresh virtual environment
and runs, in it, the README's own set-up and test command (read from README.md, so they cannot drift apart), with
the layer contracts between them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None, reason=".ci/run is a bash script")
def test_ci_runs_the_readme_test_command_in_a_fresh_venv() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Two commands")[1].split("```")[1]
    command = next(ln for ln in block.splitlines() if ln.startswith("pip install") and "pytest" in ln)
    r = subprocess.run(["bash", str(REPO / ".ci" / "run"), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    venv, install, lint, tests = r.stdout.splitlines()
    assert venv == "python3 -m venv .ci/venv"
    assert install.startswith("pip install torch==2.13.0 && ")  # torch's CPU wheel first
    assert f"{install} && {tests}" == command and tests == "python -m pytest -q"
    assert lint == "lint-imports"
    assert "/.ci/venv/" in (REPO / ".gitignore").read_text().splitlines()
