"""The docs cannot go stale: every command and Python block of README.md and of every page under docs/ runs in
the tests, in page order, in one scratch folder per page (so `runs/tiny` made by one command is there for the
next). README.md runs in the core suite (tests/test_readme.py); every other page in the `docs`-marked tests
(tests/docs/test_pages.py, .ci/run's docs step), or the `vllm`-marked ones for a page that needs the serve extra.

A command keeps its shape; only its size shrinks: training commands get fewer, smaller steps appended (later
flags win), `compare` and `study` get `--quick` and a tiny grid. The files a page tells the reader to bring
(`input.txt`, `data.csv`, `../shared/data/tinyshakespeare.txt`) are made here, small, before the page runs; a
page that makes them itself (`python -c ...` on the quick start) replaces them.

**Page markers**, an HTML comment anywhere on the page (invisible on GitHub and on the site):

- `<!-- docs-test: vllm -->`: the page needs the `serve` extra; its test is marked `vllm`. A `diffattn serve`
  command starts the server in the background (the page's later `curl` commands and Python blocks talk to it)
  and stops it when the page ends; its Python blocks run as scripts in a new process, as written.
- `<!-- docs-test: record -->`: the commands record runs of hours (a results page): each `diffattn` command must
  parse with today's command line, and none runs. Every page under docs/results/ is a record unless it says
  otherwise (`<!-- docs-test: run -->`).
- `<!-- docs-test: run -->`: the default: every command runs.

In a shell block (```bash, ```sh, ```console or a bare fence), `diffattn ...` runs through ``main(argv)`` in
the test process; `python -c`, `python -m diffattn...` and `python docs/...` in a new process; `curl` (on a `vllm`
page) as it is. Any other command must be named in `NOT_RUN`, with the reason and the test that covers it
instead: a command that is neither run nor named fails the core suite (`tests/docs/test_pages.py`), so no page
can slip one in.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from clirun import run_main, run_script

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

# Appended to a command of that kind: smaller, never different in kind. Keyed by the first word after `diffattn`.
SHRINK = {
    "train": ["--train.steps", "4", "--train.eval_every", "2", "--train.eval_batches", "1", "--train.batch_size", "2",
              "--train.log_every", "2"],
    "compare": ["--quick"],
}
# `study` also shrinks its grid and model: 2 seeds × 1 LR (no LR
# extensions), a 1-layer model, 8 steps (a command that names --steps keeps its shape, not its length), 1 job.
SHRINK_STUDY = ["--seeds", "2", "--lrs", "0.003", "--d-model", "32", "--n-layers", "1", "--seq-len", "32",
                "--batch-size", "4", "--steps", "8", "--jobs", "1", "--lr-extensions", "0"]
SHRINK["study"] = ["--quick", *SHRINK_STUDY]
TEXT = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
        "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.\n") * 60

# Commands a page shows that these tests do not run, by how they start: why, and what tests them instead.
NOT_RUN: dict[str, str] = {
    "pip ": "installs packages: tests/test_package.py installs diffattn in a fresh environment, .ci/run each extra",
    "python3 -m venv ": "makes a virtual environment (.ci/run makes each one it tests in)",
    ". ": "activates a virtual environment",
    "torchrun ": "several processes: tests/train/test_distributed.py runs DDP and FSDP2 over 2 processes",
    "tensorboard ": "a server that runs until stopped (tests/train/test_tensorboard.py reads what it shows)",
    "mkdocs ": "tests/docs/test_site.py builds the site, strictly",
    "python -m pytest ": "the tests themselves",
    "python -m diffattn.interop.lm_harness ": "lm-eval's tasks need their data sets: "
                                              "tests/interop/test_lm_harness.py runs it on a local task",
    "python benchmarks/": "a benchmark (minutes to hours), a script, not a test",
    "TRITON_INTERPRET=1 ": "tests/ops/ runs the Triton kernel under its interpreter",
    "wandb sync ": "uploads to Weights & Biases (no network here)",
}
SHELL = ("bash", "sh", "shell", "console", "")
MARKER = re.compile(r"<!--\s*docs-test:\s*([\w-]+)\s*-->")
MODES = ("run", "record", "vllm", "postgres")  # postgres: one script, run by tests/experiments/test_study_postgres.py


def pages() -> list[Path]:
    """Every Markdown page of the site (docs/), the generated ones left out: a study's own report.md and the
    serving benchmark's tables, which record what a command wrote."""
    out = []
    for p in sorted(DOCS.rglob("*.md")):
        rel = p.relative_to(DOCS).as_posix()
        if rel.startswith("_") or (rel.startswith("results/") and p.name in ("report.md", "serve.md")):
            continue
        out.append(p)
    return out


def page_mode(page: Path, text: str | None = None) -> str:
    text = page.read_text(encoding="utf-8") if text is None else text
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))  # a marker shown as code
    marks = MARKER.findall(prose)  # is not one
    unknown = [m for m in marks if m not in MODES]
    if unknown or len(set(marks)) > 1:
        raise ValueError(f"{page}: docs-test markers {marks}: one of {MODES}")
    if marks:
        return marks[0]
    return "record" if page.is_relative_to(DOCS / "results") else "run"


def blocks(text: str) -> list[tuple[str, str]]:
    """Fenced code blocks as (language, body), in order."""
    fences = re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M)
    return [(m.group(1).strip().lower(), m.group(2)) for m in fences]


def shell_commands(body: str) -> list[str]:
    """The commands of a shell block: continuations joined, comments and blank lines cut, `a && b` split."""
    joined = re.sub(r"[ \t]*\\\n\s*", " ", body)
    found = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#(?![!]).*$", "", line).strip()
        found += [part.strip() for part in line.split("&&") if part.strip()]
    return found


@dataclass
class Step:
    kind: str  # "diffattn", "python", "python-c", "python-m", "python-file", "curl", or "skip"
    text: str  # the command or the block, as the page writes it
    why: str = ""  # a skipped command: the reason (NOT_RUN)
    env: dict[str, str] | None = None  # `VAR=value command`: the variables it sets for the command


ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=(\S*)\s+")


def classify(command: str) -> Step:
    """What the tests do with one shell command of a page (`VAR=value command`: the command, with VAR set)."""
    env = {}
    while (m := ASSIGNMENT.match(command)) and not any(command.startswith(p) for p in NOT_RUN):
        env[m.group(1)] = m.group(2)
        command = command[m.end():]
    step = _classify(command)
    step.env = env or None
    return step


def _classify(command: str) -> Step:
    words = command.split()
    if words[0] == "diffattn":
        return Step("diffattn", command)
    for prefix, why in NOT_RUN.items():
        if command.startswith(prefix):
            return Step("skip", command, why)
    if words[:2] == ["python", "-c"]:
        return Step("python-c", command)
    if words[:2] == ["python", "-m"] and words[2].startswith("diffattn"):
        return Step("python-m", command)
    if words[0] == "python" and words[1].startswith("docs/"):  # a figure's script (docs/figures/)
        return Step("python-file", command)
    if words[0] == "curl":
        return Step("curl", command)
    raise ValueError(f"a command the docs tests neither run nor name in docs_pages.NOT_RUN: {command!r}")


def steps(text: str) -> list[Step]:
    out: list[Step] = []
    for lang, body in blocks(text):
        if lang in SHELL:
            out += [classify(c) for c in shell_commands(body)]
        elif lang == "python":
            out.append(Step("python", body))
    return out


def fixtures(cwd: Path) -> None:
    """The files pages ask the reader to bring, small."""
    (cwd / "input.txt").write_text(TEXT, encoding="utf-8")
    shared = cwd.parent / "shared" / "data"  # pages use ../shared beside the checkout
    shared.mkdir(parents=True, exist_ok=True)
    (shared / "tinyshakespeare.txt").write_text(TEXT, encoding="utf-8")
    rows = ["label,text"] + [f"{'near' if i % 2 else 'far'},{'ab' if i % 2 else 'a' + 'x' * (i % 5 + 3) + 'b'}"
                             for i in range(80)]
    (cwd / "data.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")


# A study `--from SRC` takes its model's shape from SRC: the shrink leaves the shape options out.
SHAPE = ("--d-model", "--n-layers")


def shrunk(argv: list[str]) -> list[str]:
    """A `diffattn` command's arguments (after `diffattn`) at the tests' size."""
    # a retrofit's schedule fits in the shrunk run: half its steps
    retrofit = ["--retrofit.steps", "2"] if argv[0] == "train" and any(a.startswith("--retrofit.") for a in argv) \
        else []
    extra = [*SHRINK.get(argv[0], []), *retrofit]
    if "--from" in argv:
        extra = [x for i, x in enumerate(extra) if x not in SHAPE and (i == 0 or extra[i - 1] not in SHAPE)]
    return [*argv, *extra]


def subprocess_env() -> dict[str, str]:
    """A new process sees this checkout's diffattn (the package may be installed from another one)."""
    src = str(REPO / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "MPLBACKEND": "Agg"}


def run_shell(step: Step, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c`, `python -m diffattn...` or `curl`, as a new process in ``cwd``."""
    argv = shlex.split(step.text)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**subprocess_env(), **(step.env or {})}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def parses(command: str) -> str | None:
    """None when a `diffattn` command parses with today's command line, else argparse's complaint."""
    import contextlib
    import io

    from diffattn.cli.main import build_parser

    argv = shlex.split(command)[1:]
    extra = argv[argv.index("--"):] if "--" in argv else []  # after --: another program's (serve: vLLM's)
    argv = argv[:len(argv) - len(extra)]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns, unknown = build_parser(load=[argv[0]]).parse_known_args(argv)
    except SystemExit as e:
        return err.getvalue().strip().splitlines()[-1] if e.code else None
    if extra and not getattr(ns, "_accepts_extra", False):
        return f"unrecognized arguments: {' '.join(extra)}"
    # `train` takes its run config's fields as --section.field VALUE (its own parser checks them against the
    # dataclasses when it runs); anything else unknown is an error
    words = [w for w in unknown if w.startswith("--")]
    if argv[0] != "train" and words or any(not re.fullmatch(r"--\w+(\.\w+)+", w) for w in words):
        return f"unrecognized arguments: {' '.join(unknown)}"
    return next((f"{w}: no such config field" for w in words if not _is_field(w[2:].split("."))), None)


def _is_field(path: list[str]) -> bool:
    """Whether `--section.field` names a field of the run config (`attn_options` and a synthetic task's `params`
    take any name: their own types check them)."""
    import dataclasses

    from diffattn.configs.run_config import SECTIONS

    cls = SECTIONS.get(path[0])
    names = {f.name for f in dataclasses.fields(cls)} if cls else set()
    return len(path) >= 2 and path[1] in names and (len(path) == 2 or path[1] in ("attn_options", "params"))


# ------------------------------------------------------------------------------------------------ the runner
def run_page(page: Path, tmp_path: Path, monkeypatch, serve: bool = False) -> None:
    """The page's steps in order in one scratch folder, as a reader runs them from the repository root."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    fixtures(cwd)
    (cwd / "docs").symlink_to(DOCS)  # `python docs/figures/...` from the "repository root"
    monkeypatch.setenv("MPLBACKEND", "Agg")
    server = None
    try:
        for step in steps(page.read_text(encoding="utf-8")):
            if step.kind == "skip":
                continue
            if serve and step.kind == "diffattn" and shlex.split(step.text)[1] == "serve":
                server = start_server(step, cwd, tmp_path)
                continue
            if serve and step.kind == "python":  # as written: a script in a new process (vLLM spawns)
                script = tmp_path / "step.py"
                script.write_text(step.text, encoding="utf-8")
                env = {k: v for k, v in subprocess_env().items()  # as a reader's shell has it: the tests'
                       if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}  # settings gone
                res = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                                     timeout=900)
                code, err = res.returncode, res.stderr
            elif step.kind == "diffattn":
                for name, value in (step.env or {}).items():
                    monkeypatch.setenv(name, value)
                res = run_main(*shrunk(shlex.split(step.text)[1:]), cwd=cwd)
                code, err = res.returncode, res.stderr
            elif step.kind == "python":
                res = run_script(step.text, cwd=cwd)
                code, err = res.returncode, res.stderr
            else:
                res = run_shell(step, cwd)
                code, err = res.returncode, res.stderr + res.stdout[-2000:]
            assert code == 0, f"{page.name}: step failed: {step.text}\n--- stderr:\n{err[-3000:]}"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=120)


def start_server(step: Step, cwd: Path, tmp_path: Path) -> subprocess.Popen:
    """`diffattn serve ...` as the page writes it, in the background, small enough for the test machine; returns
    once the server answers /health (bounded)."""
    argv = shlex.split(step.text)[1:]
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port}, which the page serves on, is in use"
    extra = [] if "--" in argv else ["--"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "diffattn", *argv, *extra, "--max-model-len", "128"],
                            cwd=cwd, env={**subprocess_env(), "OMP_NUM_THREADS": "1",
                                          "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise AssertionError(f"diffattn serve did not come up:\n{(tmp_path / 'serve.log').read_text()[-3000:]}")


def mkdocs(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    """`mkdocs ARGS` in a new process (the docs extra), with this checkout's diffattn."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "mkdocs", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
