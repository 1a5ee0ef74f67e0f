"""The one loss of every model here: cross-entropy of float32 logits against integer targets, targets of -100
left out. Training (LM and classifier), the in-training evaluation, ``diffattn eval`` (perplexity) and the study
all call :func:`cross_entropy`, so a loss logged in one place means the same thing in every other."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

IGNORE = -100  # a target that is not scored (padding, the prompt part of a sequence)


def cross_entropy(logits: Tensor, targets: Tensor, reduction: str = "sum") -> Tensor:
    """Cross-entropy of ``logits`` (..., C) against ``targets`` (...), targets equal to -100 left out.

    ``reduction="sum"``: a 0-d tensor, the sum over the scored targets (divide by their count, see
    :func:`target_count`, for a mean that does not depend on how a batch is split). ``"none"``: the loss of
    each scored target, in order (1-d). The logits are upcast to float32 first: bf16 logits would round the
    loss of a large vocabulary."""
    if reduction not in ("sum", "none"):
        raise ValueError(f"cross_entropy: reduction is 'sum' or 'none', got {reduction!r}")
    flat, y = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if reduction == "none":
        keep = y != IGNORE
        return F.cross_entropy(flat[keep], y[keep], reduction="none")
    return F.cross_entropy(flat, y, ignore_index=IGNORE, reduction="sum")


def target_count(targets: Tensor) -> int:
    """How many targets :func:`cross_entropy` scores (those that are not -100)."""
    return int((targets != IGNORE).sum())
