"""Statistics of the text experiment: t intervals against known numbers, pairing, verdicts, best LR, the fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as st

from diffattn.experiments.findings import stats


def test_t_interval_textbook_example():
    # x = 1..5: mean 3, s = sqrt(2.5), t(0.975, 4) = 2.776 (printed t-tables) -> 3 ± 2.776·1.5811/√5 = 3 ± 1.963
    mean, lo, hi = stats.t_interval([1, 2, 3, 4, 5])
    assert mean == 3
    assert lo == pytest.approx(3 - 1.9632, abs=2e-4) and hi == pytest.approx(3 + 1.9632, abs=2e-4)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_t_interval_matches_scipy_ttest(n):
    x = np.random.default_rng(n).normal(1.5, 0.3, n)
    ci = st.ttest_1samp(x, 0.0).confidence_interval(0.95)
    _, lo, hi = stats.t_interval(x)
    assert (lo, hi) == pytest.approx((ci.low, ci.high), rel=1e-12)


def test_t_interval_degenerate():
    assert math.isnan(stats.t_interval([1.0])[1])
    assert math.isnan(stats.t_interval([1.0, math.inf])[2])
    assert stats.t_interval([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)


def test_paired_difference_pairs_by_seed():
    # Seeds differ a lot from each other, but the candidate is 0.1 lower on every one: paired, that is a clear
    # "better"; an unpaired comparison (or one that matched seeds by position after sorting) would not be.
    a = {2: 3.0, 0: 1.0, 1: 2.5}
    b = {0: 1.1, 1: 2.6, 2: 3.1}
    d = stats.paired_difference(a, b)
    assert d["seeds"] == [0, 1, 2]
    assert d["differences"] == pytest.approx([-0.1, -0.1, -0.1])
    assert d["conclusion"] == stats.BETTER
    unpaired = stats.t_interval(list(a.values()))
    assert unpaired[1] < 1.1  # the spread over seeds alone would hide the difference
    # Ranks that cross between arms: pairing by sorted value (or by position) would give other differences.
    d = stats.paired_difference({1: 1.2, 0: 1.0, 2: 2.0}, {0: 1.25, 1: 1.22, 2: 2.1})
    assert d["differences"] == pytest.approx([-0.25, -0.02, -0.1])


def test_paired_difference_ignores_unpaired_seeds():
    d = stats.paired_difference({0: 1.0, 1: 1.2, 5: 9.0}, {0: 0.9, 1: 1.0, 2: 0.0})
    assert d["seeds"] == [0, 1]
    ref = st.ttest_rel([1.0, 1.2], [0.9, 1.0]).confidence_interval(0.95)
    assert d["ci95"] == pytest.approx([ref.low, ref.high])


@pytest.mark.parametrize(
    "lo,hi,want",
    [(-0.2, -0.01, stats.BETTER), (0.01, 0.3, stats.WORSE), (-0.1, 0.1, stats.NO_DIFFERENCE),
     (math.nan, math.nan, stats.TOO_FEW)],
)
def test_verdict(lo, hi, want):
    assert stats.verdict(lo, hi) == want


def test_best_lr_uses_the_mean_over_seeds():
    sweep = {1e-3: [2.0, 2.0, 2.0], 3e-3: [1.5, 1.5, 3.2], 1e-2: [1.9, 1.95, 2.0]}
    # 3e-3 has the single best run but the worst mean; 1e-2 has the lowest mean
    assert stats.best_lr(sweep) == 1e-2
    assert stats.best_lr({1e-3: [2.0, 2.1], 3e-3: [1.0, math.inf]}) == 1e-3  # a diverged seed disqualifies


def test_log_linear_fit_and_inverse():
    n = [1e5, 2e5, 4e5]
    y = [5.0 - 0.3 * math.log(x) for x in n]
    alpha, beta = stats.fit_log_linear(n, y)
    assert (alpha, beta) == pytest.approx((5.0, 0.3))
    assert stats.params_to_match((alpha, beta), 5.0 - 0.3 * math.log(3e5)) == pytest.approx(3e5)
    assert stats.params_to_match((1.0, -0.1), 0.5) == math.inf
    with pytest.raises(ValueError):
        stats.fit_log_linear([1e5, 1e5], [1.0, 2.0])
