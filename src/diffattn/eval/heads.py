"""Show each head's learned distance preference (w, v and the f-curve) of a distance-aware checkpoint.

For head i of a ``distance`` or ``diff_distance`` layer the score multiplier is f(w_i·R; v_i) with
f(x; v) = (1 + e^v) / (1 + e^(v − x)) and R the token distance. f(0) = 1 and f is increasing in x, so w_i < 0
makes f fall with distance (the head prefers short range) and w_i > 0 makes it rise towards 1 + e^v (long
range). A head is called "short" or "long" when f at the largest distance the model sees (its context − 1, else
the largest distance shown) is more than 5% below or above 1, and "neutral" when it stays within ±5% of 1 there:
the label and the numbers beside it are measured at the same distance, inside the context.
For ``diff_distance`` every diff-head has two rows, map 1 and map 2 (each map has its own w, v).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from diffattn.attention.registry import ATTENTION
from diffattn.eval.format import table
from diffattn.eval.measures import DEFAULT_DISTANCES
from diffattn.ops.distance_score import distance_f
from diffattn.system.atomic_files import atomic_output

NEUTRAL_TOL = 0.05
_KEY = re.compile(r"(?:^|\.)blocks\.(\d+)\.attn\.distance_w$")


def _preference(w: float, v: float, r_max: float) -> str:
    f_far = float(distance_f(torch.tensor(w * r_max, dtype=torch.float64), v))
    if abs(f_far - 1.0) <= NEUTRAL_TOL:
        return "neutral"
    return "long" if f_far > 1.0 else "short"


def distances_for(context: int, distances: Sequence[int] = DEFAULT_DISTANCES) -> list[int]:
    """The distances worth showing for a model of ``context`` tokens: those it can see (< context), and its
    largest one, context − 1 (where the preference is measured)."""
    inside = sorted({int(d) for d in distances if 0 <= int(d) < context - 1})
    return inside + [context - 1]


def head_table(state_dict: Mapping[str, Tensor], distances: Sequence[int] = DEFAULT_DISTANCES,
               diff: bool | None = None, context: int | None = None) -> list[dict[str, Any]]:
    """One row per (layer, head[, map]): {"layer", "head", "map" (None, or 1/2 for diff_distance), "w", "v",
    "f": {distance: f(w·distance; v)}, "preference": "short"|"long"|"neutral", "at": the distance the preference
    is measured at}: ``context − 1`` (the farthest key a query sees) when ``context`` is given, else the largest
    of ``distances``; "neutral" when |f − 1| <= 5% there.

    ``state_dict``: a model's (LM or classifier) state dict. ``diff``: whether (2h,) parameters are
    diff_distance pairs (map 1, map 2 per diff-head); None infers it from the presence of ``lambda_q1``.
    Raises ValueError when there are no distance parameters.
    """
    if not distances or any(int(d) < 0 for d in distances):
        raise ValueError(f"distances must be a non-empty list of integers >= 0, got {list(distances)}")
    layers = sorted((int(m.group(1)), k) for k in state_dict if (m := _KEY.search(k)))
    if not layers:
        raise ValueError("no distance-aware attention parameters (…attn.distance_w) in this model; "
                         "`heads` applies to attention 'distance' or 'diff_distance'")
    if diff is None:
        diff = any(k.endswith("attn.lambda_q1") for k in state_dict)
    r_max = context - 1 if context else max(int(d) for d in distances)
    rows = []
    for layer, key in layers:
        w = state_dict[key].detach().double().cpu()
        v = state_dict[key[: -len("distance_w")] + "distance_v"].detach().double().cpu()
        for i in range(len(w)):
            wi, vi = float(w[i]), float(v[i])
            fs = distance_f(torch.tensor([float(d) for d in distances], dtype=torch.float64) * wi, vi)
            rows.append({
                "layer": layer,
                "head": i // 2 if diff else i,
                "map": (i % 2 + 1) if diff else None,
                "w": wi,
                "v": vi,
                "f": {int(d): float(f) for d, f in zip(distances, fs)},
                "preference": _preference(wi, vi, r_max),
                "at": r_max,
            })
    return rows


def model_head_table(state_dict: Mapping[str, Tensor], attention: str, distances: Sequence[int] = DEFAULT_DISTANCES,
                     context: int | None = None) -> list[dict[str, Any]]:
    """:func:`head_table` of a model of attention type ``attention`` (``context``: its max_seq_len): a type with
    V1's head layout (``head_split`` 2) has two maps per diff-head, each with its own w, v."""
    return head_table(state_dict, distances, diff=ATTENTION[attention].head_split == 2, context=context)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The table as aligned text."""
    dists = list(rows[0]["f"])
    has_map = rows[0]["map"] is not None
    head = ["layer", "head"] + (["map"] if has_map else []) + ["w", "v"]
    head += [f"f(R={d})" for d in dists] + [f"prefers (|f-1| > {NEUTRAL_TOL:.0%} at R={rows[0].get('at', dists[-1])})"]
    lines = []
    for r in rows:
        cells = [str(r["layer"]), str(r["head"])] + ([str(r["map"])] if has_map else [])
        cells += [f"{r['w']:+.4f}", f"{r['v']:+.3f}"]
        cells += [f"{r['f'][d]:.3f}" for d in dists] + [r["preference"]]
        lines.append(cells)
    return "\n".join(table(head, lines, indent="", left=0))


def plot_heads(rows: list[dict[str, Any]], path: str | Path, max_distance: int) -> None:
    """f(w·R; v) against R = 0..max_distance (the model's context − 1), one panel per layer (two columns), one
    curve per head (and map), the legend beside each panel, the ±5% band of "neutral" shaded."""
    import matplotlib  # optional and slow to import: only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    layers = sorted({r["layer"] for r in rows})
    ncols = min(2, len(layers))
    nrows = -(-len(layers) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(8 * ncols, 3.9 * nrows + 0.8), squeeze=False,
                             sharey=True, constrained_layout=True)
    r = torch.arange(max_distance + 1, dtype=torch.float64)
    for ax, layer in zip(axes.flat, layers):
        for row in (x for x in rows if x["layer"] == layer):
            name = f"head {row['head']}" + (f" map {row['map']}" if row["map"] is not None else "")
            style = "--" if row["map"] == 2 else "-"
            ax.plot(r.numpy(), distance_f(r * row["w"], row["v"]).numpy(), style, lw=1.8,
                    label=f"{name}: {row['preference']} (w={row['w']:+.4f}, v={row['v']:+.2f})")
        ax.axhspan(1 - NEUTRAL_TOL, 1 + NEUTRAL_TOL, color="grey", alpha=0.15, lw=0)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xlim(0, max_distance)
        ax.set_title(f"layer {layer}", fontsize=11)
        ax.set_xlabel("distance R = |i − j| (tokens)", fontsize=10)
        ax.set_ylabel("score multiplier f(w·R; v)", fontsize=10)
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    for ax in list(axes.flat)[len(layers):]:
        ax.set_visible(False)
    fig.suptitle(f"Distance preference per head, up to the context (R ≤ {max_distance})\nbelow 1 damps, above 1 "
                 f"boosts ReLU(QKᵀ) scores; grey band: within ±{NEUTRAL_TOL:.0%} of 1 (\"neutral\")", fontsize=11)
    try:
        with atomic_output(path) as tmp:  # a failed write (a full disk) leaves no half image behind
            fig.savefig(tmp, dpi=110, format=Path(path).suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
