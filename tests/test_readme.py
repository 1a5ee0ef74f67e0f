"""README cannot go stale: every `diffattn ...` command, `python -c` command and Python block in its code blocks
runs here, in README order, in one scratch folder (so `runs/tiny` made by one command is there for the next), in
the core suite. The rules (how a command shrinks, what is made for it, what is not run and why) are the docs
pages' own, tests/docs_pages.py; the other pages run in tests/docs/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from docs_pages import REPO, run_page, shell_commands, steps

README = REPO / "README.md"


def test_readme_has_the_two_setup_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "pip install torch==2.13.0 && pip install -e . && diffattn compare" in text
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q' in text


def test_every_readme_command_runs(tmp_path: Path, monkeypatch) -> None:
    """In this process, as a user's shell would run them one after another: each `diffattn ...` line through
    ``main(argv)``, each Python block as a script (``__name__ == "__main__"``). Installing and the ``diffattn``
    entry point itself are tested by test_package.py in a fresh virtual environment."""
    ran = [s for s in steps(README.read_text(encoding="utf-8")) if s.kind != "skip"]
    assert sum(s.kind == "diffattn" for s in ran) >= 6, "README lost its command examples?"
    run_page(README, tmp_path, monkeypatch)
    reports = [p.parent for p in (tmp_path / "work").glob("reports/compare-*/results.json")]
    assert reports, "README's main job (`diffattn compare`) wrote no report"
    for folder in reports:
        check_claims_count(folder)


CLAIMS_LINE = re.compile(r"\*\*(\d+) of the (\d+) paper claims checked here reproduced")


def check_claims_count(folder: Path) -> None:
    """The claims count a compare report prints is the run's: summary.md, the top of report.md and the verdicts
    in results.json agree, and the summary's verdict table says the same."""
    claims = json.loads((folder / "results.json").read_text(encoding="utf-8"))["claims"]
    yes = sum(c["verdict"] == "reproduced" for c in claims)
    summary = (folder / "summary.md").read_text(encoding="utf-8")
    report = (folder / "report.md").read_text(encoding="utf-8")
    for text in (summary, report):
        m = CLAIMS_LINE.search(text)
        assert m, f"{folder}: no claims count in the summary"
        assert (int(m.group(1)), int(m.group(2))) == (yes, len(claims)), (folder, m.group(0))
    verdicts = [row.rsplit("|", 2)[1].strip() for row in summary.splitlines() if row.startswith("| ")][1:]
    assert verdicts == [c["verdict"] for c in claims]


@pytest.mark.parametrize("body,expected", [
    ("pip install x && diffattn compare   # the main job\n", ["pip install x", "diffattn compare"]),
    ("diffattn train --config tiny \\\n   --out runs/x  # comment\necho hi\n",
     ["diffattn train --config tiny --out runs/x", "echo hi"]),
])
def test_command_extraction(body: str, expected: list[str]) -> None:
    assert shell_commands(body) == expected
