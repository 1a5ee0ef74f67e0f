"""Where a ``diffattn study`` stands, read from its finished cells (``OUT/cells/*/result.json``): the per-arm LR
sweeps, each arm's LR bracket (issue 16: an arm whose best LR is at an edge of its list gets the next LR beyond it,
in rounds, up to ``lr_extensions``), the cells the grid needs so far and how many are done. Derived from the
finished cells alone, so every worker and every rerun agree."""

from __future__ import annotations

import math
from pathlib import Path

from diffattn.experiments.study import analysis
from diffattn.experiments.study.cell import read_json
from diffattn.experiments.study.spec import StudySpec, cell_name


def collect_cells(out: Path, spec: StudySpec) -> list[dict]:
    """Every finished cell's result.json (of this study's horizon)."""
    results = [read_json(f) for f in sorted((out / "cells").glob("*/result.json"))]
    return [r for r in results if r.get("steps") == spec.train.steps]


def is_cell(c: dict, arm: str, lr: float, seed: int, d_model: int) -> bool:
    return c["arm"] == arm and c["lr"] == lr and c["seed"] == seed and c["d_model"] == d_model


def cell_loss(c: dict) -> float:
    v = c["val_loss"]
    return math.inf if v is None else float(v)


def lr_sweeps(spec: StudySpec, cells: list[dict],
              lrs: dict[str, list[float]] | None = None) -> dict[str, dict[float, list[float]]]:
    """{arm: {lr: [val_loss per seed, in seed order]}} over the base-size cells present, at each arm's LRs
    (``lrs``: {arm: LR list}, e.g. :func:`lr_brackets`' ``lrs``; default: the base list ``spec.lrs``)."""
    sweeps = {a.name: {lr: [cell_loss(c) for s in spec.seeds for c in cells
                            if is_cell(c, a.name, lr, s, spec.model.d_model)]
                       for lr in (lrs or {}).get(a.name, spec.lrs)} for a in spec.arms()}
    return {a: {lr: v for lr, v in sw.items() if v} for a, sw in sweeps.items() if any(sw.values())}


def lr_brackets(spec: StudySpec, cells: list[dict]) -> dict[str, analysis.Bracket]:
    """Each arm's learning-rate state (:class:`analysis.Bracket`), replaying the extension rounds from the
    finished cells: start from ``spec.lrs``; a round extends every arm whose best mean LR is at an edge (with
    fewer than ``spec.lr_extensions`` rounds used), and counts only once all of its cells, of every arm, are
    finished. A result with ``status == "extend"`` names the LRs whose cells must run next.

    The arms move in lockstep, as the rounds run: a worker that reaches a round late, when some arm's cells of
    it are already finished and another's are still training, derives the same round as the workers already in
    it (an arm moved on alone would name a different round, whose cells the others hold: a worker waiting on a
    cell it can never get). Deterministic in the finished cells, so every worker and every rerun agree."""
    lrs = {a.name: list(spec.lrs) for a in spec.arms()}
    used = dict.fromkeys(lrs, 0)  # the rounds each arm took part in
    while True:
        out = {a: analysis.bracket_arm(_full_sweep(spec, cells, a, x), x, used[a], spec.lr_extensions)
               for a, x in lrs.items()}
        ext = {a: b.next_lrs for a, b in out.items() if b.status == "extend"}
        if not ext or any(len(_full_sweep(spec, cells, a, nxt)) < len(nxt) for a, nxt in ext.items()):
            return out  # nothing to extend, or this round's cells are still to run
        for a, nxt in ext.items():
            lrs[a], used[a] = sorted(lrs[a] + nxt), used[a] + 1


def _full_sweep(spec: StudySpec, cells: list[dict], arm: str, lrs: list[float]) -> dict[float, list[float]]:
    """{lr: [loss per seed]} of the LRs among ``lrs`` whose every seed has finished (a partial LR is no result)."""
    sw = lr_sweeps(spec, cells, {arm: lrs}).get(arm, {})
    return {lr: v for lr, v in sw.items() if len(v) == len(spec.seeds)}


def study_progress(out: Path, spec: StudySpec) -> dict[str, int]:
    """Finished cells of this horizon, from the run folders: {"grid", "grid_done", "ladder", "ladder_done",
    "total", "done", "brackets"}. The grid holds the base LRs and every LR extension made or pending, so it grows
    as extensions are found; it is done when every arm is bracketed or has used its ``--lr-extensions``.
    Ladder cells count once the grid is done (their LR is the grid's best)."""
    cells = collect_cells(out, spec)
    finished = {c["cell"] for c in cells}
    br = lr_brackets(spec, cells)
    # the base LRs, the extensions already made and the ones pending
    grid = [cell_name(a.name, lr, s) for a in spec.arms()
            for lr in sorted(set(br[a.name].lrs) | set(br[a.name].next_lrs)) for s in spec.seeds]
    n_ladder = len(spec.arms()) * len(spec.ladder_sizes()) * len(spec.seeds)
    grid_done = sum(n in finished for n in grid)
    ladder_done = 0
    if n_ladder and grid_done == len(grid):
        best = {a: b.best_lr for a, b in br.items()}
        ladder_done = sum(cell_name(a.name, best[a.name], s, d) in finished for a in spec.arms()
                          for d in spec.ladder_sizes() for s in spec.seeds)
    return {"grid": len(grid), "grid_done": grid_done, "ladder": n_ladder, "ladder_done": ladder_done,
            "total": len(grid) + n_ladder, "done": grid_done + ladder_done, "brackets": br}
