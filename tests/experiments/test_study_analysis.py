"""diffattn.experiments.findings.analysis: LR bracketing on fake cell results, the gap trajectory and its slope
against scipy, the token ratio on synthetic curves with known answers, and head-width parameter counts per arm
(:func:`diffattn.experiments.study.spec.head_counts`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as st

from diffattn.experiments.findings import analysis as A
from diffattn.experiments.study.defaults import default_head_dim
from diffattn.experiments.study.spec import head_counts
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM


# ------------------------------------------------------------------------------------------ LR bracketing
def _sweep(loss_of_lr, lrs, seeds=(0, 1, 2)):
    """Fake finished cells: a loss per seed (a small seed offset, so seeds differ) for each LR."""
    return {lr: [loss_of_lr(lr) + 0.01 * s for s in seeds] for lr in lrs}


def _bowl(best: float):
    return lambda lr: 2.0 + 0.1 * math.log(lr / best) ** 2  # convex in log LR, minimum at ``best``


def test_edge_best_triggers_extension_low_and_high():
    lrs = [1e-3, 2e-3, 4e-3]
    low = A.bracket_arm(_sweep(_bowl(1e-4), lrs), lrs, used=0, k=2)
    assert (low.best_lr, low.bracketed, low.status, low.next_lrs) == (1e-3, False, "extend", [5e-4])
    high = A.bracket_arm(_sweep(_bowl(1e-1), lrs), lrs, used=0, k=2)
    assert (high.best_lr, high.bracketed, high.next_lrs) == (4e-3, False, [8e-3])
    three = A.bracket_arm(_sweep(_bowl(1e-1), lrs), lrs, used=0, k=2, factor=3.0)
    assert three.next_lrs == [0.012]  # 4e-3·3 = 0.012000000000000002 in binary: tidied for the cell name


def test_interior_best_stops():
    lrs = [1e-3, 2e-3, 4e-3]
    b = A.bracket_arm(_sweep(_bowl(2.1e-3), lrs), lrs, used=1, k=2)
    assert (b.best_lr, b.bracketed, b.next_lrs, b.status, b.lr_extensions) == (2e-3, True, [], "bracketed", 1)
    rec = A.lr_record(b, "DIFF", k=2)
    assert rec == {"lrs": lrs, "best_lr": 2e-3, "bracketed": True, "lr_extensions": 1, "lr_note": None}


def test_k_caps_the_extensions():
    lrs = [5e-4, 1e-3, 2e-3, 4e-3]
    b = A.bracket_arm(_sweep(_bowl(1e-5), lrs), lrs, used=2, k=2)
    assert (b.best_lr, b.bracketed, b.next_lrs, b.status) == (5e-4, False, [], "cap")
    rec = A.lr_record(b, "DIFF", k=2)
    assert rec["bracketed"] is False and rec["lr_extensions"] == 2
    assert "DIFF's best learning rate, 0.0005, is still the lowest learning rate tried (0.0005 to 0.004)" in \
        rec["lr_note"]
    assert "after 2 extensions (--lr-extensions 2)" in rec["lr_note"]
    assert A.bracket_arm(_sweep(_bowl(1e-5), lrs), lrs, used=0, k=0).status == "cap"


def test_diverged_edge_is_not_best_and_missing_cells_wait():
    lrs = [1e-3, 2e-3, 4e-3]
    sw = _sweep(_bowl(1e-1), lrs)
    sw[4e-3] = [2.0, math.inf, 2.0]  # one seed diverged at the top: that LR can never be the best
    b = A.bracket_arm(sw, lrs, used=0, k=2)
    assert (b.best_lr, b.bracketed) == (2e-3, True)
    del sw[4e-3]
    w = A.bracket_arm(sw, lrs, used=0, k=2)
    assert (w.status, w.best_lr, w.next_lrs) == ("incomplete", None, [])


def test_single_lr_extends_both_ways():
    b = A.bracket_arm({1e-3: [2.0, 2.1]}, [1e-3], used=0, k=2)
    assert b.next_lrs == [5e-4, 2e-3]
    capped = A.bracket_arm({1e-3: [2.0, 2.1]}, [1e-3], used=0, k=0)
    assert A.unbracketed_sentence("DIFF", capped, k=0) == (
        "DIFF's best learning rate, 0.001, is still the only learning rate tried with no extensions allowed "
        "(--lr-extensions 0), so DIFF may do better at another one: this verdict may understate it.")
    assert A.max_extension_cells({"diff": [1e-3], "standard": [1e-3, 2e-3]}, n_seeds=3, k=2) == 3 * 3 + 2 * 3
    assert A.max_extension_cells({"diff": [1e-3]}, n_seeds=3, k=0) == 0


def _bracket_arms(sweeps, lrs, used, k):
    """A.bracket_arm for every arm, as the study's lr_brackets asks it (study/collect.py)."""
    return {arm: A.bracket_arm(sweeps.get(arm, {}), arm_lrs, used[arm], k) for arm, arm_lrs in lrs.items()}


def test_bracketing_loop_converges_reuses_cells_and_never_exceeds_the_planned_bound():
    """A study loop over two arms on fake results: DIFF's optimum lies two steps below the grid, the baseline's
    inside it. Running only what bracket_arm asks of each arm, then calling it again on the same finished cells
    (a resume,
    or another worker), proposes nothing new: no cell runs twice."""
    optimum = {"diff": 2.4e-4, "standard": 2e-3}
    lrs = {arm: [1e-3, 2e-3, 4e-3] for arm in optimum}
    ran: dict[str, dict[float, list[float]]] = {arm: _sweep(_bowl(o), lrs[arm]) for arm, o in optimum.items()}
    n_base = sum(len(v) for v in ran.values()) * 3
    used = {arm: 0 for arm in optimum}
    runs: list[tuple[str, float]] = []
    for _ in range(10):
        plan = _bracket_arms(ran, lrs, used, k=2)
        todo = {arm: b.next_lrs for arm, b in plan.items() if b.next_lrs}
        if not todo:
            break
        for arm, new in todo.items():
            for lr in new:
                assert lr not in ran[arm]
                ran[arm].update(_sweep(_bowl(optimum[arm]), [lr]))
                runs.append((arm, lr))
            lrs[arm] = lrs[arm] + new
            used[arm] += 1
    assert runs == [("diff", 5e-4), ("diff", 2.5e-4)]
    final = _bracket_arms(ran, lrs, used, k=2)
    assert final["diff"].best_lr == 2.5e-4 and final["diff"].status == "cap" and not final["diff"].bracketed
    assert final["standard"].bracketed and final["standard"].lr_extensions == 0
    assert _bracket_arms(ran, lrs, used, k=2) == final  # a resumed study decides the same
    assert len(runs) * 3 <= A.max_extension_cells({a: [1e-3, 2e-3, 4e-3] for a in optimum}, 3, 2)
    assert n_base == 18
    # with one more round allowed, 1.25e-4 is worse than 2.5e-4: DIFF ends bracketed
    ran["diff"].update(_sweep(_bowl(optimum["diff"]), [1.25e-4]))
    b = A.bracket_arm(ran["diff"], lrs["diff"] + [1.25e-4], used=3, k=3)
    assert (b.best_lr, b.bracketed, b.status) == (2.5e-4, True, "bracketed")


def test_bad_bracketing_arguments():
    with pytest.raises(ValueError, match="factor must be > 1"):
        A.bracket_arm({1e-3: [1.0]}, [1e-3], 0, 2, factor=1.0)
    with pytest.raises(ValueError, match="no learning rates"):
        A.bracket_arm({}, [], 0, 2)


# ------------------------------------------------------------------------------------- gap over training
STEPS = [100, 200, 300, 400, 500, 600]
# Known numbers: per seed the paired difference at each step.
DIFFS = {0: [0.30, 0.20, 0.12, 0.10, 0.08, 0.06],
         1: [0.25, 0.18, 0.10, 0.09, 0.06, 0.05],
         2: [0.35, 0.22, 0.15, 0.12, 0.11, 0.09]}


def _curves():
    base = {s: {t: 3.0 - 0.001 * t + 0.05 * s for t in STEPS} for s in DIFFS}
    cand = {s: {t: base[s][t] + DIFFS[s][i] for i, t in enumerate(STEPS)} for s in DIFFS}
    return cand, base


def test_trajectory_interval_matches_scipy():
    cand, base = _curves()
    traj = A.gap_trajectory(cand, base, tokens_per_step=8 * 128)
    assert [p["step"] for p in traj] == STEPS
    assert [p["tokens"] for p in traj] == [t * 1024 for t in STEPS]
    for i, p in enumerate(traj):
        d = np.array([DIFFS[s][i] for s in sorted(DIFFS)])
        ci = st.ttest_1samp(d, 0.0).confidence_interval(0.95)
        assert p["diff_minus_baseline"] == pytest.approx(d.mean(), abs=1e-12)
        assert p["ci95"] == pytest.approx([ci.low, ci.high], abs=1e-12)
        assert p["seeds"] == 3
    # step 100 by hand: mean 0.30, s = 0.05, t(0.975, 2) = 4.302653 -> 0.30 ± 0.124207
    assert traj[0]["ci95"] == pytest.approx([0.30 - 0.124207, 0.30 + 0.124207], abs=1e-6)


def test_trajectory_keeps_common_steps_and_seeds_only():
    cand, base = _curves()
    del cand[0][300]  # an evaluation missing in one seed drops that step for all
    base[7] = dict(base[0])  # a seed the candidate lacks is not paired
    traj = A.gap_trajectory(cand, base, 1)
    assert [p["step"] for p in traj] == [100, 200, 400, 500, 600] and traj[0]["seeds"] == 3
    one = A.gap_trajectory({0: cand[0]}, {0: base[0]}, 1)
    assert one[0]["ci95"] == [None, None] and one[0]["diff_minus_baseline"] == pytest.approx(0.30)


def test_gap_slope_per_seed_least_squares_then_t():
    cand, base = _curves()
    s = A.gap_slope(cand, base, tokens_per_step=1000)
    assert s["steps"] == [500, 600] and s["points"] == 2  # last third of 6 points
    window = [4, 5]
    slopes = [st.linregress([STEPS[i] for i in window], [DIFFS[k][i] for i in window]).slope * 1000 for k in DIFFS]
    ci = st.ttest_1samp(slopes, 0.0).confidence_interval(0.95)
    assert s["slope_per_1k_steps"] == pytest.approx(np.mean(slopes))
    assert s["ci95"] == pytest.approx([ci.low, ci.high])
    assert s["slope_per_1m_tokens"] == pytest.approx(np.mean(slopes))  # 1,000 steps × 1,000 tokens = 1M
    assert s["trend"] == A.NARROWING and s["sentence"].startswith("The gap is narrowing over the last third")


def test_gap_slope_trends():
    steps = list(range(100, 1001, 100))
    base = {s: {t: 2.0 for t in steps} for s in range(3)}

    def cand(f):
        return {s: {t: 2.0 + f(t, s) for t in steps} for s in range(3)}

    assert A.gap_slope(cand(lambda t, s: 0.05 + 1e-4 * t + 0.001 * s), base, 1)["trend"] == A.WIDENING
    assert A.gap_slope(cand(lambda t, s: -0.2 + 1e-4 * t + 0.001 * s), base, 1)["trend"] == A.NARROWING
    noisy = A.gap_slope(cand(lambda t, s: 0.03 + 1e-5 * t * (1 if s % 2 else -1)), base, 1)
    assert noisy["trend"] == A.NO_TREND and "no detectable trend" in noisy["sentence"]
    assert noisy["points"] == 4  # ceil(10 / 3)
    single = A.gap_slope({0: cand(lambda t, s: 0.1)[0]}, {0: base[0]}, 1)
    assert single["trend"] == A.UNDETERMINED and single["ci95"] == [None, None]


def test_val_curve_from_history():
    hist = [{"step": 10, "val_loss": None}, {"step": 20, "val_loss": 2.5}, {"step": 25, "train_loss": 2.0},
            {"step": 30, "val_loss": float("nan")}]
    assert A.val_curve(hist) == {20: 2.5, 30: math.inf}


def test_arm_curves_and_gap_analysis_from_cells():
    cand, base = _curves()

    def cells(arm, curves, lr):
        return [{"arm": arm, "lr": lr, "seed": s, "d_model": 128,
                 "history": [{"step": t, "val_loss": v, "train_loss": 0.0} for t, v in c.items()]}
                for s, c in curves.items()]

    all_cells = cells("diff", cand, 1e-3) + cells("standard", base, 2e-3) + cells("diff", base, 2e-3)
    c, b = A.arm_curves(all_cells, "diff", 1e-3, 128), A.arm_curves(all_cells, "standard", 2e-3, 128)
    assert c == cand and b == base and A.arm_curves(all_cells, "diff", 1e-3, 64) == {}
    g = A.gap_analysis(c, b, 1024)
    assert g["trajectory"] == A.gap_trajectory(cand, base, 1024) and g["trend"]["trend"] == A.NARROWING
    assert "reason" in g["token_ratio"]  # the candidate is above the baseline everywhere: never reaches it


# -------------------------------------------------------------------------------------- token efficiency
def test_tokens_to_reach_interpolates_the_first_crossing():
    tokens = [100, 200, 300, 400]
    assert A.tokens_to_reach(tokens, [3.0, 2.0, 1.5, 1.0], 1.75) == pytest.approx(250.0)
    assert A.tokens_to_reach(tokens, [3.0, 2.0, 2.5, 1.0], 2.0) == 200.0  # first crossing, exactly on a point
    assert A.tokens_to_reach(tokens, [3.0, 1.8, 2.5, 1.0], 2.2) == pytest.approx(100 + 0.8 / 1.2 * 100)
    assert A.tokens_to_reach(tokens, [1.0, 0.9, 0.8, 0.7], 2.0) == 100.0  # already there at the first point
    assert A.tokens_to_reach(tokens, [3.0, 2.9, 2.8, 2.7], 2.0) is None


def test_token_ratio_known_answer():
    """Baseline: L(T) = 1 + 1000 / T; the candidate is the same curve with tokens scaled by r_s, so it reaches
    the baseline's final loss exactly at r_s of the baseline's tokens (the curve is linear in 1/T, not in T,
    so the evaluations are dense enough that interpolation is close; the exact value is checked on a
    piecewise-linear curve below)."""
    steps = list(range(10, 1001, 10))
    tps = 100
    ratios = {0: 0.6, 1: 0.65, 2: 0.7}
    base = {s: {t: 1 + 1000 / (t * tps) for t in steps} for s in ratios}
    cand = {s: {t: 1 + 1000 / (t * tps / r) for t in steps} for s, r in ratios.items()}
    r = A.token_ratio(cand, base, tps)
    assert [p["ratio"] for p in r["per_seed"]] == pytest.approx(list(ratios.values()), abs=2e-3)
    ci = st.ttest_1samp([p["ratio"] for p in r["per_seed"]], 0.0).confidence_interval(0.95)
    assert r["mean"] == pytest.approx(0.65, abs=2e-3) and r["ci95"] == pytest.approx([ci.low, ci.high])
    assert r["target_loss"] == pytest.approx(1 + 1000 / (1000 * tps))
    assert A.token_ratio_text(r).startswith("0.65 [")
    assert "with 0.65 [" in A.token_ratio_sentence(r) and "~64%" in A.token_ratio_sentence(r)


def test_token_ratio_exact_on_piecewise_linear_curves():
    steps = [1, 2, 3, 4]
    base = {0: dict(zip(steps, [4.0, 3.0, 2.5, 2.0])), 1: dict(zip(steps, [4.0, 3.0, 2.5, 2.2]))}
    cand = {0: dict(zip(steps, [3.5, 2.5, 2.0, 1.8])), 1: dict(zip(steps, [3.5, 2.0, 1.9, 1.8]))}
    r = A.token_ratio(cand, base, tokens_per_step=10)
    # seed 0: target 2.0 first reached at step 3 -> 30/40; seed 1: target 2.2 between steps 1 and 2 at
    # 1 + (3.5 − 2.2)/(3.5 − 2.0) = 1.8667 -> 18.667/40
    assert [p["ratio"] for p in r["per_seed"]] == pytest.approx([0.75, (1 + 1.3 / 1.5) / 4])
    assert r["target_loss"] == pytest.approx(2.1)


def test_token_ratio_never_reached():
    steps = [1, 2, 3, 4]
    base = {0: dict(zip(steps, [4.0, 3.0, 2.5, 2.0])), 1: dict(zip(steps, [4.0, 3.0, 2.5, 2.0]))}
    cand = {0: dict(zip(steps, [3.5, 2.5, 2.0, 1.8])), 1: dict(zip(steps, [4.0, 3.5, 3.0, 2.5]))}
    r = A.token_ratio(cand, base, 10)
    assert "mean" not in r and "seed(s) 1" in r["reason"] and r["lower_bound"] == 1.0
    assert r["per_seed"][1]["ratio"] is None and r["per_seed"][0]["ratio"] == pytest.approx(0.75)
    assert A.token_ratio_text(r) == "> 1 (not reached)"
    assert A.token_ratio_sentence(r).startswith("Token efficiency: > 1 (not reached): the candidate never reaches")
    short = A.token_ratio({1: {1: 4.0, 2: 3.5}}, {1: base[1]}, 10)
    assert A.token_ratio_text(short) == "> 0.50 (not reached)"
    assert A.token_ratio({}, {}, 10)["reason"].startswith("no paired seed")


# ----------------------------------------------------------------------------------------- head width
def _n_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return TransformerLM(cfg).num_params()


@pytest.mark.parametrize("d_model,head_dim", [(128, 32), (128, 64), (256, 64), (192, 32)])
def test_head_dim_parameter_counts_per_arm(d_model, head_dim):
    layers = 2
    cfgs = {}
    for att in ("standard", "diff", "diff_v2", "distance", "diff_distance"):
        h = head_counts(d_model, head_dim, att)
        cfgs[att] = ModelConfig(vocab_size=64, d_model=d_model, n_layers=layers, n_heads=h, attention=att)
        assert cfgs[att].qk_head_dim == head_dim
    base_heads = d_model // head_dim
    assert cfgs["standard"].n_heads == base_heads and cfgs["diff"].n_heads * 2 == base_heads
    assert cfgs["diff_v2"].n_heads == base_heads
    n = {att: _n_params(c) for att, c in cfgs.items()}
    # DIFF vs its matched baseline: only λq1, λk1, λq2, λk2 (D each) and the sub-layer norm gain (2D), per layer
    assert n["diff"] - n["standard"] == layers * 6 * head_dim
    # V2: a second query head per head (d_model × h·D more) and W_λ (d_model × h), per layer
    assert n["diff_v2"] - n["standard"] == layers * (d_model * base_heads * head_dim + d_model * base_heads)
    # distance-aware: the same 6D, and (w, v) per query sub-head on both sides (2 × 2·h/2 vs 2 × h): equal
    assert n["diff_distance"] - n["distance"] == layers * 6 * head_dim


def test_head_counts_errors_are_one_line():
    with pytest.raises(ValueError, match=r"--head-dim 32 does not fit d_model 96 for diff: .* multiple of "
                                         r"2·head-dim \(64\)"):
        head_counts(96, 32, "diff")
    assert head_counts(96, 32, "standard") == 3
    with pytest.raises(ValueError, match="does not fit d_model 100 for standard"):
        head_counts(100, 32, "standard")
    with pytest.raises(ValueError, match="positive int"):
        head_counts(128, 0, "diff")
    with pytest.raises(ValueError, match="unknown attention"):
        head_counts(128, 32, "nope")


@pytest.mark.parametrize("d_model,head_dim,base_heads", [
    (128, 32, 4), (256, 64, 4), (512, 128, 4), (2048, 128, 16), (3072, 128, 24), (64, 32, 2), (96, 48, 2),
    (32, 16, 2),
])
def test_default_head_dim_follows_the_advice(d_model, head_dim, base_heads):
    assert default_head_dim(d_model) == head_dim
    assert head_counts(d_model, head_dim, "standard") == base_heads
    assert head_counts(d_model, head_dim, "diff") == base_heads // 2


def test_default_head_dim_impossible():
    with pytest.raises(ValueError, match="multiple of 4"):
        default_head_dim(6)
