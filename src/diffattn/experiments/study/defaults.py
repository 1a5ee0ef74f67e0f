"""The ``diffattn study`` command's defaults: the model shape and schedule of a run on real text and of
``--quick``, the LR-extension rounds and the timing probe's seconds.

Imports nothing heavy: ``diffattn study --help`` (and ``diffattn compare --help``) show these defaults. The typed
spec of a study, built from them, is :mod:`diffattn.experiments.study.spec`.
"""

from __future__ import annotations

import sys
from importlib import resources

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _tiny_shape() -> dict[str, int]:
    """The packaged tiny config's model shape and batch (configs/tiny.toml), read where it is said."""
    tiny = tomllib.loads((resources.files("diffattn") / "configs" / "tiny.toml").read_text(encoding="utf-8"))
    model, train = tiny["model"], tiny["train"]
    return dict(d_model=model["d_model"], n_layers=model["n_layers"], n_heads=model["n_heads"],
                seq_len=train["seq_len"], batch_size=train["batch_size"])


# The tiny shape for real text, at 1,000 steps (not tiny's 300: a study compares the arms further along), and a
# seconds-long smoke shape for tests (--quick).
TEXT_DEFAULTS = dict(_tiny_shape(), steps=1000)
TEXT_QUICK = dict(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, steps=8)
# --lr-extensions K: rounds per arm beyond an edge best LR (analysis.bracket).
DEFAULT_LR_EXTENSIONS = 2
# The timing probe's seconds of training per arm. It sizes the horizon of a --budget-minutes run; a --quick run
# ignores the budget, so its probe only feeds the printed estimate and need not cost more than the run itself.
PROBE_S, PROBE_QUICK_S = 5.0, 0.5
# A run whose worker's heartbeat stopped this long ago (killed, its machine gone) is FAIL in the study's Optuna log
# (--grace-seconds); its worker beats every quarter of it. Its cell is free as soon as its lock is.
GRACE_S = 60.0


def _head_dim_key(d_model: int, d: int) -> tuple:
    diff_heads = d_model // (2 * d)
    return (d >= 32, 32 <= d <= 128 and diff_heads >= 2, d <= 128, d)


def default_head_dim(d_model: int) -> int:
    """The Q/K (sub-)head width D a study uses when none is given, following the DIFF authors' advice.

    The advice (Ye et al., microsoft/unilm issue 1663, reply of 2025-01-08): keep the baseline's Q/K head width
    (128 in the paper) and give DIFF half the heads with V of width 2·128, "because in most settings, there is
    more redundancy in number of heads than in head dimension"; reducing the Q/K width to 64 "would have a
    strong negative impact on performance". The paper's shapes keep 128 (e.g. d_model 3072: 12 DIFF heads,
    24 baseline heads).

    At small d_model both cannot hold, so in order of priority, among even D (RoPE) with 2D dividing d_model
    (DIFF needs whole diff-heads; then the baseline has >= 2 heads): D >= 32; then D <= 128 with >= 2
    diff-heads (a one-head model cannot mix several attention patterns; a width-64 probe with 1 diff-head vs 2
    heads trailed by 0.04–0.07 nats, issue 16); then D <= 128; then the widest. So d_model 128 -> D = 32 (4
    baseline heads, 2 diff-heads), 256 -> 64, 512 and up (when divisible) -> 128, 64 -> 32 (2 and 1), and
    below 64 the widest D that fits (below the advice: d_model does not allow it). Raises ValueError when no
    even D fits (d_model not a multiple of 4)."""
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model <= 0:
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")
    ok = [d for d in range(2, d_model // 2 + 1, 2) if d_model % (2 * d) == 0]
    if not ok:
        raise ValueError(f"d_model {d_model} has no even Q/K head width D with d_model a multiple of 2·D "
                         "(DIFF needs one): use a multiple of 4")
    return max(ok, key=lambda d: _head_dim_key(d_model, d))
