"""``diffattn study DATA``: the text study's command line (:mod:`diffattn.experiments.study`).

Parses the arguments and calls :func:`diffattn.experiments.study.request.run_study`, which reads them into the
run's options and the study's typed spec, then holds and checks --out, plans, runs the grid, collects and reports
(or, with ``--worker``, only works on an existing study folder). The library is imported when the command runs:
``--help`` imports no torch.
"""

from __future__ import annotations

import argparse

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


def add_study_arguments(p: argparse.ArgumentParser) -> None:
    """The study's own options (its grid, its workers and storage, its diagnostics)."""
    g = p.add_argument_group("study")
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
    g.add_argument("--storage", default=None, help="the database of the study's Optuna log (a trial per run of a "
                   "cell): an RDB URL, e.g. postgresql://user@host/db for workers on several machines (the postgres "
                   "extra; default: SQLite in OUT/optuna.db)")
    g.add_argument("--sizes", nargs="?", const="auto", default=None, help="size ladder: d_model values "
                   "(comma-separated; bare flag: d_model × 1/2, 1, 3/2) trained at each arm's best LR")
    g.add_argument("--grace-seconds", type=float, default=GRACE_S, help="a run whose worker's heartbeat stopped "
                   f"this long ago (killed, its machine gone) is marked FAIL in the Optuna log (default {GRACE_S:g})")
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


def run(args: argparse.Namespace) -> int:
    """``diffattn study DATA ...`` (or ``--worker``): the library reads the options, does the work and says how it
    ended."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.request import run_study

    return run_study(vars(args))
