"""What both training loops share (the LM loop in train.py and the classifier loop in classify.py): the
optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from diffattn.configs.run_config import TrainConfig


def make_optimizer(model: torch.nn.Module, train_cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (embeddings and linear weights), fused where available."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), fused=fused or None)


def lr_at(step: int, train_cfg: TrainConfig) -> float:
    """Learning rate for 0-based ``step``: linear warmup to lr, then cosine decay to min_lr at train_cfg.steps."""
    if train_cfg.warmup_steps > 0 and step < train_cfg.warmup_steps:
        return train_cfg.lr * (step + 1) / train_cfg.warmup_steps
    span = max(1, train_cfg.steps - train_cfg.warmup_steps)
    progress = min(1.0, (step - train_cfg.warmup_steps) / span)
    return train_cfg.min_lr + 0.5 * (train_cfg.lr - train_cfg.min_lr) * (1 + math.cos(math.pi * progress))
