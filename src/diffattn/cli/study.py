"""``diffattn study DATA``: the text study's command line (:mod:`diffattn.experiments.study`).

Checks the arguments and --out, plans (or re-reads the plan), runs the grid with ``--jobs`` local worker
processes or in this process (``--worker``: only work on an existing study folder), then collects
(:mod:`diffattn.experiments.study.collect`) and renders the report (:mod:`diffattn.experiments.study.study_report`).
``diffattn compare --data DATA`` (its older spelling) runs it too: :mod:`diffattn.cli.compare` adds the study's
options to its own (:func:`add_study_arguments`, hidden from its help) and hands the arguments over.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

from diffattn.attention.registry import ATTENTION
from diffattn.cli.options import int_at_least
from diffattn.experiments.study.analysis import (
    DEFAULT_LR_EXTENSIONS,
    PAPER_TOKEN_RATIO,
    default_head_dim,
    head_counts,
    token_ratio_text,
)
from diffattn.experiments.study.collect import collect
from diffattn.experiments.study.plan import format_plan, make_plan
from diffattn.experiments.study.progress import study_progress
from diffattn.experiments.study.scheduler import spawn_workers, worker_main
from diffattn.experiments.study.signals import StudyInterrupted
from diffattn.experiments.study.spec import (
    SPEC_FILE,
    STUDY_WRITES,
    TEXT_DEFAULTS,
    TEXT_QUICK,
    StudyError,
    StudySpec,
    default_lrs,
    default_sizes,
    parse_variant,
    read_spec,
)
from diffattn.experiments.study.study_report import write_report
from diffattn.fileio import EX_IOERR, LOCK_NAME, RunLock, io_error_in, io_error_line, printable
from diffattn.train.rundir import check_output_dir, lock_run_dir

DESCRIPTION = ("Train DIFF and its matched baseline (and --variants) on your text over learning rates and seeds; "
               "report the gap with a confidence interval and a verdict.")


# The timing probe's seconds of training per arm. It sizes the horizon of a --budget-minutes run; a --quick run
# ignores the budget, so its probe only feeds the printed estimate and need not cost more than the run itself.
PROBE_S, PROBE_QUICK_S = 5.0, 0.5


def _probe_seconds(args: argparse.Namespace, quick: bool) -> float:
    return args.probe_seconds if args.probe_seconds is not None else (PROBE_QUICK_S if quick else PROBE_S)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``diffattn study``'s arguments: the data, the model shape and schedule, then :func:`add_study_arguments`."""
    p.add_argument("data", nargs="?", metavar="DATA", help="text file or folder of text files (a record corpus: "
                   ".jsonl/.json/.parquet) to train on; omitted only with --worker")
    p.add_argument("--out", default=None, help="study folder (default ./reports/study-<timestamp>); re-run the "
                   "same command to resume it")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (seconds): small models, few steps")
    p.add_argument("--variants", default="", help="extra attention types to train too, comma-separated (e.g. "
                   "diff_v2,diff_distance); TYPE+option (e.g. diff+shared_qk) trains a variant of TYPE")
    for flag, key, what in (("--steps", "steps", "training steps per cell"),
                            ("--d-model", "d_model", "model width, the same for every arm"),
                            ("--n-layers", "n_layers", "transformer layers"),
                            ("--n-heads", "n_heads", "DIFF heads (baseline: 2x)"),
                            ("--seq-len", "seq_len", "training context length"),
                            ("--batch-size", "batch_size", "training sequences per step")):
        default = (_heads_by_width() if key == "n_heads"
                   else f"(default {TEXT_DEFAULTS[key]}, --quick {TEXT_QUICK[key]})")
        p.add_argument(flag, type=int_at_least(flag, 1), default=None, help=f"{what} {default}")
    p.add_argument("--lr", type=float, default=None, help="a single peak learning rate instead of the --lrs grid")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per cell (0: the cores / --jobs). "
                   "Default 1: these small models gain little from intra-op threads")
    add_study_arguments(p)


def _heads_by_width() -> str:
    """--n-heads' default as the runs get it: from the Q/K head width rule (analysis.default_head_dim)."""
    def at(d_model: int) -> str:
        w = default_head_dim(d_model)
        return f"d_model {d_model}: width {w}, DIFF {head_counts(d_model, w, 'diff')}, baseline " \
               f"{head_counts(d_model, w, 'standard')}"
    return (f"(default: set by the Q/K head width rule, see --head-dim; {at(TEXT_DEFAULTS['d_model'])}; "
            f"--quick {at(TEXT_QUICK['d_model'])})")


def add_study_arguments(p: argparse.ArgumentParser, hidden: bool = False) -> None:
    """The study's own options (``hidden``: added to ``diffattn compare``, which still accepts them with --data,
    without listing them in its help)."""
    g = _Hidden(p) if hidden else p.add_argument_group("study")
    g.add_argument("--tokenizer", choices=("char", "bpe"), default="char", help="tokenizer fitted on the data")
    g.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size")
    g.add_argument("--lrs", default=None, help="learning rates, comma-separated (default: 3, log-spaced "
                   "around 3e-3·sqrt(128/d_model))")
    g.add_argument("--seeds", type=int, default=3, help="seeds per arm and LR (paired across arms)")
    g.add_argument("--heads", default=None, help="DIFF head counts to compare, comma-separated, e.g. 4,8 (each "
                   "with its baseline at twice the heads); default --n-heads")
    g.add_argument("--budget-minutes", type=float, default=None, help="size steps per cell so the whole grid "
                   "fits this wall time (timing probe on this machine)")
    g.add_argument("--jobs", type=int, default=1, help="cells at once, as separate worker processes")
    g.add_argument("--worker", action="store_true", help="only work on the study in --out (any machine that "
                   "shares the folder); the first command writes the plan")
    g.add_argument("--storage", default=None, help="Optuna RDB URL (default: OUT/optuna.journal)")
    g.add_argument("--sizes", nargs="?", const="auto", default=None, help="size ladder: d_model values "
                   "(comma-separated; bare flag: d_model × 1/2, 1, 3/2) trained at each arm's best LR")
    g.add_argument("--grace-seconds", type=float, default=300.0, help="a RUNNING cell with no heartbeat for this "
                   "long (its worker on another machine died) is re-queued")
    g.add_argument("--progress-seconds", type=float, default=60.0, help="one progress line per cell this often")
    g.add_argument("--probe-seconds", type=float, default=None, help="timing probe: seconds of training per arm "
                   f"(default {PROBE_S:g}, --quick {PROBE_QUICK_S:g}: a smoke run's probe only sizes its estimate)")
    g.add_argument("--poll-seconds", type=float, default=5.0, help="how often an idle worker looks for work")
    g.add_argument("--verbose", action="store_true", help="print each cell's evaluation and checkpoint lines too "
                   "(default: one line per cell, and a progress bar on a terminal)")
    g.add_argument("--spawned-by", type=int, default=None, help=argparse.SUPPRESS)  # a --jobs worker's parent
    # issue 16: LR bracketing, head width, early diagnostics (one block: it moves with this parser)
    g.add_argument("--lr-extensions", type=int, default=None, metavar="K", help="when an arm's best LR is at an "
                   f"edge of its list, add the next LR beyond it (×2 or ÷2) and run it, up to K times per arm "
                   f"(default {DEFAULT_LR_EXTENSIONS}; 0: only report the edge)")
    g.add_argument("--head-dim", type=int, default=None, metavar="D", help="Q/K (sub-)head width of every arm: "
                   "the baseline gets d_model/D heads, DIFF half as many with V of width 2D (default: the DIFF "
                   "authors' advice, width >= 32 and baseline heads >= 2 where d_model allows; --heads/--n-heads "
                   "set DIFF's head count instead)")
    g.add_argument("--head-dims", default=None, help="a ladder of Q/K head widths, comma-separated (e.g. "
                   "16,32,64): each width is a head group of its own, compared within it")
    g.add_argument("--diag-early-steps", type=int, default=None, metavar="N", help="per-layer attention/residual "
                   "RMS, λ and gradient norms per parameter group every log step up to step N, in each cell's "
                   "diagnostics.csv (default: min(500, steps); 0: off)")


class _Hidden:
    """``add_argument`` with the help suppressed: the study's options as ``diffattn compare`` accepts them."""

    def __init__(self, p: argparse.ArgumentParser) -> None:
        self.p = p

    def add_argument(self, *names: str, **kw: object) -> None:
        self.p.add_argument(*names, **{**kw, "help": argparse.SUPPRESS})


def check_out(out: Path) -> None:
    """Refuse, before anything is created or computed, an --out that cannot be written or holds something else:
    a file, an unwritable place (:func:`~diffattn.train.rundir.check_output_dir`), or a non-empty folder that is
    not an experiment. An experiment's folder is fine: the command resumes it in place."""
    check_output_dir(out, overwrite=True, owned_patterns=(), what="study", resumable=False)
    if out.is_dir() and not (out / SPEC_FILE).exists() and any(p.name != LOCK_NAME for p in out.iterdir()):
        raise StudyError(f"output folder {str(out)!r} exists, is not empty and holds no experiment; "
                         "give a new --out")


def _floats(s: str, what: str) -> list[float]:
    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise StudyError(f"{what} must be comma-separated numbers, got {s!r}") from None
    if not v or any(not (x > 0 and math.isfinite(x)) for x in v):
        raise StudyError(f"{what} must be positive numbers, got {s!r}")
    return v


def spec_from_args(args: argparse.Namespace) -> StudySpec:
    base = dict(TEXT_QUICK if getattr(args, "quick", False) else TEXT_DEFAULTS)
    for k in base:
        v = getattr(args, k, None)
        if v is not None:
            base[k] = v
    data = args.data
    if data is None:
        raise StudyError("give the data to study: diffattn study DATA (a text file or folder), or --worker --out DIR")
    if not Path(data).exists():
        raise StudyError(f"data {data!r} does not exist (give a text file or a folder of text files)")
    heads = [int(x) for x in _floats(args.heads, "--heads")] if args.heads else [base["n_heads"]]
    variants = [v.strip() for v in (args.variants or "").split(",") if v.strip()]
    unknown = [v for v in variants if v.split("+")[0].strip() not in ATTENTION]
    if unknown:
        raise StudyError(f"unknown attention variant(s) {unknown}; registered: {sorted(ATTENTION)}")
    for v in variants:
        parse_variant(v)
    if any(v in ("diff", "standard") or variants.count(v) > 1 for v in variants):
        raise StudyError("variants listed twice (diff and standard are always trained)")
    head_dims = _head_dims(args, base["d_model"])
    if args.lrs:
        lrs = _floats(args.lrs, "--lrs")
    elif getattr(args, "lr", None):
        lrs = [args.lr]
    else:
        lrs = default_lrs(base["d_model"])
    if args.seeds < 1:
        raise StudyError(f"--seeds must be >= 1, got {args.seeds}")
    sizes: list[int] = []
    if args.sizes == "auto":
        sizes = default_sizes(base["d_model"], [base["d_model"] // (2 * d) for d in head_dims] or heads)
    elif args.sizes:
        sizes = sorted({int(x) for x in _floats(args.sizes, "--sizes")} | {base["d_model"]})
    if args.vocab_size is not None and args.tokenizer != "bpe":
        raise StudyError("--vocab-size applies only to --tokenizer bpe")
    spec = StudySpec(
        data=str(Path(data).resolve()), tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        d_model=base["d_model"], n_layers=base["n_layers"], heads=heads, variants=variants, lrs=lrs,
        seeds=list(range(args.seeds)), seq_len=base["seq_len"], batch_size=base["batch_size"], steps=base["steps"],
        sizes=sizes, head_dims=head_dims, **_k_and_diag(args, base["steps"]),
    )
    try:  # every arm and size must be a valid model shape
        for a in spec.arms():
            for d in [spec.d_model] + spec.ladder_sizes():
                spec.arm_config(a, 256, d)
    except ValueError as e:
        raise StudyError(str(e)) from None
    return spec


def _head_dims(args: argparse.Namespace, d_model: int) -> list[int]:
    """--head-dim / --head-dims; none of them nor --heads/--n-heads: the default width (analysis.default_head_dim)."""
    if args.head_dim is not None and args.head_dims:
        raise StudyError("give --head-dim or --head-dims, not both")
    given = [args.head_dim] if args.head_dim is not None else (
        [int(x) for x in _floats(args.head_dims, "--head-dims")] if args.head_dims else [])
    if given and (args.heads or getattr(args, "n_heads", None)):
        raise StudyError("--head-dim(s) derives the head counts: give it or --heads/--n-heads, not both")
    if not given:
        return [] if args.heads or getattr(args, "n_heads", None) else [default_head_dim(d_model)]
    if len(set(given)) != len(given):
        raise StudyError(f"--head-dims lists a width twice: {given}")
    for d in given:  # one line naming the width that does not fit
        for kind in ("diff", "standard"):
            head_counts(d_model, d, kind)
    return given


def _k_and_diag(args: argparse.Namespace, steps: int) -> dict[str, int]:
    k = DEFAULT_LR_EXTENSIONS if args.lr_extensions is None else args.lr_extensions
    diag = min(500, steps) if args.diag_early_steps is None else args.diag_early_steps
    if k < 0 or diag < 0:
        raise StudyError("--lr-extensions and --diag-early-steps must be >= 0")
    return {"lr_extensions": k, "diag_early_steps": diag}


def command_line(argv: list[str] | None, out: Path | None = None) -> str:
    """The command as typed, with ``--out OUT`` added if it was not given (OUT then held a timestamp): re-running
    exactly this resumes the experiment."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if out is not None and not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv += ["--out", str(out)]
    return shlex.join(["diffattn"] + argv)


def _interrupted(signum: int, saved: str, out: Path, spec: StudySpec, resume: str) -> int:
    """The lines printed when a signal stopped the experiment; -> the exit code (130 / 143)."""
    prog = study_progress(out, spec)
    print(f"interrupted ({signal.Signals(signum).name}): {saved}. {prog['done']} of {prog['total']} cells "
          "finished; no report written (no verdict from an incomplete grid).", file=sys.stderr)
    print(f"resume with: {resume}", file=sys.stderr, flush=True)
    return 128 + signum


def _saved(e: StudyInterrupted) -> str:
    return f"cell {e.saved[0]} saved at step {e.saved[1]}" if e.saved else "no cell was in training"


def _bar(args: argparse.Namespace) -> bool:
    """A cell's progress bar: on a terminal, unless --no-progress (spawned --jobs workers share one: none)."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def run_worker(args: argparse.Namespace, threads: int) -> int:
    """``--worker``: work on the experiment in --out until its grid is done (or a signal stops it)."""
    if not args.out:
        raise StudyError("--worker needs --out (the shared experiment folder)")
    out = Path(args.out)
    spec, plan = read_spec(out)
    spawned = getattr(args, "spawned_by", None)
    prog = study_progress(out, spec)
    if prog["done"] == prog["total"]:
        if not spawned:
            report = out / "report.md"
            print(f"{out}: the experiment is finished ({prog['done']} of {prog['total']} cells); nothing to do. "
                  + (f"Its report: {report}" if report.exists() else
                     f"Write its report with: {plan.get('command', 'the first command')}"), file=sys.stderr)
        return 0
    resume = command_line(getattr(args, "_argv", None))
    try:
        ok = worker_main(out, args.storage, threads, args.grace_seconds, poll_s=args.poll_seconds,
                         progress_s=args.progress_seconds, resume_hint=None if spawned else resume,
                         parent_pid=spawned, bar=not spawned and _bar(args), verbose=args.verbose)
    except StudyInterrupted as e:
        if spawned:  # the command that started it prints the totals and how to resume
            print(f"worker {os.getpid()}: {signal.Signals(e.signum).name}: {_saved(e)}", file=sys.stderr)
            return e.exit_code
        return _interrupted(e.signum, _saved(e), out, spec, resume)
    except Exception as e:
        if io_error_in(e) is None:
            raise
        if spawned:  # its cause; the command that started it stops the others and says how to continue
            print(io_error_line(io_error_in(e), prefix=f"error: worker {os.getpid()}: "), file=sys.stderr, flush=True)
            return EX_IOERR
        return _storage_failed(e, out, spec, resume)
    if ok and not spawned:
        print(f"{out}: the experiment is finished; the first command writes the report (re-run it if it has "
              f"ended: {plan.get('command', '')})", file=sys.stderr)
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """``diffattn study DATA ...``: check, plan, run (local jobs or this process), collect, report. The folder
    is held (a second coordinator on it is refused; ``--worker`` processes join it) from before it is read."""
    t0 = time.perf_counter()
    threads = args.threads if args.threads and args.threads > 0 else max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    lock = None
    try:
        try:
            if args.jobs < 1:
                raise StudyError(f"--jobs must be >= 1, got {args.jobs}")
            if args.budget_minutes is not None and not args.budget_minutes > 0:
                raise StudyError(f"--budget-minutes must be > 0, got {args.budget_minutes}")
            if args.worker:
                return run_worker(args, threads)
            out = Path(args.out) if args.out else Path("reports") / f"study-{datetime.now():%Y%m%d-%H%M%S}"
            lock = _hold(out) if out.is_dir() else None
            check_out(out)  # nothing is created before every input has been checked
            spec = spec_from_args(args)
            quick = bool(getattr(args, "quick", False))
            budget = args.budget_minutes
            if quick and budget is not None:  # a smoke run stays a smoke run
                print("note: --quick: --budget-minutes is ignored (fixed, tiny steps)", file=sys.stderr)
                budget = None
            resume = command_line(getattr(args, "_argv", None), out)
            spec, plan = make_plan(out, spec, budget_minutes=budget, jobs=args.jobs, threads=threads,
                                   command=resume, probe_s=_probe_seconds(args, quick), quick=quick,
                                   k_given=args.lr_extensions is not None)
            lock = lock or _hold(out)
            if getattr(args, "older_spelling", False):  # a bad input stays one line: this comes after the checks
                print("note: the study has its own command now: diffattn study DATA ... (the same options; "
                      "compare --data keeps working)", file=sys.stderr)
        except (StudyError, ValueError) as e:
            print(f"error: {printable(e)}", file=sys.stderr)
            return 2
        except OSError as e:  # writing the plan: nothing of the experiment exists yet
            print(io_error_line(e, kept="nothing (the experiment had not started)", then="run the same command "
                                "again"), file=sys.stderr)
            return EX_IOERR
        return _run_study(args, out, spec, plan, resume, threads, t0)
    finally:
        if lock is not None:
            lock.release()


def _hold(out: Path) -> RunLock:
    return lock_run_dir(out, "diffattn study",
                        hint=f"; to add workers to that study instead: diffattn study --worker --out {out}",
                        written=STUDY_WRITES)


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


def _run_study(args: argparse.Namespace, out: Path, spec: StudySpec, plan: dict, resume: str, threads: int,
               t0: float) -> int:
    """Run the grid in the held folder ``out``, collect and report; -> the exit code."""
    print(format_plan(spec, plan), file=sys.stderr, flush=True)
    print(f"      folder {out} (Ctrl-C stops and saves; re-run the same command to resume; add workers elsewhere "
          f"with `diffattn study --worker --out {out}`)", file=sys.stderr, flush=True)
    try:
        if args.jobs > 1:
            extra = ["--poll-seconds", str(args.poll_seconds), "--progress-seconds", str(args.progress_seconds),
                     "--grace-seconds", str(args.grace_seconds)] + (["--verbose"] if args.verbose else [])
            codes, signum = spawn_workers(out, args.jobs, threads, args.storage, extra, resume_hint=resume)
            if signum:
                return _interrupted(signum, "each worker saved its cell (lines above)", out, spec, resume)
            if EX_IOERR in codes:
                return _storage_failed(OSError(), out, spec, resume, who="a worker (line above) ")
        else:
            worker_main(out, args.storage, threads, args.grace_seconds, poll_s=args.poll_seconds,
                        progress_s=args.progress_seconds, resume_hint=resume, bar=_bar(args), verbose=args.verbose)
        results = collect(out, spec, plan, storage_url=args.storage)
        results["wall_time_s_this_run"] = time.perf_counter() - t0
        write_report(results, out)
    except StudyInterrupted as e:
        return _interrupted(e.signum, _saved(e), out, spec, resume)
    except (StudyError, ValueError) as e:  # e.g. the data changed since the plan was made
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if io_error_in(e) is None:
            raise
        return _storage_failed(e, out, spec, resume)
    print(f"report: {out / 'report.md'} and {out / 'report.html'}", file=sys.stderr)
    inc = results.get("incomplete")
    if inc:
        print(f"incomplete: {inc['finished']} of {inc['total']} cells — no {inc['withheld']} (cells failed; "
              f"re-run to retry them: {plan.get('command') or resume})", file=sys.stderr)
        return 1
    v = results.get("verdict") or {}
    ci, diff = v.get("ci95") or [None, None], v.get("diff_minus_baseline")
    smoke = " (--quick smoke run: not evidence)" if plan.get("quick") else ""
    if diff is not None and None not in ci:
        print(f"verdict: DIFF − baseline = {diff:+.4f} nats/token, 95% CI "
              f"[{ci[0]:+.4f}, {ci[1]:+.4f}]: {v['conclusion']}{smoke}")
    elif v.get("conclusion"):  # e.g. one seed: no interval can be computed
        print(f"verdict: {v['conclusion']}{smoke}")
    if (results.get("depth") or {}).get("barely"):
        d = results["depth"]
        print(f"note: barely trained: the best arm is only {max(a['gain_nats'] for a in d['arms'].values()):.3f} "
              f"nats/token below the unigram floor ({d['unigram_nats']:.3f}); this budget says little about DIFF "
              "(more steps: --budget-minutes or --steps)")
    for note in v.get("unbracketed") or []:
        print(f"note: {note}")
    if v.get("token_ratio"):
        print(f"token ratio: {token_ratio_text(v['token_ratio'])} (paper: ~{PAPER_TOKEN_RATIO:.0%})")
    return 0
