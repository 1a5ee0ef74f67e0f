"""Ctrl-C and SIGTERM stop a training loop safely: the step in flight finishes, a checkpoint is written, and
the command exits 130 / 143 with the line to resume. Used by the training loop (train/loop.py), for every task.
A caller with its own handler (the study's worker) asks :func:`training_stop_taken` whether a loop's handler has
already taken the signal in flight.

A second signal quits at once (:func:`quit_now`), also while the main thread is inside one long torch call (a
step at the paper's shapes takes minutes), where Python's own handlers would wait for the call to return:
:class:`QuitOnSecondSignal` watches for it from a thread."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, NoReturn

Hint = str | Callable[[], str | None] | None


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


def say(msg: str) -> None:
    """A line on stderr from a signal handler or the watchdog thread: os.write, as print() may be in the middle of
    a write already."""
    os.write(2, f"{datetime.now():%H:%M:%S} {msg}\n".encode())


_quitting = threading.Lock()


def quit_now(signum: int, hint: Hint = None) -> NoReturn:
    """A second signal: say so and leave at once, without cleanup. Checkpoints are written atomically, so the
    last one written stays the resume point (a trial the study left RUNNING is recovered by the next run). From a
    handler or any thread; when two get here at once, one speaks and ends the process."""
    if not _quitting.acquire(blocking=False):
        while True:  # the other caller is ending the process
            time.sleep(1)
    text = hint() if callable(hint) else hint
    say(f"{signal.Signals(signum).name} again: quitting at once" + (f"; {text}" if text else ""))
    for q in QuitOnSecondSignal._stack:  # e.g. pass the signal on to worker processes
        if q.before_quit is not None:
            try:
                q.before_quit(signum)
            except Exception:  # quitting matters more
                pass
    os._exit(128 + signum)


class QuitOnSecondSignal:
    """While active, the second SIGINT/SIGTERM that reaches this process ends it within milliseconds
    (:func:`quit_now`, exit 130 / 143) wherever the main thread is, inside one long torch call too. What the first
    signal does is the business of Python's handlers, as before.

    How: CPython's C-level handler writes each signal's number to the wakeup fd (:func:`signal.set_wakeup_fd`)
    the moment it arrives, for every signal with a Python handler; a daemon thread reads them (torch's ops
    release the GIL, and Python switches threads every few ms otherwise). Nested uses share one watch, counted
    from the outermost; its ``hint`` (the command that resumes) is the one printed, else the nearest given;
    ``before_quit(signum)`` runs just before the process ends. Main thread only; where the wakeup fd is already
    in use (an asyncio loop), this does nothing and the handlers alone act, when the main thread returns to
    Python."""

    _stack: ClassVar[list[QuitOnSecondSignal]] = []
    _watch: ClassVar[tuple[socket.socket, socket.socket, threading.Thread] | None] = None

    def __init__(self, hint: Hint = None, before_quit: Callable[[int], Any] | None = None) -> None:
        self.hint, self.before_quit = hint, before_quit

    @classmethod
    def _hint(cls) -> Hint:
        return next((q.hint for q in cls._stack if q.hint), None)

    @classmethod
    def _read(cls, sock: socket.socket) -> None:
        seen = 0
        while True:
            try:
                data = sock.recv(64)
            except OSError:
                return
            if not data or 0 in data:  # closed, or _stop() woke this thread to end
                return
            for signum in data:
                if signum in (signal.SIGINT, signal.SIGTERM):
                    seen += 1
                    if seen >= 2:
                        quit_now(signum, cls._hint())

    @classmethod
    def _start(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = socket.socketpair()
        w.setblocking(False)
        old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        if old != -1:  # someone else's (an event loop): leave it to them
            signal.set_wakeup_fd(old)
            r.close()
            w.close()
            return
        thread = threading.Thread(target=cls._read, args=(r,), name="diffattn-second-signal", daemon=True)
        thread.start()
        cls._watch = (r, w, thread)

    @classmethod
    def _stop(cls) -> None:
        if cls._watch is None:
            return
        r, w, thread = cls._watch
        cls._watch = None
        signal.set_wakeup_fd(-1)
        try:
            w.send(b"\0")  # wake the reader: it ends
        except OSError:
            pass
        thread.join(timeout=1.0)
        r.close()
        w.close()

    def __enter__(self) -> QuitOnSecondSignal:
        if not QuitOnSecondSignal._stack:
            QuitOnSecondSignal._start()
        QuitOnSecondSignal._stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self in QuitOnSecondSignal._stack:
            QuitOnSecondSignal._stack.remove(self)
        if not QuitOnSecondSignal._stack:
            QuitOnSecondSignal._stop()


def install_handlers(handler: Any, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> dict[int, Any]:
    """Install ``handler`` for ``signals``; -> the handlers it replaced, for :func:`restore_handlers`. Handlers
    can only be installed from the main thread: elsewhere nothing is installed (and {} returned)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in signals}


def restore_handlers(old: dict[int, Any]) -> None:
    """Put back the handlers :func:`install_handlers` replaced, and forget them."""
    for sig, h in old.items():
        signal.signal(sig, h)
    old.clear()


class StopSignals:
    """Turn the first SIGINT/SIGTERM into a request to stop after the current optimizer step; a second one quits
    at once (:func:`quit_now`, within milliseconds even mid-step: :class:`QuitOnSecondSignal`), as users expect
    from a second Ctrl-C. With ``notice`` the first one says so on stderr. Signal handlers can only be installed
    from the main thread; elsewhere this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    _active: ClassVar[list[StopSignals]] = []  # the instances between __enter__ and __exit__, innermost last
    pending: ClassVar[int] = 0  # a stop asked for before the loop started (request_stop)

    def __init__(self, hint: Hint = None, notice: bool = False) -> None:
        self.signum = 0
        self.notice = notice
        self._old: dict[int, Any] = {}
        self._second = QuitOnSecondSignal(hint)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:  # the watch thread normally gets there first; without it (not the main thread), here
            quit_now(signum, QuitOnSecondSignal._hint() or self._second.hint)
        self.signum = signum
        if self.notice:
            say(f"{signal.Signals(signum).name}: stopping after the step in flight, which is then saved "
                "(again to quit at once)")

    def __enter__(self) -> StopSignals:
        if StopSignals.pending:  # asked for already: stop after the first step; a further signal quits at once
            self.signum, StopSignals.pending = StopSignals.pending, 0
        else:
            self._old = install_handlers(self._handle, self.SIGNALS)
        self._second.__enter__()
        StopSignals._active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._second.__exit__()
        restore_handlers(self._old)
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
