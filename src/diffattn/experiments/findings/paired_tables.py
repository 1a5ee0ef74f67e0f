"""Verdict tables over finished studies: every arm against a reference arm, per text and across texts (``diffattn
verdicts DIR [DIR ...] --against standard,diff_v2``), from each study's ``results.json`` (or what its finished cells
say so far: :func:`diffattn.experiments.study.collect.read_results`).

Per text: each arm at its own best LR, the per-seed paired difference arm − reference with its Student-t 95%
interval. Across texts: the equally weighted mean of the per-text mean differences (the texts are the population,
not a sample), standard error √(Σ_t s_t²/n_t) / N with Welch–Satterthwaite degrees of freedom, and the count of
texts where the arm is detectably better / worse; a text without paired seeds is left out (and said so)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from scipy import stats as _st

from diffattn.experiments.document import markdown_table
from diffattn.experiments.findings.stats import BETTER, WORSE, paired_difference, verdict


def best_seeds(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{arm name: {"label", "lr" (best), "losses" {seed: val loss at that LR}, "bracketed", "params"}}."""
    out = {}
    for a in results["arms"]:
        best = next((s for s in a["lr_sweep"] if s["lr"] == a["best_lr"]), None)
        losses = {} if best is None else {int(s["seed"]): float(s["val_loss"]) for s in best["seeds"]}
        out[a["name"]] = {"label": a["label"], "lr": a["best_lr"], "losses": losses,
                          "bracketed": a.get("bracketed"), "params": a.get("params")}
    return out


def text_rows(results: Mapping[str, Any], against: str) -> list[dict[str, Any]]:
    """One row per arm (the reference first): its best LR, mean loss, and the paired difference to ``against``
    with its interval and verdict (None for the reference itself). Sorted by mean loss after the reference."""
    arms = best_seeds(results)
    if against not in arms:
        raise ValueError(f"no arm {against!r} in this study; its arms: {sorted(arms)}")
    ref = arms[against]["losses"]
    rows = []
    for name, a in arms.items():
        mean = sum(a["losses"].values()) / len(a["losses"]) if a["losses"] else math.nan
        row = {"arm": name, "label": a["label"], "lr": a["lr"], "mean": mean, "bracketed": a["bracketed"],
               "params": a["params"], "diff": None}
        if name != against:
            row["diff"] = paired_difference(a["losses"], ref)
        rows.append(row)
    return sorted(rows, key=lambda r: (r["arm"] != against, r["mean"]))


def across(per_text: Sequence[Mapping[str, Any]], against: str) -> list[dict[str, Any]]:
    """Combine :func:`text_rows` of several texts (``per_text``: one ``results.json`` each) per arm (module
    docstring). Rows: arm, label, texts (how many entered), mean, ci95, conclusion, better / worse (texts)."""
    tables = [{r["arm"]: r for r in text_rows(res, against)} for res in per_text]
    names = [n for n in tables[0] if n != against]
    names += [n for t in tables[1:] for n in t if n != against and n not in names]
    rows = []
    for name in names:
        parts = [t[name]["diff"] for t in tables if name in t and len(t[name]["diff"]["differences"]) >= 2]
        label = next(t[name]["label"] for t in tables if name in t)
        if not parts:
            rows.append({"arm": name, "label": label, "texts": 0, "mean": math.nan, "ci95": [math.nan, math.nan],
                         "conclusion": verdict(math.nan, math.nan), "better": 0, "worse": 0})
            continue
        n = len(parts)
        means = [sum(p["differences"]) / len(p["differences"]) for p in parts]
        var_t = [statistics.variance(p["differences"]) / len(p["differences"]) for p in parts]  # s_t² / n_t
        mean = sum(means) / n
        se = math.sqrt(sum(var_t)) / n
        df = sum(var_t) ** 2 / sum(v**2 / (len(p["differences"]) - 1) for v, p in zip(var_t, parts)) if se else 1
        half = _st.t.ppf(0.975, df) * se if se else 0.0
        lo, hi = mean - half, mean + half
        rows.append({"arm": name, "label": label, "texts": n, "mean": mean, "ci95": [lo, hi],
                     "conclusion": verdict(lo, hi), "better": sum(p["conclusion"] == BETTER for p in parts),
                     "worse": sum(p["conclusion"] == WORSE for p in parts)})
    return sorted(rows, key=lambda r: r["mean"] if math.isfinite(r["mean"]) else math.inf)


def _ci(d: Mapping[str, Any] | None) -> str:
    if d is None:
        return ""
    lo, hi = d["ci95"]
    return f"{d['mean']:+.4f} [{lo:+.4f}, {hi:+.4f}]"


def text_markdown(results: Mapping[str, Any], against: Sequence[str]) -> str:
    """One table for one text: each arm's best LR, mean loss, and − each reference, paired [95% CI]."""
    tables = {ref: {r["arm"]: r for r in text_rows(results, ref)} for ref in against}
    head = ["arm", "best LR", "val loss (nats/token)"]
    for ref in against:
        head += [f"− {tables[ref][ref]['label']} [95% CI]", "verdict"]
    rows = []
    for r in text_rows(results, against[0]):
        note = "" if r["bracketed"] in (True, None) else " (LR not bracketed)"
        row = [f"{r['label']}{note}", f"{r['lr']:g}", f"{r['mean']:.4f}"]
        for ref in against:
            d = tables[ref][r["arm"]]["diff"]
            row += [_ci(d), "" if d is None else d["conclusion"]]
        rows.append(row)
    return markdown_table(head, rows)


def across_markdown(per_text: Sequence[Mapping[str, Any]], against: Sequence[str]) -> str:
    """One table over the texts: per reference, the averaged paired difference [95% CI], the verdict, and on
    how many texts the arm was detectably better / worse."""
    tables = {ref: {r["arm"]: r for r in across(per_text, ref)} for ref in against}
    order = [r["arm"] for r in across(per_text, against[0])]
    order += [against[0]] if len(against) > 1 else []  # the first reference against the others
    labels = {r["arm"]: r["label"] for res in per_text for r in text_rows(res, against[0])}
    head = ["arm"]
    for ref in against:
        head += [f"− {labels.get(ref, ref)}, mean over texts [95% CI]", "verdict", "texts better/worse"]
    rows = []
    for arm in order:
        row = [labels.get(arm, arm)]
        for ref in against:
            r = tables[ref].get(arm)
            row += ["", "", ""] if r is None else [_ci({"mean": r["mean"], "ci95": r["ci95"]}), r["conclusion"],
                                                   f"{r['better']}/{r['worse']} of {r['texts']}"]
        rows.append(row)
    return markdown_table(head, rows)


def verdicts_markdown(results: Sequence[Mapping[str, Any]], names: Sequence[str], against: Sequence[str]) -> str:
    """Per-text tables of ``results`` (one ``results.json`` each, headed by ``names``) and, with several, the across
    table."""
    if len(names) != len(results):
        raise ValueError(f"{len(names)} names for {len(results)} study folders")
    parts = [f"### {n}\n\n{text_markdown(r, against)}" for n, r in zip(names, results)]
    if len(results) > 1:
        parts.append(f"### across {len(results)} texts ({', '.join(names)})\n\n{across_markdown(results, against)}")
    return "\n\n".join(parts) + "\n"
