"""The test run prints pytest's report and nothing else: no test writes past pytest's output capture (a stray
line in every run, e.g. a val accuracy, reads as an error to a newcomer). Tests keep such numbers in their
assertion messages or log them (logging), which pytest shows on failure or with -o log_cli=true."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
BYPASS = re.compile(r"\b(capsys|capfd)\.disabled\(|sys\.__(stdout|stderr)__|/dev/tty")


def test_no_test_writes_past_the_capture() -> None:
    offenders = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(TESTS.glob("*.py")) if path.name != Path(__file__).name
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if BYPASS.search(line)
    ]
    assert not offenders, "printed past pytest's capture:\n" + "\n".join(offenders)
