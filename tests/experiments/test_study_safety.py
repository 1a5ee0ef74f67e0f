"""`diffattn study` never loses work: Ctrl-C / SIGTERM (real signals, real processes) stop every worker
with its cell saved, print the command that resumes, and that command finishes the grid reusing what was done;
no verdict from an incomplete grid; bad input leaves nothing behind; a budget that cannot be met is refused."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clirun import interruptible, run_main, signal_twice

from diffattn.cli import study
from diffattn.experiments.findings import stats
from diffattn.experiments.findings.report import write_report
from diffattn.experiments.study.budget import MIN_STEPS, format_plan, make_plan
from diffattn.experiments.study.cell import load_data, run_cell
from diffattn.experiments.study.collect import collect
from diffattn.experiments.study.request import spec_from_options
from diffattn.experiments.study.spec import StudyError, StudySpec

SRC = Path(stats.__file__).resolve().parents[2]
TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "You are all resolved rather to die than to famish? ") * 30
# Long enough cells that a signal lands while one trains (~3 ms a step here: a signal sent after a cell's second
# step has 150 steps to land in); tiny enough to take seconds. With --jobs 2, cells long enough that both
# workers train at once although one may start a second or two after the other.
SLOW = ["--quick", "--steps", "150", "--seq-len", "16", "--d-model", "16", "--batch-size", "2", "--threads", "1",
        "--seeds", "2", "--lrs", "3e-3", "--progress-seconds", "600", "--probe-seconds", "0", "--poll-seconds", "0.5",
        "--lr-extensions=0"]  # the grid alone: LR bracketing has its own tests (test_study_bracketing.py)
SLOW_JOBS = [*SLOW, "--steps", "400", "--seeds", "1"]  # 2 cells: one for each of 2 workers
FAST = ["--quick", "--steps", "4", "--seq-len", "16", "--d-model", "16", "--batch-size", "2", "--threads", "1",
        "--progress-seconds", "600", "--probe-seconds", "0", "--poll-seconds", "0.5", "--lr-extensions=0"]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    study.add_arguments(p)
    return p.parse_args(argv)


def _run(argv: list[str]) -> int:
    n = torch.get_num_threads()
    try:
        return study.run(_args(argv))
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT)
    return f


def _popen(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # stderr to a file: a pipe nobody reads while waiting would fill up and block the run
    return subprocess.Popen(interruptible([sys.executable, "-m", "diffattn", *args]), cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def _events(out: Path) -> list[tuple[str, str, str]]:
    """(what, cell, detail) of every line of events.log."""
    rows = []
    for ln in (out / "events.log").read_text().splitlines():
        parts = ln.split()
        rows.append((parts[2], parts[3], parts[4] if len(parts) > 4 else ""))
    return rows


def _training(out: Path, n: int) -> list[str]:
    """Cells that have logged steps and are not finished."""
    return [m.parent.name for m in out.glob("cells/*/metrics.csv")
            if not (m.parent / "result.json").exists() and len(m.read_text().splitlines()) >= n]


def _wait_for(proc: subprocess.Popen, log: Path, ready, what: str, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def _resume_command(err: str) -> list[str]:
    line = next(ln for ln in err.splitlines() if ln.startswith("resume with: "))
    cmd = shlex.split(line.removeprefix("resume with: "))
    assert cmd[0] == "diffattn"
    return cmd[1:]


@pytest.mark.slow
def test_sigint_saves_the_cell_and_the_printed_command_finishes_the_grid(corpus: Path, tmp_path: Path,
                                                                        capsys) -> None:
    out, log = tmp_path / "out", tmp_path / "err1.txt"
    proc = _popen(["study", str(corpus), *SLOW, "--out", "out"], tmp_path, log)
    try:  # signal once a cell is finished and the next one has logged steps
        _wait_for(proc, log, lambda: list(out.glob("cells/*/result.json")) and _training(out, 3), "steps")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "cell failed" not in err
    assert "no report written" in err and not (out / "report.md").exists() and not (out / "results.json").exists()
    finished = {p.parent.name for p in out.glob("cells/*/result.json")}
    assert 1 <= len(finished) < 4
    stops = [(c, int(d.split("=")[1])) for w, c, d in _events(out) if w == "stop"]
    assert len(stops) == 1 and stops[0][1] >= 2, stops  # the cell in training saved at the step it had reached
    cell, step = stops[0]
    assert f"cell {cell} saved at step {step}" in err
    saved = json.loads((out / "cells" / cell / "ckpt" / "config.json").read_text())["train_state"]["step"]
    assert saved == step

    cmd = _resume_command(err)  # exactly what the user is told to run
    again = run_main(*cmd, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["incomplete"] is None and res["cells"]["finished"] == 4
    assert res["verdict"] and res["verdict"]["conclusion"]
    starts = [(c, d) for w, c, d in _events(out) if w == "start"]
    for c in finished:  # reused, not trained again
        assert [s for s in starts if s[0] == c] == [(c, "step=0")]
    assert (cell, f"step={step}") in starts  # resumed where it stopped
    assert len(list(out.glob("cells/*/result.json"))) == 4

    # A worker on the finished experiment says so (it used to exit 0 printing nothing).
    capsys.readouterr()
    assert _run(["--worker", "--out", str(out)]) == 0
    assert f"{out}: the experiment is finished (4 of 4 cells); nothing to do" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_stops_every_jobs_worker_and_a_rerun_completes(corpus: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "err.txt"
    proc = _popen(["study", str(corpus), *SLOW_JOBS, "--jobs", "2", "--out", "out"], tmp_path, log)
    try:
        _wait_for(proc, log, lambda: len(_training(out, 3)) == 2, "two cells training")
        proc.send_signal(signal.SIGTERM)  # the command alone: it passes the stop on to its workers
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "resume with: " in err
    stops = {c: int(d.split("=")[1]) for w, c, d in _events(out) if w == "stop"}
    assert len(stops) == 2 and min(stops.values()) >= 2, stops  # both workers saved their cell
    assert err.count("saved at step") == 2
    assert not list(out.glob("cells/*/result.json"))
    workers = [int(ln.split()[1].rstrip(":")) for ln in err.splitlines() if ln.startswith("worker ")]
    assert len(workers) == 2
    for pid in workers:  # every worker is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The rest: a --worker on this machine (same host: no trial is left waiting for a dead worker).
    assert _run(["--worker", "--out", str(out), "--threads", "1", "--poll-seconds", "0.5",
                 "--progress-seconds", "600"]) == 0
    starts = [(c, d) for w, c, d in _events(out) if w == "start"]
    for c, step in stops.items():
        assert (c, f"step={step}") in starts
    assert len(list(out.glob("cells/*/result.json"))) == 2


@pytest.mark.slow
def test_a_second_ctrl_c_quits_at_once_and_the_rerun_recovers(corpus: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "err.txt"
    proc = _popen(["study", str(corpus), *SLOW, "--out", "out"], tmp_path, log)
    try:
        _wait_for(proc, log, lambda: _training(out, 3), "steps")
        signal_twice(proc, signal.SIGINT)  # the second as soon as the first is taken: a tiny cell saves in ms
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 130, err
    assert "SIGINT again: quitting at once; resume with: diffattn study" in err and "Traceback" not in err
    # the cell's trial was left RUNNING: its lock went with the process, so the rerun takes the cell over at once
    assert _run([str(corpus), *SLOW, "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["incomplete"] is None and res["verdict"]


def _probe_processes(parent: int) -> list[int]:
    """The timing probe's processes of ``parent`` (multiprocessing's spawned interpreters)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes()
            ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if b"--multiprocessing-fork" in cmd and ppid == str(parent):
            found.append(int(d.name))
    return found


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(pid)
        except (OSError, IndexError):
            pass
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the probe's processes through /proc")
@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_while_it_plans_ends_the_command_and_its_probe_processes(corpus: Path, tmp_path: Path,
                                                                       signals: int) -> None:
    """Issue 39: under load, two Ctrl-C while the study planned took 90 s to end. The timing probe's processes
    (fresh interpreters) arm their death signal only once they have imported torch, which takes a minute and more
    on a loaded machine; the command waited for them without a bound (the pool's shutdown) and left them running,
    holding its output open. Here they never finish starting (a sitecustomize blocks them, as a slow import does):
    one Ctrl-C, or two, and the command ends (130), and they with it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys, time\nif '--multiprocessing-fork' in sys.argv:  # a probe process: its start never ends\n"
        "    time.sleep(10**6)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(site), str(SRC), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "err.txt"
    proc = subprocess.Popen(interruptible([sys.executable, "-m", "diffattn", "study", str(corpus), "--quick",
                                           "--jobs", "2", "--probe-seconds", "1", "--out", "o"]),
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    probes: list[int] = []
    try:
        _wait_for(proc, log, lambda: len(_probe_processes(proc.pid)) == 2, "the probe's two processes")
        probes = _probe_processes(proc.pid)
        if signals == 2:
            signal_twice(proc, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)  # the old code waited for ever on one signal
        deadline = time.time() + 10
        while _alive(probes) and time.time() < deadline:  # the old code never ended them
            time.sleep(0.02)
    finally:
        for pid in [proc.pid, *_alive(probes)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    err = log.read_text()
    # Two signals: the second may land after the first has ended the command (it said "interrupted" and chose
    # 130), while the interpreter shuts down with SIGINT's default action (cli/main.py), so the process ends by
    # that signal: -2 to subprocess, 130 in a shell, as the first alone gives. A busy machine makes that likely.
    assert proc.returncode == 130 or (signals == 2 and proc.returncode == -signal.SIGINT
                                      and "interrupted" in err), (proc.returncode, err)
    assert not _alive(probes), f"probe processes still running after their command ended: {probes}"
    assert "Traceback" not in err, err


# ------------------------------------------------------------------------------ incomplete grid: no verdict
def test_an_incomplete_grid_gets_no_verdict(corpus: Path, tmp_path: Path, one_thread) -> None:
    out = tmp_path / "out"
    spec = StudySpec.from_dict(dict(data=str(corpus), d_model=16, n_layers=1, heads=[2], lrs=[1e-3], seeds=[0, 1],
                     seq_len=16, batch_size=2, steps=4))
    spec, plan = make_plan(out, spec, budget_minutes=None, jobs=1, threads=1, command="diffattn x",
                           probe_s=0)
    source, tok = load_data(out, spec)
    for arm in spec.arms():  # seed 0 of both arms: a verdict could be computed from it, and must not be
        run_cell(out, spec, arm, 1e-3, 0, source, tok)
    res = collect(out, spec, plan)
    assert res["verdict"] is None and res["comparisons"] == []
    assert res["incomplete"] == {"finished": 2, "total": 4, "withheld": "verdict"}
    write_report(res, out)
    md = (out / "report.md").read_text().split("\n\n")
    assert md[1].startswith("**incomplete: 2 of 4 cells — no verdict.**") and "diffattn x" in md[1]
    assert json.loads((out / "results.json").read_text())["verdict"] is None
    for arm in spec.arms():
        run_cell(out, spec, arm, 1e-3, 1, source, tok)
    res = collect(out, spec, plan)
    assert res["incomplete"] is None and res["verdict"] is not None


# ------------------------------------------------------------------------------ validate first, create second
@pytest.mark.parametrize("kind", ["empty", "binary", "too short"])
@pytest.mark.parametrize("with_out", [True, False])
def test_bad_data_leaves_nothing_behind(tmp_path: Path, monkeypatch, capsys, kind: str, with_out: bool) -> None:
    data = tmp_path / "data.txt"
    data.write_bytes({"empty": b"", "binary": bytes(range(256)) * 8, "too short": b"tiny"}[kind])
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = [str(data), *FAST] + (["--out", "o"] if with_out else [])
    assert _run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert list(work.iterdir()) == []  # neither o/ nor reports/study-<ts>/


def test_unusable_out_is_one_line_exit_2(corpus: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    cases = [(tmp_path / "afile" / "o", "is a file"), (tmp_path / "afile", "not a folder"),
             (tmp_path / "full", "holds no experiment")]
    if Path("/proc/self").is_dir():  # not creatable, even by root
        cases.append((Path("/proc/diffattn-test/o"), "cannot write in /proc"))
    for out, msg in cases:
        assert _run([str(corpus), *FAST, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err
    assert (tmp_path / "afile").read_text() == "x" and os.listdir(tmp_path / "full") == ["notes.txt"]


# ------------------------------------------------------------------------------------------- the budget
def _fake_probe(step_s: float):
    def probe(spec, source, threads, jobs=1, seconds=5.0, min_steps=3):
        return {f"{a.name}@{d}": {"step": step_s, "fwd": 0.001, "start": 1.0, "jobs": jobs}
                for a in spec.arms() for d in [spec.model.d_model] + spec.ladder_sizes()}
    return probe


def test_a_budget_that_cannot_be_met_is_refused_naming_one_that_can(corpus, tmp_path, monkeypatch, capsys):
    # 1 s a step: 12 cells × 10 steps ≥ 2 min
    monkeypatch.setattr("diffattn.experiments.study.budget.probe_timing", _fake_probe(1.0))
    no_quick = [a for a in FAST if a not in ("--quick", "--probe-seconds", "0")]
    argv = [str(corpus), *no_quick, "--lrs", "1e-3,2e-3,4e-3", "--seeds", "2"]
    assert _run([*argv, "--budget-minutes", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be met" in err[0], err
    assert not (tmp_path / "o").exists()
    need = float(err[0].split("the smallest budget that fits is --budget-minutes ")[1].split()[0])
    assert need > 2  # 12 cells of at least 10 s each, one job
    spec = spec_from_options(vars(_args([*argv])))
    # The named budget is the smallest to 0.1 min; one step of that less is refused, one more fits. (A step
    # apart from it, not at it: the planning time that the budget includes differs a little between calls.)
    with pytest.raises(StudyError, match="cannot be met"):
        make_plan(tmp_path / "a", spec, budget_minutes=need - 0.2, jobs=1, threads=1, command="x")
    assert not (tmp_path / "a").exists()
    budget = need + 0.1
    spec2, plan = make_plan(tmp_path / "b", spec, budget_minutes=budget, jobs=1, threads=1, command="x")
    assert spec2.train.steps >= MIN_STEPS
    assert plan["estimate_s"] + plan["overhead_s"] <= budget * 60  # the plan fits the budget it was given
    text = format_plan(spec2, plan)
    assert f"within the budget of {budget:g} min" in text
