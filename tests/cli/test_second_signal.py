"""A second Ctrl-C quits within about a second, also in the middle of a long training step, in `train`, `compare`
and `study`; the last checkpoint stays the resume point (issue 25, item 2). Real processes and signals, on
steps of seconds: a wide one-layer model on a big batch (about 1 GB per process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import SRC, interruptible, signal_twice

from diffattn.checkpoint.run_folder import load_run_checkpoint
from diffattn.train.runlog import read_metrics

pytestmark = pytest.mark.slow
LONG_STEP = ["--d-model", "1024", "--n-layers", "1", "--n-heads", "2", "--seq-len", "64", "--batch-size", "96"]
TEXT = "the quick brown fox jumps over the lazy dog. " * 100
BOUND_S = 1.5  # "within about a second", with room for a loaded machine; one step here takes 4 s and more


def _popen(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(interruptible([sys.executable, "-m", "diffattn", *args]), cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))


def _wait(proc: subprocess.Popen, log: Path, ready, timeout: float = 300) -> float:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, f"not ready within {timeout} s: {log.read_text()}"
        time.sleep(0.01)
    return time.perf_counter()


def _twice(proc: subprocess.Popen) -> float:
    """SIGINT, and again as soon as the first has been taken (a step here takes seconds: the process is inside
    one); -> seconds from the second to exit."""
    signal_twice(proc, signal.SIGINT)
    sent = time.perf_counter()
    proc.wait(timeout=300)
    return time.perf_counter() - sent


def _children(parent: int) -> list[int]:
    """Worker processes ``study --jobs`` started (their command line names their parent)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--spawned-by" in cmd and cmd[cmd.index(b"--spawned-by") + 1] == str(parent).encode():
            pids.append(int(d.name))
    return pids


def _still_running(pids: list[int], within: float) -> list[int]:
    """Those of ``pids`` still alive (not a zombie) ``within`` seconds from now; returns as soon as none is."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def test_train_quits_mid_step_and_its_last_checkpoint_stays(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text(TEXT)
    out, log = tmp_path / "run", tmp_path / "err.txt"
    proc = _popen(["train", "--config", "tiny", "--data.path", "in.txt", "--out", "run", "--no-progress",
                   "--model.d_model", "1024", "--model.n_layers", "1", "--model.n_heads", "2", "--train.seq_len", "64",
                   "--train.batch_size", "96", "--train.steps", "5", "--train.eval_every", "0",
                   "--train.ckpt_every", "1", "--train.log_every", "1"], tmp_path, log)
    try:
        _wait(proc, log, lambda: (out / "ckpt" / "manifest.json").is_file())
        step_s = read_metrics(out / "metrics.csv")[0]["elapsed_s"]  # step 1; step 2 started as it was saved
        waited = _twice(proc)  # both signals in step 2, which takes seconds
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 130, err
    assert "SIGINT again: quitting at once; resume with: diffattn train --out run --resume" in err, err
    assert "Traceback" not in err
    assert waited < BOUND_S, f"{waited:.1f} s from the second Ctrl-C to the end (a step takes {step_s:.1f} s)"
    assert load_run_checkpoint(out).train_state["step"] == 1  # intact: `--resume` continues from it


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the workers through /proc")
def test_compare_and_study_quit_mid_step(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text(TEXT)
    common = ["--quick", *LONG_STEP, "--threads", "1", "--no-progress"]
    # the needle form saves its first model's checkpoint when that model is done: one step, then the signals come
    # while it evaluates it or trains the second model
    needle = _popen(["compare", *common, "--steps", "1", "--out", "needle"], tmp_path, tmp_path / "needle.txt")
    # the study form: 8 steps, so that both workers are still training when the slower has logged its first
    study = _popen(["study", "in.txt", *common, "--steps", "8", "--seeds", "1", "--lrs", "3e-3",
                    "--jobs", "2", "--probe-seconds", "0", "--lr-extensions=0", "--progress-seconds", "600",
                    "--poll-seconds", "0.5", "--out", "study"], tmp_path, tmp_path / "study.txt")
    procs = {"needle": needle, "study": study}
    ready = {"needle": lambda: any(tmp_path.glob("needle/runs/*/ckpt/manifest.json")),
             "study": lambda: sum(len(m.read_text().splitlines()) >= 2
                                  for m in tmp_path.glob("study/cells/*/metrics.csv")) == 2}
    workers: list[int] = []
    waited: dict[str, float] = {}
    try:
        # each form gets its two signals the moment it is ready (the two run side by side: one must not wait for the
        # other, or its workers could finish first)
        deadline = time.time() + 300
        while len(waited) < len(procs):
            for name, proc in procs.items():
                if name in waited or not ready[name]():
                    assert proc.poll() is None or name in waited, (tmp_path / f"{name}.txt").read_text()
                    continue
                if name == "study":
                    workers = _children(study.pid)
                    assert len(workers) == 2, (workers, (tmp_path / "study.txt").read_text())
                waited[name] = _twice(proc)
            assert time.time() < deadline, "not ready within 300 s"
            time.sleep(0.01)
        lingering = _still_running(workers, BOUND_S)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for pid in _still_running(workers, 0):
            os.kill(pid, signal.SIGKILL)
    for name, proc in procs.items():
        err = (tmp_path / f"{name}.txt").read_text()
        assert proc.returncode == 130, (name, err)
        command = "compare" if name == "needle" else "study"
        assert f"SIGINT again: quitting at once; resume with: diffattn {command}" in err
        assert "Traceback" not in err, err
        assert waited[name] < BOUND_S, f"{name}: {waited[name]:.1f} s from the second Ctrl-C to the end"
    # the --jobs workers went with their command (killed: a second SIGTERM could merge with the first in a worker
    # that had not taken it yet, and read as one)
    assert not lingering, f"workers still running {BOUND_S} s after their command quit: {lingering}"
