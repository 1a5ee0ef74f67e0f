"""`diffattn serve`'s vLLM server dies with it, even when it is killed with SIGKILL (issue 33; no vLLM needed).

A parent process starts a child through the launch function ``diffattn serve`` uses (:func:`start_child`); the
child inherits the parent's stdout, says it is ready there, and then blocks reading stdin. The test kills the
parent with SIGKILL and waits, bounded, for end-of-file on that stdout: it comes only when every process
holding the pipe, the child included, is gone. The control starts the child with a plain ``Popen``: after the
same SIGKILL the child still holds the pipe, until the test closes its stdin.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
CHILD = "import os, sys; print('ready', os.getpid(), flush=True); sys.stdin.read()"
PARENT = f"""
import subprocess, sys
from diffattn.interop.vllm.server_child import start_child
cmd = [sys.executable, "-c", {CHILD!r}]
child = start_child(cmd) if sys.argv[1] == "start_child" else subprocess.Popen(cmd)
sys.stdin.read()
"""
WAIT = 60.0  # seconds: a bound for a loaded machine, not a timing assumption (each wait ends on an event)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's; elsewhere the server outlives a SIGKILLed parent")


def _read_until_eof(fd: int, timeout: float) -> tuple[bytes, bool]:
    """What ``fd`` gives until end-of-file (True) or ``timeout`` seconds with nothing to read (False)."""
    data, deadline = b"", time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return data, False
        chunk = os.read(fd, 4096)
        if not chunk:
            return data, True
        data += chunk


def _parent_with_child(how: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", PARENT, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    line, deadline = b"", time.monotonic() + WAIT
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, "the child never said it was ready"
        chunk = os.read(proc.stdout.fileno(), 1)
        assert chunk, "the parent or the child died before the child was ready"
        line += chunk
    word, pid = line.split()
    assert word == b"ready"
    return proc, int(pid)


def test_the_server_child_dies_with_a_sigkilled_parent():
    proc, child = _parent_with_child("start_child")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT)
        _, gone = _read_until_eof(proc.stdout.fileno(), WAIT)
        assert gone, f"child {child} still runs {WAIT:.0f} s after its parent was killed"
    finally:
        proc.stdin.close()  # a surviving child reads end-of-file and exits
        proc.stdout.close()


def test_control_a_plain_child_outlives_its_sigkilled_parent():
    proc, child = _parent_with_child("popen")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT)
        # the child blocks on stdin until we close it, so the pipe it holds cannot reach end-of-file before
        _, gone = _read_until_eof(proc.stdout.fileno(), 0.5)
        assert not gone and Path(f"/proc/{child}").exists()
    finally:
        proc.stdin.close()
    _, gone = _read_until_eof(proc.stdout.fileno(), WAIT)
    proc.stdout.close()
    assert gone, "closing its stdin did not end the control's child"
