"""Attention noise (paper Table 3): at the query position (whose next token is the answer), the attention row of
every layer and head is split into the *answer span* (the 3 tokens ``NDL key value`` of the queried needle), the
*noise context* (every other position before the query block, BOS included) and the query block itself.

The map is the effective one: softmax probs for standard attention, ``A1 − λA2`` for DIFF V1 and V2 (the probes'
``"attn"``). Its entries can be negative and its rows sum to ``1 − λ`` rather than 1, so we report two numbers per
region: ``*_signed`` = the plain sum of the map over the region (what the paper's table reads as "attention
score"; regions do not sum to 1 for DIFF), and ``*_pos_share`` = the region's share of the row's positive mass,
``Σ_region max(A, 0) / Σ_row max(A, 0)`` (in [0, 1], comparable across models; for standard attention it equals
the signed value). ``neg_mass`` is ``Σ_row min(A, 0)``, the mass DIFF cancels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.data.synthetic import NEEDLE_LEN, NeedleCell
from diffattn.eval.probes import capture_maps, effective_map, mean_se


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
        "mean_se": {k: mean_se(v.mean(dim=(1, 2))) for k, v in seqs.items()},
        "last_layer_se": {k: mean_se(v[:, -1].mean(dim=1)) for k, v in seqs.items()},
        "sequences": len(next(iter(seqs.values()))),
    }

