"""The early gap of a finished ``diffattn study``: per arm at its best LR, its cells' early diagnostics (the
attention branch's RMS over the residual stream's, λ, gradient norms per parameter group) averaged over seeds, and
the paired difference between two arms at every evaluation. Reads results.json and the cells' diagnostics.csv."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diffattn.experiments.experiment_folder import cell_name
from diffattn.experiments.findings import analysis
from diffattn.experiments.findings.report_text import num
from diffattn.system.atomic_files import open_nofollow
from diffattn.train.diagnostics import read_diagnostics

GRAD_GROUPS = ("q", "k", "v", "out", "lambda", "norm", "mlp")


def _at(rows: Sequence[dict[str, float]], step: int, key: str) -> float | None:
    """``key`` in the last row at or before ``step`` that has it (early rows stop at diag_early_steps)."""
    best = None
    for r in rows:
        if r["step"] <= step and not math.isnan(r.get(key, math.nan)):
            best = r[key]
    return best


def _mean(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _layer_means(per_seed: Sequence[Sequence[dict[str, float]]], step: int, col: str,
                 n_layers: int) -> list[float | None]:
    """Per layer, the mean over seeds of ``layer{i}.{col}`` at ``step``."""
    return [_mean([_at(r, step, f"layer{i}.{col}") for r in per_seed]) for i in range(n_layers)]


def early_steps(rows: Sequence[dict[str, float]], wanted: Sequence[int] = (50, 100, 250, 500)) -> list[int]:
    """The first logged early step and the logged early steps nearest to ``wanted`` (within the window)."""
    have = [int(r["step"]) for r in rows if not math.isnan(r.get("layer0.attn_to_resid", math.nan))]
    if not have:
        return []
    return sorted({have[0], *(min(have, key=lambda s: abs(s - w)) for w in wanted if w <= have[-1] * 1.1)})


def early_summary(out: Path, results: dict[str, Any] | None = None,
                  steps: Sequence[int] | None = None) -> dict[str, Any]:
    """{arm: {"lr", "seeds", "layers", "rows": [{step, attn_to_resid: [per layer], lambda: [...],
    grad: {group: norm summed in quadrature over layers}}]}}, each number the mean over the arm's seeds at its
    best LR. Steps past the early window repeat its last row, so ask only for steps inside it (default:
    :func:`early_steps` of the first cell read). ``results``: the
    collected results (default: read OUT/results.json)."""
    res = results
    if res is None:
        with open_nofollow(out / "results.json") as f:  # never through a link: what it names is read next
            res = json.loads(f.read())
    n_layers = int(res["spec"]["n_layers"])
    summary: dict[str, Any] = {}
    for arm in res["arms"]:
        files = [out / "cells" / cell_name(arm["name"], arm["best_lr"], s["seed"]) / "diagnostics.csv"
                 for s in arm["seeds"]]
        per_seed = [read_diagnostics(f) for f in files if f.exists()]
        if not per_seed:
            continue
        rows = []
        for step in steps if steps is not None else early_steps(per_seed[0]):
            per_layer = {g: [x for x in _layer_means(per_seed, step, f"grad.{g}", n_layers) if x is not None]
                         for g in GRAD_GROUPS}
            grads = {g: math.sqrt(sum(x * x for x in xs)) for g, xs in per_layer.items() if xs}
            lam = _layer_means(per_seed, step, "lambda", n_layers)
            if all(x is None for x in lam):
                lam = _layer_means(per_seed, step, "sigma", n_layers)
            rows.append({"step": step, "attn_to_resid": _layer_means(per_seed, step, "attn_to_resid", n_layers),
                         "attn_rms": _layer_means(per_seed, step, "attn_rms", n_layers), "lambda": lam,
                         "grad": grads})
        summary[arm["name"]] = {"label": arm.get("label", arm["name"]), "lr": arm["best_lr"],
                                "seeds": len(per_seed), "layers": n_layers, "rows": rows}
    return summary


def paired_gap(results: dict[str, Any], candidate: str, baseline: str) -> list[dict[str, Any]]:
    """Candidate − baseline validation loss at every evaluation both arms' best-LR cells share, paired by
    seed: [{step, mean, n, ci95}] (ci95 bounds None with fewer than 2 seeds), the last row being the final
    loss: :func:`diffattn.experiments.findings.analysis.gap_trajectory` on the arms' seeds."""
    arms = {a["name"]: a for a in results["arms"]}
    cand, base = ({s["seed"]: analysis.val_curve(s["history"]) for s in arms[name]["seeds"]}
                  for name in (candidate, baseline))
    return [{"step": r["step"], "mean": r["diff_minus_baseline"], "n": r["seeds"], "ci95": r["ci95"]}
            for r in analysis.gap_trajectory(cand, base, tokens_per_step=0)]


def early_tables(summary: dict[str, Any]) -> list[tuple[list[str], list[list[str]]]]:
    """(headers, rows) of two tables: the attention branch's RMS over the residual stream's per layer, and λ
    (or σ) with the gradient norm of each parameter group; [] without early diagnostics."""
    if not summary:
        return []
    n = max(v["layers"] for v in summary.values())
    ratio = [[f"{v['label']} ({v['lr']:g})", str(r["step"])] + [num(x, 2) for x in r["attn_to_resid"]]
             for v in summary.values() for r in v["rows"]]
    groups = [g for g in GRAD_GROUPS if any(g in r["grad"] for v in summary.values() for r in v["rows"])]
    grads = [[v["label"], str(r["step"]), num(_mean(r["lambda"]), 3)]
             + [num(r["grad"].get(g), 3) for g in groups]
             for v in summary.values() for r in v["rows"]]
    return [(["arm (best LR)", "step"] + [f"attn/resid L{i}" for i in range(n)], ratio),
            (["arm", "step", "λ or σ, mean over layers"] + [f"‖∇{g}‖" for g in groups], grads)]


