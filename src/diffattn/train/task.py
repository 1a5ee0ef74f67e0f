"""What the training loop needs to know about a task: how to draw a batch, the loss of a batch, how to
evaluate, and what to log. The loop (:mod:`diffattn.train.loop`) is the same for every task; :class:`LMTask`
trains a language model, :class:`diffattn.train.classify.ClassifyTask` a text classifier."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from diffattn.configs.run_config import TrainConfig
from diffattn.train.diagnostics import probe_batch
from diffattn.train.distributed import DistInfo, all_reduce_sum, micro_rows
from diffattn.train.loss import cross_entropy, target_count

Batch = tuple[Tensor, ...]  # row-major tensors: the loop hands each rank its rows (micro_rows) of every one


class Task(Protocol):
    kind: str  # RunConfig.task
    # Columns of metrics.csv after the LM's (also kept in the checkpoint's train state, as of the last evaluation).
    metric_fields: tuple[str, ...]
    # Added to train_cfg.seed for the data generator: the classifier's batches were drawn with seed + 1 before the
    # loops were one, and its tests pin seeds that train.
    seed_offset: int
    # Evaluate after the last step even with eval_every = 0 (a classifier always reports its final figures).
    eval_at_end: bool

    def get_batch(self, split: str, rows: int, gen: torch.Generator) -> Batch:
        """``rows`` examples of ``split`` drawn with ``gen`` (the loop's data generator, checkpointed)."""

    def count(self, batch: Batch) -> int:
        """How many targets the batch scores: the loss of a step is its summed loss divided by this."""

    def tokens(self, batch: Batch) -> int:
        """Tokens in the batch (tokens_seen and tokens/s)."""

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """The summed loss (0-d) of one micro-batch, already on the device."""

    def evaluate(self, model: nn.Module, train_cfg: TrainConfig, *, step: int, final: bool, device: Any,
                 dist: DistInfo, autocast: Any) -> dict[str, Any]:
        """Validation metrics: ``val_loss`` (None if there is nothing to validate on) and ``metric_fields``."""

    def eval_line(self, step: int, metrics: dict[str, Any], best_val_loss: float) -> str:
        """The line printed after an evaluation."""

    def probe(self, train_cfg: TrainConfig) -> Tensor | None:
        """Input ids of the fixed batch the attention diagnostics run on, or None for no diagnostics."""


class LMTask:
    """Next-token prediction on a :class:`diffattn.data.lm.BatchSource` (``source`` may be None when only
    :meth:`loss` and :meth:`count` are used, as the study's timing probe does)."""

    kind = "lm"
    metric_fields: tuple[str, ...] = ()
    seed_offset = 0
    eval_at_end = False

    def __init__(self, source: Any, *, diagnostics: bool = True) -> None:
        self.source, self.diagnostics = source, diagnostics

    def get_batch(self, split: str, rows: int, gen: torch.Generator) -> Batch:
        return self.source.get_batch(split, rows, gen)

    def count(self, batch: Batch) -> int:
        return target_count(batch[1])

    def tokens(self, batch: Batch) -> int:
        return batch[0].numel()

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        x, y = batch
        return cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module, train_cfg: TrainConfig, *, step: int, final: bool, device: Any,
                 dist: DistInfo, autocast: Any) -> dict[str, Any]:
        return {"val_loss": evaluate_loss(model, self.source, train_cfg, device=device, dist_info=dist,
                                          autocast=autocast)}

    def eval_line(self, step: int, metrics: dict[str, Any], best_val_loss: float) -> str:
        return f"eval at step {step}: val loss {metrics['val_loss']:.4f} (best {best_val_loss:.4f})"

    def probe(self, train_cfg: TrainConfig) -> Tensor | None:
        return probe_batch(self.source, seed=train_cfg.seed) if self.diagnostics else None


@torch.no_grad()
def evaluate_loss(
    fwd: nn.Module,
    source: Any,
    train_cfg: TrainConfig,
    *,
    device: torch.device | str = "cpu",
    dist_info: DistInfo | None = None,
    autocast: Any = None,
) -> float:
    """Mean token cross-entropy over ``eval_batches`` global validation batches (``batch_size · grad_accum ·
    world`` rows each, processed in micro-batches of ``batch_size`` per rank) drawn from a fixed-seed
    generator: every evaluation of a run sees the same data, whatever the accumulation / world-size layout."""
    dist = dist_info or DistInfo()
    g = torch.Generator().manual_seed(train_cfg.seed + 1_000_003)
    b, accum = train_cfg.batch_size, train_cfg.grad_accum
    was_training = fwd.training
    fwd.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for _ in range(train_cfg.eval_batches):
            x, y = source.get_batch("val", b * accum * dist.world, g)
            for m in range(accum):
                xb, yb = micro_rows(x, m, dist, b).to(device), micro_rows(y, m, dist, b).to(device)
                with autocast or nullcontext():
                    total += cross_entropy(fwd(xb), yb).double()
                count += target_count(yb)
    finally:
        fwd.train(was_training)
    all_reduce_sum(total, dist)
    all_reduce_sum(count, dist)
    if count.item() == 0:
        raise ValueError("validation batches contain no target tokens (all targets are -100)")
    return (total / count).item()
