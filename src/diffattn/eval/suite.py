"""Evaluate a checkpoint: perplexity, needles, attention noise, outliers, quantization; classifiers: accuracy, macro-F1.

``diffattn eval CKPT --what ppl,needle,noise,outliers,quant [--data FILE] [--out FILE]``

CKPT is a run folder or its ``ckpt/``, a converted model (which records no data: give ``--data FILE``), a
classifier run (``diffattn train --task classify``: accuracy and macro-F1 on the run's own validation split and
test file, or on ``--data FILE``), or a comparison folder (``diffattn compare --out DIR``: each model in it, or
the one named by ``--model NAME``; their results nest under ``"models"`` in the JSON).

Definitions (all measured, nothing tuned):

* **ppl**: mean cross-entropy (nats) over the target tokens that are not -100, on ``n_batches`` validation
  batches drawn with a fixed seed; ``ppl = exp(loss)``, ``bits_per_token = loss / ln 2``. On a synthetic task
  only the answer tokens count, so it is the answer perplexity.
* **needle**: exact match of the argmax at each query position (answers are single tokens), per
  (depth, length).
* **noise** (paper Table 3): at the query position (whose next token is the answer), the attention row of
  every
  layer and head is split into the *answer span* (the 3 tokens ``NDL key value`` of the queried needle), the
  *noise context* (every other position before the query block, BOS included) and the query block itself.
  The map is the effective one: softmax probs for standard attention, ``A1 − λA2`` for DIFF V1 and V2 (the
  probes' ``"attn"``). Its entries can be negative and its rows sum to ``1 − λ`` rather than 1, so we report
  two numbers per region: ``*_signed`` = the plain sum of the map over the region (what the paper's table
  reads as "attention score"; regions do not sum to 1 for DIFF), and ``*_pos_share`` = the region's share of
  the row's positive mass, ``Σ_region max(A, 0) / Σ_row max(A, 0)`` (in [0, 1], comparable across models; for
  standard attention it equals the signed value). ``neg_mass`` is ``Σ_row min(A, 0)``, the mass DIFF cancels.
* **outliers** (paper Table 5): top-1/2/3/10/100 and median of ``|x|`` over every causally visible entry of
  the
  scaled attention logits (DIFF: both ``Q1K1ᵀ/√d`` and ``Q2K2ᵀ/√d``), pooled over layers, heads and a batch;
  and the same over every element of each block's output (forward hooks on ``model.blocks``).
* **quant** (paper Fig. 8): symmetric absmax post-training quantization of the scaled logits before masking,
  ``q = round(x / s)·s`` with ``s = absmax / (2^(b−1) − 1)`` and one absmax per (batch, head) matrix, taken
  over the causally visible entries (the future ones are masked away anyway); needle accuracy and perplexity
  at each bit width, through ``score_mod``.

The probes (``capture`` / ``score_mod``) switch attention to the materialized reference path while they are
set and are always removed afterwards, so the fast path of the model is untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.data.lm import make_source
from diffattn.data.tasks import NEEDLE_LEN, NeedleCell, NeedleTask, cell_correct, needle_accuracy, needle_eval_set
from diffattn.train.loss import cross_entropy

WHATS = ("ppl", "needle", "noise", "outliers", "quant")
TOPKS = (1, 2, 3, 10, 100)
DEFAULT_BITS = (16, 8, 6, 4)


# ----------------------------------------------------------------------------------------------- probes
def _attn_modules(model: nn.Module) -> list[nn.Module]:
    if not hasattr(model, "blocks"):
        raise ValueError("the model has no .blocks: the probes need a TransformerLM-like model")
    return [b.attn for b in model.blocks]


@contextmanager
def probes(
    model: nn.Module, *, capture: bool = False, score_mod: Callable[[Tensor], Tensor] | None = None
) -> Iterator[list[list[dict[str, Tensor]]]]:
    """Set the evaluation probes on every attention module; yields one capture list per layer. Always resets
    ``capture`` and ``score_mod`` to None on exit, which returns the model to its fast path."""
    mods = _attn_modules(model)
    lists: list[list[dict[str, Tensor]]] = [[] for _ in mods]
    try:
        for m, lst in zip(mods, lists):
            m.capture = lst if capture else None
            m.score_mod = score_mod
        yield lists
    finally:
        for m in mods:
            m.capture = None
            m.score_mod = None


@torch.no_grad()
def capture_maps(model: nn.Module, inputs: Tensor) -> list[dict[str, Tensor]]:
    """Run ``inputs`` (B, T) once and return each layer's reference maps (the dict of its single call)."""
    was = model.training
    model.eval()
    try:
        with probes(model, capture=True) as lists:
            model(inputs.to(next(model.parameters()).device))
    finally:
        model.train(was)
    return [{k: v.float().cpu() for k, v in lst[-1].items()} for lst in lists]


def effective_map(maps: dict[str, Tensor]) -> Tensor:
    """The map that multiplies V, (B, H, Tq, Tk): ``attn`` (DIFF: A1 − λA2) when recorded, else ``probs``."""
    if "attn" in maps:
        return maps["attn"]
    if "probs" in maps:
        return maps["probs"]
    raise ValueError(f"captured maps have neither 'attn' nor 'probs' (keys: {sorted(maps)})")


def logit_maps(maps: dict[str, Tensor]) -> list[Tensor]:
    """All scaled logits (B, H, Tq, Tk) a layer recorded: ``logits``, or ``logits1`` and ``logits2``."""
    out = [v for k, v in sorted(maps.items()) if k.startswith("logits")]
    if not out:
        raise ValueError(f"captured maps have no logits (keys: {sorted(maps)})")
    return out


# ----------------------------------------------------------------------------------------- noise share
def attention_shares(
    attn: Tensor,
    query_pos: Tensor,
    span_start: Tensor,
    span_len: int,
    context_end: Tensor,
    per_sample: bool = False,
) -> dict[str, Tensor]:
    """Split each head's attention row at the query position into answer span / noise context / query block.

    attn: (B, H, T, T) effective map; query_pos, span_start, context_end: (B,) long (the answer span is
    ``[span_start, span_start + span_len)``, the context is ``[0, context_end)``).
    Returns per-head means over the batch, each (H,): ``answer_signed``, ``noise_signed``, ``query_signed``,
    ``answer_pos_share``, ``noise_pos_share``, ``neg_mass``, ``row_sum`` (see the module docstring); with
    ``per_sample`` each is (B, H) instead.
    """
    b, _, _, tk = attn.shape
    rows = attn[torch.arange(b), :, query_pos]  # (B, H, Tk)
    pos = torch.arange(tk)[None, :]
    ans = (pos >= span_start[:, None]) & (pos < span_start[:, None] + span_len)  # (B, Tk)
    ctx = pos < context_end[:, None]
    noise = ctx & ~ans
    visible = pos <= query_pos[:, None]
    query = visible & ~ctx
    plus = rows.clamp_min(0)
    total_plus = plus.sum(-1).clamp_min(1e-12)

    def signed(m: Tensor) -> Tensor:
        return (rows * m[:, None, :]).sum(-1)

    def share(m: Tensor) -> Tensor:
        return (plus * m[:, None, :]).sum(-1) / total_plus

    out = {
        "answer_signed": signed(ans),
        "noise_signed": signed(noise),
        "query_signed": signed(query),
        "answer_pos_share": share(ans),
        "noise_pos_share": share(noise),
        "neg_mass": rows.clamp_max(0).sum(-1),
        "row_sum": rows.sum(-1),
    }
    return out if per_sample else {k: v.mean(0) for k, v in out.items()}


def _mean_se(x: Tensor) -> float:
    """Standard error of the mean of the 1-D sample x (0 for a single value)."""
    n = x.numel()
    return (x.float().std(correction=1) / math.sqrt(n)).item() if n > 1 else 0.0


def noise_analysis(model: nn.Module, cells: Sequence[NeedleCell], query: int = 0) -> dict:
    """Attention shares at the position answering query ``query`` of each cell's sequences, per layer and
    head, averaged over all sequences. Returns {"per_layer_head": {name: [[...] per head] per layer},
    "mean": {name: float over layers and heads}, "last_layer": {name: float over its heads}, "mean_se" and
    "last_layer_se": {name: standard error of that mean over the sequences}, "sequences": their number}."""
    per_seq: dict[str, list[Tensor]] = {}  # name -> [(n, L, H) per cell]
    for cell in cells:
        maps = capture_maps(model, cell.inputs)
        layers = [
            attention_shares(
                effective_map(m),
                cell.answer_pos[:, query],
                cell.span_start[:, query],
                NEEDLE_LEN,
                cell.query_start,
                per_sample=True,
            )
            for m in maps
        ]
        for k in layers[0]:
            per_seq.setdefault(k, []).append(torch.stack([s[k] for s in layers], dim=1))
    if not per_seq:
        raise ValueError("noise_analysis needs at least one evaluation sequence")
    seqs = {k: torch.cat(v) for k, v in per_seq.items()}  # (N, L, H)
    return {
        "per_layer_head": {k: v.mean(0).tolist() for k, v in seqs.items()},
        "mean": {k: v.mean().item() for k, v in seqs.items()},
        "last_layer": {k: v[:, -1].mean().item() for k, v in seqs.items()},
        "mean_se": {k: _mean_se(v.mean(dim=(1, 2))) for k, v in seqs.items()},
        "last_layer_se": {k: _mean_se(v[:, -1].mean(dim=1)) for k, v in seqs.items()},
        "sequences": len(next(iter(seqs.values()))),
    }


# ----------------------------------------------------------------------------------------------- outliers
def outlier_stats(values: Tensor, topks: Sequence[int] = TOPKS) -> dict[str, float]:
    """top-k (the k-th largest) and median of |values| (flattened); k beyond the size is skipped."""
    a = values.detach().abs().flatten().float()
    if a.numel() == 0:
        raise ValueError("outlier_stats needs at least one value")
    top = torch.topk(a, min(max(topks), a.numel())).values
    out = {f"top{k}": top[k - 1].item() for k in topks if k <= a.numel()}
    out["median"] = a.median().item()
    return out


def _causal_visible(t: Tensor) -> Tensor:
    """Entries of (…, Tq, Tk) logits a causal decoder uses (query i sees keys j <= i + Tk − Tq), flattened."""
    tq, tk = t.shape[-2:]
    keep = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    return t[..., keep]


@torch.no_grad()
def activation_outliers(model: nn.Module, inputs: Tensor) -> dict[str, dict]:
    """Outlier statistics of the attention logits and of every block's output on ``inputs`` (B, T)."""
    hidden: list[Tensor] = []
    hooks = [
        b.register_forward_hook(lambda _m, _i, out: hidden.append(out.detach().float().cpu()))
        for b in model.blocks
    ]
    try:
        maps = capture_maps(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    causal = getattr(getattr(model, "config", None), "causal", True)
    logits = [(_causal_visible(t) if causal else t.flatten()) for m in maps for t in logit_maps(m)]
    return {
        "attn_logits": outlier_stats(torch.cat([x.flatten() for x in logits])),
        "hidden": outlier_stats(torch.cat([h.flatten() for h in hidden])),
        "attn_logits_top1_per_layer": [
            max(_causal_visible(t).abs().max().item() for t in logit_maps(m)) for m in maps
        ],
        "hidden_top1_per_layer": [h.abs().max().item() for h in hidden],
    }


def outlier_spread(model: nn.Module, batches: Sequence[Tensor]) -> dict[str, dict[str, float]]:
    """Top-1 and median of |attention logits| and |hidden states| on each batch (B, T) separately, as
    {"attn_logits_top1": {"mean", "se", "n"}, ...}: the batch-to-batch spread of the outlier statistics, so
    two models' values can be compared against their sampling noise."""
    if not batches:
        raise ValueError("outlier_spread needs at least one batch")
    per = [activation_outliers(model, x) for x in batches]
    out = {}
    for key in ("attn_logits", "hidden"):
        for stat in ("top1", "median"):
            v = torch.tensor([p[key][stat] for p in per], dtype=torch.float64)
            out[f"{key}_{stat}"] = {"mean": v.mean().item(), "se": _mean_se(v), "n": len(per)}
    return out


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


# -------------------------------------------------------------------------------------------- quantization
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


# ----------------------------------------------------------------------------------------------- perplexity
@torch.no_grad()
def perplexity(
    model: nn.Module,
    source,
    *,
    n_batches: int = 8,
    batch_size: int = 16,
    seed: int = 1234,
    split: str = "val",
) -> dict[str, float]:
    """Mean token cross-entropy over ``n_batches`` batches of ``source`` (fixed seed) -> loss, its standard
    error, ppl, bits."""
    per_token = token_losses(model, source, n_batches=n_batches, batch_size=batch_size, seed=seed, split=split)
    loss = per_token.mean().item()
    return {
        "loss": loss,
        # Spread over tokens, treated as independent: exact for one answer per sequence, a little
        # optimistic when a sequence has several.
        "loss_se": _mean_se(per_token),
        "ppl": math.exp(min(loss, 700.0)),
        "bits_per_token": loss / math.log(2),
        "tokens": per_token.numel(),
    }


@torch.no_grad()
def token_losses(
    model: nn.Module,
    source,
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


def quantization_sweep(
    model: nn.Module,
    cells: Sequence[NeedleCell] | None,
    source=None,
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
                for m in _attn_modules(model):
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
                    loss = tok.mean().item()
                    row.update(
                        ppl_loss=loss,
                        ppl_loss_se=_mean_se(tok),
                        ppl_ppl=math.exp(min(loss, 700.0)),
                        ppl_bits_per_token=loss / math.log(2),
                        ppl_tokens=tok.numel(),
                    )
                    now["ppl"] = tok
                if b is None:
                    ref = now
                else:
                    for name, v in now.items():
                        d = (v - ref[name]) if name == "ppl" else (ref[name] - v)
                        key = "ppl_rise" if name == "ppl" else f"{name}_drop"
                        row[key], row[f"{key}_se"] = d.mean().item(), _mean_se(d)
            finally:
                for m in _attn_modules(model):
                    m.use_reference = False
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------- all at once
def default_cells(
    task: NeedleTask,
    *,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    n_needles: int = 1,
    n_queries: int = 1,
    n_samples: int = 32,
    seed: int = 0,
) -> list[NeedleCell]:
    """The evaluation grid: depths × lengths (default lengths: seq_len/4, seq_len/2, seq_len, each raised to
    the shortest length where ``n_needles`` fit around the queried one at every depth). ``n_needles`` > 1
    puts ``n_needles − 1`` distractor needles (other keys) in every context, which makes the grid harder."""
    if lengths is None:
        t = task.seq_len
        lengths = sorted({task.shortest_fit(n_needles, n_queries, depths, at_least=n) for n in (t // 4, t // 2, t)})
    return needle_eval_set(
        task, depths, lengths, n_needles=n_needles, n_queries=n_queries, n_samples=n_samples, seed=seed
    )


MULTI_FACTOR = 4  # the multi-needle table draws this many times the grid's samples (spread over 5 depths)


def multi_needle_cells(task: NeedleTask, length: int, n: int, r: int, n_samples: int, seed: int) -> list:
    """The examples behind one (N needles, R queried) entry: ``n_samples`` spread over depths 0, ¼, ½, ¾, 1."""
    depths = [i / 4 for i in range(5)]
    return needle_eval_set(task, depths, [length], n_needles=n, n_queries=r,
                           n_samples=max(1, n_samples // len(depths)), seed=seed + 7919 * n + r)


def multi_needle_table(
    model: nn.Module,
    task: NeedleTask,
    length: int,
    *,
    settings=((1, 1), (2, 2), (4, 2), (6, 2)),
    n_samples: int = 32,
    seed: int = 0,
) -> dict[str, float]:
    """Paper Table 2 style: accuracy over random depths for each (N needles, R queried) at one length."""
    return multi_needle_counts(model, task, length, settings=settings, n_samples=n_samples, seed=seed)[0]


def multi_needle_counts(
    model: nn.Module,
    task: NeedleTask,
    length: int,
    *,
    settings=((1, 1), (2, 2), (4, 2), (6, 2)),
    n_samples: int = 32,
    seed: int = 0,
) -> tuple[dict[str, float], dict[str, int]]:
    """:func:`multi_needle_table` and, per entry, the number of queried answers it counts."""
    out, counts = {}, {}
    for n, r in settings:
        if n > task.vocab.n_keys or length < task.min_length(n, r):
            continue
        cells = multi_needle_cells(task, length, n, r, n_samples, seed)
        acc = needle_accuracy(model, cells)
        out[f"{n},{r}"] = sum(acc.values()) / len(acc)
        counts[f"{n},{r}"] = sum(c.answers.numel() for c in cells)
    return out, counts


def evaluate_model(
    model: nn.Module,
    *,
    what: Sequence[str] = WHATS,
    task: NeedleTask | None = None,
    source=None,
    cells: Sequence[NeedleCell] | None = None,
    bits: Sequence[int] = DEFAULT_BITS,
    ppl_batches: int = 8,
    batch_size: int = 16,
    n_samples: int = 32,
    seed: int = 0,
    quant_ppl_batches: int | None = None,
) -> dict:
    """Run the chosen evaluations. ``task`` (a NeedleTask) is needed for needle/noise; ``source`` (any
    BatchSource) for ppl; outliers use the needle cells if there are any, else a batch of ``source``."""
    bad = sorted(set(what) - set(WHATS))
    if bad:
        raise ValueError(f"unknown evaluation(s) {bad}; choose from {list(WHATS)}")
    if task is not None and cells is None:
        cells = default_cells(task, n_samples=n_samples, seed=seed)
    res: dict = {}
    if "ppl" in what:
        if source is None:
            raise ValueError("ppl needs a data source (--data FILE, or a checkpoint trained on a dataset)")
        res["ppl"] = perplexity(model, source, n_batches=ppl_batches, batch_size=batch_size)
    if "needle" in what or "noise" in what:
        if task is None:
            raise ValueError("needle/noise need a model trained on the synthetic 'needle' task")
    if "needle" in what:
        acc = needle_accuracy(model, cells)
        queries = {(c.depth, c.length): c.answers.numel() for c in cells}
        multi, multi_queries = multi_needle_counts(
            model, task, task.seq_len, n_samples=MULTI_FACTOR * n_samples, seed=seed
        )
        res["needle"] = {
            "grid": [{"depth": d, "length": n, "acc": a, "queries": queries[d, n]} for (d, n), a in acc.items()],
            "mean": sum(acc.values()) / len(acc),
            "queries": sum(queries.values()),
            "multi": multi,
            "multi_queries": multi_queries,
            "n_needles": cells[0].n_needles,
        }
    if "noise" in what:
        res["noise"] = noise_analysis(model, cells)
        res["noise"]["sequences"] = sum(len(c.inputs) for c in cells)
    if "outliers" in what:
        if cells:
            longest = max(c.length for c in cells)
            inputs = torch.cat([c.inputs for c in cells if c.length == longest])[:batch_size]
        elif source is not None:
            inputs = source.get_batch("val", batch_size, torch.Generator().manual_seed(seed))[0]
        else:
            raise ValueError("outliers need inputs: a needle task or a data source")
        res["outliers"] = activation_outliers(model, inputs)
        res["outliers"]["sequences"] = len(inputs)
        if cells:  # one batch per cell at the longest length: the spread of the statistics across batches
            res["outliers"]["spread"] = outlier_spread(
                model, [c.inputs[:batch_size] for c in cells if c.length == longest]
            )
    if "quant" in what:
        if not cells and source is None:
            raise ValueError("quant needs a needle task or a data source")
        multi = None
        if task is not None:  # the 1-needle grid saturates; several needles show the loss of precision
            n = min(4, task.max_needles)
            r = min(2, n)
            # the very examples of multi_needle_table's (n, r) entry, so its fp32 column equals that entry
            multi = multi_needle_cells(task, task.seq_len, n, r, MULTI_FACTOR * n_samples, seed)
            res["quant_multi_setting"] = {"n_needles": n, "n_queries": r, "length": task.seq_len}
        res["quant"] = quantization_sweep(
            model,
            cells,
            source,
            bits=bits,
            ppl_batches=quant_ppl_batches or max(1, ppl_batches // 2),
            batch_size=batch_size,
            multi_cells=multi,
        )
    return res


def task_from_run_config(run_config: dict, seq_len: int) -> NeedleTask | None:
    """The needle task a checkpoint was trained on (its run config's ``[data]``, built by data.make_source),
    or None when it was trained on something else."""
    data = dict(run_config.get("data") or {})
    if data.get("synthetic") != "needle":
        return None
    task, _ = make_source(data, seq_len)
    return task if isinstance(task, NeedleTask) else None
