"""Perplexity: mean cross-entropy (nats) over the target tokens that are not -100, on ``n_batches`` validation
batches drawn with a fixed seed; ``ppl = exp(loss)``, ``bits_per_token = loss / ln 2``. On a synthetic task only
the answer tokens count, so it is the answer perplexity."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.eval.probes import mean_se
from diffattn.train.loss import cross_entropy


def perplexity(model: nn.Module, source: Any, **batches: Any) -> dict[str, float]:
    """Mean token cross-entropy over the batches :func:`token_losses` draws with ``batches`` (``n_batches``,
    ``batch_size``, ``seed``, ``split``) -> :func:`loss_summary`."""
    return loss_summary(token_losses(model, source, **batches))


def loss_summary(per_token: Tensor) -> dict[str, float]:
    """The loss of the 1-D per-token cross-entropies ``per_token`` (nats), its standard error, ppl and bits."""
    loss = per_token.mean().item()
    return {
        "loss": loss,
        # Spread over tokens, treated as independent: exact for one answer per sequence, a little
        # optimistic when a sequence has several.
        "loss_se": mean_se(per_token),
        "ppl": math.exp(min(loss, 700.0)),
        "bits_per_token": loss / math.log(2),
        "tokens": per_token.numel(),
    }


@torch.no_grad()
def token_losses(
    model: nn.Module,
    source: Any,
    *,
    n_batches: int = 8,
    batch_size: int = 16,
    seed: int = 1234,
    split: str = "val",
) -> Tensor:
    """Cross-entropy (nats, float64) of every target token that is not -100 in ``n_batches`` batches of
    ``source`` drawn with ``seed``: the same tokens in the same order on every call with the same arguments."""
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    losses: list[Tensor] = []
    dev = next(model.parameters()).device
    try:
        for _ in range(n_batches):
            x, y = source.get_batch(split, batch_size, g)
            losses.append(cross_entropy(model(x.to(dev)), y.to(dev), reduction="none").cpu())
    finally:
        model.train(was)
    per_token = torch.cat(losses).double()
    if per_token.numel() == 0:
        raise ValueError("perplexity: the batches have no target tokens")
    return per_token

