"""One optimizer step: the learning rate of the step, the micro-batches (each rank's rows of the global batch,
gradients synchronised on the last one only), the loss normalised by the global batch's target count, the
GradScaler for float16, gradient clipping, and the NaN/inf checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from diffattn.configs.run_config import TrainConfig
from diffattn.model.transformer import set_lambda_scale
from diffattn.train.diagnostics import grad_group_norms
from diffattn.train.distributed import DistInfo, all_reduce_sum, as_float, micro_rows
from diffattn.train.optim import lr_at
from diffattn.train.run_state import NonFiniteLossError
from diffattn.train.task import Batch, Task


@dataclass
class StepResult:
    train_loss: float  # mean loss per target over the global batch
    grad_norm: float  # before clipping
    lr: float
    grad_groups: dict[str, float] = field(default_factory=dict)  # per parameter group, before clipping, if asked


class TrainStep:
    """``step(i, batch)`` runs optimizer step ``i`` (0-based) on one global batch, as every rank sees it.

    ``model`` is the module the optimizer holds, ``fwd`` what is called (the DDP/FSDP wrapper, maybe compiled),
    ``wrapped`` the DDP/FSDP wrapper (for no_sync). ``diverged(what, value, step)`` builds the error raised on a
    NaN/inf loss or (without a scaler, which skips such steps itself) gradient norm, before the weights change."""

    def __init__(self, task: Task, model: nn.Module, optimizer: torch.optim.Optimizer, train_cfg: TrainConfig, *,
                 fwd: nn.Module | None = None, wrapped: nn.Module | None = None, dist: DistInfo | None = None,
                 device: torch.device | str = "cpu", autocast: Any = None, scaler: Any = None,
                 diverged: Callable[[str, float, int], NonFiniteLossError] | None = None) -> None:
        self.task, self.model, self.optimizer, self.train_cfg = task, model, optimizer, train_cfg
        self.fwd = fwd if fwd is not None else model
        self.wrapped = wrapped if wrapped is not None else model
        self.dist = dist or DistInfo()
        self.device, self.scaler = device, scaler
        self.autocast = autocast if autocast is not None else nullcontext()
        self.diverged = diverged or (lambda what, value, step: NonFiniteLossError(
            f"non-finite {what} ({value}) at step {step}: training stopped"))

    def _sync(self, last: bool) -> Any:
        """Gradients are all-reduced on the last micro-batch only."""
        world, wrapped = self.dist.world, self.wrapped
        if world > 1 and hasattr(wrapped, "no_sync") and not last:
            return wrapped.no_sync()
        if world > 1 and hasattr(wrapped, "set_requires_gradient_sync"):
            wrapped.set_requires_gradient_sync(last)
        return nullcontext()

    def _backward(self, batch: Batch, n_targets: int) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; -> this rank's summed loss (float64)."""
        b, accum, world = self.train_cfg.batch_size, self.train_cfg.grad_accum, self.dist.world
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for m in range(accum):
            micro = tuple(micro_rows(t, m, self.dist, b).to(self.device) for t in batch)
            with self._sync(m == accum - 1):
                with self.autocast:
                    ls = self.task.loss(self.fwd, micro)
                # DDP/FSDP average gradients over ranks: scale by world so the result is sum / n_targets.
                loss = ls * (world / n_targets)
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += ls.detach().double()
        return loss_sum

    def __call__(self, step: int, batch: Batch, *, grad_groups: bool = False) -> StepResult:
        train_cfg, optimizer, scaler = self.train_cfg, self.optimizer, self.scaler
        lr = lr_at(step, train_cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if train_cfg.lambda_warmup_steps:
            set_lambda_scale(self.model, min(1.0, step / train_cfg.lambda_warmup_steps))
        n_targets = self.task.count(batch)
        if n_targets == 0:
            raise ValueError(f"step {step + 1}: the training batch has no target tokens (all -100)")
        train_loss = all_reduce_sum(self._backward(batch, n_targets), self.dist).item() / n_targets
        if not math.isfinite(train_loss):
            raise self.diverged("training loss", train_loss, step + 1)
        if scaler is not None:
            scaler.unscale_(optimizer)
        groups = grad_group_norms(self.model) if grad_groups else {}  # the raw gradients, before clipping
        clip = train_cfg.grad_clip if train_cfg.grad_clip > 0 else float("inf")
        gnorm = as_float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        if not math.isfinite(gnorm) and scaler is None:
            raise self.diverged("gradient norm", gnorm, step + 1)
        if scaler is not None:
            scaler.step(optimizer)  # skips the update on inf/nan gradients and lowers the scale
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return StepResult(train_loss, gnorm, lr, groups)
