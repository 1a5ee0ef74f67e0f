"""The study's Optuna record: its storage and :class:`CellRecord`, one trial per run of a cell.

The cell folders are the study's record (:mod:`~diffattn.experiments.study.workers`: a cell is claimed by holding
its folder's lock and done when its ``result.json`` is there); nothing here decides what runs. Optuna keeps a log
derived from them, for the report's trial counts and for anyone watching a study across machines: each stage (the
base grid, an LR-extension round, the ladder) is an Optuna study, each run of a cell one trial of it, written by the
worker that holds the cell. Storage: ``RDBStorage`` with Optuna's heartbeats, SQLite in ``OUT/optuna.db`` or
``--storage`` (PostgreSQL across machines); a run whose worker died is FAIL once its cell is claimed again (the lock
proves nobody runs it), or once Optuna's own check finds its heartbeat stopped for the grace period."""

from __future__ import annotations

import errno
import functools
import math
import os
import socket
import sqlite3
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.trial import TrialState

from diffattn.experiments.study.cell import log
from diffattn.experiments.study.defaults import GRACE_S
from diffattn.experiments.study.spec import StudyError
from diffattn.experiments.study.worker_signals import StudyInterrupted
from diffattn.system.atomic_files import refuse_links
from diffattn.system.io_errors import io_error_in

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
                    url, engine_kwargs=kw, heartbeat_interval=beat, grace_period=max(2 * beat, math.ceil(grace_s))))
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
    """``call()`` without Optuna's ExperimentalWarning (its heartbeats)."""
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


@contextmanager
def _as_os_errors(storage: Any) -> Iterator[None]:
    """A failure of the study's database in the block as the OSError the commands report (:func:`as_os_error`)."""
    try:
        yield
    except Exception as e:
        err = as_os_error(e, where(storage))
        if err is None:
            raise
        raise err from e


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


class CellRecord:
    """The Optuna study ``name`` of one stage (created if new), where :meth:`run` records each run of a cell."""

    def __init__(self, storage: Any, name: str) -> None:
        self.storage = storage
        with _as_os_errors(storage):
            self.study = optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                             load_if_exists=True)
            self.study_id = storage.get_study_id_from_name(name)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def run(self, cell: str, train: Callable[[], dict]) -> dict:
        """``train()``, the run of ``cell`` by the worker that holds its lock, as one trial: COMPLETE with the
        cell's validation loss, FAIL if the cell failed, PRUNED if a signal or a storage failure stopped it (raised
        again); Optuna beats its heartbeat meanwhile. -> the cell's result."""
        with _as_os_errors(self.storage):
            self._close_earlier(cell)
        result: list[dict] = []
        stopped: list[Exception] = []

        def objective(trial: Any) -> float:
            trial.set_user_attr("cell", cell)
            trial.set_user_attr("worker", self.worker)
            try:
                result.append(train())
            except Exception as e:
                if not isinstance(e, StudyInterrupted) and io_error_in(e) is None:
                    raise  # the cell failed
                stopped.append(e)  # not the cell's failure: PRUNED keeps Optuna quiet (no traceback)
                raise optuna.TrialPruned(str(e)) from None
            return float(result[0]["val_loss"])

        try:
            with _as_os_errors(self.storage):
                _experimental(lambda: self.study.optimize(objective, n_trials=1))
        except Exception as e:
            if not result or io_error_in(e) is not None:
                raise
            # e.g. Optuna took the trial for lost (a late heartbeat) and refuses its value: the folder has it
            log(f"cell {cell}: its trial was not closed ({_first_line(e)}); the cell's result stands")
        if stopped:
            raise stopped[0]
        return result[0]

    def _close_earlier(self, cell: str) -> None:
        """Earlier runs of ``cell`` still RUNNING are FAIL: the lock this worker holds proves their workers gone."""
        trials = [t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("cell") == cell]
        if any(t.state == TrialState.COMPLETE for t in trials):
            log(f"cell {cell}: its result is gone (folder deleted?): training it again")
        for t in trials:
            if t.state == TrialState.RUNNING:
                tid = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, t.number)
                try:
                    self.storage.set_trial_state_values(tid, TrialState.FAIL)
                except optuna.exceptions.UpdateFinishedTrialError:
                    pass  # Optuna's own heartbeat check got there first
