"""Outliers (paper Table 5): top-1/2/3/10/100 and median of ``|x|`` over every causally visible entry of the
scaled attention logits (DIFF: both ``Q1K1ᵀ/√d`` and ``Q2K2ᵀ/√d``), pooled over layers, heads and a batch; and the
same over every element of each block's output (forward hooks on ``model.blocks``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.data.synthetic import NeedleCell
from diffattn.eval.probes import capture_maps, logit_maps, mean_se

TOPKS = (1, 2, 3, 10, 100)


def outlier_stats(values: Tensor, topks: Sequence[int] = TOPKS) -> dict[str, float]:
    """top-k (the k-th largest) and median of |values| (flattened); k beyond the size is skipped."""
    a = values.detach().abs().flatten().float()
    if a.numel() == 0:
        raise ValueError("outlier_stats needs at least one value")
    top = torch.topk(a, min(max(topks), a.numel())).values
    out = {f"top{k}": top[k - 1].item() for k in topks if k <= a.numel()}
    out["median"] = a.median().item()
    return out


def _causal_visible(t: Tensor) -> Tensor:
    """Entries of (…, Tq, Tk) logits a causal decoder uses (query i sees keys j <= i + Tk − Tq), flattened."""
    tq, tk = t.shape[-2:]
    keep = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    return t[..., keep]


@torch.no_grad()
def activation_outliers(model: nn.Module, inputs: Tensor) -> dict[str, dict]:
    """Outlier statistics of the attention logits and of every block's output on ``inputs`` (B, T)."""
    hidden: list[Tensor] = []
    hooks = [
        b.register_forward_hook(lambda _m, _i, out: hidden.append(out.detach().float().cpu()))
        for b in model.blocks
    ]
    try:
        maps = capture_maps(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    causal = getattr(getattr(model, "config", None), "causal", True)
    logits = [(_causal_visible(t) if causal else t.flatten()) for m in maps for t in logit_maps(m)]
    return {
        "attn_logits": outlier_stats(torch.cat([x.flatten() for x in logits])),
        "hidden": outlier_stats(torch.cat([h.flatten() for h in hidden])),
        "attn_logits_top1_per_layer": [
            max(_causal_visible(t).abs().max().item() for t in logit_maps(m)) for m in maps
        ],
        "hidden_top1_per_layer": [h.abs().max().item() for h in hidden],
    }


def outlier_spread(model: nn.Module, batches: Sequence[Tensor]) -> dict[str, dict[str, float]]:
    """Top-1 and median of |attention logits| and |hidden states| on each batch (B, T) separately, as
    {"attn_logits_top1": {"mean", "se", "n"}, ...}: the batch-to-batch spread of the outlier statistics, so
    two models' values can be compared against their sampling noise."""
    if not batches:
        raise ValueError("outlier_spread needs at least one batch")
    per = [activation_outliers(model, x) for x in batches]
    out = {}
    for key in ("attn_logits", "hidden"):
        for stat in ("top1", "median"):
            v = torch.tensor([p[key][stat] for p in per], dtype=torch.float64)
            out[f"{key}_{stat}"] = {"mean": v.mean().item(), "se": mean_se(v), "n": len(per)}
    return out



def outlier_results(model: nn.Module, cells: Sequence[NeedleCell] | None, source: Any, *, batch_size: int,
                    seed: int) -> dict:
    """``evaluate_model``'s ``outliers`` entry: :func:`activation_outliers` on the needle grid's longest
    sequences (else one validation batch of ``source`` drawn with ``seed``) and, with a grid, the spread of the
    statistics across one batch per cell at that length."""
    if cells:
        longest = max(c.length for c in cells)
        inputs = torch.cat([c.inputs for c in cells if c.length == longest])[:batch_size]
    elif source is not None:
        inputs = source.get_batch("val", batch_size, torch.Generator().manual_seed(seed))[0]
    else:
        raise ValueError("outliers need inputs: a needle task or a data source")
    res = activation_outliers(model, inputs)
    res["sequences"] = len(inputs)
    if cells:
        res["spread"] = outlier_spread(model, [c.inputs[:batch_size] for c in cells if c.length == longest])
    return res
