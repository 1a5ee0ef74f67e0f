"""`diffattn compare` (the synthetic needle job) never loses the minutes spent: Ctrl-C / SIGTERM save the model in
training and print the one command that continues; rerunning it reuses the finished models, continues the
interrupted one and reports what an uninterrupted run reports; other settings are refused; a refused command
leaves no folder behind."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import SRC, interruptible, run_main

from diffattn.cli import compare
from diffattn.cli.main import main as cli_main
from diffattn.experiments.experiment_folder import resume_command
from diffattn.train.signals import TrainingInterrupted

# Long enough that a signal sent once a model has logged a few rows arrives mid-training, short enough for seconds.
ARGS = ["--quick", "--steps", "100", "--no-progress"]
TIMING = {"wall_time_s", "train_time_s", "tokens_per_s", "elapsed_s", "checkpoint"}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diffattn compare")
    compare.add_arguments(p)
    return p.parse_args(argv)


def _popen(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), "MPLBACKEND": "Agg"}
    return subprocess.Popen(interruptible([sys.executable, "-m", "diffattn", "compare", *args]), cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


def _numbers(path: Path) -> dict:
    """results.json without what depends on the clock or the folder."""
    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if k not in TIMING}
        if isinstance(o, list):
            return [strip(v) for v in o]
        return o

    return strip(json.loads(path.read_text()))


def _continue_line(err: str) -> tuple[str, list[str]]:
    lines = [ln for ln in err.splitlines() if "to continue: " in ln]
    assert len(lines) == 1, err
    return lines[0], shlex.split(lines[0].split("to continue: ", 1)[1])


@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_cleanly_and_the_same_command_resumes_exactly(tmp_path: Path) -> None:
    ref = _popen(*ARGS, "--out", "ref", cwd=tmp_path)
    # SIGINT once DIFF is done and the baseline has logged 2 rows; SIGTERM while DIFF itself trains; the SIGINT
    # run has no --out: the command it prints must name the folder.
    cut = {signal.SIGINT: (_popen(*ARGS, cwd=tmp_path), "reports/compare-*/runs/standard/metrics.csv"),
           signal.SIGTERM: (_popen(*ARGS, "--out", "term", cwd=tmp_path), "term/runs/diff/metrics.csv")}
    deadline, waiting = time.time() + 240, dict(cut)
    while waiting:
        for sig, (proc, pattern) in list(waiting.items()):
            assert proc.poll() is None, proc.communicate()
            found = list(tmp_path.glob(pattern))
            if found and _rows(found[0]) >= 2:
                proc.send_signal(sig)
                del waiting[sig]
        assert time.time() < deadline, "no training rows within 240 s"
        time.sleep(0.01)
    errs = {}
    for sig, (proc, _) in cut.items():
        _, errs[sig] = proc.communicate(timeout=120)
        assert proc.returncode == 128 + sig, errs[sig]
        assert "Traceback" not in errs[sig]
    assert ref.wait(timeout=240) == 0, ref.communicate()

    line, cmd = _continue_line(errs[signal.SIGINT])
    (folder,) = tmp_path.glob("reports/compare-*")
    assert line.startswith("SIGINT: saved Transformer at step ") and "DIFF finished before" in line
    assert cmd[:2] == ["diffattn", "compare"] and cmd[-2:] == ["--out", str(folder.relative_to(tmp_path))]
    step = int(line.split("at step ")[1].split()[0])
    # the one line says it, once (\b: DIFF's "saved checkpoint at step 100" is no match for step 10)
    assert not re.search(rf"saved checkpoint at step {step}\b", errs[signal.SIGINT])
    assert not (folder / "report.md").exists()

    res = run_main(*cmd[1:], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "[1/2] DIFF (diff, 2 heads) was trained for 100 steps by an earlier run" in res.stderr  # not retrained
    assert "resuming from step " in res.stderr
    assert _numbers(folder / "results.json") == _numbers(tmp_path / "ref" / "results.json")
    assert (folder / "summary.md").read_text() == (tmp_path / "ref" / "summary.md").read_text()

    line, cmd = _continue_line(errs[signal.SIGTERM])
    assert line.startswith("SIGTERM: saved DIFF at step ") and "finished before" not in line
    assert cmd == ["diffattn", "compare", *ARGS, "--out", "term"]


def test_other_settings_are_refused_and_overwrite_starts_over(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r"
    out.mkdir()
    # an unfinished run: the settings record a fresh run writes first, and one model's folder
    s = compare.resolve(_args(["--quick"]))
    (out / "config.json").write_text(json.dumps({"settings": s.record()}))
    (out / "runs" / "diff").mkdir(parents=True)
    (out / "runs" / "diff" / "metrics.csv").write_text("step\n")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert compare.run(_args(["--quick", "--steps", "13", "--no-progress", "--out", str(out)])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "other settings" in err and "--steps 12 there, 13 now" in err
    assert "--overwrite" in err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing was changed
    assert compare.run(_args(["--quick", "--steps", "13", "--no-progress", "--out", str(out), "--overwrite"])) == 0
    err = capsys.readouterr().err
    assert "earlier run" not in err and "resuming" not in err
    assert json.loads((out / "results.json").read_text())["settings"]["steps"] == 13


def test_refused_commands_leave_no_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert compare.run(_args(["--quick", "--variants", "nope"])) == 2  # no --out: reports/compare-<ts>
    with pytest.raises(SystemExit):  # refused when the command line is read (--threads is bounded there, issue 39)
        _args(["--quick", "--threads", "-1", "--out", "a/b"])
    assert list(tmp_path.iterdir()) == []
    capsys.readouterr()
    (tmp_path / "file").write_text("x")
    for bad in ("file", "file/sub", "/proc/diffattn-no/r"):
        assert compare.run(_args(["--quick", "--out", bad])) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and bad.split("/")[0] in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    # diverging before the first checkpoint: one line, exit 3, and the folder it made is gone again
    assert compare.run(_args(["--quick", "--lr", "1e30", "--no-progress", "--out", "nan"])) == 3
    assert "non-finite" in capsys.readouterr().err and not (tmp_path / "nan").exists()


def test_continue_command_names_the_folder_and_drops_overwrite() -> None:
    args = _args(["--quick", "--overwrite"])
    args._argv = ["compare", "--quick", "--overwrite"]
    assert resume_command(args._argv, Path("reports/compare-1"), out_given=args.out is not None) == \
        "diffattn compare --quick --out reports/compare-1"


def test_cli_turns_a_stray_training_interrupt_into_one_line(monkeypatch, capsys) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise TrainingInterrupted(signal.SIGTERM, 7, Path("ckpt"))

    monkeypatch.setattr(compare, "run", interrupted)
    assert cli_main(["compare"]) == 143
    assert capsys.readouterr().err == "interrupted: SIGTERM: saved checkpoint at step 7\n"


def test_a_signal_during_evaluation_also_stops_with_one_line(tmp_path: Path) -> None:
    """Outside the training loop (evaluating a trained model) SIGTERM still ends with the line to continue."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), "MPLBACKEND": "Agg"}
    log = tmp_path / "err.txt"
    with log.open("w") as f:
        proc = subprocess.Popen(interruptible([sys.executable, "-m", "diffattn", "compare", "--quick", "--samples",
                                               "200", "--no-progress", "--out", "r"]),
                                cwd=tmp_path, env=env, stderr=f, text=True)
        deadline = time.time() + 180
        while "evaluating" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.time() < deadline, "no evaluation within 180 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log.read_text()
    err = log.read_text()
    assert "Traceback" not in err
    line, cmd = _continue_line(err)
    assert line.startswith("SIGTERM: stopped; ") and cmd[-2:] == ["--out", "r"]
    assert (tmp_path / "r" / "runs" / "diff" / "ckpt").is_dir() and not (tmp_path / "r" / "report.md").exists()
