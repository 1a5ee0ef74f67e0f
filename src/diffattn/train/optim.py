"""What both training loops share (the LM loop in train.py and the classifier loop in classify.py): the
optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from diffattn.configs.run_config import TrainConfig


def make_optimizer(model: torch.nn.Module, tcfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (embeddings and linear weights), fused where available."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), fused=fused or None)


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Learning rate for 0-based ``step``: linear warmup to lr, then cosine decay to min_lr at tcfg.steps."""
    if tcfg.warmup_steps > 0 and step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    span = max(1, tcfg.steps - tcfg.warmup_steps)
    progress = min(1.0, (step - tcfg.warmup_steps) / span)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1 + math.cos(math.pi * progress))
