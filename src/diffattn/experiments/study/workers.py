"""The workers of a ``diffattn study``: :func:`worker_main` runs the study's stages in order (the base grid, each
LR-extension round, the size ladder), each through :func:`run_cells`; :func:`spawn_workers` starts ``--jobs`` of
them. The cell folders are the study's one record, on every machine that shares them: a worker claims a cell by
holding its folder's lock (the kernel, or the NFS server, lets go of a dead worker's), a cell is done when its
``result.json`` is there, and Optuna only logs each run (:class:`~.grid.CellRecord`). An LR-extension round is
named after its cells: every worker and rerun derives the same round from the same finished cells
(:func:`~.collect.lr_brackets`) and reaches it only once the previous stage is done."""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from diffattn.experiments.experiment_folder import cell_name
from diffattn.experiments.study.cell import CellInUse, load_data, log, run_cell
from diffattn.experiments.study.collect import collect_cells, lr_brackets
from diffattn.experiments.study.defaults import GRACE_S
from diffattn.experiments.study.optuna_log import CellRecord, opens_first, storage_open
from diffattn.experiments.study.spec import StudySpec, read_spec
from diffattn.experiments.study.worker_signals import StopRequest, StudyInterrupted
from diffattn.system.child_process import die_with_parent
from diffattn.system.io_errors import EX_IOERR, io_error_in
from diffattn.train.signals import QuitOnSecondSignal, install_handlers, quit_now, restore_handlers, say


def worker_main(out: Path, storage_url: str | None, threads: int, grace_s: float = GRACE_S,
                poll_s: float = 5.0, progress_s: float = 60.0, resume_hint: str | None = None,
                parent_pid: int | None = None, bar: bool = False, verbose: bool = False) -> bool:
    """One worker: every stage of the study in ``out``; -> True when all are done.

    It prints one line per cell (and a line every ``progress_s`` while a cell trains, or with ``bar`` the
    training loop's progress bar, for a terminal); ``verbose`` adds each cell's evaluation and checkpoint lines.
    SIGINT/SIGTERM raise StudyInterrupted once the cell in training has saved its checkpoint (:class:`StopRequest`);
    ``resume_hint`` is printed if a second signal quits at once. ``parent_pid``: a spawned worker stops the same
    way when the command that started it is gone (even killed with kill -9)."""
    if parent_pid is not None:
        die_with_parent(parent_pid, signal.SIGTERM)
    spec, plan = read_spec(out)
    if threads:
        torch.set_num_threads(threads)
    source, tok = load_data(out, spec)
    with storage_open(out, storage_url, grace_s) as storage, StopRequest(resume_hint) as stop:
        show = {"progress_s": progress_s, "bar": bar, "quiet": not verbose, "stop": stop}

        def train(record: CellRecord, arm: str, lr: float, seed: int, d_model: int | None) -> None:
            r = run_cell(out, spec, spec.arm(arm), lr, seed, source, tok, d_model=d_model, record=record.run, **show)
            log(f"{r['cell']}: val loss {r['val_loss']:.4f} nats/token")

        def stage(name: str, cells: list[tuple]) -> bool:
            record = CellRecord(storage, name)
            done = lambda c: (out / "cells" / c / "result.json").is_file()  # noqa: E731
            return run_cells({c: functools.partial(train, record, *args) for c, args in cells}, done, stop.check,
                             poll_s)

        return _stages(out, spec, plan["study_name"], storage, stage)


def cell(arm: str, lr: float, seed: int, d_model: int | None = None, base: int | None = None) -> tuple[str, tuple]:
    """(the cell's name, the arguments that train it); ``base``: the study's d_model (not in a base cell's name)."""
    return cell_name(arm, lr, seed, d_model if d_model != base else None), (arm, lr, seed, d_model)


def run_cells(cells: Mapping[str, Callable[[], None]], done: Callable[[str], bool], stop: Callable[[], None],
              poll_s: float = 5.0) -> bool:
    """Run every cell not ``done`` that no other worker holds, in order, until all are done; -> True if they are
    (False: cells failed here, after the others were done: re-run). A cell held elsewhere (CellInUse) is looked at
    again every ``poll_s``; one that fails on its own is left to the next run; a storage failure or a stop
    (``stop()`` raises StudyInterrupted, checked between cells) stops the worker."""
    failed: set[str] = set()
    while True:
        stop()
        todo = [c for c in cells if c not in failed and not done(c)]
        if not todo:
            if failed:
                log(f"{len(failed)} cell(s) failed; re-run the command to retry them")
            return not failed
        ran = False
        for c in todo:
            stop()
            if done(c):  # finished meanwhile by another worker
                continue
            try:
                cells[c]()
                ran = True
            except CellInUse:
                continue  # another worker trains it
            except StudyInterrupted:
                raise
            except Exception as e:
                if io_error_in(e) is not None:  # the storage failed, not the cell: every other cell would too
                    raise
                log(f"cell {c} failed: {type(e).__name__}: {e}")
                failed.add(c)
                ran = True
        if not ran:
            _idle(stop, poll_s)


def _idle(stop: Callable[[], None], poll_s: float) -> None:
    """Sleep ``poll_s``, noticing a stop request within a fraction of a second."""
    end = time.monotonic() + poll_s
    while (left := end - time.monotonic()) > 0:
        stop()
        time.sleep(min(left, 0.2))


def _stages(out: Path, spec: StudySpec, name: str, storage: Any, stage: Callable) -> bool:
    """The base grid, then the LR-extension rounds (while some arm's best LR is at an edge and it has rounds
    left, the cells of the next LR beyond it, one round for every such arm at a time), then the ladder."""
    if not stage(name, [cell(a.name, lr, s) for a in spec.arms() for lr in spec.lrs for s in spec.seeds]):
        return False
    for _ in range(spec.lr_extensions * 2 + 2):  # each round uses one of an arm's K extensions: this bounds it
        ext = {a: b.next_lrs for a, b in lr_brackets(spec, collect_cells(out, spec)).items() if b.status == "extend"}
        if not ext:
            break
        cells = [cell(a, lr, s) for a, lrs in ext.items() for lr in lrs for s in spec.seeds]
        round_name = f"{name}-lrext-" + hashlib.sha1("\n".join(sorted(c for c, _ in cells)).encode()).hexdigest()[:12]
        if opens_first(storage, round_name):  # every worker joins the round; one says so
            log("LR extension (best LR at an edge): " + "; ".join(
                f"{a} + lr {', '.join(f'{x:g}' for x in lrs)}" for a, lrs in ext.items()))
        if not stage(round_name, cells):
            return False
    if not spec.ladder_sizes():
        return True
    best, sizes = {a: b.best_lr for a, b in lr_brackets(spec, collect_cells(out, spec)).items()}, spec.ladder_sizes()
    return stage(f"{name}-ladder-" + "-".join(map(str, sizes)),
                 [cell(a.name, best[a.name], s, d, spec.model.d_model) for a in spec.arms() for d in sizes
                  for s in spec.seeds])


def _wait(procs: list[subprocess.Popen], tell: Callable[[subprocess.Popen, int], None]) -> list[int]:
    """Wait for every worker; the first one that stops on a storage failure (exit 74) stops the others (as on
    SIGTERM: each saves its cell), since the same failure would fail every cell of theirs too. -> exit codes."""
    stopping = False
    while any(p.poll() is None for p in procs):
        if not stopping and any(p.returncode == EX_IOERR for p in procs):
            stopping = True
            say("a worker stopped on a storage failure: stopping the others (each saves its cell)")
            for p in procs:
                tell(p, signal.SIGTERM)
        time.sleep(0.2)
    return [p.returncode for p in procs]


def spawn_workers(out: Path, jobs: int, threads: int, storage_url: str | None, extra: list[str] = (),
                  resume_hint: str | None = None) -> tuple[list[int], int]:
    """Start ``jobs`` local worker processes (``diffattn study --worker``) and wait; -> (their exit codes, the
    signal that stopped this command, or 0). Each worker runs in its own session: a Ctrl-C reaches this process alone,
    which passes it on once to every worker as SIGTERM (a worker still starting ends quietly, where SIGINT would print
    a traceback), and each saves its cell. A second signal kills them (SIGKILL: a second SIGTERM right after the first
    can merge with it) and quits at once; the next run resumes each cell from its last checkpoint."""
    procs: list[subprocess.Popen] = []
    got: list[int] = []
    told: set[int] = set()  # the workers a SIGTERM was passed on to

    def tell(p: subprocess.Popen, signum: int) -> None:
        if p.poll() is None:
            try:
                p.send_signal(signum)
            except ProcessLookupError:
                pass
        told.add(p.pid)

    def forward(signum: int, frame: Any) -> None:
        got.append(signum)
        if len(got) > 1:
            quit_now(signum, hint)  # which kills the workers first (second.before_quit)
        for p in procs:
            tell(p, signal.SIGTERM)
        say(f"{signal.Signals(signum).name}: each worker saves its cell at the current step and stops "
            "(again to quit at once)")

    hint = f"resume with: {resume_hint}" if resume_hint else None
    second = QuitOnSecondSignal(hint, before_quit=lambda signum: [tell(p, signal.SIGKILL) for p in procs])
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
            p = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, start_new_session=True)
            procs.append(p)
            if got and p.pid not in told:  # the signal came while it was being started
                tell(p, signal.SIGTERM)
            time.sleep(0.5)
        codes = _wait(procs, tell)
    finally:
        second.__exit__()
        restore_handlers(old)
    return codes, got[0] if got else 0
