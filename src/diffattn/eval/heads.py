"""Show each head's learned distance preference (w, v and the f-curve) of a distance-aware checkpoint.

For head i of a ``distance`` or ``diff_distance`` layer the score multiplier is f(w_i·R; v_i) with
f(x; v) = (1 + e^v) / (1 + e^(v − x)) and R the token distance. f(0) = 1 and f is increasing in x, so w_i < 0
makes f fall with distance (the head prefers short range) and w_i > 0 makes it rise towards 1 + e^v (long
range). A head is called "neutral" when f stays within ±5% of 1 up to the largest distance shown.
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
from diffattn.fileio import atomic_output
from diffattn.ops.distance_kernel import distance_f

NEUTRAL_TOL = 0.05
_KEY = re.compile(r"(?:^|\.)blocks\.(\d+)\.attn\.distance_w$")


def _preference(w: float, v: float, r_max: float) -> str:
    f_far = float(distance_f(torch.tensor(w * r_max, dtype=torch.float64), v))
    if abs(f_far - 1.0) <= NEUTRAL_TOL:
        return "neutral"
    return "long" if w > 0 else "short"


def head_table(state_dict: Mapping[str, Tensor], distances: Sequence[int] = DEFAULT_DISTANCES,
               diff: bool | None = None) -> list[dict[str, Any]]:
    """One row per (layer, head[, map]): {"layer", "head", "map" (None, or 1/2 for diff_distance), "w", "v",
    "f": {distance: f(w·distance; v)}, "preference": "short"|"long"|"neutral"}.

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
    r_max = max(int(d) for d in distances)
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
            })
    return rows


def model_head_table(state_dict: Mapping[str, Tensor], attention: str,
                     distances: Sequence[int] = DEFAULT_DISTANCES) -> list[dict[str, Any]]:
    """:func:`head_table` of a model of attention type ``attention``: a type with V1's head layout
    (``head_split`` 2) has two maps per diff-head, each with its own w, v."""
    return head_table(state_dict, distances, diff=ATTENTION[attention].head_split == 2)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The table as aligned text."""
    dists = list(rows[0]["f"])
    has_map = rows[0]["map"] is not None
    head = ["layer", "head"] + (["map"] if has_map else []) + ["w", "v"]
    head += [f"f(R={d})" for d in dists] + ["prefers"]
    lines = []
    for r in rows:
        cells = [str(r["layer"]), str(r["head"])] + ([str(r["map"])] if has_map else [])
        cells += [f"{r['w']:+.4f}", f"{r['v']:+.3f}"]
        cells += [f"{r['f'][d]:.3f}" for d in dists] + [r["preference"]]
        lines.append(cells)
    return "\n".join(table(head, lines, indent="", left=0))


def plot_heads(rows: list[dict[str, Any]], path: str | Path, max_distance: int) -> None:
    """f(w·R; v) against R = 0..max_distance, one panel per layer, one curve per head (and map)."""
    import matplotlib  # optional and slow to import: only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    layers = sorted({r["layer"] for r in rows})
    fig, axes = plt.subplots(1, len(layers), figsize=(4.5 * len(layers), 3.8), squeeze=False, sharey=True)
    r = torch.arange(max_distance + 1, dtype=torch.float64)
    for ax, layer in zip(axes[0], layers):
        for row in (x for x in rows if x["layer"] == layer):
            name = f"head {row['head']}" + (f" map {row['map']}" if row["map"] is not None else "")
            style = "--" if row["map"] == 2 else "-"
            ax.plot(r.numpy(), distance_f(r * row["w"], row["v"]).numpy(), style,
                    label=f"{name} (w={row['w']:+.3f}, v={row['v']:+.2f})")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("distance R = |i − j| (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("score multiplier f(w·R; v)")
    fig.suptitle("Distance preference per head: below 1 damps, above 1 boosts ReLU(QKᵀ) scores")
    fig.tight_layout()
    try:
        with atomic_output(path) as tmp:  # a failed write (a full disk) leaves no half image behind
            fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
