"""Secrets on the command line (issue 52): the password of a ``study --storage`` database URL and ``serve``'s
``--api-key`` are never printed (errors, progress, the command that resumes) nor written (study.json,
results.json, report.md, events.log, a served folder). The study showed the resume command as typed, so its plan
in study.json, results.json and the report carried the password; it now shows ``postgresql://user:***@host/db``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from clirun import run_main
from hostile import one_line_refusal, train_tiny

import diffattn.experiments.study.optuna_log as optuna_log

pytestmark = pytest.mark.usefixtures("one_thread")

SECRET = "Pa55-w0rd-s3cret"
TEXT = "It is the east, and Juliet is the sun. Arise, fair sun, and kill the envious moon. " * 40
STUDY = ["--quick", "--steps", "2", "--seq-len", "16", "--d-model", "16", "--batch-size", "2", "--threads", "1",
         "--seeds", "1", "--lrs", "0.003", "--lr-extensions", "0", "--progress-seconds", "600", "--probe-seconds",
         "0", "--poll-seconds", "0.5", "--no-progress"]


def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.parametrize("spelling", ["--storage URL", "--storage=URL"])
def test_a_storage_password_is_never_printed_nor_written(tmp_path, monkeypatch, spelling):
    """The database is this test's SQLite file behind the URL: the study runs to its report, every line it prints
    and every file it writes are searched for the password."""
    url = f"postgresql://someone:{SECRET}@db.invalid:5432/studies"
    opened: list[str | None] = []
    real, db = optuna_log.open_storage, tmp_path / "db"
    db.mkdir()

    def open_storage(out, given, grace_s=optuna_log.GRACE_S):
        opened.append(given)
        return real(db, None, grace_s)

    monkeypatch.setattr(optuna_log, "open_storage", open_storage)
    (tmp_path / "c.txt").write_text(TEXT)
    out = tmp_path / "study"
    storage = ["--storage", url] if spelling == "--storage URL" else [f"--storage={url}"]
    r = run_main("study", tmp_path / "c.txt", *STUDY, *storage, "--out", out)
    assert r.returncode == 0, r.stderr
    assert url in opened  # the URL given is the one opened, password and all
    assert SECRET not in r.stdout + r.stderr
    assert _files_holding(out, SECRET) == []
    shown = "postgresql://someone:***@db.invalid:5432/studies"
    assert shown in (out / "study.json").read_text() and shown in (out / "report.md").read_text()
    worker = run_main("study", "--worker", "--out", out, *storage)  # a worker joining the finished study
    assert worker.returncode == 0 and SECRET not in worker.stdout + worker.stderr, worker.stderr


@pytest.mark.parametrize("url,said", [
    (f"postgresql://someone:{SECRET}@127.0.0.1:1/studies", "postgresql://someone:***@127.0.0.1:1/studies"),
    (f"postgresql://someone:{SECRET}@db.invalid:port/studies", "(a URL SQLAlchemy cannot read)"),
    (f"nosuchdb://someone:{SECRET}@h/studies", "nosuchdb://someone:***@h/studies"),
    (f"mysql://someone:{SECRET}@h/studies", "--storage mysql: its database driver is not installed")])
def test_a_storage_url_that_cannot_be_opened_is_one_line_without_its_password(tmp_path, url, said):
    """(A port that is no number was a ValueError from inside the masking: "invalid literal for int()".) Without
    the postgres extra's driver the first URL is refused for that, before any connection: still one line, no secret."""
    if url.startswith("postgresql://") and ":1/" in url and importlib.util.find_spec("psycopg") is None:
        said = "--storage postgresql: its database driver is not installed"
    (tmp_path / "c.txt").write_text(TEXT)
    out = tmp_path / "study"
    err = one_line_refusal(run_main("study", tmp_path / "c.txt", *STUDY, "--storage", url, "--out", out), said)
    assert SECRET not in err and (not out.exists() or _files_holding(out, SECRET) == [])


# ------------------------------------------------------------------------------------------------ serve


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("secrets"))


def test_an_api_key_is_never_printed_nor_written(run, tmp_path, monkeypatch):
    """vLLM itself is not started: its process is a stand-in that records what it was given. The key reaches it
    in its environment only, never its command line, a line printed, or the folder it serves."""
    from diffattn.interop.vllm import server, serving

    started: dict = {}

    class Child:
        def poll(self):
            return 0

        def wait(self):
            return 0

    def start_child(cmd, env=None):
        model = Path(cmd[cmd.index("--model") + 1])
        started.update(cmd=list(cmd), env=dict(env or {}), files=_files_holding(model, SECRET),
                       served=sorted(p.name for p in model.iterdir()))
        return Child()

    class Watch:
        def join(self, timeout=None):
            pass

    monkeypatch.setattr(serving, "version_problem", lambda: None)
    monkeypatch.setattr(serving, "start_child", start_child)
    monkeypatch.setattr(server, "wait_ready", lambda *a, **kw: Watch())
    monkeypatch.delenv(server.KEY_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the tiny model's head width: no CPU kernel
    r = run_main("serve", run, "--host", "0.0.0.0", "--api-key", SECRET)
    assert r.returncode == 0, r.stderr
    assert started["env"][server.KEY_ENV] == SECRET and "config.json" in started["served"]  # it went to vLLM
    assert not any(SECRET in a for a in started["cmd"]) and started["files"] == []
    assert SECRET not in r.stdout + r.stderr and "requests need the API key" in r.stderr
    assert "no API key" not in r.stderr  # the exposure warning knows a key was given
