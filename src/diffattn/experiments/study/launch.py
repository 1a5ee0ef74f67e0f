"""What ``diffattn study`` does once its arguments are parsed: the folder held (a second coordinator is refused;
``--worker`` processes join it) and checked, the plan, the grid (``--jobs`` worker processes or this process), the
report and the verdict; and ``--worker`` (:func:`run_worker`). A stop (Ctrl-C, SIGTERM) saves the cell in
training and prints the command that resumes; a storage failure names what was kept. Exit codes as the run
driver's: 2 bad input, 74 storage, 130 / 143 a stop; 1 an incomplete grid."""

from __future__ import annotations

import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from diffattn.checkpoint.output_guard import OutputError
from diffattn.experiments.experiment_folder import ExperimentFolder, default_out, resume_command
from diffattn.experiments.findings.report import write_report
from diffattn.experiments.findings.report_text import verdict_lines
from diffattn.experiments.study.budget import format_plan, make_plan
from diffattn.experiments.study.cell import load_data
from diffattn.experiments.study.collect import collect, study_progress
from diffattn.experiments.study.defaults import GRACE_S, PROBE_QUICK_S, PROBE_S
from diffattn.experiments.study.optuna_log import shown_url, storage_open
from diffattn.experiments.study.retrofit_measures import retrofit_results
from diffattn.experiments.study.spec import SPEC_FILE, STUDY_WRITES, StudyError, StudySpec, read_spec
from diffattn.experiments.study.worker_signals import StudyInterrupted
from diffattn.experiments.study.workers import spawn_workers, worker_main
from diffattn.system.atomic_files import printable
from diffattn.system.io_errors import EX_IOERR, io_error_in, io_error_line
from diffattn.train.driver import EXIT_USAGE


@dataclass
class StudyRun:
    """How a study runs (what it studies is its :class:`StudySpec`): the folder (None: ``reports/study-<ts>``),
    the local worker processes and threads per cell (0: the cores / jobs), Optuna's storage, the budget and the
    timing probe, the cadence of the workers, and what the command line was (``argv``: the line that resumes
    repeats it)."""

    out: Path | None = None
    jobs: int = 1
    threads: int = 1
    storage: str | None = None
    budget_minutes: float | None = None
    probe_seconds: float | None = None
    quick: bool = False
    lr_extensions_given: bool = False
    grace_s: float = GRACE_S
    poll_s: float = 5.0
    progress_s: float = 60.0
    verbose: bool = False
    bar: bool = False
    spawned_by: int | None = None
    argv: list[str] | None = None

    @property
    def cell_threads(self) -> int:
        return self.threads if self.threads and self.threads > 0 else max(1, (os.cpu_count() or 1) // max(1, self.jobs))

    def probe_s(self) -> float:
        """The timing probe's seconds per arm (a --quick run's probe only sizes its estimate)."""
        return self.probe_seconds if self.probe_seconds is not None else (PROBE_QUICK_S if self.quick else PROBE_S)


def launch(opts: StudyRun, make_spec: Callable[[], StudySpec]) -> int:
    """``diffattn study DATA ...``: check, plan, run (local jobs or this process), collect, report; -> the exit
    code. ``make_spec`` builds the spec (raising StudyError for a bad option) once the folder is held and
    checked: nothing is created before every input has been checked."""
    t0 = time.perf_counter()
    try:
        _check_run(opts)
    except StudyError as e:
        return _usage(e)
    out = Path(opts.out) if opts.out else default_out("study")
    hint = f"; to add workers to that study instead: diffattn study --worker --out {out}"
    with ExitStack() as stack:
        try:
            folder = stack.enter_context(ExperimentFolder(out, "diffattn study", hint=hint, written=STUDY_WRITES))
            folder.check_study(SPEC_FILE)
            spec = make_spec()
            budget = opts.budget_minutes
            if opts.quick and budget is not None:  # a smoke run stays a smoke run
                print("note: --quick: --budget-minutes is ignored (fixed, tiny steps)", file=sys.stderr)
                budget = None
            resume = resume_command(shown_argv(opts.argv if opts.argv is not None else sys.argv[1:], opts.storage), out)
            if opts.storage:  # a URL that cannot be opened is refused before the plan's minutes
                _open_once(out, opts)
            spec, plan = make_plan(out, spec, budget_minutes=budget, jobs=opts.jobs, threads=opts.cell_threads,
                                   command=resume, probe_s=opts.probe_s(), quick=opts.quick,
                                   k_given=opts.lr_extensions_given, storage=lambda: _open_once(out, opts))
            folder.claim()  # the plan made the folder: held from now on
        except (StudyError, OutputError, ValueError) as e:
            return _usage(e)
        except OSError as e:  # writing the plan: nothing of the experiment exists yet
            print(io_error_line(e, kept="nothing (the experiment had not started)", then="run the same command "
                                "again"), file=sys.stderr)
            return EX_IOERR
        return _run_study(opts, out, spec, plan, resume, t0)


def shown_argv(argv: list[str], url: str | None) -> list[str]:
    """The command line as typed with the password of its ``--storage`` URL ``url`` masked
    (``postgresql://u:***@h/db``), however the option was spelled (``--storage URL``, ``--storage=URL``, an
    abbreviation): what the study prints as the command that resumes it and records in study.json, results.json and
    the report. The password is never printed or written: give it again, or through libpq's ``PGPASSWORD``."""
    return [a.replace(url, shown_url(url)) for a in argv] if url else list(argv)


def _usage(e: Exception) -> int:
    """A bad input: its one line, exit 2."""
    print(f"error: {printable(e)}", file=sys.stderr)
    return EXIT_USAGE


def _open_once(out: Path, opts: StudyRun) -> None:
    """Open the study's database and close it: its tables made, or the URL refused (StudyError)."""
    with storage_open(out, opts.storage, opts.grace_s):
        pass


def _check_run(opts: StudyRun) -> None:
    if opts.jobs < 1:
        raise StudyError(f"--jobs must be >= 1, got {opts.jobs}")
    if opts.budget_minutes is not None and not opts.budget_minutes > 0:
        raise StudyError(f"--budget-minutes must be > 0, got {opts.budget_minutes}")
    if not 0 < opts.grace_s < math.inf:
        raise StudyError(f"--grace-seconds must be > 0, got {opts.grace_s}")


def run_worker(opts: StudyRun) -> int:
    """``--worker``: work on the experiment in ``opts.out`` until its grid is done (or a signal stops it)."""
    try:
        _check_run(opts)
        if not opts.out:
            raise StudyError("--worker needs --out (the shared experiment folder)")
        out = Path(opts.out)
        spec, plan = read_spec(out)
    except (StudyError, ValueError) as e:
        return _usage(e)
    spawned = opts.spawned_by
    prog = study_progress(out, spec)
    if prog["done"] == prog["total"]:
        if not spawned:
            report = out / "report.md"
            print(f"{out}: the experiment is finished ({prog['done']} of {prog['total']} cells); nothing to do. "
                  + (f"Its report: {report}" if report.exists() else
                     f"Write its report with: {plan.get('command', 'the first command')}"), file=sys.stderr)
        return 0
    argv = shown_argv(opts.argv if opts.argv is not None else sys.argv[1:], opts.storage)
    resume = resume_command(argv, out, out_given=True)
    try:
        ok = worker_main(out, opts.storage, opts.cell_threads, opts.grace_s, poll_s=opts.poll_s,
                         progress_s=opts.progress_s, resume_hint=None if spawned else resume, parent_pid=spawned,
                         bar=not spawned and opts.bar, verbose=opts.verbose)
    except Exception as e:  # e.g. its --storage cannot be opened, a signal, a full disk
        return _ended(e, out, spec, resume, worker=f"worker {os.getpid()}: " if spawned else "")
    if ok and not spawned:
        print(f"{out}: the experiment is finished; the first command writes the report (re-run it if it has "
              f"ended: {plan.get('command', '')})", file=sys.stderr)
    return 0 if ok else 1


def _ended(e: Exception, out: Path, spec: StudySpec, resume: str, worker: str = "") -> int:
    """How a signal (StudyInterrupted), a bad input or a storage failure ends the experiment: its lines, its exit
    code; anything else is raised again. A spawned ``worker`` says only its own part: the command that started it
    prints the totals and how to continue (and stops the other workers on a storage failure)."""
    if isinstance(e, StudyInterrupted):
        if worker:
            print(f"{worker}{e}", file=sys.stderr)
            return e.exit_code
        return _interrupted(e.signum, e.where, out, spec, resume)
    if isinstance(e, (StudyError, ValueError)):  # e.g. the data changed since the plan was made
        return _usage(e)
    if io_error_in(e) is None:
        raise e
    if worker:
        print(io_error_line(io_error_in(e), prefix=f"error: {worker}"), file=sys.stderr, flush=True)
        return EX_IOERR
    return _storage_failed(e, out, spec, resume)


def _interrupted(signum: int, saved: str, out: Path, spec: StudySpec, resume: str) -> int:
    """The lines printed when a signal stopped the experiment; -> the exit code (130 / 143)."""
    prog = study_progress(out, spec)
    print(f"interrupted ({signal.Signals(signum).name}): {saved}. {prog['done']} of {prog['total']} cells "
          "finished; no report written (no verdict from an incomplete grid).", file=sys.stderr)
    print(f"resume with: {resume}", file=sys.stderr, flush=True)
    return 128 + signum


def _storage_failed(e: BaseException, out: Path, spec: StudySpec, resume: str, who: str = "") -> int:
    """A storage failure (a full disk) stopped the experiment: one line, exit 74."""
    prog = study_progress(out, spec)
    kept = (f"{prog['done']} of {prog['total']} cells finished (each in {out / 'cells'}; a cell in training resumes "
            "from its last checkpoint)")
    err = io_error_in(e)
    line = (io_error_line(err, kept=kept, then=resume) if err is not None
            else f"error: {who}stopped on a storage failure; kept: {kept}; to continue: fix it, then run: {resume}")
    print(line, file=sys.stderr, flush=True)
    return EX_IOERR


def _run_study(opts: StudyRun, out: Path, spec: StudySpec, plan: dict, resume: str, t0: float) -> int:
    """Run the grid in the held folder ``out``, collect and report; -> the exit code."""
    print(format_plan(spec, plan), file=sys.stderr, flush=True)
    join = f"`diffattn study --worker --out {out}" + (
        f" --storage {shlex.quote(shown_url(opts.storage))}` on any machine that shares the folder" if opts.storage
        else "` on this machine (on others: --storage postgresql://... from the start)")
    print(f"      folder {out} (Ctrl-C stops and saves; re-run the same command to resume; add workers with {join})",
          file=sys.stderr, flush=True)
    threads = opts.cell_threads
    try:
        if opts.jobs > 1:
            extra = ["--poll-seconds", str(opts.poll_s), "--progress-seconds", str(opts.progress_s),
                     "--grace-seconds", str(opts.grace_s)] + (["--verbose"] if opts.verbose else [])
            codes, signum = spawn_workers(out, opts.jobs, threads, opts.storage, extra, resume_hint=resume)
            if signum:
                return _interrupted(signum, "each worker saved its cell (lines above)", out, spec, resume)
            if EX_IOERR in codes:
                return _storage_failed(OSError(), out, spec, resume, who="a worker (line above) ")
        else:
            worker_main(out, opts.storage, threads, opts.grace_s, poll_s=opts.poll_s, progress_s=opts.progress_s,
                        resume_hint=resume, bar=opts.bar, verbose=opts.verbose)
        results = collect(out, spec, plan, storage_url=opts.storage)
        if spec.source and not results.get("incomplete"):  # --from: the retrofit verdict and its measures
            print("measuring each arm's final models (outliers, quantized attention)...", file=sys.stderr, flush=True)
            results["retrofit"] = retrofit_results(out, spec, results, load_data(out, spec)[0])
        results["wall_time_s_this_run"] = time.perf_counter() - t0
        write_report(results, out)
    except Exception as e:
        return _ended(e, out, spec, resume)
    print(f"report: {out / 'report.md'} and {out / 'report.html'}", file=sys.stderr)
    return _verdict(results, plan, resume)


def _verdict(results: dict, plan: dict, resume: str) -> int:
    """The study's last lines: the verdict in words (stdout); -> 1 for an incomplete grid."""
    inc = results.get("incomplete")
    if inc:
        print(f"incomplete: {inc['finished']} of {inc['total']} cells — no {inc['withheld']} (cells failed; "
              f"re-run to retry them: {plan.get('command') or resume})", file=sys.stderr)
        return 1
    for line in verdict_lines(results, smoke=bool(plan.get("quick"))):
        print(line)
    return 0
