"""What a finished ``diffattn study`` says about the early gap: per arm, at its best LR, the early
diagnostics of its cells (the attention branch's RMS against the residual stream's, λ, gradient norms per
parameter group) averaged over seeds, and the paired difference between any two arms at any evaluation.

Reads ``OUT/results.json`` and the cells' ``diagnostics.csv``; trains nothing and renders plain Markdown.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diffattn.experiments.study import analysis
from diffattn.fileio import open_nofollow

GRAD_GROUPS = ("q", "k", "v", "out", "lambda", "norm", "mlp")


def _cell_dir(out: Path, arm: str, lr: float, seed: int) -> Path | None:
    """The run folder of (arm, lr, seed) at the study's base size (cell names carry the lr as written)."""
    for d in sorted((out / "cells").glob(f"{arm}-lr*-s{seed}")):
        m = re.fullmatch(re.escape(arm) + r"-lr([0-9.e+-]+)-s\d+", d.name)
        if m and math.isclose(float(m.group(1)), lr, rel_tol=1e-9):
            return d
    return None


def _rows(csv_file: Path) -> list[dict[str, float]]:
    with open_nofollow(csv_file, newline="") as f:
        return [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]


def _at(rows: Sequence[dict[str, float]], step: int, key: str) -> float | None:
    """``key`` in the last row at or before ``step`` that has it (early rows stop at diag_early_steps)."""
    best = None
    for r in rows:
        if r.get("step", math.inf) <= step and key in r:
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
    have = [int(r["step"]) for r in rows if "layer0.attn_to_resid" in r]
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
    if results is None:
        with open_nofollow(out / "results.json") as f:
            results = json.loads(f.read())
    res = results
    n_layers = int(res["spec"]["n_layers"])
    summary: dict[str, Any] = {}
    for arm in res["arms"]:
        dirs = [_cell_dir(out, arm["name"], arm["best_lr"], s["seed"]) for s in arm["seeds"]]
        per_seed = [_rows(d / "diagnostics.csv") for d in dirs if d and (d / "diagnostics.csv").exists()]
        if not per_seed:
            continue
        rows = []
        for step in steps if steps is not None else early_steps(per_seed[0]):
            grads = {}
            for g in GRAD_GROUPS:
                sq = _layer_means(per_seed, step, f"grad.{g}", n_layers)
                if any(x is not None for x in sq):
                    grads[g] = math.sqrt(sum(x * x for x in sq if x is not None))
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
    loss: :func:`diffattn.experiments.study.analysis.gap_trajectory` on the arms' seeds."""
    arms = {a["name"]: a for a in results["arms"]}
    cand, base = ({s["seed"]: analysis.val_curve(s["history"]) for s in arms[name]["seeds"]}
                  for name in (candidate, baseline))
    return [{"step": r["step"], "mean": r["diff_minus_baseline"], "n": r["seeds"], "ci95": r["ci95"]}
            for r in analysis.gap_trajectory(cand, base, tokens_per_step=0)]


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None or not math.isfinite(x) else format(x, fmt)


def early_tables(summary: dict[str, Any]) -> list[tuple[list[str], list[list[str]]]]:
    """(headers, rows) of two tables: the attention branch's RMS over the residual stream's per layer, and λ
    (or σ) with the gradient norm of each parameter group; [] without early diagnostics."""
    if not summary:
        return []
    n = max(v["layers"] for v in summary.values())
    ratio = [[f"{v['label']} ({v['lr']:g})", str(r["step"])] + [_f(x, ".2f") for x in r["attn_to_resid"]]
             for v in summary.values() for r in v["rows"]]
    groups = [g for g in GRAD_GROUPS if any(g in r["grad"] for v in summary.values() for r in v["rows"])]
    grads = [[v["label"], str(r["step"]), _f(_mean(r["lambda"]))] + [_f(r["grad"].get(g)) for g in groups]
             for v in summary.values() for r in v["rows"]]
    return [(["arm (best LR)", "step"] + [f"attn/resid L{i}" for i in range(n)], ratio),
            (["arm", "step", "λ or σ, mean over layers"] + [f"‖∇{g}‖" for g in groups], grads)]


