"""Statistics of a seeds × learning-rates study on plain numbers: Student-t intervals over seeds, best-LR
selection, the paired per-seed difference and its verdict, and the loss-vs-parameters fit of a size ladder."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats as _st

BETTER = "better"
WORSE = "worse"
NO_DIFFERENCE = "no detectable difference at this budget"
TOO_FEW = "undetermined: fewer than 2 paired seeds, no confidence interval"


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """-> (mean, lo, hi): the two-sided Student-t confidence interval of the mean of ``values``
    (n − 1 degrees of freedom). With fewer than 2 values, or a non-finite value, lo = hi = nan."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size < 2 or not np.all(np.isfinite(x)):
        return mean, math.nan, math.nan
    half = float(_st.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, mean - half, mean + half


def best_lr(sweep: Mapping[float, Sequence[float]]) -> float:
    """The learning rate whose mean loss over seeds is lowest (ties: the smaller lr). Diverged runs count as
    inf, so an lr where any seed diverged is never chosen over one where none did."""
    if not sweep:
        raise ValueError("best_lr: empty sweep")
    means = {lr: float(np.mean(v)) if len(v) else math.inf for lr, v in sweep.items()}
    return min(sorted(means), key=lambda lr: means[lr])


def paired_difference(a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95) -> dict:
    """Per-seed differences a[s] − b[s] over the seeds both have, with their t interval and the verdict
    (for a loss: negative = a is better)."""
    seeds = sorted(set(a) & set(b))
    d = [a[s] - b[s] for s in seeds]
    mean, lo, hi = t_interval(d, level)
    return {"seeds": seeds, "differences": d, "mean": mean, "ci95": [lo, hi], "conclusion": verdict(lo, hi)}


def verdict(lo: float, hi: float) -> str:
    """Plain words for a CI of (candidate − baseline) loss."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return TOO_FEW
    if hi < 0:
        return BETTER
    if lo > 0:
        return WORSE
    return NO_DIFFERENCE


def fit_log_linear(params: Sequence[float], losses: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit L(N) = alpha − beta·ln N; -> (alpha, beta).

    Two parameters on a handful of sizes: a saturating power law a·N^−b + c has three, which three points
    fit exactly (with no check), and its offset c is ill-determined over a 3× range of N. Over a narrow range a
    power law is close to linear in ln N, so this is the robust choice; it should not be extrapolated far."""
    n = np.log(np.asarray(params, dtype=np.float64))
    y = np.asarray(losses, dtype=np.float64)
    if n.size < 2 or np.ptp(n) == 0:
        raise ValueError("fit_log_linear needs at least 2 distinct sizes")
    slope, intercept = np.polyfit(n, y, 1)
    return float(intercept), float(-slope)


def params_to_match(fit: tuple[float, float], target_loss: float) -> float:
    """Parameters N at which the fit L(N) = alpha − beta·ln N reaches ``target_loss`` (inf if the fit does not
    decrease with N)."""
    alpha, beta = fit
    if beta <= 0:
        return math.inf
    return math.exp((alpha - target_loss) / beta)
