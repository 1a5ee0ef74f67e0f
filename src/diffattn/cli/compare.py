"""Train DIFF and its parameter-matched baseline on a built-in retrieval task, evaluate both, write a report.

``diffattn compare``: the command line of :mod:`diffattn.experiments.needle`. It reads the arguments into the
run's typed settings (:class:`~diffattn.experiments.needle.settings.CompareSettings`) and calls
:func:`diffattn.experiments.needle.launch.launch`, which holds and checks ``--out`` (default
``./reports/compare-<timestamp>``), trains, evaluates and writes ``report.md``, ``summary.md``, ``report.html``,
PNG plots, ``results.json``, ``config.json`` and ``command.txt``. The study on a user's text is its own command,
``diffattn study DATA`` (:mod:`diffattn.cli.study`); ``compare --data``, its older spelling, is refused with one line
pointing to it. The library is imported when the command runs: ``--help`` imports no torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from diffattn.cli.options import int_at_least
from diffattn.cli.threads import threads_type
from diffattn.experiments.needle.defaults import DEFAULTS, QUICK
from diffattn.system.atomic_files import printable

if TYPE_CHECKING:  # the type of the library's settings (imported when the command runs)
    from diffattn.experiments.needle.settings import CompareSettings


def _positive_int(name: str):
    return int_at_least(name, 1)


def _default(key: str) -> str:
    return f"default {DEFAULTS[key]:g}, --quick {QUICK[key]:g}"


class _StudyMoved(argparse.Action):
    """``--data``: the study's older spelling, refused in one line (exit 2) as soon as it is read, before any
    study option that follows it is called unrecognized."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        parser.error("compare --data is gone: the study on your text is its own command, "
                     "diffattn study DATA (the same options; see diffattn study --help)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The needle job's arguments (``--data``, the study's older spelling, only points to ``diffattn study``)."""
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
    p.add_argument("--data", action=_StudyMoved, help=argparse.SUPPRESS)
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
                   help=f"peak learning rate: warmup, then cosine decay to lr/10 (default {DEFAULTS['lr']:g})")
    p.add_argument(
        "--samples",
        type=_positive_int("--samples"),
        default=None,
        help="evaluation sequences per (depth, length) cell",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--threads",
        type=threads_type(),
        default=1,
        help="torch intra-op threads for this run (0: torch's default). Default 1: these small models gain "
        "little from intra-op threads, and on busy cores extra threads slowed training several-fold",
    )


def resolve(args: argparse.Namespace) -> CompareSettings:
    """The run's typed settings: the defaults (or --quick) overridden by the explicit arguments. Raises
    ValueError (one line) for a bad value."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.needle.settings import CompareSettings

    if getattr(args, "threads", 1) < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    variants = [v.strip() for v in (args.variants or "").split(",") if v.strip()]
    return CompareSettings.from_knobs({k: getattr(args, k, None) for k in DEFAULTS}, seed=args.seed,
                                      quick=bool(args.quick), variants=variants, threads=getattr(args, "threads", 1))


def run(args: argparse.Namespace) -> int:
    """``diffattn compare``: settings, then the library does the work and says how it ended."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.needle.launch import launch

    try:
        s = resolve(args)
    except ValueError as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    return launch(s, args.out, overwrite=args.overwrite, argv=getattr(args, "_argv", None),
                  progress=not args.no_progress)
