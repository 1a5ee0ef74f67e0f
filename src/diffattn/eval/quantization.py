"""Quantization (paper Fig. 8): symmetric absmax post-training quantization of the scaled logits before masking,
``q = round(x / s)·s`` with ``s = absmax / (2^(b−1) − 1)`` and one absmax per (batch, head) matrix, taken over the
causally visible entries (the future ones are masked away anyway); needle accuracy and perplexity at each bit
width, through the probes' ``score_mod``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.data.synthetic import NeedleCell, NeedleData, cell_correct
from diffattn.eval.measures import DEFAULT_BITS
from diffattn.eval.needles import MULTI_FACTOR, multi_needle_cells
from diffattn.eval.perplexity import loss_summary, token_losses
from diffattn.eval.probes import attn_modules, mean_se, probes


def _correct(model: nn.Module, cells: Sequence[NeedleCell]) -> list[Tensor]:
    """Per cell, 1.0 / 0.0 for each queried answer, flattened (float64); the model is scored in eval mode."""
    was = model.training
    model.eval()
    try:
        return [cell_correct(model, c).flatten().double() for c in cells]
    finally:
        model.train(was)


def _answers(cells: Sequence[NeedleCell]) -> int:
    """Number of queried answers in ``cells`` (each sequence answers ``n_queries`` queries)."""
    return sum(len(c.inputs) * c.n_queries for c in cells)


def absmax_quantize(x: Tensor, bits: int, mask: Tensor | None = None) -> Tensor:
    """Symmetric absmax fake-quantization of x (…, Tq, Tk), one scale per leading index (per (batch, head)).

    ``s = absmax / (2^(bits−1) − 1)``, ``q = round(x / s) · s``; the absmax is over the entries where ``mask``
    (broadcastable to x, True = counted) holds, all entries if None. Entries inside the mask lie within
    ``s / 2`` of their original value. An all-zero matrix stays zero.
    """
    if not isinstance(bits, int) or bits < 2:
        raise ValueError(f"bits must be an int >= 2, got {bits!r}")
    xf = x.float()
    a = xf.abs() if mask is None else xf.abs().masked_fill(~mask, 0.0)
    absmax = a.amax(dim=(-2, -1), keepdim=True)
    qmax = 2 ** (bits - 1) - 1
    scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    return (torch.round(xf / scale).clamp(-qmax, qmax) * scale).to(x.dtype)


def quant_score_mod(bits: int, causal: bool = True) -> Callable[[Tensor], Tensor]:
    """A ``score_mod`` quantizing the scaled logits to ``bits`` (absmax over the causally visible entries)."""

    def mod(logits: Tensor) -> Tensor:
        tq, tk = logits.shape[-2:]
        keep = torch.ones(tq, tk, dtype=torch.bool, device=logits.device).tril(tk - tq) if causal else None
        return absmax_quantize(logits, bits, keep)

    return mod


def quantization_sweep(
    model: nn.Module,
    cells: Sequence[NeedleCell] | None,
    source: Any = None,
    *,
    bits: Sequence[int] = DEFAULT_BITS,
    ppl_batches: int = 4,
    batch_size: int = 16,
    multi_cells: Sequence[NeedleCell] | None = None,
) -> list[dict]:
    """Needle accuracy (mean over ``cells``; ``multi_acc``: mean over the harder ``multi_cells`` if given) and
    perplexity with the logits quantized to each bit width. The first row (``bits`` None) is the unquantized
    reference path.

    Every row scores the same examples and tokens, so each quantized row also carries the paired change from
    the reference row and its standard error (the spread of the per-answer / per-token differences):
    ``needle_drop``/``needle_drop_se``, ``multi_drop``/``multi_drop_se`` (accuracy lost) and
    ``ppl_rise``/``ppl_rise_se`` (answer loss gained, nats)."""
    causal = getattr(getattr(model, "config", None), "causal", True)
    rows = []
    ref: dict[str, Tensor] = {}
    for b in [None, *bits]:
        with probes(model, score_mod=None if b is None else quant_score_mod(b, causal)) as _:
            if b is None:  # reference path without quantization: the same code path as the quantized rows
                for m in attn_modules(model):
                    m.use_reference = True
            try:
                row: dict = {"bits": b}
                now: dict[str, Tensor] = {}
                for name, cs in (("needle", cells), ("multi", multi_cells)):
                    if cs:
                        per_cell = _correct(model, cs)  # one forward pass serves the accuracy and the pairing
                        row[f"{name}_acc"] = sum(c.mean().item() for c in per_cell) / len(per_cell)
                        row[f"{name}_queries"] = _answers(cs)
                        now[name] = torch.cat(per_cell)
                if source is not None:
                    tok = token_losses(model, source, n_batches=ppl_batches, batch_size=batch_size)
                    row.update({f"ppl_{k}": v for k, v in loss_summary(tok).items()})
                    now["ppl"] = tok
                if b is None:
                    ref = now
                else:
                    for name, v in now.items():
                        d = (v - ref[name]) if name == "ppl" else (ref[name] - v)
                        key = "ppl_rise" if name == "ppl" else f"{name}_drop"
                        row[key], row[f"{key}_se"] = d.mean().item(), mean_se(d)
            finally:
                for m in attn_modules(model):
                    m.use_reference = False
        rows.append(row)
    return rows



def quant_results(model: nn.Module, task: NeedleData | None, cells: Sequence[NeedleCell] | None, source: Any, *,
                  bits: Sequence[int], ppl_batches: int, batch_size: int, n_samples: int, seed: int) -> dict:
    """``evaluate_model``'s ``quant`` entry: :func:`quantization_sweep` on the needle grid and, for a needle
    task, on the examples of the multi-needle table's (4, 2) entry (``quant_multi_setting`` says which)."""
    if not cells and source is None:
        raise ValueError("quant needs a needle task or a data source")
    res: dict = {}
    multi = None
    if task is not None:  # the 1-needle grid saturates; several needles show the loss of precision
        n = min(4, task.max_needles)
        r = min(2, n)
        # the very examples of multi_needle_counts' (n, r) entry, so its fp32 column equals that entry
        multi = multi_needle_cells(task, task.seq_len, n, r, MULTI_FACTOR * n_samples, seed)
        res["quant_multi_setting"] = {"n_needles": n, "n_queries": r, "length": task.seq_len}
    res["quant"] = quantization_sweep(model, cells, source, bits=bits, ppl_batches=ppl_batches,
                                      batch_size=batch_size, multi_cells=multi)
    return res
