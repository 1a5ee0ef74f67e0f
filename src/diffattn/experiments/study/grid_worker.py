"""One grid of a ``diffattn study`` in Optuna (``GridSampler`` over its cells): :class:`GridWorker` pulls
cells until the grid is done, one cell at a time. It records a heartbeat in its trial; a RUNNING trial whose
worker died (same host: the process is gone; another host: no heartbeat for ``grace_s``) is marked FAIL and its
grid point re-queued, so a killed worker never blocks the grid, and the re-run cell resumes from its checkpoint.

Optuna is imported where it is used (:mod:`diffattn.experiments.study.scheduler` says why)."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from diffattn.experiments.study import worker_signals
from diffattn.experiments.study.cell import CellInUse, _log
from diffattn.experiments.study.worker_signals import StudyInterrupted
from diffattn.fileio import io_error_in, pid_alive

NO_PID_GRACE_S = 60.0


def _grid_keys(space: dict[str, list]) -> list[tuple]:
    """Grid points in GridSampler's grid_id order (parameter names sorted, values in the given order)."""
    names = sorted(space)
    return [tuple(zip(names, combo)) for combo in itertools.product(*(space[n] for n in names))]


class GridWorker:
    """Pull the cells of one Optuna grid study until every grid point has a COMPLETE trial.

    A grid point is identified by its parameters (``trial.params``); GridSampler's ``grid_id`` (the same in
    every process: its shuffle is seeded) is used to re-queue a point and to spot a racing trial whose
    parameters are not written yet."""

    def __init__(self, storage: Any, study_name: str, space: dict[str, list], run: Callable[[dict], float],
                 grace_s: float = 300.0, heartbeat_s: float = 20.0, poll_s: float = 5.0,
                 kept: Callable[[dict], bool] | None = None):
        import optuna  # heavy: loaded on use (module docstring)

        self.space, self.run_fn = space, run
        # whether a point's result is still where its cell put it (a COMPLETE trial whose cell folder was
        # deleted is no result: the point runs again); None: a COMPLETE trial is done
        self.kept = kept
        self.keys = _grid_keys(space)
        self.grace_s, self.heartbeat_s, self.poll_s = grace_s, heartbeat_s, poll_s
        self.host = socket.gethostname()
        self.study = optuna.create_study(
            study_name=study_name, storage=storage, sampler=optuna.samplers.GridSampler(space),
            direction="minimize", load_if_exists=True,
        )
        self.gave_up: set[tuple] = set()  # points that crashed in this process (retried on the next run)
        self.interrupted: StudyInterrupted | None = None
        self.storage_error: Exception | None = None  # a storage failure in a cell: stops this worker
        self.started: set[int] = set()  # numbers of the trials this worker has run

    # -- trial bookkeeping
    def _trials(self):
        return self.study._storage.get_all_trials(self.study._study_id, deepcopy=False)

    @staticmethod
    def _key(t) -> tuple | None:
        return tuple(sorted(t.params.items())) if t.params else None

    def _by_key(self) -> dict[tuple, list]:
        out: dict[tuple, list] = {k: [] for k in self.keys}
        for t in self._trials():
            k = self._key(t)
            if k in out:
                out[k].append(t)
        return out

    def _requeue(self, gid: int, why: str, retry_of: int | None = None) -> None:
        import optuna  # heavy: loaded on use (module docstring)

        search_space = {k: list(v) for k, v in sorted(self.space.items())}
        self.study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            system_attrs={"grid_id": gid, "search_space": search_space, "requeued": why, "retry_of": retry_of},
        ))

    def recover(self) -> int:
        """Mark RUNNING trials whose worker is gone as FAIL and re-queue their grid points; -> how many."""
        from optuna.exceptions import UpdateFinishedTrialError  # heavy: loaded on use (module docstring)
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        n, now = 0, time.time()
        for t in self._trials():
            if t.state != TrialState.RUNNING:
                continue
            ua = t.user_attrs
            pid = int(ua.get("pid", -1))
            # gone: its process has ended, or it is this process but not a trial this worker runs (one an earlier
            # command in this same process left RUNNING when a storage failure kept it from being closed)
            gone = ua.get("host") == self.host and "pid" in ua and (
                not pid_alive(pid) or (pid == os.getpid() and t.number not in self.started))
            last = ua.get("heartbeat") or (t.datetime_start.timestamp() if t.datetime_start else now)
            # A live worker records its pid within moments of starting a trial: one with none after a minute
            # died (killed, or its storage failed) while Optuna was still creating it.
            orphan = "pid" not in ua and now - last > min(self.grace_s, NO_PID_GRACE_S)
            if not (gone or orphan or now - last > self.grace_s):
                continue
            try:
                changed = self.study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue  # another worker recovered it first
            if changed and t.system_attrs.get("grid_id") is not None:
                self._requeue(t.system_attrs["grid_id"], "stale", t.number)
                n += 1
        return n

    def _requeue_where(self, stuck: Callable[[tuple, list], bool], why: str,
                       say: Callable[[tuple], None] | None = None) -> int:
        """Queue again each grid point whose trials ``stuck(key, trials)`` picks (by its grid_id); -> how many."""
        n = 0
        for k, ts in self._by_key().items():
            gid = next((t.system_attrs["grid_id"] for t in ts if "grid_id" in t.system_attrs), None)
            if gid is not None and stuck(k, ts):
                if say is not None:
                    say(k)
                self._requeue(gid, why)
                n += 1
        return n

    def requeue_failed(self) -> int:
        """Grid points whose trials all failed (a crash in an earlier run): queue them again once."""
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        return self._requeue_where(lambda k, ts: all(t.state in (TrialState.FAIL, TrialState.PRUNED) for t in ts),
                                   "failed earlier")

    def _done(self, key: tuple, states: set) -> bool:
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        return TrialState.COMPLETE in states and (self.kept is None or self.kept(dict(key)))

    def requeue_lost(self, log: Callable[[str], None] = _log) -> int:
        """Grid points with a COMPLETE trial whose result is gone (its cell folder deleted): queue them again,
        once (not while one of their trials waits or runs); -> how many."""
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        def lost(k: tuple, ts: list) -> bool:
            states = {t.state for t in ts}
            return TrialState.COMPLETE in states and not self._done(k, states) and not states & {
                TrialState.WAITING, TrialState.RUNNING}

        return self._requeue_where(lost, "result missing", lambda k: log(
            f"cell {', '.join(f'{a} {v}' for a, v in k)}: its result is gone (folder deleted?): training it again"))

    def requeue_stranded(self) -> int:
        """Grid points that nobody will run: every trial of theirs PRUNED, none waiting, running or complete
        (the cell's folder was in use by a process outside this grid, or a worker stopped on a storage
        failure). Queue each again, so a worker tries it once more after its poll; -> how many.
        Without this the point is neither free nor running, and every worker would wait on it for ever."""
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        return self._requeue_where(lambda k, ts: k not in self.gave_up and all(t.state == TrialState.PRUNED
                                                                                for t in ts), "stranded")

    def remaining(self) -> tuple[list[tuple], list[tuple]]:
        """(points with no COMPLETE trial, those of them this worker may start now: never tried, or one of
        its trials is WAITING)."""
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        todo, free = [], []
        waiting = any(t.state == TrialState.WAITING for t in self._trials())
        for k, ts in self._by_key().items():
            states = {t.state for t in ts}
            if self._done(k, states):
                continue
            todo.append(k)
            if k not in self.gave_up and (not states or waiting):
                free.append(k)
        return todo, free

    # -- the loop
    def work(self, log: Callable[[str], None] = _log) -> bool:
        """Run cells until the grid is complete; -> True if it is (False: cells failed here, re-run)."""
        self.recover()
        self.requeue_failed()
        self.requeue_lost(log)
        while True:
            self.recover()
            todo, free = self.remaining()
            if not todo:
                return True
            if not free:
                if all(k in self.gave_up for k in todo):
                    log(f"{len(todo)} cell(s) failed; re-run the command to retry them")
                    return False
                self._idle(self.poll_s)  # the rest are running in other workers
                self.requeue_stranded()
                continue
            self._check_stop()
            failed_before = len(self.gave_up)
            try:
                self.study.optimize(self._objective, n_trials=1)
            except Exception as e:
                # A storage failure (a full disk) would fail every cell alike, and a failure outside a cell (in
                # the study's own bookkeeping) would come back on every pass: stop, and let the command say how
                # to continue. A cell that failed on its own is FAIL; keep going with the other cells.
                if self.storage_error is None and (io_error_in(e) is not None or len(self.gave_up) == failed_before):
                    raise
                if self.storage_error is None:
                    log(f"cell failed: {type(e).__name__}: {e}")
            if self.storage_error is not None:
                raise self.storage_error
            if self.interrupted is not None:
                raise self.interrupted
            self._check_stop()

    @staticmethod
    def _check_stop() -> None:
        if worker_signals.active_stop is not None and worker_signals.active_stop.signum:
            raise StudyInterrupted(worker_signals.active_stop.signum)

    def _idle(self, seconds: float) -> None:
        """Sleep, but notice a stop request within a fraction of a second."""
        end = time.monotonic() + seconds
        while True:
            self._check_stop()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.2))

    def _objective(self, trial) -> float:
        import optuna  # heavy: loaded on use (module docstring)

        key = None
        try:
            params = {n: trial.suggest_categorical(n, self.space[n]) for n in sorted(self.space)}  # a write too
            key = tuple(sorted(params.items()))
            return self._run_trial(trial, params, key)
        except optuna.TrialPruned:
            raise
        except CellInUse as e:  # a live worker trains it (one thought dead came back): not ours, not a failure
            trial.set_user_attr("in_use", str(e))
            raise optuna.TrialPruned(str(e)) from None
        except StudyInterrupted as e:
            # Not a failure: PRUNED keeps Optuna quiet (a FAIL logs a traceback), and the point goes back in
            # the queue at once, so that the next run (or a worker elsewhere that is still running) resumes
            # the cell from the checkpoint it just saved.
            self.interrupted = e
            trial.set_user_attr("interrupted", str(e))
            gid = self.study._storage.get_trial_system_attrs(trial._trial_id).get("grid_id")
            if gid is not None:
                self._requeue(gid, "interrupted", trial.number)
            raise optuna.TrialPruned(str(e)) from None
        except BaseException as e:
            if isinstance(e, Exception) and io_error_in(e) is not None:
                # The storage failed, not the cell: no FAIL (and no traceback from Optuna); work() stops. The
                # point is queued again by the next run (requeue_failed), which resumes the cell's checkpoint.
                self.storage_error = e
                raise optuna.TrialPruned(str(e)) from None
            if key is not None:
                self.gave_up.add(key)
            raise

    def _run_trial(self, trial, params: dict, key: tuple) -> float:
        import optuna  # heavy: loaded on use (module docstring)
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        storage, tid = self.study._storage, trial._trial_id
        self.started.add(trial.number)
        gid = storage.get_trial_system_attrs(tid).get("grid_id")
        trial.set_user_attr("host", self.host)
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("heartbeat", time.time())
        # GridSampler hands out a point that is RUNNING elsewhere when nothing else is left, and two workers can
        # race for one point: the lowest-numbered live trial owns it, any later one stands down.
        for t in self._trials():
            same = self._key(t) == key or (gid is not None and t.system_attrs.get("grid_id") == gid)
            if t.number == trial.number or not same:
                continue
            complete = t.state == TrialState.COMPLETE and (self.kept is None or self.kept(params))
            if complete or (t.state == TrialState.RUNNING and t.number < trial.number):
                trial.set_user_attr("duplicate_of", t.number)
                raise optuna.TrialPruned()
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.heartbeat_s):
                try:
                    storage.set_trial_user_attr(tid, "heartbeat", time.time())
                except Exception:  # a storage hiccup must not kill the training thread
                    pass

        hb = threading.Thread(target=beat, daemon=True)
        hb.start()
        try:
            value = float(self.run_fn(params))
        finally:
            stop.set()
            hb.join()
        return value
