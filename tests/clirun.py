"""Run ``diffattn ...`` the two ways the tests need: :func:`run_main` in this process through ``main(argv)`` (the
default: no interpreter start, no second import of torch), and :func:`run_diffattn` as ``python -m diffattn``
in a real subprocess on this checkout's sources (not an installed copy), for the tests where a real process is
the point: signals, kill -9, exit status, start-up, the installed entry point."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def run_diffattn(*args: str, cwd: str | os.PathLike | None = None, timeout: float = 120,
                 module: str = "diffattn") -> subprocess.CompletedProcess:
    """``python -m <module> *args`` with PYTHONPATH on src/ and one OpenMP thread; returns the finished
    process (stdout and stderr as text)."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + (os.pathsep + path if path else "")}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@dataclass
class Ran:
    """What :func:`run_main` returns: the fields of a finished ``subprocess.CompletedProcess`` the tests read."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _in_folder_captured(cwd: str | os.PathLike | None) -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """Run the body in folder ``cwd`` with stdout and stderr captured; the working folder is put back."""
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        os.chdir(here)


def run_main(*args: object, cwd: str | os.PathLike | None = None) -> Ran:
    """``diffattn *args`` in this process, in folder ``cwd``: the exit code and what it printed. What a command
    may change for the whole process (the working folder, torch's thread count and determinism) is put back."""
    import torch

    from diffattn.cli.main import main

    threads, determinism = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        with _in_folder_captured(cwd) as (out, err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse: --help, a usage error
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(determinism)
    return Ran(code, out.getvalue(), err.getvalue())


def run_script(source: str, cwd: str | os.PathLike | None = None) -> Ran:
    """Python ``source`` run as a script (``__name__ == "__main__"``) in this process, in folder ``cwd``: exit 0,
    or 1 with its traceback as stderr."""
    with _in_folder_captured(cwd) as (out, err):
        try:
            exec(compile(source, "<script>", "exec"), {"__name__": "__main__"})
        except Exception:
            return Ran(1, out.getvalue(), traceback.format_exc())
    return Ran(0, out.getvalue(), err.getvalue())


# ------------------------------------------------------------------------------------------- signal tests
# A process a test sends SIGINT or SIGTERM to starts as a user's terminal starts it: both signals at their default
# action and not blocked. It cannot inherit that from pytest, which may itself run with SIGINT ignored: a job a
# non-interactive shell starts in the background (`python -m pytest -q &`, a CI step) ignores SIGINT, children keep
# an ignored signal across exec, and the child then ran to its end through the test's Ctrl-C (issue 32). So the
# child resets them itself, then execs the real command (same pid: tests watching /proc/PID still see it).
_FRESH_SIGNALS = ("import os, signal, sys\n"
                  "for s in (signal.SIGINT, signal.SIGTERM):\n"
                  "    signal.signal(s, signal.SIG_DFL)\n"
                  "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})\n"
                  "os.execv(sys.argv[1], sys.argv[1:])\n")


def interruptible(argv: list) -> list[str]:
    """``argv`` (its first item the program's path, e.g. ``sys.executable``) run with SIGINT and SIGTERM at their
    defaults, whatever this process inherited: what a signal test passes to ``subprocess.Popen``."""
    return [sys.executable, "-c", _FRESH_SIGNALS, *map(str, argv)]


def wait_delivered(proc: subprocess.Popen, sig: int, timeout: float = 60) -> None:
    """Wait until ``sig``, sent to ``proc``, is no longer pending there: a handler has taken it (or the process
    ended). A second signal of the same kind sent after that is a second signal; one sent while the first is
    still pending merges with it (the kernel keeps one of each). Reads /proc/PID/status (Linux)."""
    import time

    bit, deadline = 1 << (sig - 1), time.monotonic() + timeout
    while proc.poll() is None:
        try:
            fields = dict(ln.split(":", 1) for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            return  # gone
        if fields["State"].split()[0] == "Z" or not (int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)) & bit:
            return
        assert time.monotonic() < deadline, f"signal {sig} still pending in {proc.pid} after {timeout} s"
        time.sleep(0.0002)


def signal_twice(proc: subprocess.Popen, sig: int = 2) -> None:
    """Send ``sig`` (SIGINT) to ``proc`` twice, so that it reaches it as two signals, whatever the timing. Two
    signals of one kind sent to a process merge when the second comes before the first was taken, and one sent
    after the first was taken may find a process that has already finished (a tiny study cell saves in ms). So each
    goes to its own thread of the process (``tgkill``): each thread keeps its own pending signal, and both are taken
    (Python's C handler runs twice, once in each thread: two bytes on the wakeup fd a second-signal watch reads).
    Without ``tgkill`` (not glibc): the second as soon as the first was taken (:func:`wait_delivered`)."""
    import ctypes

    tids = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task")) if Path(f"/proc/{proc.pid}/task").is_dir() \
        else []
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None or len(tids) < 2:
        proc.send_signal(sig)
        wait_delivered(proc, sig)
        proc.send_signal(sig)
        return
    others = [t for t in tids if t != proc.pid]
    assert tgkill(proc.pid, proc.pid, sig) == 0, os.strerror(ctypes.get_errno())  # the main thread's
    for t in others:  # another thread's (one may have ended since it was listed: take the next)
        if tgkill(proc.pid, t, sig) == 0:
            return
    # every other thread ended between the listing and now (a loaded machine): the second as soon as the first
    # was taken, as without tgkill
    wait_delivered(proc, sig)
    proc.send_signal(sig)
