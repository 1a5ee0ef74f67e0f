"""The signals API the study's worker relies on: whether a running training loop has taken a signal; and a
second signal quitting at once, also in the middle of one long torch call (issue 25, item 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from clirun import SRC, interruptible

from diffattn.train.signals import QuitOnSecondSignal, StopSignals, training_stop_taken


def test_training_stop_taken_while_a_loop_that_took_a_signal_runs() -> None:
    assert not training_stop_taken()
    with StopSignals() as outer:
        assert not training_stop_taken()  # running, no signal yet
        with StopSignals() as inner:
            os.kill(os.getpid(), signal.SIGINT)  # handled by the innermost handler, in this thread
            assert inner.signum == signal.SIGINT and outer.signum == 0
            assert training_stop_taken()
        assert not training_stop_taken()  # the loop that took it has finished
    assert not training_stop_taken()


# One C call of seconds in which Python's own handlers cannot run: a 4000 × 4000 matmul on one thread.
_LONG_CALL = """
import os, signal, sys, time
import torch
from diffattn.train.signals import StopSignals
a = torch.randn(4000, 4000)
with StopSignals(hint="resume with: the command"):
    os.kill(os.getpid(), signal.SIGINT)  # the first: a request to stop after the step in flight
    print("in the call", flush=True)
    for _ in range(20):
        a @ a
print("the call returned", flush=True)
"""


def test_a_second_signal_quits_within_a_second_in_the_middle_of_a_long_torch_call() -> None:
    """Python runs its signal handlers between bytecodes only: a handler alone would wait for the call to end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(interruptible([sys.executable, "-c", _LONG_CALL]), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "in the call\n", proc.communicate()  # the first signal is taken
        proc.send_signal(signal.SIGINT)  # the second, during the 20 matmuls of a second or more each
        sent = time.perf_counter()
        out, err = proc.communicate(timeout=120)
        waited = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "SIGINT again: quitting at once; resume with: the command" in err and "Traceback" not in err, err
    assert "returned" not in out
    assert waited < 1.5, f"the second signal took {waited:.1f} s to end the process"


def test_the_watch_ends_with_the_last_context_and_leaves_the_wakeup_fd_free() -> None:
    with StopSignals():
        with StopSignals():
            assert QuitOnSecondSignal._watch is not None
        assert QuitOnSecondSignal._watch is not None
    assert QuitOnSecondSignal._watch is None
    assert signal.set_wakeup_fd(-1) == -1
    assert not [t for t in threading.enumerate() if t.name == "diffattn-second-signal"]
