"""The study report's figures (PNG): the validation loss against the learning rate, against training tokens (with
the paired gap over training below it), and against parameters on the size ladder; every arm in a colour of its
own."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from diffattn.experiments import plots
from diffattn.experiments.plots import plt


def arm_colors(arms: list[dict]) -> dict[str, str]:
    """{arm name: colour}: the registry's colour for the first arm of each attention type, a spare colour for
    every further arm of a type already drawn (V1 with and without its norm must not share a line colour)."""
    out: dict[str, str] = {}
    used: set[str] = set()
    spare = 0
    for i, a in enumerate(arms):
        c = plots.color_for(a["attention"], i)
        for _ in range(8):  # the spare palette is finite: past it, colours repeat
            if c not in used:
                break
            c = plots.color_for(f"spare{spare}", spare)
            spare += 1
        out[a["name"]] = c
        used.add(c)
    return out


def draw_trajectory(results: dict, ax) -> bool:
    """DIFF − baseline validation loss at each evaluation (each arm at its best LR), with its 95% band, on
    ``ax``; -> whether there was anything to draw."""
    drawn = False
    for i, v in enumerate(results["comparisons"]):
        pts = [p for p in v.get("trajectory") or [] if p["diff_minus_baseline"] is not None]
        if not pts:
            continue
        drawn = True
        c = plots.color_for("diff" if i == 0 else f"comparison{i}", i)
        ax.plot([p["tokens"] for p in pts], [p["diff_minus_baseline"] for p in pts], marker="o", lw=2, color=c,
                label=f"{v['candidate']} − {v['baseline']}")
        band = [(p["tokens"], *p["ci95"]) for p in pts if p["ci95"][0] is not None]
        if band:
            ax.fill_between([t for t, _, _ in band], [lo for _, lo, _ in band], [hi for _, _, hi in band],
                            color=c, alpha=0.2)
    if drawn:
        ax.axhline(0, color="grey", lw=1)
        plots.label_axes(ax, "training tokens", "Δ val loss (nats/token)",
                         "Paired gap over training (band: 95% CI; below 0: candidate better)")
    return drawn


def plot_lr_sweep(results: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = arm_colors(results["arms"])
    for a in results["arms"]:
        c = colors[a["name"]]
        lrs = [p["lr"] for p in a["lr_sweep"]]
        means = [p["val_loss"] if p["val_loss"] is not None else np.nan for p in a["lr_sweep"]]
        ax.plot(lrs, means, color=c, marker="o", lw=2, label=f"{a['label']} (mean)")
        for p in a["lr_sweep"]:
            ys = [s["val_loss"] for s in p["seeds"] if s["val_loss"] is not None]
            ax.scatter([p["lr"]] * len(ys), ys, color=c, s=12, alpha=0.5)
            if len(ys) > 1:
                ax.vlines(p["lr"], min(ys), max(ys), color=c, alpha=0.5, lw=1)
        ax.scatter([a["best_lr"]], [a["val_loss_mean"]], color=c, marker="*", s=160, zorder=5)
    ax.set_xscale("log")
    plots.label_each_tick(ax, sorted({p["lr"] for a in results["arms"] for p in a["lr_sweep"]}))
    plots.label_axes(ax, "peak learning rate (every LR tried)", "validation loss (nats/token)",
                     "Validation loss vs LR (dots: seeds; bar: seed range; star: best LR)")
    return plots.savefig_tight(fig, path)


def plot_curves(results: dict, path: Path) -> Path:
    """Loss vs tokens per arm; below it, when the verdict has one, the gap over training with its band (one
    figure: the report keeps its three images)."""
    gap = any(c.get("trajectory") for c in results["comparisons"])
    fig, axes = plt.subplots(2 if gap else 1, 1, figsize=(7, 7.6 if gap else 4.2), squeeze=False)
    ax = axes[0][0]
    if gap:
        draw_trajectory(results, axes[1][0])
    colors = arm_colors(results["arms"])
    for a in results["arms"]:
        c = colors[a["name"]]
        runs = [{h["tokens_seen"]: h["val_loss"] for h in s["history"] if h.get("val_loss") is not None}
                for s in a["seeds"]]
        runs = [r for r in runs if r]
        if not runs:
            continue
        xs = sorted(set.intersection(*(set(r) for r in runs)))
        ys = np.array([[r[x] for x in xs] for r in runs])
        ax.plot(xs, ys.mean(0), color=c, lw=2, label=f"{a['label']}, lr {a['best_lr']:g}")
        if len(runs) > 1:
            ax.fill_between(xs, ys.min(0), ys.max(0), color=c, alpha=0.2)
    plots.label_axes(ax, "training tokens", "validation loss (nats/token, sampled batches)",
                     "Loss vs tokens at each arm's best LR (band: seed range)")
    return plots.savefig_tight(fig, path)


def plot_ladder(results: dict, path: Path) -> Path:
    lad = results["ladder"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = {a["name"]: a for a in results["arms"]}
    colors = arm_colors(results["arms"])
    for name, arm in lad["arms"].items():
        a, c = names[name], colors[name]
        pts = [p for p in arm["points"] if p["val_loss_mean"] is not None]
        if not pts:
            continue
        n = np.array([p["non_embedding_params"] for p in pts], dtype=float)
        y = np.array([p["val_loss_mean"] for p in pts])
        err = [[p["val_loss_mean"] - (p["val_loss_ci95"][0] if p["val_loss_ci95"][0] is not None
                                      else p["val_loss_mean"]) for p in pts]]
        ax.errorbar(n, y, yerr=[err[0], err[0]], fmt="o", color=c, label=a["label"])
        if arm["fit"]:
            grid = np.geomspace(n.min() * 0.8, n.max() * 1.25, 50)
            ax.plot(grid, arm["fit"]["alpha"] - arm["fit"]["beta"] * np.log(grid), color=c, lw=1.5, alpha=0.8)
    ax.set_xscale("log")
    plots.label_axes(ax, "non-embedding parameters", "validation loss (nats/token)",
                     "Size ladder at each arm's best LR; lines: L = α − β·ln N")
    return plots.savefig_tight(fig, path)
