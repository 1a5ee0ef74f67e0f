"""The ``diffattn compare`` command's knobs and constants: the default run and ``--quick``, the needle task's
parameters, the evaluation constants and the ``--variants`` spelling (``TYPE`` or ``TYPE+shared_qk``).

Imports nothing heavy: ``diffattn compare --help`` shows these defaults. The typed settings of a run, built from
these knobs, are :mod:`diffattn.experiments.needle.settings`.
"""

from __future__ import annotations

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
    lr=3e-3,  # not TrainConfig's general 1e-3: small models on a short run take a higher LR (README's figures)
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
