"""The test run prints pytest's report and nothing else: no test writes past pytest's output capture (a stray
line in every run, e.g. a val accuracy, reads as an error to a newcomer). Tests keep such numbers in their
assertion messages or log them (logging), which pytest shows on failure or with -o log_cli=true."""

from __future__ import annotations

import re
from pathlib import Path

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
