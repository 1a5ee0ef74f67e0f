"""Per-layer attention diagnostics on a fixed probe batch: what differential attention is doing while it trains.

The training loop draws the probe batch once (:func:`probe_batch`, from the validation split) and calls
:func:`attention_diagnostics` at each evaluation; the columns go to ``diagnostics.csv`` next to
``metrics.csv`` and to TensorBoard (``diag/<column>``). Columns for layer i (maps from the materialized
reference op; a *row* is one (sequence, head, query) triple, and row averages are over all rows):

``layer{i}.lambda`` (V1, diff_distance)
    The layer's effective λ = (exp(λq1·λk1) − exp(λq2·λk2) + λ_init)·lambda_scale. A layer with a head mask
    (``ModelConfig.diff_heads``): the λ of its selected heads (the others have none), and ``neg_mass``,
    ``sigma`` and ``entropy2`` are over the selected heads too (an unselected head's second map is unused);
    ``entropy1`` is over every head.
``layer{i}.sigma`` (V2)
    The mean over tokens and heads of lambda_scale·σ(W_λ x), V2's per-token λ.
``layer{i}.gate`` (gated attention)
    The mean over tokens, heads and channels of its output gate σ(x·W_θ) (a retrofit's annealed gate).
``retrofit_s`` (a retrofit, :mod:`diffattn.train.retrofit`)
    The schedule factor: 0 at the exact conversion, 1 from the end of the schedule on.
``layer{i}.neg_mass`` (differential types)
    The mass of the negative part of the differential map A1 − w·A2 (w = λ, or σ per token and head):
    mean over rows of Σ_j max(0, w·A2_ij − A1_ij). The subtracted mass w·Σ_j A2_ij is just w (softmax rows
    sum to 1), so this is the informative quantity: how much attention ends up *negative* after the
    subtraction. It is 0 for a freshly converted model (A1 = A2 and w = 0 or ½) and grows as the maps
    specialise.
``layer{i}.entropy1``, ``layer{i}.entropy2``
    Mean row entropy (nats) of A1 and A2 (V2: the even and the odd query heads' maps); other attention types
    have one map, reported as ``entropy1``. ln(number of keys) is uniform attention; 0 is one-hot.

Early-training rows (issue 16: why DIFF starts slower): every ``log_every`` steps while step <=
``TrainConfig.diag_early_steps``, a row holds the columns above (λ, σ, ...) and these (:func:`early_diagnostics`,
:func:`grad_group_norms`); rows after that window leave them empty:

``layer{i}.attn_rms``, ``layer{i}.resid_rms``, ``layer{i}.attn_to_resid``
    On the probe batch: the RMS of the attention branch's output (what the block adds to the residual stream,
    before dropout) and of the residual stream entering the block, and their ratio.
``layer{i}.grad.<group>``, ``grad.emb``, ``grad.final_norm``
    The L2 norm of the gradient of each parameter group before clipping: ``q``, ``k``, ``v``, ``out``
    (attention projections), ``lambda`` (λ vectors, V2's W_λ), ``norm`` (the block's RMSNorm gains, V1's
    sub-layer norm included), ``mlp``, and ``other`` (e.g. the distance parameters); the embeddings (tied with
    the output head) and the final norm. Under FSDP a rank sees its shard only: these are then partial.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.model.parts import parameter_part
from diffattn.system.atomic_files import atomic_output, names_path, open_nofollow

__all__ = ["DiagnosticsLog", "attention_diagnostics", "early_diagnostics", "grad_group_norms", "probe_batch",
           "read_diagnostics"]


def probe_batch(source, n: int = 2, max_len: int = 128, seed: int = 0) -> Tensor:
    """A fixed (n, ≤ max_len) LongTensor of input ids from ``source``'s "val" split ("train" if it has no
    validation data), drawn with its own generator so the training data order is untouched."""
    gen = torch.Generator().manual_seed(seed)
    try:
        x, _ = source.get_batch("val", n, gen)
    except (ValueError, IndexError, RuntimeError):
        x, _ = source.get_batch("train", n, gen)
    return x[:, :max_len].contiguous()


def _row_entropy(p: Tensor) -> Tensor:
    """Mean over rows of −Σ_j p log p; p: (..., Tk) rows of a softmax (masked keys are exact zeros)."""
    return -torch.special.xlogy(p, p).sum(-1).mean()


@torch.no_grad()
def attention_diagnostics(model: nn.Module, input_ids: Tensor) -> dict[str, float]:
    """The columns described in the module docstring for ``model`` (a TransformerLM or TransformerClassifier,
    possibly sharded by FSDP2, which is called directly so its hooks gather the weights) on ``input_ids`` (B, T).
    The model is run in eval mode and put back in its previous mode."""
    body = getattr(model, "body", None) or getattr(getattr(model, "encoder", None), "body", None)
    if body is None:
        raise TypeError(f"attention_diagnostics wants a TransformerLM or TransformerClassifier, got "
                        f"{type(model).__name__}")
    attns = [block.attn for block in body.blocks]
    was_training = model.training
    model.eval()
    for a in attns:
        a.capture = []
    try:
        model(input_ids.to(next(model.parameters()).device))
        cols: dict[str, float] = {}
        for i, a in enumerate(attns):
            maps = a.capture[-1]
            p = f"layer{i}."
            on = maps.get("heads")  # a head mask (diff_heads): λ, σ, the negative map are the selected heads'
            sel = slice(None) if on is None else on
            if "probs1" in maps:  # V1-style: two maps per diff-head, one λ per layer
                lam = maps["lambda"].float()
                cols[p + "lambda"] = float(lam if on is None else lam.flatten()[on].mean())  # equal: m_h·λ, m_h = 1
                cols[p + "neg_mass"] = float(torch.relu(-maps["attn"][:, sel].float()).sum(-1).mean())
                cols[p + "entropy1"] = float(_row_entropy(maps["probs1"].float()))
                cols[p + "entropy2"] = float(_row_entropy(maps["probs2"][:, sel].float()))
            elif "attn" in maps:  # V2: adjacent query heads, a per-token σ
                probs = maps["probs"].float()
                cols[p + "sigma"] = float(maps["lambda"][:, sel].float().mean())
                cols[p + "neg_mass"] = float(torch.relu(-maps["attn"][:, sel].float()).sum(-1).mean())
                cols[p + "entropy1"] = float(_row_entropy(probs[:, 0::2]))
                cols[p + "entropy2"] = float(_row_entropy(probs[:, 1::2][:, sel]))
            else:
                if "gate" in maps:  # gated attention: the mean gate σ(x·W_θ) as the head's output sees it
                    cols[p + "gate"] = float(maps["gate"].float().mean())
                cols[p + "entropy1"] = float(_row_entropy(maps["probs"].float()))
        return cols
    finally:
        for a in attns:
            a.capture = None
        model.train(was_training)


_GRAD_GROUP = {"ffn": "mlp", "attention": "other", "classifier_head": "other"}  # parts named as the columns


def _group_of(name: str) -> str:
    """Column of a parameter name (``body.blocks.3.attn.q_proj.weight`` -> ``layer3.grad.q``)."""
    layer, part = parameter_part(name)
    if part in ("embeddings", "lm_head"):
        return "grad.emb"
    if layer is None:
        return "grad.final_norm" if part == "norm" else "grad.other"
    return f"layer{layer}.grad.{_GRAD_GROUP.get(part, part)}"


@torch.no_grad()
def grad_group_norms(model: nn.Module) -> dict[str, float]:
    """The L2 norm of the current gradients per parameter group (module docstring), read only: call it after
    the backward pass and before the optimizer step (and before clipping, for the raw norms)."""
    sq: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        key = _group_of(name.replace("_orig_mod.", "").replace("module.", ""))
        sq[key] = sq.get(key, 0.0) + float(g.detach().float().pow(2).sum())
    return {k: math.sqrt(v) for k, v in sorted(sq.items())}


def _rms(x: Tensor) -> float:
    return float(x.detach().float().pow(2).mean().sqrt())


@torch.no_grad()
def early_diagnostics(model: nn.Module, input_ids: Tensor) -> dict[str, float]:
    """Per layer on ``input_ids`` (B, T): the attention branch's output RMS against the residual stream's RMS
    (module docstring; λ is :func:`attention_diagnostics`' column). Forward hooks on one eval-mode pass; the
    model is put back in its mode, and no random state is used, so training is unchanged."""
    body = getattr(model, "body", None)
    if body is None:
        raise TypeError(f"early_diagnostics wants a TransformerLM, got {type(model).__name__}")
    cols: dict[str, float] = {}
    handles = []
    for i, block in enumerate(body.blocks):
        def resid(mod: nn.Module, args: tuple, i: int = i) -> None:
            cols[f"layer{i}.resid_rms"] = _rms(args[0])

        def attn_out(mod: nn.Module, args: tuple, out: Tensor, i: int = i) -> None:
            cols[f"layer{i}.attn_rms"] = _rms(out)

        handles += [block.register_forward_pre_hook(resid), block.attn.register_forward_hook(attn_out)]
    was_training = model.training
    model.eval()
    try:
        model(input_ids.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    for i in range(len(body.blocks)):
        r = cols.get(f"layer{i}.resid_rms", math.nan)
        cols[f"layer{i}.attn_to_resid"] = cols.get(f"layer{i}.attn_rms", math.nan) / r if r else math.nan
    return dict(sorted(cols.items(), key=lambda kv: _layer_order(kv[0])))


def _layer_order(col: str) -> tuple[int, str]:
    return (int(col[5:].split(".", 1)[0]), col) if col.startswith("layer") else (-1, col)


class DiagnosticsLog:
    """``diagnostics.csv``: one row per evaluation, ``step`` then the columns of the first row. Opening it
    for a run resumed at ``start_step`` drops rows logged after that step (as metrics.csv does)."""

    def __init__(self, path: str | os.PathLike, start_step: int = 0):
        self.path = Path(path)
        self.fields: list[str] | None = None
        rows: list[dict[str, str]] = []
        if start_step and self.path.is_file():
            with open_nofollow(self.path, newline="") as f:  # a link's target is never copied in
                reader = csv.DictReader(f)
                self.fields = list(reader.fieldnames or []) or None
                rows = [r for r in reader if r.get("step") and int(r["step"]) <= start_step]
        with atomic_output(self.path) as tmp, open(tmp, "w", newline="") as f:
            if self.fields:
                w = csv.DictWriter(f, fieldnames=self.fields)
                w.writeheader()
                w.writerows(rows)

    def append(self, step: int, cols: dict[str, float]) -> None:
        new = self.fields is None
        if new:
            self.fields = ["step", *cols]
        with names_path(self.path), open_nofollow(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow({"step": step, **{k: repr(v) for k, v in cols.items()}})


def read_diagnostics(path: str | os.PathLike) -> list[dict[str, float]]:
    """diagnostics.csv -> list of dicts of floats (empty cells -> nan)."""
    with open_nofollow(path, newline="") as f:
        return [{k: float(v) if v != "" else math.nan for k, v in row.items()} for row in csv.DictReader(f)]
