"""Scheduling a ``diffattn study``: an Optuna study (``GridSampler`` over the cells) in
``OUT/optuna.journal`` (JournalFileStorage, on any shared filesystem) or an RDB URL (``--storage``).

Any number of ``--worker`` processes (:func:`worker_main`; :func:`spawn_workers` starts local ones), on any
machines that see OUT, pull cells until the grid is done, one cell at a time
(:class:`~diffattn.experiments.study.grid_worker.GridWorker`, which re-queues the cells of a dead worker). After
the base grid come the LR-extension rounds (:func:`_extend_lrs`, each a further grid whose points are cell keys)
and then the size ladder.

Optuna is imported where it is used: ``diffattn compare`` without ``--data`` loads this module but never
schedules, and need not pay for importing Optuna."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffattn.experiments.study import worker_signals
from diffattn.experiments.study.cell import _log, load_data, run_cell
from diffattn.experiments.study.grid_worker import GridWorker
from diffattn.experiments.study.journal import repair_journal
from diffattn.experiments.study.progress import collect_cells, ladder_lrs, lr_brackets
from diffattn.experiments.study.spec import StudySpec, cell_name, read_spec
from diffattn.experiments.study.worker_signals import _say, _StopRequest, quit_now
from diffattn.fileio import EX_IOERR
from diffattn.train.signals import QuitOnSecondSignal, install_handlers, restore_handlers


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
        worker_signals.die_with_parent(parent_pid, signal.SIGTERM)
    spec, plan = read_spec(out)
    if threads:
        torch.set_num_threads(threads)
    source, tok = load_data(out, spec)
    storage = open_storage(out, storage_url)
    with _StopRequest(resume_hint) as guard:
        worker_signals.active_stop = guard
        try:
            show = {"progress_s": progress_s, "bar": bar, "quiet": not verbose}
            return _work(out, spec, plan, storage, source, tok, grace_s, poll_s, show)
        finally:
            worker_signals.active_stop = None


def _work(out: Path, spec: StudySpec, plan: dict, storage: Any, source: Any, tok: Any, grace_s: float,
          poll_s: float, show: dict[str, Any]) -> bool:
    study_name = plan["study_name"]

    def grid_cell(p: dict) -> float:
        r = run_cell(out, spec, spec.arm(p["arm"]), p["lr"], p["seed"], source, tok, **show)
        _log(f"{r['cell']}: val loss {r['val_loss']:.4f} nats/token")
        return r["val_loss"]

    def grid_kept(p: dict) -> bool:
        return _kept(out, spec, p["arm"], p["lr"], p["seed"])

    w = GridWorker(storage, study_name, spec.grid(), grid_cell, grace_s=grace_s, poll_s=poll_s, kept=grid_kept)
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
                    ladder_cell, grace_s=grace_s, poll_s=poll_s,
                    kept=lambda p: _kept(out, spec, p["arm"], best[p["arm"]], p["seed"], p["d_model"]))
    return lw.work()


def _opens_first(storage: Any, name: str) -> bool:
    """Create the Optuna study ``name``; -> whether this process created it (the storage makes that atomic, so
    of the workers that reach an LR-extension round together, exactly one announces it)."""
    import optuna  # heavy: loaded on use (module docstring)

    try:
        optuna.create_study(study_name=name, storage=storage, direction="minimize")
    except optuna.exceptions.DuplicatedStudyError:
        return False
    return True


def _kept(out: Path, spec: StudySpec, arm: str, lr: float, seed: int, d_model: int | None = None) -> bool:
    """Whether the cell's result is in its folder (a folder deleted after the cell finished: it trains again)."""
    size = d_model if d_model not in (None, spec.model.d_model) else None
    return (out / "cells" / cell_name(arm, lr, seed, size) / "result.json").is_file()


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
        tag = hashlib.sha1("\n".join(sorted(keys)).encode()).hexdigest()[:12]
        if _opens_first(storage, f"{study_name}-lrext-{tag}"):  # every worker joins the round; one says so
            _log("LR extension (best LR at an edge): " + "; ".join(f"{a} + lr {x}" for a, x in ext.items()))

        def ext_cell(p: dict) -> float:
            arm, lr, seed = p["cell"].split("|")
            return grid_cell({"arm": arm, "lr": float(lr), "seed": int(seed)})

        def ext_kept(p: dict) -> bool:
            arm, lr, seed = p["cell"].split("|")
            return _kept(out, spec, arm, float(lr), int(seed))

        if not GridWorker(storage, f"{study_name}-lrext-{tag}", {"cell": sorted(keys)}, ext_cell,
                          grace_s=grace_s, poll_s=poll_s, kept=ext_kept).work():
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
    would print a KeyboardInterrupt traceback): each saves its cell at the current step and exits. On a second
    signal the workers are killed (SIGKILL: a second SIGTERM sent right after the first can merge with it in a
    worker that has not taken the first yet, and would read as one) and this process quits at once; a worker
    quitting at once saves nothing either, and the next run resumes from each cell's last checkpoint and
    recovers its trial. A worker whose parent is gone stops as on SIGTERM (``--spawned-by``)."""
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
    def kill_all(signum: int) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass

    second = QuitOnSecondSignal(hint, before_quit=kill_all)
    old = install_handlers(forward)
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
        restore_handlers(old)
    return codes, got[0] if got else 0
