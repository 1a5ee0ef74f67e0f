"""The settings of a ``diffattn compare`` run: defaults, --quick, the evaluation constants, the ``--variants``
spelling (``TYPE`` or ``TYPE+shared_qk``) and the command line that reruns a run.

A run's settings are one plain dict (the defaults, or --quick, overridden by explicit values; built from the
command line by :mod:`diffattn.cli.compare`), recorded in ``config.json`` so a rerun can tell whether it
continues the same run.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from diffattn.attention.registry import ATTENTION
from diffattn.experiments.plots import label_for

#: ``--variants`` suffix: the type with ``shared_qk=True`` (label suffix "-sym").
SHARED_QK = "+shared_qk"

# Default run (about 3-4 minutes on 2 CPU cores) and --quick (a smoke run of seconds, for tests).
DEFAULTS = dict(
    steps=1000,
    seq_len=64,
    d_model=64,
    n_layers=2,
    n_heads=2,
    batch_size=32,
    lr=3e-3,
    samples=96,
    n_evals=8,
    depths=(0.0, 0.25, 0.5, 0.75, 1.0),
)
QUICK = dict(DEFAULTS, steps=12, seq_len=32, d_model=32, n_layers=1, batch_size=8, samples=4, n_evals=1,
             depths=(0.0, 1.0))
TASK_PARAMS = dict(max_needles=4, max_queries=2)
# Needles in every context of the depth × length grid: the queried one at the cell's depth and one distractor
# with another key. With a single needle every cell of both models read 1.00; with two, a model that takes the
# first needle it sees (right at depth 0, wrong whenever the distractor comes first) is told apart from one
# that matches the key, and accuracies spread over 0-1 (with four they crowd near chance).
GRID_NEEDLES = 2
BITS = (16, 8, 6, 4)


def split_variant(variant: str) -> tuple[str, bool]:
    """``"diff+shared_qk"`` -> ("diff", True); ``"diff_v2"`` -> ("diff_v2", False)."""
    if variant.endswith(SHARED_QK):
        return variant[: -len(SHARED_QK)], True
    return variant, False


def label(variant: str) -> str:
    """How the report names a ``--variants`` entry: the type's label, "-sym" for ``TYPE+shared_qk``."""
    base, shared = split_variant(variant)
    return label_for(base) + ("-sym" if shared else "")


def check_variants(variants: list[str]) -> None:
    """Raise ValueError (one line) for an unregistered type, ``+shared_qk`` on a type that does not define it,
    or a variant listed twice (diff and standard are always trained)."""
    unknown = [v for v in variants if split_variant(v)[0] not in ATTENTION]
    if unknown:
        raise ValueError(f"unknown attention variant(s) {unknown}; registered: {sorted(ATTENTION)}, each also as "
                         f"TYPE{SHARED_QK} where shared_qk is defined")
    no_sym = [v for v in variants if split_variant(v)[1] and not ATTENTION[split_variant(v)[0]].supports_shared_qk]
    if no_sym:
        raise ValueError(f"variant(s) {no_sym}: shared_qk is not defined for that type; it is for "
                         f"{sorted(n for n, c in ATTENTION.items() if c.supports_shared_qk)}")
    dup = {v for v in variants if variants.count(v) > 1 or v in ("diff", "standard")}
    if dup:
        raise ValueError(f"variant(s) {sorted(dup)} listed twice (diff and standard are always trained)")


def command_line(s: dict, out: Path) -> str:
    """The full command that reruns settings ``s`` into ``out`` (every setting spelled out)."""
    parts = ["diffattn", "compare"]
    if s["quick"]:
        parts.append("--quick")
    for k in ("steps", "seq_len", "d_model", "n_layers", "n_heads", "batch_size", "lr", "samples"):
        parts += [f"--{k.replace('_', '-')}", str(s[k])]
    parts += ["--seed", str(s["seed"]), "--threads", str(s["threads"])]
    if s["variants"]:
        parts += ["--variants", ",".join(s["variants"])]
    parts += ["--out", str(out)]
    return shlex.join(parts)
