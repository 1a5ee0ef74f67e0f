"""Every page of the site runs (tests/docs_pages.py says how, and how a page is marked): each `run` page's
commands and Python blocks in order in a scratch folder (marked `docs`: .ci/run's docs step), each `vllm` page the
same with the serve extra (marked `vllm`: the serving step), and each `record` page's `diffattn` commands parsed
with today's command line (cheap: the core suite). The core suite also checks, reading only, that every command
on every page is one the tests run or one `NOT_RUN` names, and that every page has a known marker."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest
from docs_pages import DOCS, REPO, blocks, page_mode, pages, parses, run_page, steps

PAGES = pages()
IDS = [p.relative_to(DOCS).as_posix() for p in PAGES]


def _mode(page: Path) -> str:
    return page_mode(page)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_command_on_the_page_is_run_or_named(page: Path) -> None:
    """Reading only: the page's marker is known and each of its shell commands is one the tests run or skip
    for a named reason (docs_pages.NOT_RUN), so no page can carry a command nothing tries."""
    text = page.read_text(encoding="utf-8")
    mode = page_mode(page, text)
    if mode not in ("record", "postgres"):  # a postgres page is one script its own test runs whole
        steps(text)  # raises on a command the tests neither run nor name


@pytest.mark.parametrize("page", [p for p in PAGES if _mode(p) == "record"],
                         ids=[i for p, i in zip(PAGES, IDS) if _mode(p) == "record"])
def test_recorded_commands_parse_with_todays_command_line(page: Path) -> None:
    """A results page records commands that ran for hours: each still parses (an option renamed since fails)."""
    text = page.read_text(encoding="utf-8")
    from docs_pages import blocks, shell_commands

    commands = [c for lang, body in blocks(text) if lang in ("bash", "sh", "shell", "console", "")
                for c in shell_commands(body) if c.startswith("diffattn ")]
    for command in commands:
        assert parses(command) is None, f"{page.name}: {command}\n{parses(command)}"


def _runs_something(page: Path) -> bool:
    try:
        return any(s.kind != "skip" for s in steps(page.read_text(encoding="utf-8")))
    except ValueError:  # test_every_command_on_the_page_is_run_or_named says which command
        return True


RUN_PAGES = [p for p in PAGES if _mode(p) == "run" and _runs_something(p)]


@pytest.mark.docs
@pytest.mark.parametrize("page", RUN_PAGES, ids=[p.relative_to(DOCS).as_posix() for p in RUN_PAGES])
def test_page_runs(page: Path, tmp_path: Path, monkeypatch) -> None:
    run_page(page, tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------ what the pages claim
def test_the_compare_tutorials_claims_count_matches_its_table() -> None:
    """The compare tutorial's count of reproduced claims is the tally of its own table's verdicts (both copied
    from one run's report)."""
    text = (DOCS / "tutorials" / "compare.md").read_text(encoding="utf-8")
    section = text.split("## Reproducing the paper", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"\*\*(\d+) of (\d+) claims reproduced", section)
    assert m, "the compare tutorial lost its claims count"
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| |")]
    verdicts = [v.strip() for row in rows for v in row.rstrip(" |").rsplit("|", 1)[1].split("/")]
    assert len(verdicts) == int(m.group(2)) == 14
    assert verdicts.count("reproduced") == int(m.group(1))
    assert "exactly" not in section  # figures differ across machines (the page says how)


def test_the_concepts_page_has_every_registered_attention_type() -> None:
    """The build checks it too (docs/_tools/hooks.py); this is the cheap form, in the core suite."""
    from diffattn.attention.registry import ATTENTION

    headings = [ln for ln in (DOCS / "concepts" / "attention.md").read_text(encoding="utf-8").splitlines()
                if ln.startswith("#")]
    missing = [n for n in ATTENTION if not any(f"`{n}`" in h for h in headings)]
    assert not missing, f"docs/concepts/attention.md has no section for {missing}"


def test_every_page_is_in_the_nav() -> None:
    """A page no one can reach is a page no one reads: every page is in mkdocs.yml's nav (named, or matched by one
    of its `*` entries, which do not cross a folder), or listed under not_in_nav (the reports a study wrote)."""
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    listed = re.findall(r"([\w./*-]+\.md)\??\s*$", config.split("\nnav:\n", 1)[1], re.M)
    globs = [re.compile(re.escape(p).replace(r"\*", "[^/]*") + "$") for p in listed if "*" in p]
    not_in_nav = config.split("not_in_nav: |\n", 1)[1].split("\n\n", 1)[0].split()
    for page in DOCS.rglob("*.md"):
        rel = page.relative_to(DOCS).as_posix()
        if rel.startswith("_") or rel in listed or any(g.match(rel) for g in globs):
            continue
        assert any(fnmatch.fnmatch(rel, p.replace("**/", "*")) for p in not_in_nav), \
            f"docs/{rel} is in no nav entry of mkdocs.yml"


def test_readme_is_a_front_page() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, "README.md is a front page (at most ~250 lines): move detail to docs/"
    assert "mkdocs serve" in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (REPO / link).is_file(), f"README links to {link}, which does not exist"


def test_results_json_next_to_results_pages_is_json() -> None:
    """The results pages link their data; a truncated JSON there would be a broken record."""
    for path in DOCS.glob("results/*/results.json"):
        json.loads(path.read_text(encoding="utf-8"))


def test_the_exit_codes_page_has_the_programs_codes() -> None:
    """docs/reference/faults.md's table names every code the program's one exit-code map gives."""
    from diffattn.system.io_errors import EX_IOERR
    from diffattn.train.driver import EXIT_DIVERGED, EXIT_USAGE

    text = (DOCS / "reference" / "faults.md").read_text(encoding="utf-8")
    table = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    codes = {int(c) for row in re.findall(r"^\| ([\d /]+) \|", table, re.M) for c in row.split("/")}
    assert {0, 1, EXIT_USAGE, EXIT_DIVERGED, EX_IOERR, 130, 143} <= codes, codes


def test_every_test_a_page_names_exists() -> None:
    """A page that cites `tests/x.py::test_name` as the proof of a claim cites a test that is there."""
    suites = "".join(f.read_text(encoding="utf-8") for f in (REPO / "tests").rglob("*.py"))
    cited = {(p.relative_to(DOCS).as_posix(), n) for p in PAGES
             for n in re.findall(r"::(test_\w+)", p.read_text(encoding="utf-8"))}
    missing = sorted((page, n) for page, n in cited if f"def {n}(" not in suites)
    assert not missing, f"pages cite tests that do not exist: {missing}"


def test_the_layout_page_names_every_module() -> None:
    """docs/development/layout.md is the tour of src/diffattn: every module is on it (cli/ is one module per
    command, and says so)."""
    text = (DOCS / "development" / "layout.md").read_text(encoding="utf-8")
    src = REPO / "src" / "diffattn"
    missing = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.py")
                     if not p.name.startswith("_") and p.parent.name != "cli" and p.stem not in text)
    assert not missing, f"docs/development/layout.md does not name {missing}"


# A path of the machine a page or a record was made on: a reader's clone has none of them. The rule: an absolute
# path under a root that holds one machine's or one user's files (/work, /root, /home, /Users, /tmp, /opt, /mnt,
# /scratch, /data, a Windows drive) is refused in every text file under docs/ and in README.md (pages, and the
# study.json/results.json/report/log records beside them); a path is relative to the clone instead (`../shared/
# data/...`, `weights/...`, `runs/...`), or `$TMPDIR/...` for a temporary folder a log names. System locations every
# Debian/Ubuntu install has (/usr/..., /etc/..., /dev/..., /proc/...) are not one machine's and stay allowed (the
# pages build a corpus from /usr/share/info and time with /usr/bin/time). A path inside a URL or after a word
# (`https://host/home/x`, `a/tmp/b`, a glob `*/data/`) is not an absolute path and is not matched.
MACHINE_PATH = re.compile(r"(?<![\w./:$~*-])(?:/(?:work|root|home|Users|tmp|opt|mnt|scratch|data)/"
                          r"|[A-Za-z]:\\\\?[\w.-])")


def _machine_paths(text: str) -> list[str]:
    return [text[max(0, m.start() - 40):m.end() + 40].replace("\n", " ") for m in MACHINE_PATH.finditer(text)]


@pytest.mark.parametrize("text,found", [
    ("diffattn study /work/shared/data/tinyshakespeare.txt", True),
    ('{"data": "/home/alice/corpus.txt"}', True),
    ("wrote /root/out/nvidia-h200.json", True),
    ("File \"/tmp/torchinductor_root/x.py\"", True),
    ("C:\\Users\\me\\model", True),
    ("diffattn study ../shared/data/tinyshakespeare.txt --out runs/x", False),
    ("cd /usr/share/info && zcat x.gz; /usr/bin/time -v diffattn info runs/tiny", False),
    ("https://github.com/home/tmp/work/x and http://127.0.0.1:8000/tmp/", False),
    ("$TMPDIR/bench-serve-1/diff and runs/tmp/x; cat */data/x.part*", False),
], ids=["work", "home-in-json", "root", "tmp", "windows", "relative", "system", "url", "tmpdir"])
def test_the_machine_path_rule(text: str, found: bool) -> None:
    assert bool(_machine_paths(text)) is found


def test_no_page_or_record_names_a_path_of_the_machine_it_ran_on() -> None:
    """Every text file under docs/ (pages and the records beside them) and README.md: no absolute path of one
    machine (the rule above MACHINE_PATH); a reader runs every command from a clone."""
    found = []
    for path in [REPO / "README.md", *sorted(p for p in DOCS.rglob("*") if p.is_file())]:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a figure
            continue
        found += [f"{path.relative_to(REPO)}: ...{hit}..." for hit in _machine_paths(text)]
    assert not found, f"{len(found)} absolute machine paths (make them relative to the clone):\n" + \
        "\n".join(found[:20])


# What a page's commands write, as the page names it: an --out/--plot target, a folder save_pretrained writes, a
# file a Python block or a shell redirection writes. Placeholders (DIR, FILE, RUN) and paths into docs/ are not.
WRITES = re.compile(r"--(?:out|plot) ([\w./-]+)|save_pretrained\(\"([\w./-]+)\"|Path\(['\"]([\w./-]+)['\"]\)"
                    r"\.write_text|> ([\w./-]+\.\w+)\s*$", re.M)


def test_what_the_pages_write_into_the_repository_root_is_ignored_by_git() -> None:
    """A reader runs the tutorials from the repository root: every file or folder they write there is in
    .gitignore (root-anchored), so `git status` stays clean (the results pages' downloads are listed there too)."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    texts = [REPO / "README.md", *(p for p in PAGES if not p.is_relative_to(DOCS / "results"))]
    written = set()
    for page in texts:
        body = "\n".join(b for _, b in blocks(page.read_text(encoding="utf-8")))
        for m in WRITES.finditer(body):
            path = next(g for g in m.groups() if g) + ("/" if m.group(2) else "")  # save_pretrained: a folder
            if path.startswith(("docs/", "/", "$", ".")) or not re.search(r"[a-z]", path):
                continue
            written.add(path.split("/")[0] + ("/" if "/" in path else ""))
    written.add("input.txt")  # the quick start's python -c writes it
    assert {"runs/", "reports/", "hf/", "vllm/", "my-model/", "story.txt"} <= written, written  # the scan works
    res = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *sorted(written)],
                         cwd=REPO, capture_output=True, text=True)
    missing = [ln.split("\t", 1)[1] for ln in res.stdout.splitlines() if ln.startswith("::")]
    assert not missing, f"the pages write these into the repository root and .gitignore does not ignore them: {missing}"


def test_the_readme_and_the_quick_start_name_every_registered_type() -> None:
    """`diffattn doctor` lists every registered attention type; README's list of types and the quick start's
    registry paragraph name each of them (`sink` was missing once)."""
    from diffattn.attention.registry import ATTENTION

    for path in (REPO / "README.md", DOCS / "quickstart.md"):
        text = path.read_text(encoding="utf-8")
        missing = [n for n in ATTENTION if f"`{n}`" not in text]
        assert not missing, f"{path.relative_to(REPO)} does not name the registered types {missing}"
