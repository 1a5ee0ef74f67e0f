"""Scheduling a ``compare --data`` study: an Optuna study (``GridSampler`` over the cells) in
``OUT/optuna.journal`` (JournalFileStorage, on any shared filesystem) or an RDB URL (``--storage``).

Any number of ``--worker`` processes (:func:`worker_main`; :func:`spawn_workers` starts local ones), on any
machines that see OUT, pull cells until the grid is done, one cell at a time (:class:`GridWorker`). A worker
records a heartbeat in its trial; a RUNNING trial whose worker died (same host: the process is gone; another
host: no heartbeat for ``grace_s``) is marked FAIL and its grid point re-queued, so a killed worker never blocks
the grid, and the re-run cell resumes from its checkpoint. After the base grid come the LR-extension rounds
(:func:`_extend_lrs`, each a further grid whose points are cell keys) and then the size ladder.

Optuna is imported where it is used: ``diffattn compare`` without ``--data`` loads this module but never
schedules, and need not pay for importing Optuna."""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffattn.experiments.study import signals
from diffattn.experiments.study.cell import CellInUse, _log, load_data, run_cell
from diffattn.experiments.study.journal import repair_journal
from diffattn.experiments.study.progress import collect_cells, ladder_lrs, lr_brackets
from diffattn.experiments.study.signals import StudyInterrupted, _say, _StopRequest, quit_now
from diffattn.experiments.study.spec import StudySpec, read_spec
from diffattn.fileio import EX_IOERR, io_error_in
from diffattn.train.signals import QuitOnSecondSignal


def open_storage(out: Path, url: str | None):
    import optuna  # heavy: loaded on use (module docstring)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url:
        return optuna.storages.RDBStorage(url)
    from optuna.storages import JournalStorage  # heavy: loaded on use (module docstring)
    from optuna.storages.journal import JournalFileBackend  # heavy: loaded on use (module docstring)

    note = repair_journal(out / "optuna.journal")  # a torn last record (a full disk) would block every read
    if note:
        _log(f"note: {note}")
    return JournalStorage(JournalFileBackend(str(out / "optuna.journal")))


NO_PID_GRACE_S = 60.0


def _grid_keys(space: dict[str, list]) -> list[tuple]:
    """Grid points in GridSampler's grid_id order (parameter names sorted, values in the given order)."""
    names = sorted(space)
    return [tuple(zip(names, combo)) for combo in itertools.product(*(space[n] for n in names))]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class GridWorker:
    """Pull the cells of one Optuna grid study until every grid point has a COMPLETE trial.

    A grid point is identified by its parameters (``trial.params``); GridSampler's ``grid_id`` (the same in
    every process: its shuffle is seeded) is used to re-queue a point and to spot a racing trial whose
    parameters are not written yet."""

    def __init__(self, storage: Any, study_name: str, space: dict[str, list], run: Callable[[dict], float],
                 grace_s: float = 300.0, heartbeat_s: float = 20.0, poll_s: float = 5.0):
        import optuna  # heavy: loaded on use (module docstring)

        self.space, self.run_fn = space, run
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
                not _pid_alive(pid) or (pid == os.getpid() and t.number not in self.started))
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

    def requeue_failed(self) -> int:
        """Grid points whose trials all failed (a crash in an earlier run): queue them again once."""
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        n = 0
        for ts in self._by_key().values():
            if ts and all(t.state in (TrialState.FAIL, TrialState.PRUNED) for t in ts):
                gid = next((t.system_attrs["grid_id"] for t in ts if "grid_id" in t.system_attrs), None)
                if gid is not None:
                    self._requeue(gid, "failed earlier")
                    n += 1
        return n

    def remaining(self) -> tuple[list[tuple], list[tuple]]:
        """(points with no COMPLETE trial, those of them this worker may start now: never tried, or one of
        its trials is WAITING)."""
        from optuna.trial import TrialState  # heavy: loaded on use (module docstring)

        todo, free = [], []
        waiting = any(t.state == TrialState.WAITING for t in self._trials())
        for k, ts in self._by_key().items():
            states = {t.state for t in ts}
            if TrialState.COMPLETE in states:
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
        if signals.active_stop is not None and signals.active_stop.signum:
            raise StudyInterrupted(signals.active_stop.signum)

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
            if t.state == TrialState.COMPLETE or (t.state == TrialState.RUNNING and t.number < trial.number):
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


def worker_main(out: Path, storage_url: str | None, threads: int, grace_s: float = 300.0,
                poll_s: float = 5.0, progress_s: float = 60.0, resume_hint: str | None = None,
                parent_pid: int | None = None, bar: bool = False, verbose: bool = False) -> bool:
    """One worker: the grid, then (with sizes) the ladder. -> True when both are complete.

    It prints one line per cell (and a line every ``progress_s`` while a cell trains, or with ``bar`` the
    training loop's progress bar, for a terminal); ``verbose`` adds each cell's evaluation and checkpoint lines.

    SIGINT/SIGTERM (see :class:`_StopRequest`) raise :class:`StudyInterrupted` once the cell in training has
    saved its checkpoint; ``resume_hint`` is printed if a second signal quits at once. ``parent_pid``: a
    spawned worker stops the same way when the command that started it is gone (even killed with kill -9)."""
    if parent_pid is not None:
        signals.die_with_parent(parent_pid, signal.SIGTERM)
    spec, plan = read_spec(out)
    if threads:
        torch.set_num_threads(threads)
    source, tok = load_data(out, spec)
    storage = open_storage(out, storage_url)
    with _StopRequest(resume_hint) as guard:
        signals.active_stop = guard
        try:
            show = {"progress_s": progress_s, "bar": bar, "quiet": not verbose}
            return _work(out, spec, plan, storage, source, tok, grace_s, poll_s, show)
        finally:
            signals.active_stop = None


def _work(out: Path, spec: StudySpec, plan: dict, storage: Any, source: Any, tok: Any, grace_s: float,
          poll_s: float, show: dict[str, Any]) -> bool:
    study_name = plan["study_name"]

    def grid_cell(p: dict) -> float:
        r = run_cell(out, spec, spec.arm(p["arm"]), p["lr"], p["seed"], source, tok, **show)
        _log(f"{r['cell']}: val loss {r['val_loss']:.4f} nats/token")
        return r["val_loss"]

    w = GridWorker(storage, study_name, spec.grid(), grid_cell, grace_s=grace_s, poll_s=poll_s)
    if not w.work() or not _extend_lrs(out, spec, storage, study_name, grid_cell, grace_s, poll_s):
        return False
    if not spec.ladder_sizes():
        return True
    best = ladder_lrs(out, spec)

    def ladder_cell(p: dict) -> float:
        lr = best[p["arm"]]
        r = run_cell(out, spec, spec.arm(p["arm"]), lr, p["seed"], source, tok, d_model=p["d_model"], **show)
        _log(f"{r['cell']}: val loss {r['val_loss']:.4f} nats/token")
        return r["val_loss"]

    space = {"arm": [a.name for a in spec.arms()], "d_model": spec.ladder_sizes(), "seed": list(spec.seeds)}
    lw = GridWorker(storage, f"{study_name}-ladder-" + "-".join(map(str, spec.ladder_sizes())), space,
                    ladder_cell, grace_s=grace_s, poll_s=poll_s)
    return lw.work()


def _extend_lrs(out: Path, spec: StudySpec, storage: Any, study_name: str, grid_cell: Callable[[dict], float],
                grace_s: float, poll_s: float) -> bool:
    """LR bracketing after the base grid: while some arm's best LR is at an edge (and it has rounds left), run
    the cells of the next LR beyond it, one round for all such arms at a time.

    A round is its own Optuna grid study over one parameter, the cell key ``arm|lr|seed``, named after its
    contents: :func:`lr_brackets` derives the same round from the same finished cells in every worker and every
    rerun, so they all join that study (finished cells are reused, killed ones re-queued, as in the base grid).
    A worker reaches this only once the previous grid is complete (GridWorker.work waits for the others)."""
    for _ in range(spec.lr_extensions * 2 + 2):  # each round uses one of an arm's K extensions: this bounds it
        br = lr_brackets(spec, collect_cells(out, spec))
        keys = [f"{arm}|{lr!r}|{s}" for arm, b in br.items() if b.status == "extend"
                for lr in b.next_lrs for s in spec.seeds]
        if not keys:
            return True
        ext = {a: f"{', '.join(f'{x:g}' for x in b.next_lrs)}" for a, b in br.items() if b.status == "extend"}
        _log("LR extension (best LR at an edge): " + "; ".join(f"{a} + lr {x}" for a, x in ext.items()))
        tag = hashlib.sha1("\n".join(sorted(keys)).encode()).hexdigest()[:12]

        def ext_cell(p: dict) -> float:
            arm, lr, seed = p["cell"].split("|")
            return grid_cell({"arm": arm, "lr": float(lr), "seed": int(seed)})

        if not GridWorker(storage, f"{study_name}-lrext-{tag}", {"cell": sorted(keys)}, ext_cell,
                          grace_s=grace_s, poll_s=poll_s).work():
            return False
    return True


def _wait(procs: list[subprocess.Popen], tell: Callable[[subprocess.Popen, int], None]) -> list[int]:
    """Wait for every worker; the first one that stops on a storage failure (exit 74) stops the others (as on
    SIGTERM: each saves its cell), since the same failure would fail every cell of theirs too. -> exit codes."""
    stopping = False
    while any(p.poll() is None for p in procs):
        if not stopping and any(p.returncode == EX_IOERR for p in procs):
            stopping = True
            _say("a worker stopped on a storage failure: stopping the others (each saves its cell)")
            for p in procs:
                tell(p, signal.SIGTERM)
        time.sleep(0.2)
    return [p.returncode for p in procs]


def spawn_workers(out: Path, jobs: int, threads: int, storage_url: str | None, extra: list[str] = (),
                  resume_hint: str | None = None) -> tuple[list[int], int]:
    """Start ``jobs`` local worker processes (``diffattn study --worker``) and wait; -> (their exit codes,
    the signal that stopped this command, or 0).

    Each worker runs in its own session, so a Ctrl-C at the terminal reaches this process alone, which passes
    it on exactly once to every worker, as SIGTERM (a worker still starting up then ends quietly, where SIGINT
    would print a KeyboardInterrupt traceback): each saves its cell at the current step and exits. A second
    signal is passed on as well (the workers quit at once) and this process quits at once. A worker whose
    parent is gone stops as on SIGTERM (``--spawned-by``)."""
    procs: list[subprocess.Popen] = []
    told: dict[int, int] = {}  # pid -> signals passed on
    got: list[int] = []

    def tell(p: subprocess.Popen, signum: int) -> None:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        told[p.pid] = told.get(p.pid, 0) + 1

    def forward(signum: int, frame: Any) -> None:
        got.append(signum)
        if len(got) > 1:
            quit_now(signum, hint)  # which passes the signal on first (second.before_quit)
        for p in procs:
            tell(p, signum)
        _say(f"{signal.Signals(signum).name}: each worker saves its cell at the current step and stops "
             "(again to quit at once)")

    hint = f"resume with: {resume_hint}" if resume_hint else None
    second = QuitOnSecondSignal(hint, before_quit=lambda signum: [tell(p, signum) for p in procs])
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    second.__enter__()
    try:
        for _ in range(jobs):
            if got:
                break  # no further worker starts
            cmd = [sys.executable, "-m", "diffattn", "study", "--worker", "--out", str(out), "--threads",
                   str(threads), "--spawned-by", str(os.getpid()), *extra]
            if storage_url:
                cmd += ["--storage", storage_url]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            p = subprocess.Popen(cmd, env=env, start_new_session=True)
            procs.append(p)
            if got and not told.get(p.pid):  # the signal came while it was being started
                tell(p, got[0])
            time.sleep(0.5)
        codes = _wait(procs, tell)
    finally:
        second.__exit__()
        for sig, h in old.items():
            signal.signal(sig, h)
    return codes, got[0] if got else 0
