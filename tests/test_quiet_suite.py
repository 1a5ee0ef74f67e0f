"""The test run prints pytest's report and nothing else: no test writes past pytest's output capture (a stray
line in every run, e.g. a val accuracy, reads as an error to a newcomer). Tests keep such numbers in their
assertion messages or log them (logging), which pytest shows on failure or with -o log_cli=true."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
BYPASS = re.compile(r"\b(capsys|capfd)\.disabled\(|sys\.__(stdout|stderr)__|/dev/tty")


def offenders(root: Path, skip: Path | None = None) -> list[str]:
    """Lines of the .py files under ``root`` (every subfolder: the tests mirror the package) that write past
    the capture, as "relative/path.py:line: text"."""
    return [
        f"{path.relative_to(root).as_posix()}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py")) if path != skip
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if BYPASS.search(line)
    ]


def test_no_test_writes_past_the_capture() -> None:
    found = offenders(TESTS, skip=Path(__file__).resolve())
    assert not found, "printed past pytest's capture:\n" + "\n".join(found)


def test_the_scan_reaches_the_test_subfolders(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "test_x.py").write_text("def test_x(capsys):\n    with capsys.disabled():\n        pass\n")
    (tmp_path / "test_y.py").write_text("import sys\nsys.__stdout__.write('x')\n")
    assert offenders(tmp_path) == ["test_y.py:2: sys.__stdout__.write('x')",
                                   "train/test_x.py:2: with capsys.disabled():"]


# A worker of `pytest -n N` whose end is slow (pytest's garbage collections over a large heap on a busy machine,
# here a loop of them), with hypothesis's gc callback registered (a @given test ran): execnet sends it a SIGINT
# 5 s after the run told it to stop.
_SLOW_END = '''
import gc, importlib.util, time
if {fixed}:
    spec = importlib.util.spec_from_file_location("suite_conftest", {conftest!r})
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    pytest_sessionfinish = suite.pytest_sessionfinish

def pytest_unconfigure(config):
    junk = [[object() for _ in range(50)] for _ in range(5000)]
    t = time.time()
    while time.time() - t < 8:
        gc.collect()
'''


@pytest.mark.slow
@pytest.mark.parametrize("fixed", [True, False], ids=["suite's conftest", "without it"])
def test_a_worker_ended_by_xdist_prints_no_keyboard_interrupt(tmp_path: Path, fixed: bool) -> None:
    """Issue 52: a passing run ended with a PytestUnraisableExceptionWarning holding a KeyboardInterrupt from
    hypothesis's gc callback. The suite's conftest has its workers ignore SIGINT once their tests are done. (The
    second case shows the SIGINT still comes: when it no longer does, the hook in conftest.py can go.)"""
    (tmp_path / "conftest.py").write_text(_SLOW_END.format(fixed=fixed, conftest=str(TESTS / "conftest.py")))
    (tmp_path / "test_h.py").write_text("from hypothesis import given, strategies as st\n\n"
                                        "@given(st.integers())\ndef test_h(x):\n    assert x == x\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-q", "-p", "no:cacheprovider", "-W", "default",
                        "test_h.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert "1 passed" in out, out
    assert ("KeyboardInterrupt" in out) is not fixed, out
