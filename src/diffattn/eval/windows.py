"""Which windows ``diffattn eval`` reads from a language model's data, and what reading them costs.

* :func:`default_seq_len`: the window when ``--seq-len`` is not given: a run's training length, or, for a model
  that records none (a converted model, a transformers folder), the longest power of two up to its context whose
  evaluation fits :data:`FLOP_BUDGET` (about a minute of a 2-core CPU), so that a 135M model with an 8,192-token
  context does not spend hours on a CPU before printing anything (:func:`fit_window`: nor longer than the data).
* :func:`run_sample`: a run evaluated on its own data reads the validation sample its training evaluations read
  (the same generator seed, batches and rows), so ``eval``'s loss is the run's own validation loss at that step.
* :func:`estimate` and :func:`progress`: the line printed before the work starts (windows, tokens, FLOPs from
  the planner's count, seconds at this machine's measured speed on the model's largest matrix product),
  a second line when the first batch's pace says otherwise, and a progress bar over the windows on long work.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from diffattn.configs.run_config import RunConfig
from diffattn.data.lm import TokenWindows
from diffattn.train.plan import flops_per_token, humanize

# Forward FLOPs one evaluation may take by default: a 2-core CPU does ~50 GFLOP/s in these forwards, so about a
# minute. It sizes the default window of a model that records no training length (default_seq_len).
FLOP_BUDGET = 3e12
MIN_WINDOW = 128
# Generator seed offset of the training loop's validation batches (train.task.evaluate_loss draws them with
# train.seed + this), so that eval can read the same sample.
VAL_SEED_OFFSET = 1_000_003


def forward_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward FLOPs per token at context ``seq_len``: the planner's count (matmuls and attention) for this model."""
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return flops_per_token(model.config, seq_len, {"matmul": matmul})["recompute"]


def windows_read(what: Sequence[str], *, ppl_batches: int, batch_size: int, bits: Sequence[int]) -> int:
    """Windows of the data the chosen measures forward through the model: ppl's batches, quant's half as many per
    bit width and for its reference row, one batch for outliers."""
    n = ppl_batches * batch_size if "ppl" in what else 0
    if "quant" in what:
        n += (len(bits) + 1) * max(1, ppl_batches // 2) * batch_size
    if "outliers" in what:
        n += batch_size
    return n


def default_seq_len(model: nn.Module, windows: int) -> int:
    """The longest power of two (or the context itself) up to ``model.config.max_seq_len`` whose ``windows``
    forwards fit :data:`FLOP_BUDGET`, but at least ``min(MIN_WINDOW, context)``."""
    context = int(model.config.max_seq_len)
    options = sorted({min(context, 2 ** k) for k in range(4, 40) if 2 ** k <= 2 * context} | {context})
    fits = [t for t in options if windows * t * forward_flops_per_token(model, t) <= FLOP_BUDGET]
    return max(fits + [min(MIN_WINDOW, context)])


def fit_window(source: Any, seq_len: int) -> Any:
    """``source`` (built with any window) reading windows of ``seq_len`` tokens, or of the longest its shortest
    split holds: a default window never asks for more text than the data has."""
    if not isinstance(source, TokenWindows):
        return source
    shortest = min(b - a for a, b in source.splits.values())
    return TokenWindows(source.tokens, max(1, min(seq_len, shortest - 1)), source.vocab_size, source.val_fraction)


def run_sample(train_state: dict | None, run: RunConfig) -> dict[str, Any] | None:
    """The validation sample a run's training evaluations read, and the loss it recorded on it: {"seed",
    "batches", "batch_size", "seq_len", "val_loss", "step" (of that evaluation), "checkpoint_step"}; None for a
    model with no such record (no train section, never evaluated, a synthetic task, whose eval loss counts
    answers only)."""
    t = run.train
    history = (train_state or {}).get("history") or []
    last = next((r for r in reversed(history) if r.get("val_loss") is not None), None)
    if "train" not in run.recorded or run.data.synthetic or last is None or not t.eval_batches:
        return None
    rows = t.batch_size * t.grad_accum * int((train_state or {}).get("world_size") or 1)
    return {"seed": t.seed + VAL_SEED_OFFSET, "batches": t.eval_batches, "batch_size": rows,
            "seq_len": t.seq_len, "val_loss": float(last["val_loss"]), "step": int(last.get("step") or 0),
            "checkpoint_step": (train_state or {}).get("step")}


GEMM_ROWS = 4096  # rows of the timed matrix product: an evaluation batch's tokens, up to this many


def _measured_flops_per_s(model: nn.Module, rows: int) -> float:
    """This machine's speed on this model's largest matrix product (not the vocabulary head) at an evaluation
    batch's row count, timed here for at least 50 ms. A forward of one short window understated it several times
    (small products are bound by memory, not arithmetic); this overstates the whole forward a little (attention,
    norms), which the first batch's pace then corrects (:func:`progress`)."""
    vocab = getattr(model.config, "vocab_size", None)
    lin = max((m for m in model.modules() if isinstance(m, nn.Linear)),
              key=lambda m: 0 if m.out_features == vocab else m.weight.numel())
    x = torch.randn(rows, lin.in_features, dtype=lin.weight.dtype, device=lin.weight.device)
    with torch.no_grad():
        F.linear(x, lin.weight)  # warm-up
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < 0.05:
            F.linear(x, lin.weight)
            n += 1
        dt = (time.perf_counter() - t0) / n
    return 2 * rows * lin.weight.numel() / max(dt, 1e-9)


def estimate(model: nn.Module, what: Sequence[str], windows: int, seq_len: int,
             batch_size: int) -> tuple[str, float]:
    """(the line printed before an evaluation starts, its estimated seconds)."""
    flops = windows * seq_len * forward_flops_per_token(model, seq_len)
    speed = _measured_flops_per_s(model, max(1, min(GEMM_ROWS, batch_size * seq_len)))
    seconds = flops / speed
    params = sum(p.numel() for p in model.parameters())
    line = (f"estimate: {', '.join(what)} read {windows:,} windows of {seq_len:,} tokens ({humanize(windows * seq_len)}"
            f" tokens) through {humanize(params)} parameters: {flops:.2g} FLOPs, about {_duration(seconds)} here "
            f"(at {speed:.2g} FLOP/s, this machine's matrix products); --seq-len, --batches, --batch-size or --what "
            "make it less")
    return line, seconds


def _duration(s: float) -> str:
    if s < 90:
        return f"{max(1, round(s))} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


@contextlib.contextmanager
def progress(model: nn.Module, windows: int, estimate_s: float, tty: bool | None = None) -> Iterator[None]:
    """Follow the ``windows`` the model forwards while the body runs (a forward hook counts them, so the measures
    need not know of it). Once the first batch is done, its pace gives the real total: when that is more than
    twice or less than half ``estimate_s`` a line says so, and a progress bar on stderr follows the rest on a
    terminal, or anywhere when the total is over 30 s (off a terminal it is redrawn at most every 30 s)."""
    tty = sys.stderr.isatty() if tty is None else tty
    t0, seen = time.perf_counter(), {"windows": 0, "bar": None, "said": False}

    def count(_m: nn.Module, args: tuple, _out: Any) -> None:  # returns None: the output stays the model's
        n = int(args[0].shape[0]) if args else 0
        seen["windows"] += n
        if seen["bar"] is not None:
            seen["bar"].update(n)
            return
        total = (time.perf_counter() - t0) * windows / max(1, seen["windows"])
        if not seen["said"] and not estimate_s / 2 <= total <= estimate_s * 2:
            print(f"estimate after the first {seen['windows']:,} windows: about {_duration(total)} in all",
                  file=sys.stderr, flush=True)
        seen["said"] = True
        if tty or total > 30:
            seen["bar"] = tqdm(total=windows, initial=seen["windows"], unit="window", desc="eval", file=sys.stderr,
                               mininterval=0.5 if tty else 30.0, dynamic_ncols=tty)

    hook = model.register_forward_hook(count)
    try:
        yield
    finally:
        hook.remove()
        if seen["bar"] is not None:
            seen["bar"].close()
