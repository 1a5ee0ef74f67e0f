"""Train DIFF and its parameter-matched baseline on a built-in retrieval task, evaluate both, write a report.

``diffattn compare``: the command line of :mod:`diffattn.experiments.needle`. The study on a user's text has its
own command, ``diffattn study DATA`` (:mod:`diffattn.cli.study`); ``compare --data DATA``, its older spelling,
still runs it (with a one-line pointer). It writes ``report.md``,
``summary.md``, ``report.html``, PNG plots, ``results.json``, ``config.json`` and ``command.txt`` to
``./reports/compare-<timestamp>`` (or ``--out``). Every input and --out are checked before anything is created
(:mod:`diffattn.train.rundir`). Ctrl-C or SIGTERM saves the model in training and prints the command that
continues (the same command, with ``--out`` named); rerunning it reuses the finished models and resumes the
interrupted one, so the report matches an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime
from pathlib import Path

import torch

from diffattn.cli import study
from diffattn.cli.options import int_at_least
from diffattn.experiments.needle.run import CompareInterrupted, run_compare
from diffattn.experiments.needle.settings import DEFAULTS, QUICK, check_variants, command_line
from diffattn.experiments.study.spec import TEXT_DEFAULTS, TEXT_QUICK
from diffattn.fileio import EX_IOERR, RunLock, atomic_write, io_error_in, io_error_line, open_nofollow, printable
from diffattn.train.rundir import (
    COMPARE_OUTPUTS,
    OutputError,
    check_output_dir,
    claim_run_dir,
    first_missing,
    lock_run_dir,
    release_run_dir,
)
from diffattn.train.signals import QuitOnSecondSignal, Terminated, sigterm_raises
from diffattn.train.state import NonFiniteLossError


def _positive_int(name: str):
    return int_at_least(name, 1)


def _default(key: str) -> str:
    """The help's default of a setting the needle job and the --data experiment both have (they differ)."""
    return (f"default {DEFAULTS[key]:g}, --quick {QUICK[key]:g}; with --data {TEXT_DEFAULTS[key]:g}, "
            f"--quick {TEXT_QUICK[key]:g}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The needle job's arguments; then ``--data`` and the study's options, which ``diffattn study`` has now (still
    accepted here, not listed in the help)."""
    p.add_argument(
        "--variants",
        default="",
        help="extra attention types to train too, comma-separated "
        "(e.g. diff_v2,diff_distance); must be registered. TYPE+shared_qk (e.g. diff+shared_qk) trains TYPE "
        "with K from the query projection (symmetric QKᵀ)",
    )
    p.add_argument(
        "--steps",
        type=_positive_int("--steps"),
        default=None,
        help=f"training steps per model (default {DEFAULTS['steps']}, --quick {QUICK['steps']})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for initialization, data and evaluation sets")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (seconds): small models, few steps")
    p.add_argument(
        "--data",
        default=None,
        help="text file or folder: run the study on it instead (now its own command: diffattn study DATA)",
    )
    p.add_argument("--out", default=None, help="report folder (default ./reports/compare-<timestamp>)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in --out, replacing the run there (default: refuse a finished run; an "
                   "unfinished one with the same settings continues)")
    p.add_argument("--seq-len", type=_positive_int("--seq-len"), default=None, help="training context length")
    p.add_argument("--d-model", type=_positive_int("--d-model"), default=None,
                   help=f"model width, the same for every model ({_default('d_model')})")
    p.add_argument("--n-layers", type=_positive_int("--n-layers"), default=None,
                   help=f"transformer layers per model ({_default('n_layers')})")
    p.add_argument(
        "--n-heads", type=_positive_int("--n-heads"), default=None, help="DIFF heads (baseline: 2x)"
    )
    p.add_argument("--batch-size", type=_positive_int("--batch-size"), default=None,
                   help=f"training sequences per step ({_default('batch_size')})")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate: warmup, then cosine decay to lr/10 (default {DEFAULTS['lr']:g}); "
                   "with --data, a single LR instead of the --lrs grid")
    p.add_argument(
        "--samples",
        type=_positive_int("--samples"),
        default=None,
        help="evaluation sequences per (depth, length) cell",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for this run (0: torch's default). Default 1: these small models gain "
        "little from intra-op threads, and on busy cores extra threads slowed training several-fold",
    )
    study.add_study_arguments(p, hidden=True)


def resolve(args: argparse.Namespace) -> dict:
    """The full settings of the run: defaults (or --quick) overridden by explicit arguments."""
    base = dict(QUICK if args.quick else DEFAULTS)
    for k in base:
        v = getattr(args, k, None)
        if v is not None:
            base[k] = v
    if not base["lr"] > 0:
        raise ValueError(f"--lr must be > 0, got {base['lr']}")
    variants = [v.strip() for v in (args.variants or "").split(",") if v.strip()]
    base.update(
        seed=args.seed,
        quick=bool(args.quick),
        variants=variants,
        data=args.data,
        threads=getattr(args, "threads", 1),
    )
    return base


def continue_command(args: argparse.Namespace, s: dict, out: Path) -> str:
    """The command that continues this run: the user's own command line (``args._argv``, set by the CLI) with
    ``--out`` added when it was not given (the default folder name has a timestamp) and ``--overwrite``
    dropped (it would start over); in-process callers get the run's full command line instead."""
    argv = getattr(args, "_argv", None)
    if argv is None:
        return command_line(s, out)
    kept = [a for a in argv if not (a.startswith("--ov") and "--overwrite".startswith(a))]
    if args.out is None:
        kept += ["--out", str(out)]
    return shlex.join(["diffattn", *kept])


# ------------------------------------------------------------------------------------------------ --out
def _settings_record(s: dict) -> dict:
    return json.loads(json.dumps(s))  # tuples as lists: what config.json holds


def check_out(out: Path, s: dict, overwrite: bool) -> str:
    """Decide what to do with ``out`` before anything is written (:func:`~diffattn.train.rundir.check_output_dir`:
    a file, an unwritable place or another finished run is refused): "new" (empty or missing, or replaced with
    ``overwrite``), "resume" (an unfinished run of the same settings) or "finished" (this run, done: nothing to
    do, as ``compare --data`` says of a finished experiment). Raises :class:`OutputError` for a run with other
    settings too."""
    old = check_output_dir(out, overwrite=True, owned_patterns=COMPARE_OUTPUTS, what="compare", resumable=False)
    if not old or overwrite:
        return "new"
    try:
        with open_nofollow(out / "config.json") as f:
            recorded = json.loads(f.read())["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    if not isinstance(recorded, dict):  # not a run we can identify
        check_output_dir(out, overwrite=False, owned_patterns=COMPARE_OUTPUTS, what="compare", resumable=False)
    now = _settings_record(s)
    diff = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
    if (out / "report.md").exists():
        if not diff:
            return "finished"
        check_output_dir(out, overwrite=False, owned_patterns=COMPARE_OUTPUTS, what="compare", resumable=False)
    if diff:
        what = "; ".join(f"--{k.replace('_', '-')} {recorded.get(k)!r} there, {now.get(k)!r} now" for k in diff)
        raise OutputError(
            f"{out} holds an unfinished compare run with other settings ({what}); nothing was changed. To continue "
            f"it, rerun its own command (in {out / 'command.txt'}); to replace it, add --overwrite; or choose "
            "another --out."
        )
    return "resume"


def _claim_out(out: Path, s: dict, overwrite: bool) -> tuple[str, Path | None]:
    """Validate first (:func:`check_out`), create second; -> (mode, the topmost folder this created or None)."""
    mode = check_out(out, s, overwrite)
    created = first_missing(out)
    if mode == "finished":
        print(f"{out}: this comparison is finished; nothing to do. Its report: {out / 'report.md'} (to run it "
              "again from scratch, add --overwrite)", file=sys.stderr)
    elif mode == "new":
        if claim_run_dir(out, overwrite=overwrite, what="compare", resumable=False, patterns=COMPARE_OUTPUTS,
                         create=True):
            print(f"note: --overwrite: removed the previous report in {out}", file=sys.stderr)
    else:
        print(f"continuing the unfinished run in {out}", file=sys.stderr)
    return mode, created


def _stopped(e: KeyboardInterrupt | Terminated, out: Path, resume_cmd: str) -> int:
    """A second signal, or one outside training (evaluation): the checkpoints stay; -> the exit code."""
    code = getattr(e, "exit_code", 130)
    name = "SIGTERM" if code == 143 else "SIGINT"
    print(f"{name}: stopped; the checkpoints in {out / 'runs'} are kept; to continue: {resume_cmd}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    if args.data is not None or args.worker:
        args.older_spelling = True  # the study says, once its inputs are valid, that it has its own command now
        return study.run(args)
    try:
        s = resolve(args)
        check_variants(s["variants"])
        if args.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {args.threads}")
    except ValueError as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("reports") / f"compare-{datetime.now():%Y%m%d-%H%M%S}"
    lock = None
    # Validate first (settings, what --out holds), create second: a refused command leaves no folder behind. The
    # folder is held for the whole command (a second compare into it is refused), from before it is read.
    try:
        try:
            lock = lock_run_dir(out, "diffattn compare") if out.is_dir() else None
            mode, created = _claim_out(out, s, args.overwrite)
            if mode == "finished":
                return 0
            lock = lock or lock_run_dir(out, "diffattn compare")
        except (OutputError, OSError) as e:
            print(f"error: {printable(e)}", file=sys.stderr)
            return 2
        return _run_claimed(args, s, out, mode, created, lock)
    finally:
        if lock is not None:
            lock.release()


def _run_claimed(args: argparse.Namespace, s: dict, out: Path, mode: str, created: Path | None,
                 lock: RunLock) -> int:
    """Train, evaluate and report into the claimed (and held) folder ``out``; -> the exit code."""
    resume_cmd = continue_command(args, s, out)
    old_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if mode == "new":  # the settings, so that a rerun into this folder can tell whether it continues the run
            atomic_write(out / "config.json", json.dumps({"command": command_line(s, out), "settings": s},
                                                         indent=2) + "\n")
            atomic_write(out / "command.txt", command_line(s, out) + "\n")
        # a second Ctrl-C quits at once, also in the middle of a long training step
        with sigterm_raises(), QuitOnSecondSignal(f"resume with: {resume_cmd}"):
            results = run_compare(s, out, progress=not args.no_progress)
    except CompareInterrupted as e:
        print(e.line(resume_cmd), file=sys.stderr)
        return e.exit_code
    except NonFiniteLossError as e:
        if mode == "new":  # nothing worth keeping (no checkpoint): leave no folder behind
            release_run_dir(out, created=created, patterns=COMPARE_OUTPUTS, lock=lock)
        print(f"error: {printable(e)}", file=sys.stderr)
        return 3
    except (KeyboardInterrupt, Terminated) as e:
        return _stopped(e, out, resume_cmd)
    except Exception as e:
        err = io_error_in(e)
        if err is None:
            raise
        if mode == "new" and release_run_dir(out, created=created, patterns=COMPARE_OUTPUTS, lock=lock):
            kept, then = "nothing (no model had saved a checkpoint)", "run the same command again"
        else:
            kept, then = f"the models trained so far and the last checkpoint of the one in training ({out})", resume_cmd
        print(io_error_line(err, kept=kept, then=then), file=sys.stderr)
        return EX_IOERR
    finally:
        torch.set_num_threads(old_threads)  # in-process callers (tests) keep their setting
    print(f"report: {out / 'report.md'} and {out / 'report.html'} ({results['wall_time_s']:.0f} s)")
    return 0
