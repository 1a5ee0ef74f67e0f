"""Command-line options several commands share: whole-number argument types, the ``--out`` folder with its
``--overwrite`` (the output guard, :mod:`diffattn.checkpoint.output_guard`, checks them), and the one-line usage error
(exit 2) for a bad value found after parsing. ``--threads`` is :mod:`diffattn.cli.threads`'."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import ExitStack

from diffattn.checkpoint.folder_kind import NotAModelFolder, model_folder_kind
from diffattn.system.atomic_files import printable


def int_at_least(name: str, minimum: int, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type`` for option ``name``: a whole number >= ``minimum`` (and <= ``maximum``, ``why`` saying
    what bounds it), else a one-line error."""
    what = "a positive integer" if minimum == 1 else f"a whole number >= {minimum}"
    low = what if minimum == 1 else f">= {minimum}"

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {printable(repr(s))}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be {low}, got {v}")
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be at most {maximum}{f' ({why})' if why else ''}, got {v}")
        return v

    return parse


def add_output_folder(p: argparse.ArgumentParser, out_help: str, overwrite_help: str) -> None:
    """``--out`` (required: the folder to write) and ``--overwrite`` (write into a non-empty one)."""
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--overwrite", action="store_true", help=overwrite_help)


def usage_error(msg: str) -> int:
    """Print ``error: msg`` to stderr; -> 2, the exit status of bad input."""
    print(f"error: {printable(msg)}", file=sys.stderr)
    return 2


def model_folder_refused(path: object, option: str = "") -> int | None:
    """2, after the one-line refusal (after ``option``, e.g. "--init-from", when it names the folder), when
    ``path`` (given as a model folder) holds no model or does not exist; else None. What every command that
    reads a model checks first, before it imports torch: a refusal is quick, and the same mistake reads the same
    in every command (:mod:`diffattn.checkpoint.folder_kind`)."""
    try:
        model_folder_kind(str(path))
    except NotAModelFolder as e:
        return usage_error(f"{option}: {e}" if option else str(e))
    return None


def add_checkpoint_choice(p: argparse.ArgumentParser, what: str) -> None:
    """``--checkpoint last|best``: which of a run's checkpoints the command ``what`` reads."""
    p.add_argument("--checkpoint", choices=("last", "best"), default="last",
                   help=f"which of a run's checkpoints to {what}: last (the newest, where a resume continues) or "
                        "best (RUN/best: the evaluation with the lowest validation loss, for a classifier the "
                        "highest validation accuracy)")


def run_holding_output(out: object, command: str, owned: list | tuple, source: object,
                       run: Callable[[], int]) -> int:
    """``run()`` while holding the output folder ``out`` (as a training run holds its folder): a `train` running
    there refuses ``command``, and is refused while it writes; a refusal is one line and exit 2."""
    from diffattn.checkpoint.output_guard import OutputError, OutputFolder  # imported when a command runs

    with ExitStack() as stack:
        try:  # a folder that does not exist yet is made by the command: nothing else runs in it
            stack.enter_context(OutputFolder(out, command, written=owned, quiet=True, source=source))
        except OutputError as e:
            print(f"error: {printable(e)}", file=sys.stderr)
            return 2
        return run()
