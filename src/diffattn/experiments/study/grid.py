"""The study's Optuna side: its storage and the grids its cells run in.

Storage: ``RDBStorage`` with heartbeats, SQLite in ``OUT/optuna.db`` or ``--storage`` (PostgreSQL across machines).
A RUNNING trial whose heartbeat stopped for the grace period is failed by the next worker that looks
(``fail_stale_trials``) and queued again (``RetryHeartbeatStaleTrialCallback``); its cell resumes from its last
checkpoint. A :class:`Grid` is one study over cell names under ``GridSampler``; a cell is done when its
``result.json`` is in its folder, and a cell nobody will run (its trials failed or pruned, its result deleted) is
queued again with the same callback."""

from __future__ import annotations

import errno
import functools
import math
import os
import socket
import sqlite3
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.trial import TrialState

from diffattn.experiments.study.cell import CellInUse, log
from diffattn.experiments.study.defaults import GRACE_S
from diffattn.experiments.study.spec import StudyError
from diffattn.experiments.study.worker_signals import StudyInterrupted
from diffattn.fileio import refuse_links
from diffattn.io_errors import io_error_in

DB_FILE = "optuna.db"


def open_storage(out: Path, url: str | None, grace_s: float = GRACE_S) -> Any:
    """The study's RDBStorage: ``url``, or SQLite in ``OUT/optuna.db``; a heartbeat every quarter of the grace
    period (whole seconds, as Optuna takes them; the grace at least two beats). StudyError (one line) for a
    database that cannot be opened or whose driver is not installed."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    kw: dict[str, Any] = {}
    db = None
    if url is None:
        refuse_links(out, [f"{DB_FILE}*"])  # SQLite writes it (and its write-ahead log) in place
        db = out.resolve() / DB_FILE
        url = sqlalchemy.engine.URL.create("sqlite", database=str(db)).render_as_string()
        kw = {"creator": functools.partial(_sqlite, db)}
    elif url.startswith("postgresql"):
        kw = {"connect_args": {"connect_timeout": 30}}  # a host that does not answer is an error, not a hang
    beat = max(1, round(grace_s / 4))
    try:
        for again in (True, False):  # two processes creating the tables at once: one fails, and finds them
            try:
                return _experimental(lambda: optuna.storages.RDBStorage(
                    url, engine_kwargs=kw, heartbeat_interval=beat, grace_period=max(2 * beat, math.ceil(grace_s)),
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback()))
            except sqlalchemy.exc.SQLAlchemyError:
                if not again:
                    raise
                time.sleep(1.0)
    except ImportError as e:  # e.g. no psycopg for postgresql://
        raise StudyError(f"--storage {url.split(':', 1)[0]}: its database driver is not installed "
                         f"({e.__cause__ or e}); for PostgreSQL: pip install 'diffattn[postgres]'") from None
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError, ValueError) as e:
        err = io_error_in(e) or as_os_error(e, str(db or shown_url(url)))
        if err is not None and err.errno == errno.ENOSPC:
            raise err from e
        if db is None:
            raise StudyError(f"cannot open the study's storage {shown_url(url)}: {_first_line(e)}") from None
        raise StudyError(f"{db}: {_first_line(e)}; move it away (mv {db} {db}.bad) and run the command again: "
                         "finished cells are reused from their result.json, the others resume from their "
                         "checkpoints") from None


def _experimental(call: Callable[[], Any]) -> Any:
    """``call()`` without Optuna's ExperimentalWarning (its heartbeats and their retry callback)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return call()


@contextmanager
def storage_open(out: Path, url: str | None, grace_s: float = GRACE_S) -> Iterator[Any]:
    """:func:`open_storage`, its connections closed after the block (SQLite then folds its write-ahead log back
    into the file: a process that ran a study does not keep the database open for the rest of its life)."""
    storage = open_storage(out, url, grace_s)
    try:
        yield storage
    finally:
        storage.remove_session()
        storage.engine.dispose()


def _sqlite(db: Path) -> Any:
    """A connection to the study's SQLite file: a write-ahead log, synced at its checkpoints only (5x fewer
    fsyncs; a power cut may lose the last records, never the file, and the cells' folders hold the results), and
    a minute's wait for another worker's write."""
    con = sqlite3.connect(db, timeout=60, check_same_thread=False)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    return con


def opens_first(storage: Any, name: str) -> bool:
    """Create the Optuna study ``name``; -> whether this process created it (the storage makes that atomic, so
    of the workers that reach an LR-extension round together, exactly one announces it)."""
    try:
        optuna.create_study(study_name=name, storage=storage, direction="minimize")
    except optuna.exceptions.DuplicatedStudyError:
        return False
    return True


def as_os_error(e: BaseException, where: str) -> OSError | None:
    """The storage failure behind an error of the study's database ``where`` (``e`` or one in its chain: Optuna
    can raise another error over it), as an OSError the commands report in one line (exit 74): SQLite's "database
    or disk is full" is ENOSPC; any other failure to write, EIO."""
    kinds = (optuna.exceptions.StorageInternalError, sqlalchemy.exc.OperationalError)
    seen: set[int] = set()
    while e is not None and not isinstance(e, kinds) and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if not isinstance(e, kinds):
        return None
    text = _first_line(e.__cause__ or e)
    return OSError(errno.ENOSPC if "full" in text else errno.EIO, text.removeprefix("(sqlite3.OperationalError) "),
                   where)


def where(storage: Any) -> str:
    """The study's database as a user names it: the SQLite file, or the URL without its password."""
    url = storage.engine.url
    return url.database if url.drivername == "sqlite" else shown_url(url)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def shown_url(url: Any) -> str:
    """A database URL without its password."""
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):  # ValueError: a port that is no number
        return "(a URL SQLAlchemy cannot read)"


class Grid:
    """The cells of one Optuna grid study, run one trial at a time until every cell is done (module docstring).

    ``cells``: {cell name: run it -> its validation loss}; ``done(name)``: whether the cell's result is in its
    folder; ``stop()``: raises StudyInterrupted when this worker was asked to stop (checked between cells)."""

    def __init__(self, storage: Any, name: str, cells: Mapping[str, Callable[[], float]],
                 done: Callable[[str], bool], stop: Callable[[], None], poll_s: float = 5.0):
        self.storage, self.cells, self.done, self.stop, self.poll_s = storage, dict(cells), done, stop, poll_s
        self.study = optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                         sampler=optuna.samplers.GridSampler({"cell": list(self.cells)}),
                                         load_if_exists=True)
        self.study_id = storage.get_study_id_from_name(name)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.gave_up: set[str] = set()  # cells that failed in this process (retried by the next run)
        self.interrupted: StudyInterrupted | None = None
        self.storage_error: Exception | None = None  # a storage failure in a cell: stops this worker
        self.current: int | None = None  # the number of the trial this worker runs

    def work(self) -> bool:
        """Run cells until every one is done; -> True if they are (False: cells failed here: re-run)."""
        try:
            return self._work()
        except Exception as e:
            err = as_os_error(e, where(self.storage))
            if err is None:
                raise
            raise err from e

    def _work(self) -> bool:
        requeue = True  # at the start, and after each poll: a cell nobody will run is queued again
        while True:
            self.stop()
            todo = [c for c in self.cells if not self.done(c)]
            if not todo:
                return True
            if requeue:  # (Optuna's own check of the heartbeats runs before each trial)
                self._fail_stale()
            trials = self._trials()
            if requeue and self._requeue(todo, trials):
                trials = self._trials()
            waiting = any(t.state == TrialState.WAITING for ts in trials.values() for t in ts)
            if waiting or any(not trials[c] and c not in self.gave_up for c in todo):
                self._run_one()
                requeue = False
                continue
            if all(c in self.gave_up for c in todo):
                log(f"{len(todo)} cell(s) failed; re-run the command to retry them")
                return False
            self._idle()  # the rest are running in other workers
            requeue = True

    def _trials(self) -> dict[str, list]:
        out: dict[str, list] = {c: [] for c in self.cells}
        for t in self.study.get_trials(deepcopy=False):
            if t.params.get("cell") in out:
                out[t.params["cell"]].append(t)
        return out

    def _fail_stale(self) -> None:
        """Optuna's stale-trial check (the heartbeats), plus the one case it cannot see: a trial whose worker died
        before its first heartbeat (Optuna fails only trials that have one), failed and retried the same way."""
        _experimental(lambda: optuna.storages.fail_stale_trials(self.study))
        grace = self.storage.grace_period
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            started = t.datetime_start.timestamp() if t.datetime_start else time.time()
            if (t.user_attrs.get("worker") or {}).get("trial") != t.number and time.time() - started > grace:
                tid = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, t.number)
                try:
                    if self.storage.set_trial_state_values(tid, TrialState.FAIL):
                        self._retry(t)
                except optuna.exceptions.UpdateFinishedTrialError:
                    pass  # another worker got there first

    def _retry(self, trial: Any) -> None:
        _experimental(lambda: optuna.storages.RetryHeartbeatStaleTrialCallback()(self.study, trial))

    def _requeue(self, todo: list[str], trials: dict[str, list]) -> int:
        """Queue again each cell of ``todo`` that nobody will run; -> how many."""
        n = 0
        for c in todo:
            ts = trials[c]
            if c in self.gave_up or not ts or any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in ts):
                continue
            if any(t.state == TrialState.COMPLETE for t in ts):
                log(f"cell {c}: its result is gone (folder deleted?): training it again")
            self._retry(ts[-1])
            n += 1
        return n

    def _run_one(self) -> None:
        """One trial; a cell that failed on its own is FAIL and the worker goes on, anything else stops it."""
        failed_before, self.current = len(self.gave_up), None
        try:
            self.study.optimize(self._objective, n_trials=1)
        except Exception as e:
            if self.storage_error is not None:
                raise self.storage_error from None
            if len(self.gave_up) > failed_before:  # the cell failed on its own: FAIL, and on with the others
                log(f"cell failed: {type(e).__name__}: {e}")
            elif self._failed_elsewhere():  # its heartbeat came late: Optuna refuses the value; the copy has it
                log(f"trial {self.current}: another worker took it for lost meanwhile; its cell's result stands")
            else:
                raise  # a failure of the study's own bookkeeping would come back on every pass
        if self.storage_error is not None:  # (the cell's trial was pruned: the storage failed, not the cell)
            raise self.storage_error
        if self.interrupted is not None:
            raise self.interrupted

    def _failed_elsewhere(self) -> bool:
        if self.current is None:
            return False
        tid = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, self.current)
        return self.storage.get_trial(tid).state == TrialState.FAIL

    def _objective(self, trial: Any) -> float:
        tid = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial.number)
        self.storage.record_heartbeat(tid)  # first: from here on the trial is Optuna's to recover
        # its own number: a retried copy carries its original's attributes, and this one's marks it as beating
        trial.set_user_attr("worker", {"trial": trial.number, "at": self.worker})
        self.current = trial.number
        cell = trial.suggest_categorical("cell", list(self.cells))
        try:
            return float(self.cells[cell]())
        except CellInUse as e:  # a live worker trains it (one thought lost came back): not ours, not a failure
            trial.set_user_attr("in_use", str(e))
            raise optuna.TrialPruned(str(e)) from None
        except StudyInterrupted as e:  # not a failure: PRUNED keeps Optuna quiet, and the cell is queued again
            self.interrupted = e
            raise optuna.TrialPruned(str(e)) from None
        except Exception as e:
            if io_error_in(e) is not None:  # the storage failed, not the cell: no FAIL; the worker stops
                self.storage_error = e
                raise optuna.TrialPruned(str(e)) from None
            self.gave_up.add(cell)
            raise

    def _idle(self) -> None:
        """Sleep ``poll_s``, noticing a stop request within a fraction of a second."""
        end = time.monotonic() + self.poll_s
        while (left := end - time.monotonic()) > 0:
            self.stop()
            time.sleep(min(left, 0.2))
