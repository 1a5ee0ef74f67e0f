"""Training: AdamW, warmup + cosine schedule, clipping, accumulation, AMP, checkpoints, exact resume, DDP/FSDP2.

CONTRACT (used by compare.py and classify.py; keep these names and signatures):
  TrainConfig            dataclass below
  make_optimizer(model, tcfg) -> torch.optim.AdamW   weight decay on matrices (dim >= 2) only
  lr_at(step, tcfg) -> float                          linear warmup then cosine to min_lr
  train_lm(model, source, tcfg, *, out_dir=None, progress=True) -> TrainResult
      source: a diffattn.data.BatchSource; loss = cross-entropy over targets, ignore_index=-100
  TrainResult.history: list of dicts {"step", "train_loss", "val_loss" (or None), "lr", "tokens_per_s"}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 10
    log_every: int = 10
    ckpt_every: int = 0  # 0: checkpoint at each evaluation and at the end
    seed: int = 1337
    dtype: str = "float32"  # "bfloat16" / "float16": autocast where the device supports it
    compile: bool = False
    deterministic: bool = False
    parallel: str = "ddp"  # under torchrun: "ddp" or "fsdp" (FSDP2 fully_shard)


def make_optimizer(model: torch.nn.Module, tcfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (embeddings and linear weights), fused where available."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), fused=fused or None)


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Learning rate for 0-based ``step``: linear warmup to lr, then cosine decay to min_lr at ``tcfg.steps``."""
    if tcfg.warmup_steps > 0 and step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / tcfg.warmup_steps
    span = max(1, tcfg.steps - tcfg.warmup_steps)
    progress = min(1.0, (step - tcfg.warmup_steps) / span)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1 + math.cos(math.pi * progress))
