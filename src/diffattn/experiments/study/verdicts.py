"""Verdict tables over finished studies: every arm against a reference arm, per text and across texts (``diffattn
verdicts DIR [DIR ...] --against standard,diff_v2``). A study without ``results.json`` is read from its finished
cells, its LRs marked unbracketed where extensions have not run yet.

Per text: each arm at its own best LR, the per-seed paired difference arm − reference with its Student-t 95%
interval. Across texts: the equally weighted mean of the per-text mean differences (the texts are the population,
not a sample), standard error √(Σ_t s_t²/n_t) / N with Welch–Satterthwaite degrees of freedom, and the count of
texts where the arm is detectably better / worse; a text without paired seeds is left out (and said so)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scipy import stats as _st

from diffattn.experiments.document import markdown_table
from diffattn.experiments.study.stats import BETTER, WORSE, best_lr, paired_difference, verdict


def read_results(folder: str | Path) -> dict[str, Any]:
    """A finished study's ``results.json``; for a study still running (or stopped), the same from the cells
    finished so far (:func:`results_from_cells`). One line naming the file when neither can be read."""
    f = Path(folder) / "results.json"
    if not f.exists() and (Path(folder) / "cells").is_dir():
        return results_from_cells(folder)
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{f}: not a finished study's results ({type(e).__name__}: {e})") from None


def results_from_cells(folder: str | Path) -> dict[str, Any]:
    """``results.json``'s arms from a study's finished cells: each arm's LRs whose seeds have all finished, its best
    LR among them, and ``bracketed`` only when a lower and a higher LR were trained and worse (an unfinished
    study: its LR extensions may be missing)."""
    from diffattn.experiments.study.spec import read_spec  # the spec module loads models; only needed here

    spec = read_spec(Path(folder))[0]
    grid: dict[str, dict[float, dict[int, float]]] = {}
    for f in sorted(Path(folder).glob("cells/*/result.json")):
        r = json.loads(f.read_text())
        if r.get("d_model", spec.model.d_model) != spec.model.d_model:  # a size-ladder cell: not the LR sweep's
            continue
        grid.setdefault(r["arm"], {}).setdefault(float(r["lr"]), {})[int(r["seed"])] = float(r["val_loss"])
    arms = []
    for arm in spec.arms():
        sweep = {lr: v for lr, v in grid.get(arm.name, {}).items() if set(v) >= set(spec.seeds)}
        if not sweep:
            continue
        best = best_lr({lr: list(v.values()) for lr, v in sweep.items()})
        arms.append({"name": arm.name, "label": arm.label, "best_lr": best,
                     "bracketed": min(sweep) < best < max(sweep), "params": None,
                     "lr_sweep": [{"lr": lr, "seeds": [{"seed": s, "val_loss": x} for s, x in sorted(v.items())]}
                                  for lr, v in sorted(sweep.items())]})
    return {"arms": arms, "partial": True}


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


def verdicts_markdown(folders: Sequence[str | Path], against: Sequence[str], names: Sequence[str] | None = None) -> str:
    """Per-text tables (headed by ``names`` or the folder names) and, with several folders, the across table."""
    results = [read_results(f) for f in folders]
    names = list(names) if names else [Path(f).name for f in folders]
    if len(names) != len(results):
        raise ValueError(f"{len(names)} names for {len(results)} study folders")
    parts = [f"### {n}\n\n{text_markdown(r, against)}" for n, r in zip(names, results)]
    if len(results) > 1:
        parts.append(f"### across {len(results)} texts ({', '.join(names)})\n\n{across_markdown(results, against)}")
    return "\n\n".join(parts) + "\n"
