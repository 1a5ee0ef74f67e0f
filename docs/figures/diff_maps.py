"""The figure of docs/concepts/cancelling.md: a DIFF head's two softmax maps and their difference.

    diffattn compare --out reports/compare                     # about 4 minutes on 2 CPU cores
    python docs/figures/diff_maps.py reports/compare/runs/diff

Reads the DIFF model a `diffattn compare` run trained on the built-in multi-needle task (any DIFF run on that
task), draws one context of the task (its needles, the first queried one at depth 0.5) through the model's
materialized reference path (the evaluation probes), and plots for one head (default: the first layer's first)
A1 = softmax(Q1K1ᵀ/√d), λ·A2 and A1 − λ·A2, whole and at the query that asks for the needle, with the layer's λ.
Writes docs/concepts/img/diff_maps.png (or --out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "concepts" / "img" / "diff_maps.png"


def maps(run: Path, seed: int, layer: int, head: int):
    """One layer's maps on one context of the run's own needle task, and that layer's λ."""
    import torch

    from diffattn import load_pretrained
    from diffattn.checkpoint.model_folders import open_model_folder
    from diffattn.data.synthetic import make_synthetic
    from diffattn.eval.probes import capture_maps

    recorded = open_model_folder(run).run_config
    if recorded.data.synthetic != "needle":
        sys.exit(f"error: {run} was not trained on the needle task (data.synthetic = {recorded.data.synthetic!r})")
    model = load_pretrained(run)
    task = make_synthetic("needle", recorded.train.seq_len, **recorded.data.params)
    n = min(4, task.max_needles)
    sample = task.sample(torch.Generator().manual_seed(seed), task.seq_len, n, min(2, n), depth=0.5)
    got = capture_maps(model, torch.tensor([sample.seq[:-1]]))[layer]
    a1, attn = got["probs1"][0, head], got["attn"][0, head]  # (T, T)
    with torch.no_grad():
        lam = float(model.blocks[layer].attn.lambda_full())
    return a1, a1 - attn, attn, sample, f"layer {layer}, head {head}, λ = {lam:.2f}"


def draw(a1, la2, diff, sample, which: str, out: Path, made_by: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = sample.answer_pos[0]  # the query token whose next token is the needle's value
    span = sample.span_start[0]
    fig, axes = plt.subplots(2, 3, figsize=(12, 7.2), gridspec_kw={"height_ratios": [3, 2]})
    lim = float(max(a1.max(), la2.max()))
    titles = ["A1 = softmax(Q1K1ᵀ/√d)", "λ·A2 = λ·softmax(Q2K2ᵀ/√d)", "A1 − λ·A2 (what multiplies V)"]
    for ax, m, title in zip(axes[0], (a1, la2, diff), titles):
        vmin = -lim if m is diff else 0.0
        im = ax.imshow(m.numpy(), cmap="RdBu_r" if m is diff else "viridis", vmin=vmin, vmax=lim)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.axhline(q, color="white" if m is not diff else "black", lw=0.6, ls=":")
        fig.colorbar(im, ax=ax, fraction=0.046)
    keys = range(a1.shape[-1])
    for ax, m in zip(axes[1], (a1, la2, diff)):
        ax.bar(keys, m[q].numpy(), color=["#d62728" if span <= k < span + 3 else "#1f77b4" for k in keys])
        ax.axhline(0, color="black", lw=0.5)
        ax.set_ylim(-lim * 0.35, max(lim, float(m[q].max())) * 1.05)
        ax.set_xlabel("key position (red: the queried needle)")
        ax.set_title(f"row {q}: the query for the needle", fontsize=9)
    fig.suptitle(f"A trained DIFF head ({which}) on a needle context. Made by: {made_by}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a DIFF run on the needle task: a compare folder's runs/diff")
    ap.add_argument("--seed", type=int, default=5, help="which context of the task to draw (default 5)")
    ap.add_argument("--layer", type=int, default=0, help="which layer (default 0, the first)")
    ap.add_argument("--head", type=int, default=0, help="which of its diff-heads (default 0)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"the PNG to write (default {OUT})")
    args = ap.parse_args(argv)
    made_by = f"python docs/figures/diff_maps.py {args.run}"
    draw(*maps(args.run, args.seed, args.layer, args.head), args.out, made_by)
    return 0


if __name__ == "__main__":
    sys.exit(main())
