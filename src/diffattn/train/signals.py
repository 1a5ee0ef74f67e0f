"""Ctrl-C and SIGTERM stop a training loop safely: the step in flight finishes, a checkpoint is written, and
the command exits 130 / 143 with the line to resume. Used by the training loop (train/loop.py), for every task.
A caller with its own handler (the study's worker) asks :func:`training_stop_taken` whether a loop's handler has
already taken the signal in flight."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, ClassVar


class TrainingInterrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM arrived: the step in flight was finished and a checkpoint written (if the run
    has an output folder). ``exit_code`` is the shell's 128 + signal number (130, 143). ``save_error``: the
    storage failure (a full disk) that kept that checkpoint from being written; the previous one stays."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, save_error: OSError | None = None) -> None:
        self.signum, self.step, self.checkpoint, self.save_error = signum, step, checkpoint, save_error
        self.exit_code = 128 + signum  # also when the save failed: the user's signal is why the command stopped
        name = signal.Signals(signum).name
        where = f"saved checkpoint at step {step}" if checkpoint is not None else f"stopped after step {step}"
        if save_error is not None:
            where += f"; its checkpoint could not be saved ({save_error.strerror or save_error})"
        super().__init__(f"{name}: {where}")


class StopSignals:
    """Turn the first SIGINT/SIGTERM into a request to stop after the current optimizer step; a second one
    falls through to the default action (quit at once, as users expect from a second Ctrl-C). Signal handlers
    can only be installed from the main thread; elsewhere this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    _active: ClassVar[list[StopSignals]] = []  # the instances between __enter__ and __exit__, innermost last
    pending: ClassVar[int] = 0  # a stop asked for before the loop started (request_stop)

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        for sig, old in self._old.items():  # the next signal acts at once
            signal.signal(sig, old)

    def __enter__(self) -> StopSignals:
        if StopSignals.pending:  # asked for already: stop after the first step; a further signal quits at once
            self.signum, StopSignals.pending = StopSignals.pending, 0
        elif threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        StopSignals._active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        if self in StopSignals._active:
            StopSignals._active.remove(self)


def request_stop(signum: int) -> None:
    """An outer handler (a study worker's) took a SIGINT/SIGTERM while a training loop is being set up: the loop
    stops after its first step and saves, as if the signal had come then (0 withdraws the request). Raising from
    the handler instead could be swallowed by any ``except Exception`` on the way (an optional import that
    failed, a kernel's self-check), and the worker would train on for good."""
    StopSignals.pending = signum


def training_stop_taken() -> bool:
    """Whether a training loop in this process, running now, has taken a SIGINT/SIGTERM (and is finishing its step
    and saving before it stops). An outer handler that receives a signal while this is true got the second one."""
    return any(s.signum for s in StopSignals._active)


class Terminated(BaseException):
    """SIGTERM arrived outside a training loop (e.g. during evaluation). A BaseException, as KeyboardInterrupt
    is, so ``except Exception`` clauses on the way up do not swallow it. ``exit_code`` is 143."""

    exit_code = 128 + signal.SIGTERM


class sigterm_raises:  # noqa: N801  (used as a context manager, like contextlib's lower-case helpers)
    """While active, SIGTERM raises :class:`Terminated` in the main thread instead of killing the process at
    once, so a command can print how to continue before it exits 143. :class:`StopSignals` inside a training
    loop takes over for its duration (and restores this handler for a second signal, which then quits at
    once). Outside the main thread this does nothing."""

    def __init__(self) -> None:
        self._old: Any = None

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise Terminated()

    def __enter__(self) -> sigterm_raises:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None
