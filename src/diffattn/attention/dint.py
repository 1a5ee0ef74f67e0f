"""DINT attention (Differential Integral Transformer, Cang et al., arXiv 2501.17486): (A1 − λ·A2 + λ·G)·V, where
A1 = softmax(Q1K1ᵀ/√d), A2 = softmax(Q2K2ᵀ/√d) as in V1 and G holds the column means of A1 (the "integral",
global importance of each key), so every row of A1 − λA2 + λG sums to 1 (one λ for both terms).

The mean runs over the rows the query may see: G_ij = Σ_i' W_ii' A1_i'j with W the row-normalized visibility
of query i (W_ii' = 1/|{i': visible}| for the positions i' it may attend to). Bidirectional, that is the paper's
column mean over all rows; causal, it is the prefix mean G_ij = (1/i)·Σ_{i' ≤ i} A1_i'j (1-based i), so no
output depends on a later token (a mean over all rows would leak them). Since G·V = W·(A1·V), the fast op needs
no extra map: G·V is the running (visible-row) mean of A1·V over positions, a cumulative sum on the plain
causal path. Under the KV cache, the rows A1·V of earlier positions are kept next to K and V.

Shapes as :mod:`diffattn.attention.diff` (V1 layout); mask conventions: :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffattn.attention.base import AttentionConfig, MaskArgs
from diffattn.attention.diff import MultiheadDiffAttention, diff_attention_parts
from diffattn.attention.diff_recipes import DiffConversion, DiffServed
from diffattn.attention.registry import converts, register, serves
from diffattn.attention.serving import AttentionShape, VllmParts
from diffattn.ops.core import ScoreMod, build_mask, check_diff_shapes, masked_softmax, repeat_kv, upcast
from diffattn.ops.kv_cache import KVCache


def _check_full(q: Tensor, k: Tensor, offset: int | Tensor) -> None:
    """G averages the rows of the queries themselves, so the queries must be the keys' positions."""
    if not isinstance(offset, int) or offset != 0 or q.shape[-2] != k.shape[-2]:
        raise ValueError("dint attention averages A1 over the query rows: it needs the whole sequence (queries "
                         f"= keys, offset 0), got {q.shape[-2]} queries, {k.shape[-2]} keys, offset "
                         f"{offset if isinstance(offset, int) else 'a tensor'}; decode with the module's KV cache")


def visible_rows(tq: int, *, causal: bool, attn_mask: Tensor | None, device=None) -> Tensor | None:
    """Which rows i' query i averages: the positions it may attend to, bool broadcastable to (B, H, Tq, Tq);
    None: all of them (bidirectional, no mask)."""
    mask = build_mask(tq, tq, causal=causal, attn_mask=attn_mask, device=device)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask != float("-inf")
    return mask


def visible_mean(rows: Tensor, vis: Tensor | None) -> Tensor:
    """The mean of ``rows`` (B, H, S, D) over the positions ``vis`` (bool, broadcastable to (B, H, Tq, S))
    marks for each query, computed in fp32: (B, H, Tq, D) (Tq = 1 for None: all rows). A query that sees none
    gets zeros."""
    r = upcast(rows)
    if vis is None:
        return r.mean(-2, keepdim=True).to(rows.dtype)
    w = vis.to(r.dtype)
    return ((w @ r) / w.sum(-1, keepdim=True).clamp_min(1)).to(rows.dtype)


def prefix_mean(rows: Tensor) -> Tensor:
    """Row i of the result is the mean of rows 0..i of ``rows`` (B, H, T, D): the plain causal case of
    :func:`visible_mean`, as a cumulative sum (fp32)."""
    r = upcast(rows)
    n = torch.arange(1, r.shape[-2] + 1, device=r.device, dtype=r.dtype)[:, None]
    return (r.cumsum(-2) / n).to(rows.dtype)


def dint_attention_ref(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, *, causal: bool = True,
                       attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                       score_mod: ScoreMod | None = None, return_maps: bool = False):
    """DINT attention, materialized: (A1 − λ·A2 + λ·G)·V with G = W·A1 (module docstring), the whole sequence.

    q: (B, 2h, T, d), k: (B, 2hkv, T, d), v: (B, hkv, T, 2d) in V1's layout (diff-head i: sub-heads 2i, 2i+1);
    lam: scalar. Returns (B, h, T, 2d) (before the per-head norm), plus maps {"logits1", "logits2", "probs1",
    "probs2", "G", "attn" (the effective map A1 − λA2 + λG)} when asked.
    """
    h, n_rep = check_diff_shapes(q, k, v, "dint attention")
    _check_full(q, k, offset)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    t = q.shape[-2]
    mask = build_mask(t, t, causal=causal, attn_mask=attn_mask, device=q.device)
    logits = [(q[:, s::2] @ repeat_kv(k[:, s::2], n_rep).transpose(-1, -2)) * scale for s in (0, 1)]
    if score_mod is not None:
        logits = [score_mod(x) for x in logits]
    probs = [masked_softmax(x, mask) for x in logits]
    vis = visible_rows(t, causal=causal, attn_mask=attn_mask, device=q.device)
    vis = torch.ones(t, t, dtype=torch.bool, device=q.device) if vis is None else vis
    w = vis.to(probs[0].dtype)
    g = (w / w.sum(-1, keepdim=True).clamp_min(1)) @ probs[0]
    attn = probs[0] - lam * probs[1] + lam * g
    out = attn @ repeat_kv(v, n_rep)
    if not return_maps:
        return out
    return out, {"logits1": logits[0], "logits2": logits[1], "probs1": probs[0], "probs2": probs[1], "G": g,
                 "attn": attn}


def dint_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, *, causal: bool = True,
                   attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None) -> Tensor:
    """Fast DINT attention: A1·V and A2·V from V1's one SDPA call (:func:`~diffattn.attention.diff.
    diff_attention_parts`, O(T) memory), then G·V as the visible-row mean of A1·V (a cumulative sum when plainly
    causal). Shapes as :func:`dint_attention_ref`."""
    check_diff_shapes(q, k, v, "dint attention")
    _check_full(q, k, offset)
    o1, o2 = diff_attention_parts(q, k, v, causal=causal, attn_mask=attn_mask, scale=scale)
    if causal and attn_mask is None:
        g = prefix_mean(o1)
    else:
        g = visible_mean(o1, visible_rows(q.shape[-2], causal=causal, attn_mask=attn_mask, device=q.device))
    return o1 - lam * o2 + lam * g


class RowCache(KVCache):
    """The KV cache plus ``rows`` (B, h, S, 2d): each cached position's A1·V, which G·V averages."""

    def __init__(self, k_shape, v_shape, rows_shape, dtype: torch.dtype, device=None):
        super().__init__(k_shape, v_shape, dtype=dtype, device=device)
        self.register_buffer("rows", torch.zeros(rows_shape, dtype=dtype, device=device), persistent=False)


@register("dint", label="DINT", color="#8c564b")
class DINTAttention(MultiheadDiffAttention):
    """DINT attention (Cang et al. 2025) on V1's parameters and head layout: (A1 − λA2 + λG)·V per diff-head,
    G the visible-row mean of A1 (module docstring). λ as V1's (λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, one per
    layer, shared by the −λA2 and +λG terms; timm's ``dual_lambda`` works too) and V1's per-head RMSNorm
    × (1 − λ_init) (``subln``), as the paper keeps DIFF's multi-head design. Parameters are V1's, so the
    matched baseline is V1's (standard attention at twice the heads) and ``convert --to dint`` is V1's exact
    recipe (λ = 0 also zeroes λG). The fast op runs V1's core layouts (:func:`~diffattn.attention.diff.
    diff_attention_parts`; the fused Triton kernel returns only A1·V − λA2·V, so it means the padded SDPA call).
    Maps recorded by ``capture``: logits1, logits2, probs1, probs2, G, attn, lambda.
    """

    fast_op, ref_op = staticmethod(dint_attention), staticmethod(dint_attention_ref)
    selects_heads = False  # V1's head mask (diff_heads) is V1's own forward; this type's op takes none

    kernel_family = "diff"  # V1's core layouts (its Triton kernel returns no separate maps: the padded SDPA call)
    window_note = ("its integral G averages the A1 rows of the positions a query sees, and those rows attend to "
                   "keys behind the query's window: the window would not bound what a position sees")
    unsupported = {"export": "transformers has no DINT model"}

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype, device=None) -> None:
        rows = (batch_size, self.num_heads, max_seq_len, 2 * self.head_dim)
        self.cache = RowCache(*self.cache_shapes(batch_size, max_seq_len), rows, dtype=dtype, device=device)

    def core(self, q: Tensor, k: Tensor, v: Tensor, margs: MaskArgs, lam: Tensor) -> Tensor:
        if self.cache is None:
            return super().core(q, k, v, margs, lam)
        # decoding: A1·V and A2·V of the new rows, then G·V from every cached row the query may see
        if self.reference_path:
            n_rep = self.n_rep
            scale = margs.scale or q.shape[-1] ** -0.5
            logits = [(q[:, s::2] @ repeat_kv(k[:, s::2], n_rep).transpose(-1, -2)) * scale for s in (0, 1)]
            if self.score_mod is not None:
                logits = [self.score_mod(x) for x in logits]
            probs = [masked_softmax(x, margs.attn_mask) for x in logits]
            o1, o2 = (p @ repeat_kv(v, n_rep) for p in probs)
            self.record({"logits1": logits[0], "logits2": logits[1], "probs1": probs[0], "probs2": probs[1],
                         "lambda": lam.detach()})
        else:
            o1, o2 = diff_attention_parts(q, k, v, **margs)
        self.cache.rows.index_copy_(2, margs.offset, o1.to(self.cache.rows.dtype))
        g = visible_mean(self.cache.rows, margs.attn_mask).to(o1.dtype)
        return o1 - lam * o2 + lam * g


# ``convert --to dint``: V1's recipe, exact here too (λ = 0 zeroes the λ·G term as well as λ·A2)
converts(DINTAttention)(DiffConversion)


@serves(DINTAttention)
class DintServed(DiffServed):
    """V1's maps, then (A1 − λA2 + λG)·V with G·V the running mean of A1·V over the positions each query sees: a
    second ``Attention`` layer whose queries and keys are zeros (uniform weights over the visible positions) and
    whose values are A1·V. KV cache: V1's plus each position's A1·V (h heads of width 2d, and zero keys as wide,
    since vLLM's kernels want K as wide as V): 4·hkv·d + 4·h·d values per token and layer."""

    def __init__(self, cfg: AttentionConfig, layer: int, parts: VllmParts):
        super().__init__(cfg, layer, parts)
        self.mean = parts.attention(self.q_heads, 2 * self.d, 1.0, self.q_heads, name="mean")

    @classmethod
    def shape(cls, cfg: AttentionConfig) -> AttentionShape:
        h, d = cfg.n_heads, cfg.qk_head_dim
        return AttentionShape(((2 * h, cfg.kv_heads, 2 * d), (h, h, 2 * d)))

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        o1, o2 = self.maps(positions, x)
        rows = o1.reshape(o1.shape[0], -1)
        zeros = torch.zeros_like(rows)
        g = self.mean(zeros, zeros, rows).view(o1.shape)
        lam = self.head_lambda(o1.dtype)
        return self.combine(o1 - lam * o2 + lam * g)
