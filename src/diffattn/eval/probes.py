"""The evaluation probes: they switch every attention module to its materialized reference path and record
its maps (``capture``) or change its scaled logits (``score_mod``) while they are set, and are always removed
afterwards, so the fast path of the model is untouched. Also the standard error every evaluation reports."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch import Tensor


def attn_modules(model: nn.Module) -> list[nn.Module]:
    if not hasattr(model, "blocks"):
        raise ValueError("the model has no .blocks: the probes need a TransformerLM-like model")
    return [b.attn for b in model.blocks]


@contextmanager
def probes(
    model: nn.Module, *, capture: bool = False, score_mod: Callable[[Tensor], Tensor] | None = None
) -> Iterator[list[list[dict[str, Tensor]]]]:
    """Set the evaluation probes on every attention module; yields one capture list per layer. Always resets
    ``capture`` and ``score_mod`` to None on exit, which returns the model to its fast path."""
    mods = attn_modules(model)
    lists: list[list[dict[str, Tensor]]] = [[] for _ in mods]
    try:
        for m, lst in zip(mods, lists):
            m.capture = lst if capture else None
            m.score_mod = score_mod
        yield lists
    finally:
        for m in mods:
            m.capture = None
            m.score_mod = None


@torch.no_grad()
def capture_maps(model: nn.Module, inputs: Tensor) -> list[dict[str, Tensor]]:
    """Run ``inputs`` (B, T) once and return each layer's reference maps (the dict of its single call)."""
    was = model.training
    model.eval()
    try:
        with probes(model, capture=True) as lists:
            model(inputs.to(next(model.parameters()).device))
    finally:
        model.train(was)
    return [{k: v.float().cpu() for k, v in lst[-1].items()} for lst in lists]


def effective_map(maps: dict[str, Tensor]) -> Tensor:
    """The map that multiplies V, (B, H, Tq, Tk): ``attn`` (DIFF: A1 − λA2) when recorded, else ``probs``."""
    if "attn" in maps:
        return maps["attn"]
    if "probs" in maps:
        return maps["probs"]
    raise ValueError(f"captured maps have neither 'attn' nor 'probs' (keys: {sorted(maps)})")


def logit_maps(maps: dict[str, Tensor]) -> list[Tensor]:
    """All scaled logits (B, H, Tq, Tk) a layer recorded: ``logits``, or ``logits1`` and ``logits2``."""
    out = [v for k, v in sorted(maps.items()) if k.startswith("logits")]
    if not out:
        raise ValueError(f"captured maps have no logits (keys: {sorted(maps)})")
    return out


def mean_se(x: Tensor) -> float:
    """Standard error of the mean of the 1-D sample x (0 for a single value)."""
    n = x.numel()
    return (x.float().std(correction=1) / math.sqrt(n)).item() if n > 1 else 0.0

