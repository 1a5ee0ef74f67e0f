"""How a ``diffattn study`` worker stops on SIGINT/SIGTERM (:class:`StudyInterrupted`, :class:`StopRequest`: the
first signal saves the cell in training and starts no other, a second quits at once). A process the study starts
ends with the command that started it: :func:`diffattn.system.child_process.die_with_parent`."""

from __future__ import annotations

import signal
from typing import Any

from diffattn.train.signals import (
    QuitOnSecondSignal,
    install_handlers,
    quit_now,
    request_stop,
    restore_handlers,
    say,
    training_stop_taken,
)


class StudyInterrupted(Exception):
    """SIGINT/SIGTERM stopped this worker: the cell in training (if any) saved its checkpoint at the step it had
    reached and no further cell was started. ``saved``: (cell, step) of that cell; ``exit_code``: 130 / 143."""

    def __init__(self, signum: int, saved: tuple[str, int] | None = None) -> None:
        self.signum, self.saved = signum, saved
        self.exit_code = 128 + signum
        self.where = f"cell {saved[0]} saved at step {saved[1]}" if saved else "no cell was in training"
        super().__init__(f"{signal.Signals(signum).name}: {self.where}")


class StopRequest:
    """A worker's SIGINT/SIGTERM handler (main thread only), passed to each cell (``run_cell(stop=...)``).

    While a cell trains, train's own handler takes the first signal (it finishes the step, saves and raises
    TrainingInterrupted) and then re-installs this one. Outside training the first signal only asks the worker
    to start no further cell (:meth:`check` raises StudyInterrupted between cells; an evaluation in flight finishes
    and its result is kept). Any later signal quits at once: the cell then resumes from its last checkpoint on the
    next run. ``training`` is set around the train call: a signal reaching this handler then came before train's
    handler was installed (the loop is asked to stop after its first step: :func:`~diffattn.train.signals.
    request_stop`, not an exception that code on the way could swallow) or after train's handler took the first
    one, told apart by :func:`~diffattn.train.signals.training_stop_taken`."""

    def __init__(self, resume_hint: str | None = None) -> None:
        self.signum = 0
        self.training = False
        self._old: dict[int, Any] = {}
        # the second signal quits within milliseconds, also in the middle of a long training step
        self._second = QuitOnSecondSignal(f"resume with: {resume_hint}" if resume_hint else None)

    def __enter__(self) -> StopRequest:
        self._old = install_handlers(self._handle)
        self._second.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._second.__exit__()
        restore_handlers(self._old)
        request_stop(0)

    def check(self) -> None:
        """Raise StudyInterrupted if a stop was asked for (between cells)."""
        if self.signum:
            raise StudyInterrupted(self.signum)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum or (self.training and training_stop_taken()):
            quit_now(signum, self._second.hint)
        self.signum = signum
        if self.training:  # train has not installed its handler yet (or has just finished): it stops at its
            request_stop(signum)  # first step and saves (run_cell withdraws the request if it never started)
            return
        say(f"{signal.Signals(signum).name}: no further cell starts; the one finishing now is kept "
            "(again to quit at once)")
