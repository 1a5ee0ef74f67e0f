"""Processes that end with the command that started them, however it ends (``kill -9`` too): the kernel's
``PR_SET_PDEATHSIG`` on Linux (:func:`parent_death_signal`), elsewhere a thread that polls for a new parent. Used by
``diffattn serve`` for its vLLM server (armed between fork and exec) and by ``diffattn study`` for its workers and
timing-probe processes (:func:`die_with_parent`, armed by the child itself)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal() -> Callable[[int], bool] | None:
    """On Linux, a function that asks the kernel to send this process ``signum`` when its parent dies (-> whether
    the kernel took it), looked up now so that a forked child only has to call it; elsewhere None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda signum: prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """Have this process receive ``signum`` when its parent ``parent_pid`` dies, however it dies, so that no
    process outlives the command that started it. A parent already gone signals at once. (With SIGTERM a study
    worker saves its cell and stops; the timing probe's processes, with nothing to save, take SIGKILL.)

    Linux sends the signal each time the child passes to another thread of the dying parent (a parent with a
    watch thread: twice), and a second SIGTERM would read as "again: quit at once" before the worker saved its
    cell. So a signal with a handler is armed as SIGHUP and passed on once as ``signum`` (workers run in their own
    session: no terminal sends them SIGHUP)."""
    deathsig = signum
    if signum != signal.SIGKILL and threading.current_thread() is threading.main_thread():

        def once(*_: Any) -> None:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a later one is the same parent's death
            os.kill(os.getpid(), signum)

        deathsig = signal.SIGHUP
        signal.signal(signal.SIGHUP, once)
    arm = parent_death_signal()
    if arm is None or not arm(deathsig):
        threading.Thread(target=_poll_parent, args=(parent_pid, signum), daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os.kill(os.getpid(), signum)


def _poll_parent(parent_pid: int, signum: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signum)
