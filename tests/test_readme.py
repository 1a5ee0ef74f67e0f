"""README cannot go stale: every `diffattn ...` command and every Python block in its code blocks runs here, in
README order, in one scratch folder (so `runs/tiny` made by one command is there for the next).

A command keeps its shape; only its size shrinks: training commands get fewer, smaller steps appended (later
flags win), `compare` gets `--quick`. The files the README tells the reader to bring (`input.txt`, `data.csv`,
a local Llama folder) are made here, small."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from clirun import run_main, run_script

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# Appended to a command of that kind: smaller, never different in kind. Keyed by the first word after `diffattn`.
SHRINK = {
    "train": ["--train.steps", "4", "--train.eval_every", "2", "--train.eval_batches", "1", "--train.batch_size", "2",
              "--train.log_every", "2"],
    "compare": ["--quick"],
}
# `study` (and its older spelling `compare --data`) also shrinks its grid and model: 2 seeds × 1 LR (no LR
# extensions), a 1-layer model, 8 steps (a command that names --steps keeps its shape, not its length), 1 job.
SHRINK_STUDY = ["--seeds", "2", "--lrs", "0.003", "--d-model", "32", "--n-layers", "1", "--seq-len", "32",
                "--batch-size", "4", "--steps", "8", "--jobs", "1", "--lr-extensions", "0"]
SHRINK["study"] = ["--quick", *SHRINK_STUDY]
TEXT = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
        "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.\n") * 60


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """Fenced code blocks as (language, body), in order."""
    return [(m.group(1).strip().lower(), m.group(2)) for m in re.finditer(r"```([^\n]*)\n(.*?)```", text, re.S)]


def shell_commands(body: str) -> list[str]:
    """The `diffattn ...` commands of a shell block (continuations joined, comments and `cmd && ` prefixes cut)."""
    joined = re.sub(r"[ \t]*\\\n\s*", " ", body)
    found = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for part in line.split("&&"):
            part = part.strip()
            if part.startswith("diffattn "):
                found.append(part)
    return found


def readme_steps() -> list[tuple[str, str]]:
    steps: list[tuple[str, str]] = []
    for lang, body in readme_blocks(README.read_text(encoding="utf-8")):
        if lang in ("bash", "sh", "shell", "console", ""):
            steps += [("sh", c) for c in shell_commands(body)]
        elif lang == "python":
            steps.append(("python", body))
    return steps


def _fixtures(cwd: Path) -> None:
    (cwd / "input.txt").write_text(TEXT, encoding="utf-8")
    shared = cwd.parent / "shared" / "data"  # README's commands use ../shared beside the checkout
    shared.mkdir(parents=True)
    (shared / "tinyshakespeare.txt").write_text(TEXT, encoding="utf-8")
    rows = ["label,text"] + [f"{'near' if i % 2 else 'far'},{'ab' if i % 2 else 'a' + 'x' * (i % 5 + 3) + 'b'}"
                             for i in range(80)]
    (cwd / "data.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")


def test_readme_has_the_two_setup_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "pip install torch==2.13.0 && pip install -e . && diffattn compare" in text
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q' in text


def test_every_readme_command_runs(tmp_path: Path, monkeypatch) -> None:
    """In this process, as a user's shell would run them one after another: each `diffattn ...` line through
    ``main(argv)``, each Python block as a script (``__name__ == "__main__"``). Installing and the ``diffattn``
    entry point itself are tested by test_package.py in a fresh virtual environment."""
    steps = readme_steps()
    assert sum(kind == "sh" for kind, _ in steps) >= 8, "README lost its command examples?"
    tmp_path = tmp_path / "work"
    tmp_path.mkdir()
    _fixtures(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for kind, step in steps:
        if not runs_here(kind, step):
            continue
        if kind == "sh":
            argv = shlex.split(step)
            study = "--data" in argv and argv[1] == "compare"
            res = run_main(*argv[1:], *SHRINK.get(argv[1], []), *(SHRINK_STUDY if study else []), cwd=tmp_path)
        else:
            res = run_script(step, cwd=tmp_path)
        assert res.returncode == 0, f"README step failed: {step}\n--- stderr:\n{res.stderr[-3000:]}"
    reports = [p.parent for p in tmp_path.glob("reports/compare-*/results.json")]
    assert reports, "README's main job (`diffattn compare`) wrote no report"
    for folder in reports:
        check_claims_count(folder)


# Not run here: `diffattn serve` starts a server that runs until stopped, and the vLLM examples need the serve
# extra and minutes of vLLM start-up; tests/serve/test_vllm_plugin.py runs both (marked vllm).
NOT_RUN = ("diffattn serve ",)
VLLM_IMPORT = re.compile(r"^\s*(from|import) vllm\b", re.M)


def runs_here(kind: str, step: str) -> bool:
    return not (step.startswith(NOT_RUN) if kind == "sh" else VLLM_IMPORT.search(step))


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


def test_readme_claims_count_matches_its_table() -> None:
    """README's main-job count is the tally of its own table's verdicts (both copied from one run's report)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Reproducing the paper", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"\*\*(\d+) of (\d+) claims reproduced", section)
    assert m, "README's main-job section lost its claims count"
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| |")]
    verdicts = [v.strip() for row in rows for v in row.rstrip(" |").rsplit("|", 1)[1].split("/")]
    assert len(verdicts) == int(m.group(2)) == 14
    assert verdicts.count("reproduced") == int(m.group(1))
    assert "exactly" not in section  # figures differ across machines (README says how)


@pytest.mark.parametrize("body,expected", [
    ("pip install x && diffattn compare   # the main job\n", ["diffattn compare"]),
    ("diffattn train --config tiny \\\n   --out runs/x  # comment\necho hi\n",
     ["diffattn train --config tiny --out runs/x"]),
])
def test_command_extraction(body: str, expected: list[str]) -> None:
    assert shell_commands(body) == expected
