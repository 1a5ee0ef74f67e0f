"""A study across machines, on a real PostgreSQL server (issue 42): two worker processes join one study through
``--storage postgresql://...``, one is killed with SIGKILL in the middle of a cell, and the study finishes with every
cell trained to its end once and the same verdict, to the last digit, as one process alone.

The server is Debian's ``postgresql`` package, started here in a temporary folder on loopback (a fixture; as root,
under the ``postgres`` account, since ``initdb`` refuses root). Without its binaries or the driver (the ``postgres``
extra) the tests are skipped with the reason; under ``DIFFATTN_REQUIRE_POSTGRES=1`` (``.ci/run``'s PostgreSQL step)
they fail instead."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from clirun import SRC

pytestmark = [pytest.mark.postgres, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX server")]
TEXT = "It is the east, and Juliet is the sun. Arise, fair sun, and kill the envious moon. " * 60
# 4 cells (2 arms × 2 seeds) of 300 steps: long enough that the second worker is caught in the middle of one
STUDY = ["--quick", "--steps", "300", "--seq-len", "16", "--d-model", "16", "--batch-size", "2", "--threads", "1",
         "--seeds", "2", "--lrs", "0.003", "--lr-extensions", "0", "--probe-seconds", "0", "--progress-seconds",
         "600", "--poll-seconds", "0.2", "--no-progress"]


def unavailable(why: str) -> None:
    """Skip, or fail where PostgreSQL must be there (``DIFFATTN_REQUIRE_POSTGRES=1``: .ci/run's step)."""
    if os.environ.get("DIFFATTN_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"DIFFATTN_REQUIRE_POSTGRES=1 but {why}")
    pytest.skip(why)


def _server_bin() -> Path | None:
    """The folder of Debian's initdb and pg_ctl (not on PATH there), or of those on PATH."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int("0" + p.parts[-3].split(".")[0]))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


def _need_server() -> Path:
    """The server's binaries, with the driver; else skip (or fail) naming what is missing."""
    bindir = _server_bin()
    if bindir is None:
        unavailable("no PostgreSQL server (initdb, pg_ctl): apt-get install postgresql")
    try:
        import psycopg  # noqa: F401  (the driver of postgresql://, SQLAlchemy 2.1)
    except ImportError:
        unavailable("no PostgreSQL driver: pip install -e '.[postgres]'")
    return bindir


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL server of its own on 127.0.0.1, for the module: its URL (trust authentication, user diffattn)."""
    bindir = _need_server()
    run_as: dict = {}
    if os.geteuid() == 0:  # initdb refuses root: the server runs as the account Debian's package makes
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            unavailable("running as root, and there is no postgres account to run the server as")
        run_as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
    home = Path(tempfile.mkdtemp(prefix="diffattn-pg-"))  # not under pytest's folder: the server's account reads it
    if run_as:
        os.chown(home, run_as["user"], run_as["group"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data, log = home / "data", home / "server.log"

    def pg(*args: str) -> None:
        r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, **run_as)
        if r.returncode:
            log_text = log.read_text() if log.exists() else ""
            pytest.fail(f"{args[0]} failed: {r.stderr or r.stdout}{log_text[-2000:]}")

    try:
        pg(bindir / "initdb", "-D", data, "-U", "diffattn", "-A", "trust", "-E", "UTF8", "--no-sync")
        pg(bindir / "pg_ctl", "-D", data, "-l", log, "-w", "-t", "60", "-o",
           f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        yield f"postgresql://diffattn@127.0.0.1:{port}/postgres"  # SQLAlchemy 2.1 (the postgres extra): psycopg 3
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], capture_output=True,
                           timeout=60, **run_as)
        shutil.rmtree(home, ignore_errors=True)


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + (os.pathsep + path if path else "")}


def _events(out: Path) -> list[tuple[str, str, str, str]]:
    """(who as host:pid, what, cell, detail) of each line of events.log."""
    if not (out / "events.log").exists():
        return []
    rows = []
    for ln in (out / "events.log").read_text().splitlines():
        _, who, what, cell, *rest = ln.split()
        rows.append((who, what, cell, rest[0] if rest else ""))
    return rows


def _saved_step(cell: Path) -> int:
    try:
        return json.loads((cell / "ckpt" / "config.json").read_text())["train_state"]["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_two_workers_on_postgresql_one_killed_mid_cell(postgres_url: str, tmp_path: Path) -> None:
    import optuna

    (tmp_path / "c.txt").write_text(TEXT)
    ref = subprocess.run([sys.executable, "-m", "diffattn", "study", "c.txt", *STUDY, "--out", "ref"], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    shared = tmp_path / "shared"
    common = [*STUDY, "--storage", postgres_url, "--grace-seconds", "2"]
    a_log, b_log = open(tmp_path / "a.txt", "w"), open(tmp_path / "b.txt", "w")
    a = subprocess.Popen([sys.executable, "-m", "diffattn", "study", "c.txt", *common, "--out", "shared"],
                         cwd=tmp_path, env=_env(), stdout=a_log, stderr=a_log)
    b = None
    try:
        deadline = time.time() + 300
        while not (shared / "study.json").exists():  # the first command plans; then a worker joins it
            assert a.poll() is None and time.time() < deadline, (tmp_path / "a.txt").read_text()
            time.sleep(0.02)
        b = subprocess.Popen([sys.executable, "-m", "diffattn", "study", "--worker", "--out", "shared", "--storage",
                              postgres_url, "--grace-seconds", "2", "--poll-seconds", "0.2", "--threads", "1",
                              "--progress-seconds", "600"], cwd=tmp_path, env=_env(), stdout=b_log, stderr=b_log)
        killed = None
        while killed is None:  # B's cell, in training with a checkpoint saved: kill -9 B there
            assert b.poll() is None and time.time() < deadline, (tmp_path / "b.txt").read_text()
            for who, what, cell, _ in _events(shared):
                if (what == "start" and who.endswith(f":{b.pid}") and _saved_step(shared / "cells" / cell) > 0
                        and not (shared / "cells" / cell / "result.json").exists()):
                    b.send_signal(signal.SIGKILL)
                    killed = cell
            time.sleep(0.01)
        b.wait(timeout=60)
        assert a.wait(timeout=600) == 0, (tmp_path / "a.txt").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
    err = (tmp_path / "a.txt").read_text()
    assert "Traceback" not in err
    # every cell trained to its end once: one `done` each; the killed one resumed where B's last checkpoint was
    events = _events(shared)
    done = sorted(c for _, w, c, _ in events if w == "done")
    assert done == sorted(p.name for p in (tmp_path / "ref" / "cells").iterdir()) and len(done) == 4
    starts = [(who, d) for who, w, c, d in events if w == "start" and c == killed]
    assert len(starts) == 2 and starts[0][0].endswith(f":{b.pid}") and starts[1][0].endswith(f":{a.pid}")
    assert int(starts[1][1].removeprefix("step=")) > 0, starts  # resumed, not restarted
    # the study's Optuna log: B's run of the killed cell FAIL (A held its lock: B was gone), then A's COMPLETE
    storage = optuna.storages.RDBStorage(postgres_url)
    plan = json.loads((shared / "study.json").read_text())["plan"]
    trials = optuna.load_study(study_name=plan["study_name"], storage=storage).get_trials()
    assert sorted(t.state.name for t in trials) == ["COMPLETE"] * 4 + ["FAIL"]
    runs = [(t.state.name, t.user_attrs["worker"].split(":")[-1]) for t in trials if t.user_attrs["cell"] == killed]
    assert runs == [("FAIL", str(b.pid)), ("COMPLETE", str(a.pid))], runs
    # the same results, to the last digit, as one process alone
    one, two = (json.loads((tmp_path / f / "results.json").read_text()) for f in ("ref", "shared"))
    assert two["verdict"] == one["verdict"]
    assert [a["seeds"] for a in two["arms"]] == [a["seeds"] for a in one["arms"]]


def test_the_how_to_runs_as_written(tmp_path: Path) -> None:
    """docs/howto/study-across-machines.md: its block (a server of its own, two workers, one killed) as written."""
    _need_server()
    page = (Path(__file__).resolve().parents[2] / "docs" / "howto" / "study-across-machines.md").read_text()
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```", page, re.S | re.M) if "initdb" in b)
    env = {**_env(), "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Counter({'COMPLETE': 4, 'FAIL': 1})" in r.stdout, r.stdout
    assert "server stopped" in r.stdout and "Traceback" not in r.stderr
