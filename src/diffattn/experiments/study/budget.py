"""The plan of a ``diffattn study``: the timing probe, the steps per cell that fit ``--budget-minutes``
(:func:`plan_steps`, with the LR-extension rounds it may need), the wall-time estimate, and :func:`make_plan`,
which checks everything and then creates OUT with ``tokenizer.json`` and ``study.json``."""

from __future__ import annotations

import bisect
import json
import math
import multiprocessing
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffattn.checkpoint.output_guard import first_missing
from diffattn.configs.run_config import TrainConfig
from diffattn.eval.format import count
from diffattn.experiments.findings import analysis
from diffattn.experiments.study.cell import MAX_VAL_TOKENS, prepare_data
from diffattn.experiments.study.spec import (
    SPEC_FILE,
    StudyError,
    StudySpec,
    write_spec,
)
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import atomic_write
from diffattn.system.child_process import die_with_parent
from diffattn.system.io_errors import WRITE_FAILURES
from diffattn.train.optim import make_optimizer
from diffattn.train.signals import QuitOnSecondSignal
from diffattn.train.step import TrainStep
from diffattn.train.task import LMTask


def makespan(costs: list[float], jobs: int) -> float:
    """Wall time of running cells of these costs on ``jobs`` workers that each take the next cell when free
    (longest first, as a good greedy schedule; the real order is random, so this is a slight underestimate)."""
    loads = [0.0] * max(1, jobs)
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads)


def plan_steps(cells: list[tuple[float, ...]], budget_s: float, jobs: int, min_steps: int = 10,
               rounds: list[list[tuple[float, ...]]] = (), passes: Callable[[int], int] | None = None) -> int:
    """Largest steps per cell (at least ``min_steps``) whose estimated wall time (:func:`estimate_s`: the grid's
    ``cells``, then each of ``rounds`` of LR extensions after it) fits ``budget_s``; the estimate grows with the
    steps, so a doubling search then a bisection find it."""

    def est(steps: int) -> float:
        return estimate_s(cells, rounds, steps, jobs, passes)

    if est(min_steps) > budget_s:
        return min_steps
    hi = min_steps
    while est(hi * 2) <= budget_s:
        hi *= 2
    return hi - 1 + bisect.bisect_right(range(hi, 2 * hi), budget_s, key=est)  # the last that fits, in [hi, 2·hi)


def estimate_s(cells: list[tuple[float, ...]], rounds: list[list[tuple[float, ...]]], steps: int,
               jobs: int, passes: Callable[[int], int] | None = None) -> float:
    """Wall time of ``cells`` then each of ``rounds`` in turn, ``steps`` per cell: the :func:`makespan` of
    steps · step + fixed + passes(steps) · forward per cell, where a cell is (seconds per training step, fixed
    seconds: the final validation pass and start-up[, seconds per evaluation batch's forward pass]) and
    ``passes(steps)`` the forward passes of its evaluations (:meth:`StudySpec.eval_passes`)."""
    n = passes(steps) if passes is not None else 0
    return sum(makespan([steps * c[0] + c[1] + n * (c[2] if len(c) > 2 else 0.0) for c in stage], jobs)
               for stage in [cells, *rounds] if stage)


def extension_costs(spec: StudySpec, timing: dict[str, dict[str, float]],
                    val_tokens: int | None = None) -> list[list[tuple[float, float, float]]]:
    """(step seconds, fixed seconds, forward seconds) of the LR-extension cells the study may need, per round,
    at the most: every arm extends in each of its ``lr_extensions`` rounds (a single-LR arm by two LRs in its
    first), as :func:`analysis.max_extension_cells` counts them."""
    per_arm = {name.split("@")[0]: (st, fixed, fwd)
               for st, fixed, fwd, name in cell_costs(spec, timing, val_tokens, False)}
    single = len(set(spec.lrs)) == 1
    return [[per_arm[a.name] for a in spec.arms()
             for _ in range((2 if single and r == 0 else 1) * len(spec.seeds))]
            for r in range(spec.lr_extensions)]


def cell_costs(spec: StudySpec, timing: dict[str, dict[str, float]], val_tokens: int | None = None,
               ladder: bool = True) -> list[tuple[float, float, float, str]]:
    """(step seconds, fixed seconds, seconds per evaluation forward pass, cell name) for every cell of the grid
    (and the ladder), from a timing probe ``timing[f"{arm}@{d_model}"] = {"step": s, "fwd": s}``. The fixed
    part is the final validation pass and the start; the evaluations depend on the steps
    (:meth:`StudySpec.eval_passes`)."""
    n_val_fwd = _val_batches(spec, val_tokens) * 32 // spec.train.batch_size
    out = []
    for a in spec.arms():
        for d in [spec.model.d_model] + (spec.ladder_sizes() if ladder else []):
            t = timing[f"{a.name}@{d}"]
            n = len(spec.lrs) * len(spec.seeds) if d == spec.model.d_model else len(spec.seeds)
            out += [(t["step"], n_val_fwd * t["fwd"] + t.get("start", 1.0), t["fwd"], f"{a.name}@{d}")] * n
    return out


def _val_batches(spec: StudySpec, val_tokens: int | None = None) -> int:
    cap = spec.val_tokens or MAX_VAL_TOKENS
    v = cap if val_tokens is None else min(val_tokens, cap)
    return max(1, math.ceil(v / spec.train.seq_len / 32))


def _probe_init(parent_pid: int) -> None:
    # A Ctrl-C at the terminal reaches the probe processes too: only the command itself handles it. And they
    # end with the command, even one killed with kill -9 (else they, and multiprocessing's resource tracker
    # that waits for them, would run on for good).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)


def _probe_ready(_: int) -> None:
    time.sleep(0.5)  # long enough that every pool process gets one: all have imported torch before timing


def _probe_cell(cfg: dict, tokens: np.ndarray, seq_len: int, batch_size: int, threads: int, seconds: float,
                min_steps: int, seed: int) -> tuple[float, float]:
    """In a probe process: -> (seconds per training step after a warm-up step, seconds per forward pass of an
    evaluation batch) of a model of config ``cfg`` on windows of ``tokens``. The step is the training loop's
    own (:class:`~diffattn.train.step.TrainStep`: lr, loss, backward, clipping, optimizer), as a cell runs it."""
    torch.set_num_threads(max(1, threads))
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig.from_dict(cfg))
    train_cfg = TrainConfig(lr=1e-3, batch_size=batch_size, seq_len=seq_len)
    train_step = TrainStep(LMTask(None), model, make_optimizer(model, train_cfg), train_cfg)
    g = torch.Generator().manual_seed(seed)
    t = torch.from_numpy(np.asarray(tokens, dtype=np.int64))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(len(t) - seq_len - 1, (batch_size,), generator=g)
        w = torch.stack([t[j:j + seq_len + 1] for j in i.tolist()])
        return w[:, :-1], w[:, 1:]

    n, t0 = -1, 0.0
    while n < min_steps or time.perf_counter() - t0 < seconds:
        if n == 0:
            t0 = time.perf_counter()  # after the warm-up step
        train_step(n + 1, batch())
        n += 1
    step = (time.perf_counter() - t0) / n
    x, _ = batch()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(x)
    return step, time.perf_counter() - t0


def probe_timing(spec: StudySpec, source: Any, threads: int, jobs: int = 1, seconds: float = 5.0,
                 min_steps: int = 3) -> dict[str, dict[str, float]]:
    """Seconds per training step and per evaluation batch for every arm and ladder size, measured here as the
    grid will run: ``jobs`` separate processes training at once, each for at least ``seconds`` after a
    warm-up step. (A few steps of one process alone overstated the speed 3× on a busy machine, where each job
    gets only its share of the cores; threads in one process understated it 2-3× on an idle one, where the
    GIL serialises the Python overhead of small models.)"""
    jobs = max(1, jobs)
    a0, b0 = source.splits["train"]
    tokens = np.asarray(source.tokens[a0:min(b0, a0 + 200_000)], dtype=np.int64)  # enough to draw batches
    out: dict[str, dict[str, float]] = {}
    ex = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_probe_init,
                             initargs=(os.getpid(),))
    with QuitOnSecondSignal(before_quit=lambda _: _kill_probes(ex)):
        try:
            # The processes start here, with SIGINT blocked (the mask survives exec): a Ctrl-C at the terminal
            # reaches them too, and one still importing torch would print a KeyboardInterrupt traceback.
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                ready = ex.map(_probe_ready, range(jobs))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
            list(ready)
            for a in spec.arms():
                for d in [spec.model.d_model] + spec.ladder_sizes():
                    cfg = spec.arm_config(a, source.vocab_size, d).to_dict()
                    res = [f.result() for f in [ex.submit(_probe_cell, cfg, tokens, spec.train.seq_len,
                                                          spec.train.batch_size, threads, seconds, min_steps, i)
                                                for i in range(jobs)]]
                    out[f"{a.name}@{d}"] = {"step": float(np.mean([r[0] for r in res])),
                                            "fwd": float(np.mean([r[1] for r in res])), "start": 1.0, "jobs": jobs}
        except BaseException:
            _kill_probes(ex)  # a Ctrl-C: nothing of theirs is worth waiting for
            raise
    ex.shutdown()
    return out


def _kill_probes(ex: ProcessPoolExecutor) -> None:
    """End the probe's processes now. Waiting for them (the executor's shutdown) had no bound: one still starting
    (importing torch, a minute and more on a loaded machine) has not armed its death signal yet, and lived on
    after the command, holding its output open (issue 39: two Ctrl-C while the study planned took 90 s)."""
    for p in multiprocessing.active_children():  # the probe's are this process's only ones
        p.kill()
    ex.shutdown(wait=False, cancel_futures=True)


def machine() -> str:
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        cpu = ""
    return f"{socket.gethostname()}: {os.cpu_count()} CPU cores {cpu}, torch {torch.__version__}".strip()


def format_plan(spec: StudySpec, plan: dict) -> str:
    n_grid = len(spec.arms()) * len(spec.lrs) * len(spec.seeds)
    n_ladder = len(spec.arms()) * len(spec.ladder_sizes()) * len(spec.seeds)
    tok = spec.train.steps * spec.train.batch_size * spec.train.seq_len
    n_ext = analysis.max_extension_cells({a.name: spec.lrs for a in spec.arms()}, len(spec.seeds),
                                         spec.lr_extensions)
    lines = [
        f"plan: {count(n_grid, 'cell')} = {count(len(spec.arms()), 'arm')} "
        f"({', '.join(a.name for a in spec.arms())}) × {count(len(spec.lrs), 'LR')} "
        f"({', '.join(f'{x:g}' for x in spec.lrs)}) × {count(len(spec.seeds), 'seed')}"
        + (f", + {n_ladder} ladder cells (d_model {', '.join(map(str, spec.ladder_sizes()))})" if n_ladder else ""),
        (f"      + up to {n_ext} LR-extension cells: an arm whose best LR is at an edge of its list gets the next "
         f"LR beyond it (×2 or ÷2), up to {count(spec.lr_extensions, 'time')} (--lr-extensions); counted in the "
         "estimate"
         if n_ext else "      no LR extensions (--lr-extensions 0): an edge best LR is only reported"),
        f"      Q/K head width {spec.head_dim if spec.head_dim else 'per group'}: "
        + ", ".join(f"{a.name} {count(a.n_heads, 'head')}" for a in spec.arms()),
        f"      {count(spec.train.steps, 'step')} per cell × batch {spec.train.batch_size} × {spec.train.seq_len} "
        "tokens = "
        f"{tok:,} tokens per cell, {tok * (n_grid + n_ladder):,} in all (before LR extensions)",
    ]
    if plan.get("estimate_s") is not None:
        total = plan["estimate_s"] + plan.get("overhead_s", 0.0)
        lines.append(f"      estimated wall time {total / 60:.1f} min with {count(plan['jobs'], 'job')} (cells "
                     f"{plan['estimate_s'] / 60:.1f} min, planning and report {plan.get('overhead_s', 0.0):.0f} s"
                     + (f"; {plan['estimate_without_lr_extensions_s'] / 60:.1f} min if no LR extension is needed"
                        if plan.get("estimate_without_lr_extensions_s") is not None and n_ext else "") + ")"
                     + (f", within the budget of {plan['budget_minutes']:g} min" if plan.get("budget_minutes")
                        else ""))
    return "\n".join(lines)


# Seconds a budget must leave for what is not a cell: the end of the command (collect the results, draw the
# plots, write the report) and, with --jobs > 1, starting each worker process (importing torch, reading data).
REPORT_S = 10.0
WORKER_START_S = 5.0


def make_plan(out: Path, spec: StudySpec, *, budget_minutes: float | None, jobs: int, threads: int,
              command: str, probe_s: float = 5.0, quick: bool = False, k_given: bool = True,
              storage: Callable[[], Any] | None = None) -> tuple[StudySpec, dict]:
    """Size the horizon (``--budget-minutes``: timing probe + :func:`plan_steps`) and write study.json.

    Everything is checked before anything is created: the data, the timing probe and whether the budget can be
    met (:class:`StudyError` naming the smallest budget that can). Only then OUT is created, with tokenizer.json,
    the study's database (``storage()``: its tables exist before a worker can start, as two creating them at once
    collide) and study.json; if that fails, the folders it made are removed."""
    t_start = time.perf_counter()
    if (out / SPEC_FILE).exists():
        return write_spec(out, spec, {}, steps_given=budget_minutes is None, k_given=k_given)
    if probe_s <= 0 and budget_minutes is not None:
        raise StudyError("--budget-minutes needs the timing probe (--probe-seconds > 0)")
    source, tok = prepare_data(spec)
    timing = probe_timing(spec, source, threads, jobs, probe_s) if probe_s > 0 else {}
    val_tokens = source.split_size("val")
    now = datetime.now(timezone.utc)
    plan: dict[str, Any] = {
        "study_name": f"study-{now:%Y%m%d-%H%M%S}-{os.getpid()}", "jobs": jobs, "threads_per_job": threads,
        "timing_probe": timing, "machine": machine(), "command": command, "budget_minutes": budget_minutes,
        "quick": quick, "created": now.isoformat(timespec="seconds"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None, "estimate_s": None}
    if timing:
        costs = [(s, f, fwd) for s, f, fwd, _ in cell_costs(spec, timing, val_tokens)]
        rounds = extension_costs(spec, timing, val_tokens)
        # What the budget pays for besides the cells: the planning so far (data, probe), the report, workers.
        overhead = time.perf_counter() - t_start + REPORT_S + (WORKER_START_S + 0.5 * jobs if jobs > 1 else 0.0)
        plan["overhead_s"] = overhead
        if budget_minutes is not None:
            steps = _budget_steps(costs, budget_minutes, jobs, overhead, rounds, spec.eval_passes)
            spec = spec.with_steps(steps)
        plan["estimate_s"] = estimate_s(costs, rounds, spec.train.steps, jobs, spec.eval_passes)
        plan["estimate_without_lr_extensions_s"] = estimate_s(costs, [], spec.train.steps, jobs, spec.eval_passes)
    created = _create_folder(out)
    try:
        atomic_write(out / "tokenizer.json", json.dumps(tok.to_dict()))
        if storage is not None:
            storage()
        return write_spec(out, spec, plan)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


MIN_STEPS = 10


def _budget_steps(costs: list[tuple[float, ...]], budget_minutes: float, jobs: int, overhead_s: float,
                  rounds: list[list[tuple[float, ...]]] = (), passes: Callable[[int], int] | None = None) -> int:
    """Steps per cell for the budget, or StudyError naming the smallest budget that fits (MIN_STEPS per cell).
    ``rounds``: the LR-extension cells it may need (:func:`extension_costs`), budgeted at their most."""
    cells_s = budget_minutes * 60 - overhead_s
    least = estimate_s(costs, rounds, MIN_STEPS, jobs, passes)
    if least > cells_s:
        need = math.ceil((least + overhead_s) / 6) / 10  # minutes, rounded up to 0.1
        raise StudyError(
            f"--budget-minutes {budget_minutes:g} cannot be met: even {MIN_STEPS} steps per cell need about "
            f"{need:g} min for {len(costs)} cells (+ up to {sum(map(len, rounds))} LR-extension cells) "
            f"with {jobs} job(s) on this machine (timing probe, report and "
            f"start-up included); the smallest budget that fits is --budget-minutes {need:g} (or train fewer "
            "cells: --lrs, --seeds, --variants, --sizes, --lr-extensions; or more --jobs on a machine with the "
            "cores)")
    return plan_steps(costs, cells_s, jobs, MIN_STEPS, rounds, passes)


def _create_folder(out: Path) -> Path | None:
    """mkdir -p OUT; -> the topmost folder it created (None: OUT existed). An OSError becomes one line."""
    created = first_missing(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in WRITE_FAILURES:
            raise  # a full or failing disk: the command's storage-failure line (exit 74)
        raise StudyError(f"cannot create the output folder {str(out)!r}: {e.strerror or e}") from None
    return created
