"""The experiments' PNG plots (matplotlib, Agg): one colour and label per attention type, loss curves, needle
grids, attention maps, outliers, quantization; written atomically. The documents they go into are
:mod:`diffattn.experiments.document`'s."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator, NullLocator  # noqa: E402

from diffattn.attention.registry import attention_color, attention_label  # noqa: E402
from diffattn.system.atomic_files import atomic_output  # noqa: E402

# One colour per model kind, the same in every plot: the registry's (``@register(..., color=...)``); a kind
# without one takes a spare colour by position.
_EXTRA = ["#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def color_for(attention: str, index: int = 0) -> str:
    """The plot colour of attention type ``attention`` (a spare one by ``index`` for an unknown type): every
    plot asks here, so the colours come from the attention registry (``@register(..., color=...)``)."""
    return attention_color(attention) or _EXTRA[index % len(_EXTRA)]


def label_for(attention: str) -> str:
    """How reports name attention type ``attention`` (the name itself when unknown); the one place asked."""
    return attention_label(attention) or attention


def savefig_tight(fig, path: Path) -> Path:
    """:func:`savefig` after a tight layout."""
    fig.tight_layout()
    return savefig(fig, path)


def label_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Axis labels, title and a small legend: what every single-panel plot ends with."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


def label_each_tick(ax, xs: Sequence[float]) -> None:
    """One x tick per value in ``xs`` (e.g. every learning rate tried, on a log axis), labelled as written
    (``3e-3``, not only the decades), slanted when there are many so that they do not overlap."""
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{x:g}" for x in xs], rotation=40 if len(xs) > 4 else 0,
                       ha="right" if len(xs) > 4 else "center", fontsize=8 if len(xs) > 8 else 9)


def savefig(fig, path: Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` atomically (a failed write leaves no half image) and close it."""
    try:
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=Path(path).suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path


def plot_loss_curves(models: Sequence[dict], path: Path) -> Path:
    """models: [{"label", "attention", "history": [{"step", "train_loss", "val_loss"}]}]."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, m in enumerate(models):
        c = color_for(m["attention"], i)
        h = m["history"]
        ax.plot(
            [r["step"] for r in h],
            [r["train_loss"] for r in h],
            color=c,
            alpha=0.55,
            lw=1,
            label=f"{m['label']} train",
        )
        val = [(r["step"], r["val_loss"]) for r in h if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), color=c, lw=2, marker="o", ms=3, label=f"{m['label']} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy on answer tokens (nats)")
    ax.set_title("Training curves (same data, same seed)")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.legend(fontsize=8)
    return savefig_tight(fig, path)


def _grid_array(grid: Sequence[dict]) -> tuple[np.ndarray, list[float], list[int]]:
    """(depths × lengths) accuracy array of a needle grid, with its depth and length axes."""
    depths = sorted({g["depth"] for g in grid})
    lengths = sorted({g["length"] for g in grid})
    a = np.full((len(depths), len(lengths)), np.nan)
    for g in grid:
        a[depths.index(g["depth"]), lengths.index(g["length"])] = g["acc"]
    return a, depths, lengths


def plot_diagnostics(models: Sequence[dict], path: Path) -> Path:
    """models: [{"label", "attention", "diagnostics": [diagnostics.csv rows]}] -> three panels over steps,
    each averaged over layers: λ (V1) or mean σ (V2); the negative map's mass; the entropy of each map. Every
    panel has its y label and its legend (the models; the entropy panel also its two line styles)."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (("λ (V1) / mean σ(W_λx) (V2)", "λ or σ, mean over layers"),
              ("negative mass of A1 − λA2", "mass below 0 per row, mean over layers"),
              ("row entropy of each map", "entropy (nats), mean over layers"))
    for i, m in enumerate(models):
        rows = m.get("diagnostics") or []
        if not rows:
            continue
        c, steps = color_for(m["attention"], i), [r["step"] for r in rows]

        def mean_of(suffix: str, rows=rows) -> list[float] | None:
            keys = [k for k in rows[0] if k.endswith(suffix)]
            return [sum(r[k] for k in keys) / len(keys) for r in rows] if keys else None

        lam, second = mean_of(".lambda") or mean_of(".sigma"), mean_of(".entropy2")
        for ax, ys, style, what in ((axes[0], lam, "-", ""), (axes[1], mean_of(".neg_mass"), "-", ""),
                                    (axes[2], mean_of(".entropy1"), "-", ", A1" if second else ""),
                                    (axes[2], second, "--", ", A2")):
            if ys is not None:
                ax.plot(steps, ys, style, color=c, marker="o", ms=3, label=m["label"] + what)
    for ax, (title, ylabel) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)  # values as they are, not "1e-5 + 2.548"
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:  # a standard model has no λ and no second map: say so rather than leave an empty frame
            ax.text(0.5, 0.5, "no differential model", ha="center", va="center", transform=ax.transAxes,
                    color="grey")
    return savefig_tight(fig, path)


def plot_needle_heatmaps(models: Sequence[dict], path: Path, title: str | None = None) -> Path:
    """models: [{"label", "grid": [{"depth", "length", "acc"}]}] -> one accuracy heatmap per model, and with
    two or more models a last panel of the first minus the second (red: the first is better)."""
    n = len(models)
    panels = n + (1 if n >= 2 else 0)
    fig, axes = plt.subplots(
        1, panels, figsize=(3.6 * panels + 1.6, 3.9), squeeze=False, constrained_layout=True
    )
    im = None
    arrays = []
    for k, m in enumerate(models):
        a, depths, lengths = _grid_array(m["grid"])
        arrays.append(a)
        ax = axes[0][k]
        im = ax.imshow(a, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        _annotate(ax, a, lambda v: f"{v:.2f}", lambda v: "white" if v < 0.6 else "black")
        _grid_axes(ax, depths, lengths, first=k == 0)
        ax.set_title(m["label"])
    fig.colorbar(im, ax=axes[0][:n].tolist(), label="exact-match accuracy", shrink=0.9)
    if n >= 2:
        ax = axes[0][n]
        delta = arrays[0] - arrays[1]
        lim = max(0.05, float(np.nanmax(np.abs(delta))))
        im2 = ax.imshow(delta, vmin=-lim, vmax=lim, cmap="RdBu_r", aspect="auto")
        _annotate(ax, delta, lambda v: f"{v:+.2f}", lambda v: "white" if abs(v) > 0.6 * lim else "black")
        _grid_axes(ax, depths, lengths, first=False)
        ax.set_title(f"{models[0]['label']} − {models[1]['label']}")
        fig.colorbar(im2, ax=ax, label="accuracy difference", shrink=0.9)
    fig.suptitle(title or "Needle retrieval accuracy by depth and length")
    return savefig(fig, path)


def _annotate(ax, a: np.ndarray, text, color) -> None:
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            ax.text(j, i, text(a[i, j]), ha="center", va="center", fontsize=8, color=color(a[i, j]))


def _grid_axes(ax, depths: Sequence[float], lengths: Sequence[int], first: bool) -> None:
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    if first:
        ax.set_ylabel("depth of the queried needle")


# Marker and line style per model index, so overlapping lines stay distinguishable.
_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
_STYLES = ["-", "--", "-.", ":"]


def _se(p: float, n: int | None) -> float:
    return float(np.sqrt(max(p * (1 - p), 0.0) / n)) if n else 0.0


def _model_errorbar(ax, xs, ys, es, m: dict, i: int) -> None:
    """Model i's line with error bars, in its own colour, marker and line style (hollow markers, so a line
    drawn over another stays visible)."""
    ax.errorbar(xs, ys, yerr=es, color=color_for(m["attention"], i), marker=_MARKERS[i % len(_MARKERS)],
                ls=_STYLES[i % len(_STYLES)], mfc="white", ms=6, capsize=3, label=m["label"])


def plot_multi_needle(models: Sequence[dict], path: Path, length: int | None = None) -> Path:
    """models: [{"label", "attention", "multi": {"N,R": acc}, "multi_queries": {"N,R": answers}}] -> accuracy vs
    number of needles N, with ± one binomial standard error."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.12
    for i, m in enumerate(models):
        keys = list(m["multi"])
        xs = np.array([int(k.split(",")[0]) for k in keys], dtype=float)
        xs = xs + (i - (len(models) - 1) / 2) * width  # dodge: equal values stay visible side by side
        ys = [m["multi"][k] for k in keys]
        es = [_se(m["multi"][k], (m.get("multi_queries") or {}).get(k)) for k in keys]
        _model_errorbar(ax, xs, ys, es, m, i)
    keys = list(models[0]["multi"]) if models else []
    ax.set_xticks([int(k.split(",")[0]) for k in keys], [f"N={k.split(',')[0]}\nR={k.split(',')[1]}" for k in keys])
    ax.set_xlabel("needles in the context (N) and how many are queried (R)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    where = f" at L={length}" if length else ""
    ax.set_title(f"Multi-needle retrieval{where} (paper Table 2); bars: ±1 standard error", fontsize=10)
    return savefig_tight(fig, path)


def plot_attention_maps(examples: Sequence[dict], path: Path) -> Path:
    """examples: [{"label", "attention", "map": (T, T) head-mean last-layer effective map, "rows": (H, T)
    per-head rows at the query position, "query_pos", "span": (start, end), "context_end",
    "distractors"?: starts of the other needles, "answer_share"?: the span's share of the row's positive
    mass}]."""
    n = len(examples)
    fig, axes = plt.subplots(
        n,
        2,
        figsize=(12.5, 3.3 * n + 0.4),
        squeeze=False,
        gridspec_kw={"width_ratios": [1, 2]},
        constrained_layout=True,
    )
    for i, e in enumerate(examples):
        a = np.asarray(e["map"])
        # Colour limit: the 99th percentile of |a| over the causal entries, so the first rows (which put all
        # their weight on a few keys) do not wash out the rest of the map.
        low = np.abs(a[np.tril_indices_from(a)])
        lim = max(float(np.quantile(low, 0.99)), 1e-6)
        ax = axes[i][0]
        im = ax.imshow(a, cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set_title(f"{e['label']}: last layer, mean over heads", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax = axes[i][1]
        rows = np.asarray(e["rows"])
        s0, s1 = e["span"]
        ax.axvspan(s0 - 0.5, s1 - 0.5, color="gold", alpha=0.35, label="answer span (needle)")
        for k, d0 in enumerate(e.get("distractors", [])):
            ax.axvspan(d0 - 0.5, d0 + s1 - s0 - 0.5, color="gray", alpha=0.2, label=None if k else "other needle")
        ax.axvline(e["context_end"] - 0.5, color="gray", ls=":", lw=1, label="context ends / query begins")
        for h, r in enumerate(rows):
            ax.plot(np.arange(len(r)), r, lw=1.2, alpha=0.85, label=f"head {h}")
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlim(-0.5, e["query_pos"] + 0.5)
        share = e.get("answer_share")
        tail = f" (answer span: {share:.1%} of the positive mass)" if share is not None else ""
        ax.set_title(f"{e['label']}: query row, last layer, per head{tail}", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("attention weight")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the curves
    fig.suptitle("Attention on one evaluation example (DIFF: effective map A1 − λA2; can be negative)")
    return savefig(fig, path)  # constrained layout keeps the suptitle clear of the panel titles


def plot_outliers(models: Sequence[dict], path: Path) -> Path:
    """models: [{"label", "attention", "outliers": {"attn_logits": {..}, "hidden": {..}}}] -> bar groups."""
    stats = ["top1", "top10", "median"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / max(1, len(models))
    for ax, key, title in zip(axes, ("attn_logits", "hidden"), ("|attention logits|", "|hidden states|")):
        for i, m in enumerate(models):
            vals = [m["outliers"][key].get(s, np.nan) for s in stats]
            x = np.arange(len(stats)) + (i - (len(models) - 1) / 2) * width
            bars = ax.bar(x, vals, width, color=color_for(m["attention"], i), label=m["label"])
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(stats)), ["top-1", "top-10", "median"])
        ax.set_ylabel("magnitude")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Activation outliers (paper Table 5)")
    return savefig_tight(fig, path)


def plot_quantization(models: Sequence[dict], path: Path) -> Path:
    """models: [{"label", "attention", "quant": [{"bits" (None = fp32), "needle_acc", "needle_queries"?,
    "multi_acc"?, "multi_queries"?, "ppl_ppl"?}], "grid_title"?, "multi_title"?}] -> one panel per evaluation set
    (accuracy vs bits, ± one binomial standard error) and one of answer perplexity vs bits.

    The x axis is categorical (fp32, then the bit widths, high to low) and each model's points are shifted
    a little sideways with its own marker and line style, so equal values never hide each other."""
    acc = "exact-match accuracy"
    panels = []
    if any("needle_acc" in r for m in models for r in m["quant"]):
        panels.append(("needle_acc", "needle_queries", models[0].get("grid_title", "needle grid"), acc))
    if any("multi_acc" in r for m in models for r in m["quant"]):
        panels.append(("multi_acc", "multi_queries", models[0].get("multi_title", "several needles"), acc))
    if any("ppl_ppl" in r for m in models for r in m["quant"]):
        panels.append(("ppl_ppl", None, "answer perplexity (lower is better)", "perplexity"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.2), squeeze=False)
    width = 0.14
    for ax, (key, n_key, title, ylabel) in zip(axes[0], panels):
        cats: list = []
        for i, m in enumerate(models):
            rows = [r for r in m["quant"] if key in r]
            rows.sort(key=lambda r: -(r["bits"] if r["bits"] is not None else 1e9))  # fp32 first
            cats = [("fp32" if r["bits"] is None else str(r["bits"])) for r in rows]
            xs = np.arange(len(rows)) + (i - (len(models) - 1) / 2) * width
            ys = [r[key] for r in rows]
            es = [_se(r[key], r.get(n_key)) for r in rows] if n_key else None
            _model_errorbar(ax, xs, ys, es, m, i)
        ax.set_xticks(range(len(cats)), cats)
        ax.set_xlabel("attention-logit bits (absmax, per batch×head)")
        ax.set_ylabel(ylabel)
        if n_key:
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Attention-logit quantization (paper Fig. 8); bars: ±1 standard error")
    return savefig_tight(fig, path)
