"""The ``diffattn study`` command's defaults: the model shape and schedule of a run on real text and of
``--quick``, the LR-extension rounds and the timing probe's seconds.

Imports nothing heavy: ``diffattn study --help`` (and ``diffattn compare --help``) show these defaults. The typed
spec of a study, built from them, is :mod:`diffattn.experiments.study.spec`.
"""

from __future__ import annotations

# The tiny shape (configs/tiny.toml) for real text, and a seconds-long smoke shape for tests (--quick).
TEXT_DEFAULTS = dict(d_model=128, n_layers=4, n_heads=4, seq_len=128, batch_size=16, steps=1000)
TEXT_QUICK = dict(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, steps=8)
# --lr-extensions K: rounds per arm beyond an edge best LR (analysis.bracket).
DEFAULT_LR_EXTENSIONS = 2
# The timing probe's seconds of training per arm. It sizes the horizon of a --budget-minutes run; a --quick run
# ignores the budget, so its probe only feeds the printed estimate and need not cost more than the run itself.
PROBE_S, PROBE_QUICK_S = 5.0, 0.5
