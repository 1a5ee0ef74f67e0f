"""``diffattn study DATA``: the text study's command line (:mod:`diffattn.experiments.study`).

Reads the arguments into the run's options and the study's typed spec (:func:`spec_from_args`) and calls
:func:`diffattn.experiments.study.launch.launch` (or ``run_worker`` with ``--worker``: only work on an existing
study folder), which holds and checks --out, plans, runs the grid, collects and reports. ``diffattn compare --data
DATA`` (its older spelling) runs it too: :mod:`diffattn.cli.compare` adds the study's options to its own
(:func:`add_study_arguments`, hidden from its help) and hands the arguments over. The library is imported when the
command runs: ``--help`` imports no torch.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from diffattn.cli.options import int_at_least
from diffattn.cli.threads import threads_type
from diffattn.experiments.study.defaults import (
    DEFAULT_LR_EXTENSIONS,
    GRACE_S,
    PROBE_QUICK_S,
    PROBE_S,
    TEXT_DEFAULTS,
    TEXT_QUICK,
    default_head_dim,
)

if TYPE_CHECKING:  # the types of the library's objects (imported when the command runs)
    from diffattn.experiments.study.launch import StudyRun
    from diffattn.experiments.study.spec import StudySpec

DESCRIPTION = ("Train DIFF and its matched baseline (and --variants) on your text over learning rates and seeds; "
               "report the gap with a confidence interval and a verdict.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``diffattn study``'s arguments: the data, the model shape and schedule, then :func:`add_study_arguments`."""
    p.add_argument("data", nargs="?", metavar="DATA", help="text file or folder of text files (a record corpus: "
                   ".jsonl/.json/.parquet) to train on; omitted only with --worker")
    p.add_argument("--from", dest="source", default=None, metavar="SRC", help="the retrofit study: a pretrained "
                   "standard-attention model (a transformers folder of a family diffattn reads, or a diffattn "
                   "checkpoint) that every arm starts from: `standard` is SRC continued, each --variants type "
                   "(default diff) is SRC converted exactly and fine-tuned; the shape and tokenizer are SRC's")
    p.add_argument("--retrofit-steps", type=int, default=None, metavar="N", help="with --from: each converted arm "
                   "anneals from the exact conversion into a real model of its type over N steps (V1's λ_init, V2's "
                   "σ, the gate: train --retrofit.steps); default: no schedule, the conversion fine-tuned as it is")
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
    p.add_argument("--threads", type=threads_type(), default=1, help="torch intra-op threads per cell (0: the "
                   "cores / --jobs). Default 1: these small models gain little from intra-op threads")
    add_study_arguments(p)


def _heads_by_width() -> str:
    """--n-heads' default as the runs get it: from the Q/K head width rule (defaults.default_head_dim)."""
    def at(d_model: int) -> str:
        w = default_head_dim(d_model)  # DIFF: half the baseline's heads, each with two Q/K sub-heads of width w
        return f"d_model {d_model}: width {w}, DIFF {d_model // (2 * w)}, baseline {d_model // w}"
    return (f"(default: set by the Q/K head width rule, see --head-dim; {at(TEXT_DEFAULTS['d_model'])}; "
            f"--quick {at(TEXT_QUICK['d_model'])})")


def add_study_arguments(p: argparse.ArgumentParser, hidden: bool = False) -> None:
    """The study's own options (``hidden``: added to ``diffattn compare``, which still accepts them with --data,
    without listing them in its help)."""
    g = _Hidden(p) if hidden else p.add_argument_group("study")
    g.add_argument("--tokenizer", choices=("char", "bpe"), default=None, help="tokenizer fitted on the data "
                   "(default char)")
    g.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size")
    g.add_argument("--eval-batches", type=int_at_least("--eval-batches", 1), default=None, metavar="N",
                   help="batches of each evaluation during a cell's training (default 8)")
    g.add_argument("--evals", type=int_at_least("--evals", 1), default=None, metavar="N", help="validation points "
                   "per cell, each with a checkpoint (default 10; 4 with --from, whose checkpoints are GBs)")
    g.add_argument("--val-tokens", type=int, default=None, metavar="N", help="the final validation pass of each "
                   "cell reads at most N tokens (default 262,144; smaller for a large --from model on a CPU)")
    g.add_argument("--lrs", default=None, help="learning rates, comma-separated (default: 3, log-spaced "
                   "around 3e-3·sqrt(128/d_model))")
    g.add_argument("--seeds", type=int, default=3, help="seeds per arm and LR (paired across arms)")
    g.add_argument("--heads", default=None, help="DIFF head counts to compare, comma-separated, e.g. 4,8 (each "
                   "with its baseline at twice the heads); default --n-heads")
    g.add_argument("--budget-minutes", type=float, default=None, help="size steps per cell so the whole grid "
                   "fits this wall time (timing probe on this machine)")
    g.add_argument("--jobs", type=int, default=1, help="cells at once, as separate worker processes")
    g.add_argument("--worker", action="store_true", help="only work on the study in --out (any machine that "
                   "shares the folder, and its --storage); the first command writes the plan")
    g.add_argument("--storage", default=None, help="the study's Optuna database: an RDB URL, e.g. postgresql://"
                   "user@host/db for workers on several machines (the postgres extra; default: SQLite in "
                   "OUT/optuna.db)")
    g.add_argument("--sizes", nargs="?", const="auto", default=None, help="size ladder: d_model values "
                   "(comma-separated; bare flag: d_model × 1/2, 1, 3/2) trained at each arm's best LR")
    g.add_argument("--grace-seconds", type=float, default=GRACE_S, help="a RUNNING cell whose worker's heartbeat "
                   f"stopped this long ago (killed, its machine gone) is queued again (default {GRACE_S:g})")
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


def options(args: argparse.Namespace) -> StudyRun:
    """How the study runs, from the arguments (what it studies is :func:`spec_from_args`')."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.launch import StudyRun

    return StudyRun(out=Path(args.out) if args.out else None, jobs=args.jobs, threads=args.threads,
                    storage=args.storage, budget_minutes=args.budget_minutes, probe_seconds=args.probe_seconds,
                    quick=bool(getattr(args, "quick", False)), lr_extensions_given=args.lr_extensions is not None,
                    grace_s=args.grace_seconds, poll_s=args.poll_seconds, progress_s=args.progress_seconds,
                    verbose=args.verbose, bar=not getattr(args, "no_progress", False) and sys.stderr.isatty(),
                    spawned_by=getattr(args, "spawned_by", None), argv=getattr(args, "_argv", None),
                    older_spelling=getattr(args, "older_spelling", False))


def _floats(s: str, what: str) -> list[float]:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.spec import StudyError

    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise StudyError(f"{what} must be comma-separated numbers, got {s!r}") from None
    if not v or any(not (x > 0 and math.isfinite(x)) for x in v):
        raise StudyError(f"{what} must be positive numbers, got {s!r}")
    return v


def spec_from_args(args: argparse.Namespace) -> StudySpec:
    """The study the command line asks for: the defaults (or ``--quick``) overridden by what was given, every
    arm and size checked to be a valid model shape. Raises StudyError (one line)."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.attention.registry import ATTENTION
    from diffattn.experiments.study.spec import StudyError, StudySpec, default_lrs, default_sizes, parse_variant

    if getattr(args, "source", None):
        return _source_spec(args)
    if getattr(args, "retrofit_steps", None) is not None:
        raise StudyError("--retrofit-steps applies only with --from SRC (a retrofit starts from a pretrained model)")
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
    spec = StudySpec.from_dict(dict(
        data=str(Path(data).resolve()), tokenizer=args.tokenizer or "char", val_tokens=_val_tokens(args),
        vocab_size=args.vocab_size,
        d_model=base["d_model"], n_layers=base["n_layers"], heads=heads, variants=variants, lrs=lrs,
        seeds=list(range(args.seeds)), seq_len=base["seq_len"], batch_size=base["batch_size"], steps=base["steps"],
        sizes=sizes, head_dims=head_dims, **_k_and_diag(args, base["steps"]), **_eval_batches(args),
    ))
    try:  # every arm and size must be a valid model shape
        for a in spec.arms():
            for d in [spec.model.d_model] + spec.ladder_sizes():
                spec.arm_config(a, 256, d)
    except ValueError as e:
        raise StudyError(str(e)) from None
    return spec


def _source_spec(args: argparse.Namespace) -> StudySpec:
    """``--from SRC``: the retrofit study (:func:`diffattn.experiments.study.source.source_spec` checks it)."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.source import source_spec
    from diffattn.experiments.study.spec import StudyError

    if args.data is None:
        raise StudyError("give the data to study: diffattn study DATA --from SRC")
    base = dict(TEXT_QUICK if getattr(args, "quick", False) else TEXT_DEFAULTS)
    shape = {k: getattr(args, k, None) for k in ("d_model", "n_layers", "n_heads", "head_dim")}
    for flag, given in (("--heads", args.heads), ("--head-dims", args.head_dims), ("--sizes", args.sizes),
                        ("--tokenizer", args.tokenizer), ("--vocab-size", args.vocab_size)):
        if given is not None:
            raise StudyError(f"{flag} does not apply with --from: the model's shape and tokenizer are SRC's")
    lrs = _floats(args.lrs, "--lrs") if args.lrs else [args.lr] if getattr(args, "lr", None) else None
    if args.seeds < 1:
        raise StudyError(f"--seeds must be >= 1, got {args.seeds}")
    steps = args.steps if args.steps is not None else base["steps"]
    return source_spec(args.data, args.source, variants=args.variants, lrs=lrs, seeds=args.seeds, steps=steps,
                       seq_len=args.seq_len or base["seq_len"], batch_size=args.batch_size or base["batch_size"],
                       val_tokens=_val_tokens(args), shape=shape, retrofit_steps=args.retrofit_steps,
                       **_k_and_diag(args, steps), **_eval_batches(args))


def _eval_batches(args: argparse.Namespace) -> dict[str, int]:
    """--eval-batches and --evals, as given."""
    return {k: getattr(args, k) for k in ("eval_batches", "evals") if getattr(args, k, None) is not None}


def _val_tokens(args: argparse.Namespace) -> int | None:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.spec import StudyError

    v = getattr(args, "val_tokens", None)
    if v is not None and v < 1:
        raise StudyError(f"--val-tokens must be >= 1, got {v}")
    return v


def _head_dims(args: argparse.Namespace, d_model: int) -> list[int]:
    """--head-dim / --head-dims; none of them nor --heads/--n-heads: the default width (defaults.default_head_dim)."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.spec import StudyError, head_counts

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
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.spec import StudyError

    k = DEFAULT_LR_EXTENSIONS if args.lr_extensions is None else args.lr_extensions
    diag = min(500, steps) if args.diag_early_steps is None else args.diag_early_steps
    if k < 0 or diag < 0:
        raise StudyError("--lr-extensions and --diag-early-steps must be >= 0")
    return {"lr_extensions": k, "diag_early_steps": diag}


def run(args: argparse.Namespace) -> int:
    """``diffattn study DATA ...`` (or ``--worker``): the library does the work and says how it ended."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.launch import launch, run_worker

    opts = options(args)
    if args.worker:
        return run_worker(opts)
    return launch(opts, lambda: spec_from_args(args))
