"""The analysis a reviewer needs on top of a ``diffattn study`` verdict (issue 16): per-arm learning-rate bracketing,
the DIFF − baseline gap over training and token efficiency (the paper's metric). Pure functions on plain numbers: a
*sweep* is ``{lr: [final val loss per seed]}`` of one arm (diverged: inf), a *curve* ``{seed: {step: val loss}}`` of
one arm at its best LR (its in-training evaluations, :func:`val_curve`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffattn.experiments.findings import stats

DEFAULT_LR_FACTOR = 2.0
PAPER_TOKEN_RATIO = 0.64  # DIFF matches the Transformer's loss with ~64% of its training tokens (Ye et al. 2024)

NARROWING = "narrowing"
WIDENING = "widening"
NO_TREND = "no detectable trend"
UNDETERMINED = "undetermined"


# ============================================================================ 1. per-arm LR bracketing
@dataclass
class Bracket:
    """One arm's learning-rate state after the cells of its current LR list.

    ``lrs``: every LR tried (sorted); ``best_lr``: lowest mean loss over seeds (None until every LR has a
    result); ``bracketed``: the best is strictly inside ``lrs`` (a lower and a higher LR were both worse);
    ``next_lrs``: LRs to run next (empty: done, or waiting for cells); ``lr_extensions``: rounds used so far;
    ``status``: "bracketed" | "extend" | "cap" (edge best, K rounds used) | "incomplete" (cells missing)."""

    lrs: list[float]
    best_lr: float | None
    bracketed: bool
    next_lrs: list[float] = field(default_factory=list)
    lr_extensions: int = 0
    status: str = "incomplete"


def _tidy_lr(lr: float) -> float:
    # ×2 / ÷2 are exact in binary; other factors (×3) are not, and an LR is part of a cell's folder name
    # (``lr{lr:g}``, 6 digits), so round to what the name shows: a rerun then finds the same cells.
    return float(f"{lr:.6g}")


def bracket_arm(sweep: Mapping[float, Sequence[float]], lrs: Sequence[float], used: int,
                k: int, factor: float = DEFAULT_LR_FACTOR) -> Bracket:
    """Decide one arm: is its best LR bracketed, and if not, which LR(s) to add beyond the edge where it sits.

    ``sweep``: {lr: [loss per seed]} of the finished cells; ``lrs``: the arm's LR list so far (the base list plus
    earlier extensions); ``used``: extension rounds already run; ``k``: the cap (``--lr-extensions``);
    ``factor`` > 1: the step beyond an edge (best at the lowest LR -> lowest / factor, at the highest -> highest ·
    factor; a single-LR list is extended both ways). Pure and deterministic, so a resumed or parallel study that
    calls it on the same finished cells gets the same answer, and an LR already in ``lrs`` is never proposed."""
    if factor <= 1:
        raise ValueError(f"the LR extension factor must be > 1, got {factor}")
    if k < 0 or used < 0:
        raise ValueError(f"--lr-extensions and the rounds used must be >= 0, got {k} and {used}")
    tried = sorted({float(x) for x in lrs})
    if not tried:
        raise ValueError("bracket_arm: the arm has no learning rates")
    if any(not sweep.get(lr) for lr in tried):  # wait for the arm's cells: a missing LR could be the best
        return Bracket(tried, None, False, [], used, "incomplete")
    best = stats.best_lr({lr: sweep[lr] for lr in tried})
    lo_edge, hi_edge = best == tried[0], best == tried[-1]
    if not (lo_edge or hi_edge):
        return Bracket(tried, best, True, [], used, "bracketed")
    if used >= k:
        return Bracket(tried, best, False, [], used, "cap")
    nxt = ([_tidy_lr(tried[0] / factor)] if lo_edge else []) + ([_tidy_lr(tried[-1] * factor)] if hi_edge else [])
    return Bracket(tried, best, False, [x for x in nxt if x not in tried], used, "extend")


def unbracketed_sentence(label: str, b: Bracket, k: int) -> str | None:
    """A plain sentence for the verdict when the arm's best LR is still at an edge; None when it is bracketed
    (or the arm is not finished, which the verdict reports elsewhere)."""
    if b.bracketed or b.best_lr is None:
        return None
    span = f" ({b.lrs[0]:g} to {b.lrs[-1]:g})"
    if len(b.lrs) == 1:
        side, way, span = "the only learning rate tried", "another", ""
    elif b.best_lr == b.lrs[0]:
        side, way = "the lowest learning rate tried", "a lower"
    else:
        side, way = "the highest learning rate tried", "a higher"
    after = (f"after {b.lr_extensions} extension{'s' * (b.lr_extensions != 1)} (--lr-extensions {k})"
             if b.lr_extensions or k else "with no extensions allowed (--lr-extensions 0)")
    return (f"{label}'s best learning rate, {b.best_lr:g}, is still {side}{span} {after}, so {label} may do "
            f"better at {way} one: this verdict may understate it.")


def lr_record(b: Bracket, label: str, k: int) -> dict[str, Any]:
    """The per-arm LR fields of results.json."""
    return {"lrs": list(b.lrs), "best_lr": b.best_lr, "bracketed": b.bracketed, "lr_extensions": b.lr_extensions,
            "lr_note": unbracketed_sentence(label, b, k)}


def max_extension_cells(lrs: Mapping[str, Sequence[float]], n_seeds: int, k: int) -> int:
    """The most cells LR extensions can add to a grid, for the budget planner: per arm and round one LR × the
    seeds, except that a single-LR arm's first round adds two (its best is at both edges). ``lrs``: {arm: base
    LR list}. An upper bound: arms whose best is interior stop early."""
    return sum((k + (1 if k and len(set(arm_lrs)) == 1 else 0)) * n_seeds for arm_lrs in lrs.values())


# ============================================================================ 2. the gap over training
def val_curve(history: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """{step: val loss} from a cell's ``history`` rows: the rows with an evaluation (``val_loss`` not None).
    Training stops at a non-finite loss, so a diverged cell's curve simply ends early; a non-finite value that
    does appear becomes inf (worse than any loss)."""
    out: dict[int, float] = {}
    for row in history:
        v = row.get("val_loss")
        if v is not None:
            out[int(row["step"])] = float(v) if math.isfinite(float(v)) else math.inf
    return out


def arm_curves(cells: Sequence[Mapping[str, Any]], arm: str, lr: float, d_model: int) -> dict[int, dict[int, float]]:
    """{seed: {step: val loss}} of one arm at one LR and size, from finished cells' result.json dicts."""
    return {int(c["seed"]): val_curve(c.get("history") or []) for c in cells
            if c["arm"] == arm and c["lr"] == lr and c["d_model"] == d_model}


def gap_analysis(candidate: Mapping[int, Mapping[int, float]], baseline: Mapping[int, Mapping[int, float]],
                 tokens_per_step: int) -> dict[str, Any]:
    """What the verdict says about the curves (each arm's at its best LR), for results.json."""
    return {"trajectory": gap_trajectory(candidate, baseline, tokens_per_step),
            "trend": gap_slope(candidate, baseline, tokens_per_step),
            "token_ratio": token_ratio(candidate, baseline, tokens_per_step)}


def finite(x: float) -> float | None:
    """``x``, or None for inf / nan (JSON has neither)."""
    return x if math.isfinite(x) else None


def mean_ci(values: Sequence[float]) -> tuple[float, list[float | None]]:
    """(mean, [lo, hi]) of ``values``: :func:`stats.t_interval`'s 95% interval, its bounds as results.json keeps them
    (None for none)."""
    mean, lo, hi = stats.t_interval(values)
    return mean, [finite(lo), finite(hi)]


def _paired(candidate: Mapping[int, Mapping[int, float]],
            baseline: Mapping[int, Mapping[int, float]]) -> tuple[list[int], list[int]]:
    """(the seeds both curves have, the evaluation steps both have in every one of them)."""
    seeds = sorted(set(candidate) & set(baseline))
    return seeds, sorted(set.intersection(*(set(candidate[s]) & set(baseline[s]) for s in seeds))) if seeds else []


def gap_trajectory(candidate: Mapping[int, Mapping[int, float]], baseline: Mapping[int, Mapping[int, float]],
                   tokens_per_step: int) -> list[dict[str, Any]]:
    """The paired difference candidate − baseline (curves) at every evaluation step both arms have in every paired
    seed: ``[{step, tokens, diff_minus_baseline, ci95, seeds}]`` by step, ci95 the Student-t interval over seeds
    ([None, None] with one). Steps missing in some seed are left out, so every point has the same seeds."""
    seeds, steps = _paired(candidate, baseline)
    out = []
    for step in steps:
        d = stats.paired_difference({s: candidate[s][step] for s in seeds}, {s: baseline[s][step] for s in seeds})
        lo, hi = d["ci95"]
        out.append({"step": step, "tokens": step * tokens_per_step, "diff_minus_baseline": finite(d["mean"]),
                    "ci95": [finite(lo), finite(hi)], "seeds": len(seeds)})
    return out


def gap_slope(candidate: Mapping[int, Mapping[int, float]], baseline: Mapping[int, Mapping[int, float]],
              tokens_per_step: int, fraction: float = 1 / 3) -> dict[str, Any]:
    """Is the gap narrowing? The slope of candidate − baseline over the last ``fraction`` of the common evaluations:
    per seed the least-squares slope of its paired difference against step, then the Student-t interval of those
    slopes over seeds (the seeds are the replicates; pooling a seed's successive evaluations in one OLS would make the
    interval too narrow). -> ``{slope_per_1k_steps, ci95, slope_per_1m_tokens, ci95_per_1m_tokens, steps, points,
    seeds, mean_gap, trend, sentence}``; ``trend``: "narrowing" (the interval lies on the side that moves the mean gap
    towards 0), "widening", "no detectable trend", or "undetermined" (fewer than 2 seeds or 2 points)."""
    seeds, steps = _paired(candidate, baseline)
    n_win = max(2, math.ceil(len(steps) * fraction))
    window = steps[-n_win:]
    base = {"steps": [window[0], window[-1]] if window else None, "points": len(window), "seeds": len(seeds)}
    if len(window) < 2:
        return {**base, "slope_per_1k_steps": None, "ci95": [None, None], "slope_per_1m_tokens": None,
                "ci95_per_1m_tokens": [None, None], "mean_gap": None, "trend": UNDETERMINED,
                "sentence": "The gap's trend is undetermined: fewer than 2 common evaluation points."}
    x = np.asarray(window, dtype=np.float64)
    diffs = np.array([[candidate[s][t] - baseline[s][t] for t in window] for s in seeds])
    slopes = [float(np.polyfit(x, d, 1)[0]) * 1000 for d in diffs] if np.all(np.isfinite(diffs)) else []
    mean, lo, hi = stats.t_interval(slopes) if slopes else (math.nan, math.nan, math.nan)
    gap = float(diffs.mean()) if diffs.size else math.nan
    trend = _trend(gap, lo, hi)
    per_tok = 1e6 / (1000 * tokens_per_step)  # nats per 1k steps -> nats per million tokens
    out = {**base, "slope_per_1k_steps": finite(mean), "ci95": [finite(lo), finite(hi)],
           "slope_per_1m_tokens": finite(mean * per_tok),
           "ci95_per_1m_tokens": [finite(lo * per_tok), finite(hi * per_tok)], "mean_gap": finite(gap), "trend": trend}
    out["sentence"] = _slope_sentence(out)
    return out


def _trend(gap: float, lo: float, hi: float) -> str:
    if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(gap)):
        return UNDETERMINED
    if lo <= 0 <= hi or gap == 0:
        return NO_TREND
    towards_zero = hi < 0 if gap > 0 else lo > 0
    return NARROWING if towards_zero else WIDENING


def _slope_sentence(s: dict) -> str:
    where = f"over the last third (steps {s['steps'][0]:,} to {s['steps'][1]:,}, {s['points']} evaluations)"
    if s["trend"] == UNDETERMINED:
        return (f"The gap's trend {where} is undetermined: it needs at least 2 paired seeds "
                f"({s['seeds']} here) with finite losses.")
    lo, hi = s["ci95"]
    nums = (f"slope {s['slope_per_1k_steps']:+.4f} nats per 1,000 steps, 95% CI [{lo:+.4f}, {hi:+.4f}] "
            f"(per-seed least squares, Student t over {s['seeds']} seeds; mean gap {s['mean_gap']:+.4f} nats)")
    head = {NARROWING: "The gap is narrowing", WIDENING: "The gap is widening",
            NO_TREND: "The gap shows no detectable trend"}[s["trend"]]
    return f"{head} {where}: {nums}."


def bits_per_char(loss: float | None, chars_per_token: float) -> float | None:
    """A loss in nats/token as bits/char; None for none or a non-finite one."""
    return None if loss is None or not math.isfinite(loss) else loss / chars_per_token / math.log(2)


def comparison(cand: Mapping[str, Any], base: Mapping[str, Any], cells: Sequence[Mapping[str, Any]], d_model: int,
               tokens_per_step: int, chars_per_token: float) -> dict[str, Any]:
    """The paired verdict of arm ``cand`` against arm ``base`` (results.json's arm entries) at each one's best LR,
    with the gap over training (``trajectory``, ``trend``: :func:`gap_analysis` of their curves from ``cells`` at
    ``d_model``), the token ratio and a note for each arm whose best LR is still at an edge."""
    d = stats.paired_difference(*({s["seed"]: math.inf if s["val_loss"] is None else s["val_loss"]
                                     for s in arm["seeds"]} for arm in (cand, base)))
    lo, hi = d["ci95"]
    curves = [arm_curves(cells, x["name"], x["best_lr"], d_model) for x in (cand, base)]
    return {"candidate": cand["name"], "baseline": base["name"], "diff_minus_baseline": finite(d["mean"]),
            "ci95": [finite(lo), finite(hi)], "conclusion": d["conclusion"], "seeds": d["seeds"],
            "differences": [finite(x) for x in d["differences"]],
            "bpc_diff_minus_baseline": bits_per_char(d["mean"], chars_per_token),
            "bpc_ci95": [bits_per_char(lo, chars_per_token), bits_per_char(hi, chars_per_token)],
            "candidate_lr": cand["best_lr"], "baseline_lr": base["best_lr"], **gap_analysis(*curves, tokens_per_step),
            "unbracketed": [x["lr_note"] for x in (cand, base) if x.get("lr_note")],
            "candidate_params": cand["params"], "baseline_params": base["params"],
            "param_difference": (cand["params"] - base["params"]) / base["params"]}


# ============================================================================ 3. token efficiency
def tokens_to_reach(tokens: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """Tokens at which a loss-vs-tokens curve first reaches ``target``, by linear interpolation between the two
    evaluations around the first crossing; None if it never does. If the first evaluation is already at or
    below the target, its tokens (an upper bound: nothing is known before it). ``tokens`` increasing."""
    t = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    below = np.nonzero(y <= target)[0]
    if below.size == 0:
        return None
    i = int(below[0])
    if i == 0:
        return float(t[0])
    t0, t1, y0, y1 = t[i - 1], t[i], y[i - 1], y[i]
    if not math.isfinite(y0):  # a diverged point before the crossing: no line to interpolate on
        return float(t1)
    return float(t0 + (y0 - target) / (y0 - y1) * (t1 - t0))


def token_ratio(candidate: Mapping[int, Mapping[int, float]], baseline: Mapping[int, Mapping[int, float]],
                tokens_per_step: int) -> dict[str, Any]:
    """The paper's token efficiency: per paired seed, the tokens the candidate needs to reach the baseline's final
    validation loss (the last point of its curve, the same sampled batches) over the baseline's tokens, then the mean
    and Student-t 95% interval; below 1: fewer tokens. -> ``{mean, ci95, target_loss, per_seed}``, or, when the
    candidate never reaches the target in some seed, ``{reason, lower_bound, target_loss, per_seed}`` (a censored seed
    has no ratio, and dropping it would bias the mean down; ``lower_bound``: its last tokens over the baseline's)."""
    seeds = sorted(set(candidate) & set(baseline))
    per_seed, missing = [], []
    for s in seeds:
        bsteps, csteps = sorted(baseline[s]), sorted(candidate[s])
        if not bsteps or not csteps:
            continue
        target = baseline[s][bsteps[-1]]
        b_tok = bsteps[-1] * tokens_per_step
        got = tokens_to_reach([t * tokens_per_step for t in csteps], [candidate[s][t] for t in csteps], target)
        per_seed.append({"seed": s, "target_loss": target, "tokens": got, "baseline_tokens": b_tok,
                         "ratio": None if got is None else got / b_tok})
        if got is None:
            missing.append((s, csteps[-1] * tokens_per_step / b_tok))
    targets = [p["target_loss"] for p in per_seed]
    target_loss = finite(float(np.mean(targets))) if targets else None
    if not per_seed:
        return {"reason": "no paired seed with validation curves", "lower_bound": None, "target_loss": None,
                "per_seed": []}
    if missing:
        return {"reason": f"the candidate never reaches the baseline's final validation loss in seed(s) "
                          f"{', '.join(str(s) for s, _ in missing)}",
                "lower_bound": min(b for _, b in missing), "target_loss": target_loss, "per_seed": per_seed}
    mean, lo, hi = stats.t_interval([p["ratio"] for p in per_seed])
    return {"mean": mean, "ci95": [finite(lo), finite(hi)], "target_loss": target_loss, "per_seed": per_seed}


def token_ratio_text(r: Mapping[str, Any]) -> str:
    """The report's cell for :func:`token_ratio`: "0.81 [0.74, 0.88]", "0.81 (1 seed, no interval)", or
    "> 1 (not reached)" (the bound shown when the candidate ran fewer tokens than the baseline)."""
    if "mean" not in r:
        b = r.get("lower_bound")
        return "> 1 (not reached)" if b is None or abs(b - 1) < 1e-9 else f"> {b:.2f} (not reached)"
    lo, hi = r["ci95"]
    if lo is None:
        return f"{r['mean']:.2f} ({len(r['per_seed'])} seed, no interval)"
    return f"{r['mean']:.2f} [{lo:.2f}, {hi:.2f}]"


def token_ratio_sentence(r: Mapping[str, Any], candidate: str = "DIFF", baseline: str = "the baseline") -> str:
    """The report's sentence for :func:`token_ratio`, next to the paper's figure (160B DIFF tokens matched a
    251B-token Transformer, 63.7%, at 3B parameters: Ye et al. 2024, scaling study)."""
    target = r.get("target_loss")
    loss = f" ({target:.4f} nats/token, mean over seeds)" if target is not None else ""
    paper = f"the paper reports ~{PAPER_TOKEN_RATIO:.0%} at 3B parameters"
    if "mean" in r:
        return (f"Token efficiency: {candidate} reaches {baseline}'s final validation loss{loss} with "
                f"{token_ratio_text(r)} of {baseline}'s training tokens (per paired seed, linear interpolation on "
                f"the loss-vs-tokens curve; Student-t 95% CI; below 1 is fewer tokens); {paper}.")
    return (f"Token efficiency: {token_ratio_text(r)}: {r['reason']}{loss}, so it needs more tokens than "
            f"{baseline} was trained on; {paper}.")


# ============================================================================ 4. the size ladder
def size_ladder(points: Mapping[str, Mapping[str, Any]], pairs: Sequence[tuple[str, str]], sizes: Sequence[int],
                base_d: int) -> dict[str, Any]:
    """What a size ladder says. ``points``: {arm: {"lr": its best LR, "sizes": {d_model: (non-embedding parameters,
    [val loss per seed])}}}; ``pairs``: (candidate, baseline) arms to match. -> ``{"sizes", "arms": {arm: {"lr",
    "points": [{d_model, non_embedding_params, val_loss_mean, val_loss_ci95, seeds}], "fit"}}, "matches"}``: per arm
    the fit L = alpha − beta·ln N (N = non-embedding parameters; two sizes with a finite mean at least), and per pair
    the parameters the candidate's fit needs to reach its baseline's mean loss at ``base_d``."""
    arms: dict[str, dict] = {}
    for name, p in points.items():
        pts = []
        for d, (n, losses) in sorted(p["sizes"].items()):
            mean, ci = mean_ci(losses)
            pts.append({"d_model": d, "non_embedding_params": n, "val_loss_mean": finite(mean), "val_loss_ci95": ci,
                        "seeds": len(losses)})
        ok = [q for q in pts if q["val_loss_mean"] is not None]
        fit = None
        if len(ok) >= 2:
            alpha, beta = stats.fit_log_linear([q["non_embedding_params"] for q in ok],
                                               [q["val_loss_mean"] for q in ok])
            fit = {"alpha": alpha, "beta": beta, "form": "L = alpha - beta * ln(N)"}
        arms[name] = {"lr": p["lr"], "points": pts, "fit": fit}
    matches = []
    for cand, base in pairs:
        c, b = arms.get(cand), arms.get(base)
        bp = next((q for q in b["points"] if q["d_model"] == base_d), None) if b else None
        if not c or not c["fit"] or bp is None or bp["val_loss_mean"] is None:
            continue
        need = stats.params_to_match((c["fit"]["alpha"], c["fit"]["beta"]), bp["val_loss_mean"])
        ns = [q["non_embedding_params"] for q in c["points"]]
        matches.append({"candidate": cand, "baseline": base, "baseline_params": bp["non_embedding_params"],
                        "baseline_loss": bp["val_loss_mean"], "candidate_params_needed": finite(need),
                        "ratio": finite(need / bp["non_embedding_params"]),
                        "extrapolated": not (min(ns) <= need <= max(ns)) if math.isfinite(need) else True})
    return {"sizes": list(sizes), "arms": arms, "matches": matches}
