"""A ``diffattn study`` read from its finished cells (``OUT/cells/*/result.json``): where it stands (the per-arm LR
sweeps, each arm's LR bracket, the cells the grid needs so far and how many are done: :func:`study_progress`) and
its results (:func:`collect`: best LRs, means and 95% CIs over seeds, the paired verdicts, the early gap, the
size-ladder fit, the Optuna trial counts); renders nothing.

LR bracketing (issue 16): an arm whose best LR is at an edge of its list gets the next LR beyond it, in rounds, up to
``lr_extensions``; a round is derived from the finished cells alone, so every worker and every rerun agree."""

from __future__ import annotations

import math
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from diffattn.experiments.experiment_folder import cell_name
from diffattn.experiments.findings import analysis, early, stats
from diffattn.experiments.findings.analysis import bits_per_char, finite, mean_ci
from diffattn.experiments.findings.depth import training_depth, unigram_floor
from diffattn.experiments.study.cell import MAX_VAL_TOKENS, chars_per_token, load_data, read_json
from diffattn.experiments.study.optuna_log import storage_open
from diffattn.experiments.study.spec import Arm, StudySpec, head_group
from diffattn.system.atomic_files import open_nofollow


def collect_cells(out: Path, spec: StudySpec) -> list[dict]:
    """Every finished cell's result.json (of this study's horizon)."""
    results = [read_json(f) for f in sorted((out / "cells").glob("*/result.json"))]
    return [r for r in results if r.get("steps") == spec.train.steps]


def cells_at(spec: StudySpec, cells: list[dict], arm: str, lr: float, d_model: int | None = None) -> list[dict]:
    """The finished cells of ``arm`` at ``lr`` (and ``d_model``: by default the base size), in seed order."""
    at = (arm, lr, d_model or spec.model.d_model)
    return [c for s in spec.seeds for c in cells if (c["arm"], c["lr"], c["d_model"]) == at and c["seed"] == s]


def cell_loss(c: dict) -> float:
    v = c["val_loss"]
    return math.inf if v is None else float(v)


def lr_sweeps(spec: StudySpec, cells: list[dict],
              lrs: dict[str, list[float]] | None = None) -> dict[str, dict[float, list[float]]]:
    """{arm: {lr: [val_loss per seed, in seed order]}} over the base-size cells present, at each arm's LRs
    (``lrs``: {arm: LR list}, e.g. :func:`lr_brackets`' ``lrs``; default: the base list ``spec.lrs``)."""
    sweeps = {a.name: {lr: [cell_loss(c) for c in cells_at(spec, cells, a.name, lr)]
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


def pairs(spec: StudySpec) -> list[tuple[Arm, Arm]]:
    """(candidate, baseline) for every non-standard arm: the baseline is the standard arm of its head group."""
    out, groups = [], {}
    for a in spec.arms():
        groups.setdefault(head_group(a.name), []).append(a)
    for g in groups.values():
        base = next(a for a in g if a.attention == "standard" and not a.options)
        out += [(a, base) for a in g if a is not base]
    return out


def _arm_entry(a: Any, br: Any, sw: dict[float, list[float]], cells: list[dict], spec: StudySpec,
               cpt: float) -> dict[str, Any]:
    """One arm's results: its LR sweep (``sw``: {lr: the seeds' losses}) and bracket ``br``, and its seeds at
    its best LR, with means and 95% intervals in nats/token and bits/char (``cpt``: characters per token)."""
    blr = br.best_lr if br.best_lr is not None else stats.best_lr(sw)
    at_best = cells_at(spec, cells, a.name, blr)
    losses = [cell_loss(c) for c in at_best]
    mean, ci = mean_ci(losses)
    bmean, bci = mean_ci([bits_per_char(x, cpt) or math.inf for x in losses])
    sweep = [{"lr": lr, "val_loss": finite(sum(v) / len(v)), "seeds": [
        {"seed": c["seed"], "val_loss": finite(cell_loss(c)), "diverged": bool(c.get("diverged"))}
        for c in cells_at(spec, cells, a.name, lr)]}
        for lr, v in sorted(sw.items())]
    return {"name": a.name, "label": a.label, "attention": a.attention, "n_heads": a.n_heads,
            "params": at_best[0]["params"], "non_embedding_params": at_best[0]["non_embedding_params"],
            "lr_sweep": sweep, **analysis.lr_record(br, a.label, spec.lr_extensions), "best_lr": blr,
            "seeds": [{"seed": c["seed"], "val_loss": finite(cell_loss(c)), "bpc": bits_per_char(cell_loss(c), cpt),
                       "history": c["history"]} for c in at_best],
            "val_loss_mean": finite(mean), "val_loss_ci95": ci, "bpc_mean": finite(bmean), "bpc_ci95": bci}


def collect(out: Path, spec: StudySpec, plan: dict, storage_url: str | None = None) -> dict[str, Any]:
    """The results of the cells finished so far. No verdict (and no comparison) unless every grid cell is
    finished, and no parameter ratio unless every ladder cell is: ``incomplete`` says which is missing."""
    cells = collect_cells(out, spec)
    progress = study_progress(out, spec)
    grid_done = progress["grid_done"] == progress["grid"]
    ladder_done = grid_done and progress["ladder_done"] == progress["ladder"]
    source, tok = load_data(out, spec)
    cpt = chars_per_token(source, tok)
    brackets = progress["brackets"]
    sweeps = lr_sweeps(spec, cells, {a: sorted(set(b.lrs) | set(b.next_lrs)) for a, b in brackets.items()})
    by_name = {a.name: _arm_entry(a, brackets[a.name], sweeps[a.name], cells, spec, cpt) for a in spec.arms()
               if sweeps.get(a.name)}
    arms_out = list(by_name.values())
    comparisons = [analysis.comparison(by_name[c.name], by_name[b.name], cells, spec.model.d_model,
                                       spec.train.batch_size * spec.train.seq_len, cpt)
                   for c, b in (pairs(spec) if grid_done else []) if c.name in by_name and b.name in by_name]
    primary = next((c for c in comparisons if c["candidate"].startswith("diff") and
                    by_name[c["candidate"]]["attention"] == "diff"), None)
    if primary is None and spec.source and comparisons:  # --from without a diff arm: its first variant
        primary = comparisons[0]
    results: dict[str, Any] = {
        "arms": arms_out, "verdict": primary, "comparisons": comparisons,
        "ladder": _ladder(spec, cells, by_name, ladder_done),
        "data": {"path": spec.data.path, "tokenizer": spec.data.tokenizer, "vocab_size": source.vocab_size,
                 "val_tokens": source.split_size("val"), "train_tokens": source.split_size("train"),
                 "chars_per_token": cpt},
        "spec": spec.to_dict(), "plan": plan,
        "cells": {"finished": progress["done"], "total": progress["total"], "grid": progress["grid"],
                  "base": len(spec.arms()) * len(spec.lrs) * len(spec.seeds), "grid_finished": progress["grid_done"],
                  "ladder": progress["ladder"], "ladder_finished": progress["ladder_done"],
                  "train_seconds": sum(c.get("train_seconds") or 0 for c in cells)},
        # None when complete; else what is missing and what is withheld because of it
        "incomplete": None if grid_done and (ladder_done or not progress["ladder"]) else {
            "finished": progress["done"], "total": progress["total"],
            "withheld": "verdict" if not grid_done else "size-ladder parameter ratio"},
        "study": _study_summary(out, plan, storage_url), "wall": _wall(out)}
    results["early"] = _early(out, results, spec) if grid_done else None
    if arms_out:
        results["depth"] = training_depth(unigram_floor(source, MAX_VAL_TOKENS), arms_out,
                                          spec.train.steps * spec.train.batch_size * spec.train.seq_len)
    return results


def _early(out: Path, results: dict[str, Any], spec: StudySpec) -> dict[str, Any]:
    """The early diagnostics per arm at its best LR, and each differential arm against the others of its type
    and head group (e.g. V1 with and without its sub-layer norm), paired over seeds at every evaluation."""
    names = {a["name"]: a for a in results["arms"]}
    between = [{"candidate": a.name, "other": b.name, "gap": early.paired_gap(results, a.name, b.name)}
               for a in spec.arms() for b in spec.arms()
               if a.name in names and b.name in names and a.attention == b.attention != "standard"
               and not a.options and b.options and head_group(a.name) == head_group(b.name)]
    return {"arms": early.early_summary(out, results), "between": between}


def _ladder(spec: StudySpec, cells: list[dict], by_name: dict[str, dict], complete: bool = True) -> dict | None:
    """The size ladder (:func:`~diffattn.experiments.findings.analysis.size_ladder`) of each arm's cells at its best
    LR; the candidates' parameters to match their baselines only from a ``complete`` ladder."""
    if not spec.ladder_sizes():
        return None
    sizes = sorted({spec.model.d_model, *spec.ladder_sizes()})
    points = {name: {"lr": e["best_lr"], "sizes": {
        d: (cs[0]["non_embedding_params"], [cell_loss(c) for c in cs])
        for d in sizes if (cs := cells_at(spec, cells, name, e["best_lr"], d))}} for name, e in by_name.items()}
    return analysis.size_ladder(points, [(c.name, b.name) for c, b in pairs(spec)] if complete else [], sizes,
                                spec.model.d_model)


def _study_summary(out: Path, plan: dict, storage_url: str | None) -> dict:
    """{Optuna study: {trial state: count}} of the base grid, each LR-extension round and the ladder, in the order
    they were created."""
    try:
        name = plan.get("study_name", "")
        with storage_open(out, storage_url) as storage:
            names = [s.study_name for s in storage.get_all_studies()]
            return {n: dict(Counter(t.state.name for t in storage.get_all_trials(storage.get_study_id_from_name(n))))
                    for n in names if n == name or n.startswith(name + "-")}
    except Exception as e:  # the report must still render from the run folders
        return {"error": f"{type(e).__name__}: {e}"}


def _wall(out: Path) -> dict:
    """First cell start to last cell finish, from events.log (spans re-runs: interruptions included)."""
    f = out / "events.log"
    if not f.exists():
        return {}
    times = []
    with open_nofollow(f) as fh:
        for line in fh.read().splitlines():
            try:
                times.append(datetime.fromisoformat(line.split()[0]))
            except (ValueError, IndexError):
                continue
    if not times:
        return {}
    return {"first_start": times[0].isoformat(), "last_event": times[-1].isoformat(),
            "seconds": (max(times) - min(times)).total_seconds()}
