"""How a ``compare --data`` worker stops on SIGINT/SIGTERM: :class:`StudyInterrupted`, the worker's handler
(:class:`_StopRequest`) and the handler of the running worker (:data:`active_stop`), and quitting at once on a
second signal."""

from __future__ import annotations

import signal
import threading
from typing import Any

from diffattn.train.signals import QuitOnSecondSignal, quit_now, training_stop_taken
from diffattn.train.signals import say as _say


class StudyInterrupted(Exception):
    """SIGINT/SIGTERM stopped this worker: the cell in training (if any) saved its checkpoint at the step it had
    reached and no further cell was started. ``saved``: (cell, step) of that cell; ``exit_code``: 130 / 143."""

    def __init__(self, signum: int, saved: tuple[str, int] | None = None) -> None:
        self.signum, self.saved = signum, saved
        self.exit_code = 128 + signum
        where = f"{saved[0]} saved at step {saved[1]}" if saved else "no cell was in training"
        super().__init__(f"{signal.Signals(signum).name}: {where}")


class _StopRequest:
    """This worker's SIGINT/SIGTERM handler (main thread only).

    While a cell trains, train_lm's own handler takes the first signal (it finishes the step, saves and raises
    TrainingInterrupted) and then re-installs this one. Outside training the first signal only asks the worker
    to start no further cell (an evaluation in flight finishes and its result is kept). Any later signal quits
    at once: the cell then resumes from its last checkpoint on the next run. ``training`` is set around the
    train_lm call: a signal reaching this handler then came before train_lm's handler was installed or after
    train_lm's handler took the first one, told apart by :func:`~diffattn.train.signals.training_stop_taken`."""

    def __init__(self, resume_hint: str | None = None) -> None:
        self.signum = 0
        self.training = False
        self.resume_hint = resume_hint
        self._old: dict[int, Any] = {}
        # the second signal quits within milliseconds, also in the middle of a long training step
        self._second = QuitOnSecondSignal(f"resume with: {resume_hint}" if resume_hint else None)

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        self._second.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._second.__exit__()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum or (self.training and training_stop_taken()):
            quit_now(signum, self._second.hint)
        self.signum = signum
        if self.training:  # train_lm has not installed its handler yet (or has finished): nothing to save
            raise StudyInterrupted(signum)
        _say(f"{signal.Signals(signum).name}: no further cell starts; the one finishing now is kept "
             "(again to quit at once)")


# The handler of this process's worker, while one runs (set by scheduler.worker_main, read where a cell
# starts training and between cells).
active_stop: _StopRequest | None = None
