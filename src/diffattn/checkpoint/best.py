"""A run's best checkpoint: ``RUN/best/`` holds the weights of the evaluation that scored best so far, by the
task's own measure (a language model: the lowest validation loss; a classifier: the highest validation accuracy),
beside the last checkpoints (``ckpt/``, ``ckpt-step-N``) that a resume continues from.

It is one checkpoint in the usual format (weights, run config, tokenizer, train state; no optimizer or RNG state,
so not a resume point), written atomically like every other (:func:`~diffattn.checkpoint.format.save_checkpoint`).
The train state of every checkpoint records the best so far (``best``: metric, value, step), so a resumed run
goes on comparing against it. ``eval --checkpoint best`` and ``export --checkpoint best`` read it."""

from __future__ import annotations

import math
from typing import Any

BEST = "best"
# The measure that picks a task's best checkpoint: (metric, "min" or "max").
BY_TASK = {"lm": ("val_loss", "min"), "classify": ("val_accuracy", "max")}


def record_best(task: str, metrics: dict[str, Any], state: dict[str, Any], step: int) -> bool:
    """After an evaluation at ``step``: whether it beats the best so far by the task's measure; if so it
    becomes ``state["best"]`` ({"metric", "value", "step"})."""
    metric, mode = BY_TASK.get(task, BY_TASK["lm"])
    value = metrics.get(metric)
    if value is None or not math.isfinite(value):
        return False
    prev = (state.get("best") or {}).get("value")
    if prev is not None and not (value < prev if mode == "min" else value > prev):
        return False
    state["best"] = {"metric": metric, "value": float(value), "step": int(step)}
    return True


def describe_best(best: dict[str, Any] | None) -> str:
    """``val accuracy 0.7805 at step 300``: the best so far, as the log and eval say it."""
    if not best:
        return "none yet"
    return f"{best['metric'].replace('_', ' ')} {best['value']:.4f} at step {best['step']}"


def best_train_state(state: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """The train state the best checkpoint records: its step and tokens, the best, the evaluations so far and
    the task's metrics of that evaluation (what ``info`` and ``eval`` read back)."""
    keep = ("step", "tokens_seen", "best_val_loss", "best", "history", "elapsed_s", *fields)
    return {k: state.get(k) for k in keep}
