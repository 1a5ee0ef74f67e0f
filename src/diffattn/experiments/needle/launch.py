"""What ``diffattn compare`` does once its arguments are parsed: the folder held and checked, the run, and how it
ended as one line and one exit code.

:func:`launch` holds ``--out``
(:class:`~diffattn.experiments.experiment_folder.ExperimentFolder`) from before it is read,
decides whether it starts a new comparison, continues an unfinished one of the same settings or finds this one
finished, records the settings (``config.json``, ``command.txt``) and runs :func:`~diffattn.experiments.needle.run.
run_compare` under the signal handlers. Ctrl-C or SIGTERM saves the model in training and prints the command that
continues (:func:`~diffattn.experiments.experiment_folder.resume_command`); rerunning it reuses the finished models and
resumes the interrupted one, so the report matches an uninterrupted run. Exit codes are the run driver's
(:func:`~diffattn.train.driver.exit_code`): 2 bad input, 3 a NaN/inf loss, 130 / 143 a stop, 74 a storage failure.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path

import torch

from diffattn.checkpoint.output_guard import OutputError
from diffattn.experiments.experiment_folder import ExperimentFolder, default_out, resume_command
from diffattn.experiments.needle.compare_report import verdict_lines
from diffattn.experiments.needle.run import CompareInterrupted, run_compare
from diffattn.experiments.needle.settings import CompareSettings
from diffattn.system.atomic_files import atomic_write, printable
from diffattn.system.io_errors import EX_IOERR, io_error_in, io_error_line
from diffattn.train.driver import EXIT_DIVERGED, EXIT_USAGE, exit_code
from diffattn.train.runlog import notes_last
from diffattn.train.signals import QuitOnSecondSignal, Terminated, sigterm_raises


def launch(s: CompareSettings, out: Path | None = None, *, overwrite: bool = False, argv: list[str] | None = None,
           progress: bool = True) -> int:
    """Run the comparison ``s`` into ``out`` (default ``reports/compare-<timestamp>``); -> the exit code, after
    one line on stderr for a refusal, a stop or a failure. ``argv``: the command line as typed (the line that
    continues repeats it). Nothing is created before every input is checked."""
    out_given = out is not None
    out = Path(out) if out is not None else default_out("compare")
    with ExitStack() as stack:
        try:  # held before it is read: a second compare into it is refused
            folder = stack.enter_context(ExperimentFolder(out, "diffattn compare"))
            mode = folder.compare_mode(s.record(), overwrite)
            if mode == "finished":
                print(f"{out}: this comparison is finished; nothing to do. Its report: {out / 'report.md'} (to run "
                      "it again from scratch, add --overwrite)", file=sys.stderr)
                return 0
            if mode == "new":
                folder.claim_new(overwrite)
            else:
                print(f"continuing the unfinished run in {out}", file=sys.stderr)
        except (OutputError, OSError) as e:
            print(f"error: {printable(e)}", file=sys.stderr)
            return EXIT_USAGE
        resume = resume_command(argv, out, out_given=out_given, fallback=s.command_line(out))
        with notes_last():  # a missing optional tracker is said once, after the verdict
            return _run(s, folder, mode, resume, progress)


def _run(s: CompareSettings, folder: ExperimentFolder, mode: str, resume: str, progress: bool) -> int:
    """Train, evaluate and report into the claimed (and held) folder; -> the exit code."""
    out = folder.out
    old_threads = torch.get_num_threads()
    if s.threads:
        torch.set_num_threads(s.threads)
    try:
        if mode == "new":  # the settings, so that a rerun into this folder can tell whether it continues the run
            cmd = s.command_line(out)
            atomic_write(out / "config.json", json.dumps({"command": cmd, "settings": s.record()}, indent=2) + "\n")
            atomic_write(out / "command.txt", cmd + "\n")
        # a second Ctrl-C quits at once, also in the middle of a long training step
        with sigterm_raises(), QuitOnSecondSignal(f"resume with: {resume}"):
            results = run_compare(s, out, progress=progress)
    except CompareInterrupted as e:
        print(e.line(resume), file=sys.stderr)
        return e.exit_code
    except (KeyboardInterrupt, Terminated) as e:  # a second signal, or one outside training (evaluation)
        code = getattr(e, "exit_code", 130)
        print(f"{'SIGTERM' if code == 143 else 'SIGINT'}: stopped; the checkpoints in {out / 'runs'} are kept; to "
              f"continue: {resume}", file=sys.stderr)
        return code
    except Exception as e:
        code = exit_code(e)
        if code == EXIT_DIVERGED:
            if mode == "new":  # nothing worth keeping (no checkpoint): leave no folder behind
                folder.undo()
            print(f"error: {printable(e)}", file=sys.stderr)
            return code
        if code != EX_IOERR:
            raise
        if mode == "new" and folder.undo():
            kept, then = "nothing (no model had saved a checkpoint)", "run the same command again"
        else:
            kept, then = f"the models trained so far and the last checkpoint of the one in training ({out})", resume
        print(io_error_line(io_error_in(e), kept=kept, then=then), file=sys.stderr)
        return EX_IOERR
    finally:
        torch.set_num_threads(old_threads)  # in-process callers (tests) keep their setting
    for line in verdict_lines(results):  # what the run found, in the terminal too
        print(printable(line))
    print(f"report: {out / 'report.md'} and {out / 'report.html'} ({results['wall_time_s']:.0f} s)")
    return 0
