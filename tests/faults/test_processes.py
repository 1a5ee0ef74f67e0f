"""Faults that need real processes: two commands on one run folder (the lock), kill -9 in the middle of a save and
before the first checkpoint (what is left, and that the next command tidies it and goes on), and no process
outliving a `study` killed with kill -9 (the timing probe's processes, multiprocessing's resource
tracker, the --jobs workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from faultinject import CORPUS, leftovers, tiny_run

from diffattn.checkpoint.format import load_checkpoint
from diffattn.cli.main import main
from diffattn.train.runlog import read_metrics

SRC = Path(__file__).resolve().parents[2] / "src"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")


@pytest.fixture(autouse=True)
def _deterministic(one_thread):
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}


def _popen(*args: str, code: str | None = None) -> subprocess.Popen:
    """``python -m diffattn ARGS``, or ``python -c CODE`` (which may patch things first) with ARGS as sys.argv."""
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "diffattn", *args]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, what: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, (what, proc.communicate())
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


def _steps(run: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run / "metrics.csv")]


def test_a_second_resume_while_the_run_trains_is_refused(tmp_path: Path, capsys) -> None:
    """The issue's case: `train --resume` started while the run still trains was accepted; both wrote the folder
    and the next resume died on the mixed metrics.csv. Now the second is refused naming the first, and a holder
    killed with kill -9 blocks nobody."""
    cfg, corpus = tiny_run(tmp_path, steps=4000, log_every=1, eval_every=1000, ckpt_every=10)
    run = tmp_path / "run"
    first = _popen("train", "--config", str(cfg), "--data.path", str(corpus), "--out", str(run), "--no-progress")
    _wait_for(lambda: (run / "ckpt" / "manifest.json").is_file(), "a checkpoint", proc=first)
    for argv in (["--out", str(run), "--resume"], ["--config", str(cfg), "--data.path", str(corpus), "--out",
                                                  str(run), "--overwrite"]):
        capsys.readouterr()
        assert main(["train", *argv, "--no-progress"]) == 2  # this test's process is another process, too
        err = capsys.readouterr().err
        assert f"{run} is in use by diffattn train (pid {first.pid} on " in err and "Traceback" not in err, err
    assert first.poll() is None  # untouched, still training
    first.send_signal(signal.SIGKILL)
    first.wait()
    saved = load_checkpoint(run / "ckpt").train_state["step"]
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--train.steps", str(saved + 2)]) == 0
    assert _steps(run) == list(range(1, saved + 3))  # one run's rows, in order, none twice
    assert (run / "diagnostics.csv").read_text().count("step,") == 1
    assert leftovers(tmp_path) == []


_BLOCKED_SAVE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    real, nth = os.replace, {"n": 0}
    ready = Path(sys.argv[1])
    block = sys.argv[2]  # "aside": before the old checkpoint is moved aside; "swap": between the two renames
    def replace(src, dst):
        if str(dst).endswith(("/ckpt", ".old-" + str(os.getpid()))):
            nth["n"] += 1
            if nth["n"] == {"aside": 2, "swap": 3}[block]:  # the second save
                ready.write_text("now")
                time.sleep(600)
        return real(src, dst)
    os.replace = replace
    from diffattn.cli.main import main
    sys.exit(main(sys.argv[3:]))
""")


def test_kill_9_in_a_save_leaves_what_the_next_command_tidies(tmp_path: Path, capsys, block: str = "swap") -> None:
    """Killed between a save's two renames (the worst moment: ckpt/ moved aside, the new one not yet in place;
    "aside", killed before the first rename, leaves a subset: test_io_errors.py tries that one in-process)."""
    cfg, corpus = tiny_run(tmp_path)
    argv = ["train", "--config", str(cfg), "--data.path", str(corpus), "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "ref")]) == 0
    reference = read_metrics(tmp_path / "ref" / "metrics.csv")
    run, ready = tmp_path / "run", tmp_path / "ready"
    p = _popen(str(ready), block, *argv, "--out", str(run), code=_BLOCKED_SAVE)
    _wait_for(ready.exists, "the second save to block", proc=p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = sorted(x.name for x in run.iterdir() if x.name.startswith("."))
    assert any(x.startswith(f".ckpt.tmp-{p.pid}-") for x in left), left  # a whole checkpoint never swapped in
    assert (run / "ckpt").exists() == (block == "aside"), left
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"note: {run}: removed what a killed process left: .ckpt.tmp-{p.pid}-" in err
    assert ("put back as ckpt/, step 2" in err) == (block == "swap")
    assert load_checkpoint(run / "ckpt").train_state["step"] == 4
    assert [(r["train_loss"], r["val_loss"]) for r in read_metrics(run / "metrics.csv")] == \
        [(r["train_loss"], r["val_loss"]) for r in reference]
    assert leftovers(tmp_path) == [] and not list(run.glob(".ckpt.*"))


def test_kill_9_before_the_first_checkpoint_then_plain_train_starts_again(tmp_path: Path, capsys) -> None:
    """Before: `train` refused the folder (`--resume`), `--resume` refused it (no checkpoint), each pointing at
    the other; only --overwrite got out."""
    cfg, corpus = tiny_run(tmp_path, steps=4000, log_every=1, eval_every=0, ckpt_every=0)
    run = tmp_path / "run"
    argv = ["train", "--config", str(cfg), "--data.path", str(corpus), "--out", str(run), "--no-progress"]
    p = _popen(*argv)
    _wait_for(lambda: _rows(run / "metrics.csv") >= 3, "3 steps", proc=p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (run / "ckpt").exists() and (run / "metrics.csv").exists()
    capsys.readouterr()
    assert main([*argv, "--train.steps", "4"]) == 0
    assert "held a run stopped before its first checkpoint (nothing to resume); starting it again" in \
        capsys.readouterr().err
    assert _steps(run) == [1, 2, 3, 4] and leftovers(tmp_path) == []


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _descendants(pid: int) -> set[int]:
    kids, found, todo = _children(), set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def _study(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["study", str(corpus), "--out", str(out), "--seeds", "1", "--lrs", "0.01",
            "--lr-extensions", "0", "--d-model", "16", "--n-layers", "1", "--head-dim", "8", "--seq-len", "8",
            "--batch-size", "2", "--diag-early-steps", "0", "--progress-seconds", "3600", "--no-progress", *extra]


@pytest.mark.parametrize("phase", ["probe", "workers"])
def test_no_process_outlives_a_compare_killed_with_kill_9(tmp_path: Path, phase: str) -> None:
    """The issue: kill -9 while `study` planned left a probe process (~380 MB) and multiprocessing's
    resource_tracker running for good, one pair per kill. Now the probe's processes and the --jobs workers
    follow their command (PR_SET_PDEATHSIG; a worker saves its cell first), and the tracker ends with them."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS * 4)
    extra = (["--budget-minutes", "30", "--probe-seconds", "60", "--jobs", "2"] if phase == "probe"
             else ["--steps", "100000", "--probe-seconds", "0", "--jobs", "2"])
    p = _popen(*_study(corpus, tmp_path / "exp", *extra))
    want = 3 if phase == "probe" else 2  # probe: 2 pool processes + the resource tracker; workers: 2 workers
    _wait_for(lambda: len(_alive(_descendants(p.pid))) >= want, f"{want} child processes", proc=p)
    if phase == "workers":
        _wait_for(lambda: (tmp_path / "exp" / "events.log").exists()
                  and (tmp_path / "exp" / "events.log").read_text().count(" start ") >= 2, "2 cells training", proc=p)
    kids = _alive(_descendants(p.pid))
    p.send_signal(signal.SIGKILL)
    p.wait()
    _wait_for(lambda: not _alive(kids), f"the children {sorted(_alive(kids))} to end", timeout=60)
    if phase == "workers":  # each worker saved its cell on the way out
        log = (tmp_path / "exp" / "events.log").read_text()
        assert log.count(" stop ") == 2, log
