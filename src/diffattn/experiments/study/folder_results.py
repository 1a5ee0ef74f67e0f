"""``diffattn verdicts``' study folders: each one's ``results.json``, or for a study still running (or stopped) the
same from its finished cells, and the verdict tables over them (:mod:`diffattn.experiments.findings.paired_tables`).
Light: a finished study's tables need no torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diffattn.experiments.findings.paired_tables import verdicts_markdown
from diffattn.experiments.findings.stats import best_lr


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
    from diffattn.experiments.study.spec import read_spec  # it loads torch: only a study still running needs it

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


def verdict_tables(folders: Sequence[str | Path], against: Sequence[str], names: Sequence[str] | None = None) -> str:
    """``diffattn verdicts``: :func:`~diffattn.experiments.findings.paired_tables.verdicts_markdown` of the studies in
    ``folders`` (headed by ``names``, default the folder names)."""
    return verdicts_markdown([read_results(f) for f in folders], list(names or [Path(f).name for f in folders]),
                             against)
