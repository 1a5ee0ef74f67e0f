"""The output folder of an experiment (``diffattn compare``, ``diffattn study``) and the command that continues
it: one guard for both.

:class:`ExperimentFolder` holds the folder (its lock, taken as soon as it exists, from before it is read until the
command ends; a second command on it is refused, naming the first), validates it before anything is created
(:meth:`~ExperimentFolder.compare_mode`: a new, unfinished or finished comparison; :meth:`~ExperimentFolder.
check_study`: an empty folder or a study's own), claims a new comparison's folder and, after a failure, removes
what a new one wrote when no model saved a checkpoint. :func:`resume_command` is the line every stop prints: the
command as typed, with ``--out`` named (the default folder has a timestamp) and ``--overwrite`` dropped (it would
start over). Each model's or cell's own run folder is the run driver's (:class:`diffattn.train.driver.RunFolder`).
"""

from __future__ import annotations

import json
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from diffattn.checkpoint.output_guard import TRAIN_OUTPUTS, OutputError, OutputFolder, check_output_dir
from diffattn.system.atomic_files import open_nofollow
from diffattn.system.run_lock import LOCK_NAME
from diffattn.system.untrusted import loads_json

# What `diffattn compare` writes in its folder (the study resumes in place instead).
COMPARE_OUTPUTS = ("report.md", "report.html", "summary.md", "results.json", "config.json", "command.txt", "*.png",
                   "runs")


def cell_name(arm: str, lr: float, seed: int, d_model: int | None = None) -> str:
    """The folder name of a study's cell, ``OUT/cells/<name>``: arm, size (``d_model`` of a ladder cell), LR, seed."""
    size = f"-d{d_model}" if d_model is not None else ""
    return f"{arm}{size}-lr{lr:g}-s{seed}"


def default_out(kind: str) -> Path:
    """``reports/<kind>-<timestamp>``: the folder of an experiment run without ``--out``."""
    return Path("reports") / f"{kind}-{datetime.now():%Y%m%d-%H%M%S}"


def resume_command(argv: list[str] | None, out: Path, *, out_given: bool | None = None,
                   fallback: str | None = None) -> str:
    """The command that continues an experiment in ``out``: ``argv`` (the command line as typed, without the
    program) with ``--out OUT`` added when it was not given (``out_given``; None: looked for in ``argv``) and
    ``--overwrite`` dropped; ``fallback`` (the full command of the settings) when it was not run from the
    command line."""
    if argv is None and fallback is not None:
        return fallback
    argv = list(argv or [])
    kept = [a for a in argv if not (a.startswith("--ov") and "--overwrite".startswith(a))]
    if out_given is None:
        out_given = any(a == "--out" or a.startswith("--out=") for a in kept)
    if not out_given:
        kept += ["--out", str(out)]
    return shlex.join(["diffattn", *kept])


class ExperimentFolder(OutputFolder):
    """An experiment's folder for one command: an :class:`~diffattn.checkpoint.output_guard.OutputFolder` (``with
    folder:`` holds its lock from before it is read until the command ends, ``command`` naming the holder in a
    refusal and ``hint`` ending it) whose contents the experiment checks and claims itself."""

    def __init__(self, out: Path, command: str, hint: str = "",
                 written: tuple[str, ...] = (*TRAIN_OUTPUTS, *COMPARE_OUTPUTS)) -> None:
        super().__init__(out, command, hint=hint, written=written)

    @property
    def out(self) -> Path:
        return self.path

    # ----------------------------------------------------------------------------------------- compare
    def compare_mode(self, record: dict[str, Any], overwrite: bool) -> str:
        """What to do with a comparison's folder, decided before anything is written (a file, an unwritable
        place or another finished run is refused: OutputError): "new" (empty or missing, or replaced with
        ``overwrite``), "resume" (an unfinished run of the same settings ``record``) or "finished" (this run,
        done: nothing to do). An unfinished run of other settings is refused too."""
        out = self.out
        old = check_output_dir(out, overwrite=True, owned_patterns=COMPARE_OUTPUTS, what="compare", resumable=False)
        if not old or overwrite:
            return "new"
        try:
            with open_nofollow(out / "config.json") as f:
                recorded = loads_json(f.read(), out / "config.json")["settings"]  # bounded: no RecursionError
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None
        if not isinstance(recorded, dict):  # not a run we can identify
            check_output_dir(out, overwrite=False, owned_patterns=COMPARE_OUTPUTS, what="compare", resumable=False)
        now = json.loads(json.dumps(record))  # tuples as lists: what config.json holds
        diff = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
        if (out / "report.md").exists():
            if not diff:
                return "finished"
            check_output_dir(out, overwrite=False, owned_patterns=COMPARE_OUTPUTS, what="compare", resumable=False)
        if diff:
            what = "; ".join(f"--{k.replace('_', '-')} {recorded.get(k)!r} there, {now.get(k)!r} now" for k in diff)
            raise OutputError(
                f"{out} holds an unfinished compare run with other settings ({what}); nothing was changed. To "
                f"continue it, rerun its own command (in {out / 'command.txt'}); to replace it, add --overwrite; or "
                "choose another --out."
            )
        return "resume"

    def claim_new(self, overwrite: bool) -> None:
        """Make the folder a new comparison's: create and hold it, remove a previous run's outputs with
        ``overwrite`` (saying so). :meth:`undo` takes it back after a failure (unless a model saved a checkpoint)."""
        if self.claim(patterns=COMPARE_OUTPUTS, overwrite=overwrite, what="compare", resumable=False):
            print(f"note: --overwrite: removed the previous report in {self.out}", file=sys.stderr)

    # ------------------------------------------------------------------------------------------- study
    def check_study(self, spec_file: str) -> None:
        """Refuse, before anything is created or computed, a folder that cannot be written or holds something
        else: a file, an unwritable place, or a non-empty folder that is not a study (no ``spec_file``). A
        study's folder is fine: the command resumes it in place."""
        out = self.out
        check_output_dir(out, overwrite=True, owned_patterns=(), what="study", resumable=False)
        if out.is_dir() and not (out / spec_file).exists() and any(p.name != LOCK_NAME for p in out.iterdir()):
            raise OutputError(f"output folder {str(out)!r} exists, is not empty and holds no experiment; "
                              "give a new --out")
