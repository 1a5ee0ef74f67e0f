"""Differential attention V1 whose two maps are distance-aware (DA-Transformer scores), each with its own
distance profile. Shapes as :mod:`diffattn.attention.diff`; mask conventions: :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch import Tensor

from diffattn.attention.base import AttentionBase, AttentionConfig, HeadOptions, head_options
from diffattn.attention.diff import DiffOptions, MultiheadDiffAttention, diff_combine_ref, v1_kwargs
from diffattn.attention.distance import DistanceOptions, distance_attention, distance_init
from diffattn.attention.registry import register
from diffattn.ops.core import ScoreMod, check_diff_shapes, repeat_kv
from diffattn.ops.distance_score import check_distance_params, distance_logits, distance_mask, distance_positions


def diff_distance_attention_ref(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, w: Tensor, v_param: Tensor,
                                *, causal: bool = True, attn_mask: Tensor | None = None, offset: int | Tensor = 0,
                                scale: float | None = None, score_mod: ScoreMod | None = None,
                                return_maps: bool = False):
    """Differential V1 attention with distance-aware maps, materialized:
    (softmax(ReLU(Q1K1ᵀ) ⊙ f(w1·R; v1)/√d) − λ·softmax(ReLU(Q2K2ᵀ) ⊙ f(w2·R; v2)/√d))·V.

    Layout as :func:`diff_attention_ref` (q (B, 2h, Tq, d), k (B, 2hkv, Tk, d), v (B, hkv, Tk, 2d)).
    w, v_param: (2h,) in the query sub-head order — entry 2i belongs to map 1 of diff-head i, 2i+1 to map 2 —
    so each map has its own distance profile (the difference of two profiles can express band-pass ranges,
    which one shared profile cannot). Returns (B, h, Tq, 2d) (before the per-head norm), plus {"logits1",
    "logits2", "probs1", "probs2", "attn"} when asked.
    """
    h, n_rep = check_diff_shapes(q, k, v, "diff distance attention")
    check_distance_params(w, v_param, 2 * h, "diff distance attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qpos = distance_positions(q.shape[-2], offset, q.device)
    mask = distance_mask(qpos, k.shape[-2], causal, attn_mask)
    logits = [distance_logits(q[:, s::2], repeat_kv(k[:, s::2], n_rep), w[s::2], v_param[s::2], qpos, scale)
              for s in (0, 1)]
    return diff_combine_ref(logits, mask, lam, repeat_kv(v, n_rep), score_mod, return_maps)


def diff_distance_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, w: Tensor, v_param: Tensor, *,
                            causal: bool = True, attn_mask: Tensor | None = None, offset: int | Tensor = 0,
                            scale: float | None = None, block_q: int = 256, block_k: int = 256,
                            backend: str = "auto") -> Tensor:
    """Fast differential distance attention: one :func:`distance_attention` call over the 2h sub-heads (as
    :func:`diff_attention` does with SDPA: sub-heads reordered to (hkv, 2, n_rep), V repeated for its two key
    sub-heads), then A1·V − λ·A2·V. Shapes as :func:`diff_distance_attention_ref`; ``backend`` as
    :func:`distance_attention` ("auto": FlexAttention on CUDA)."""
    b, h2, tq, d = q.shape
    h, n_rep = check_diff_shapes(q, k, v, "diff distance attention")
    check_distance_params(w, v_param, h2, "diff distance attention")
    hkv = v.shape[1]

    def order(x: Tensor) -> Tensor:  # query sub-head (g, r, s) -> (g, s, r)
        return x.view(hkv, n_rep, 2).transpose(1, 2).reshape(h2)

    q = q.view(b, hkv, n_rep, 2, tq, d).transpose(2, 3).reshape(b, h2, tq, d)
    o = distance_attention(q, k, v.repeat_interleave(2, dim=1), order(w), order(v_param), causal=causal,
                           attn_mask=attn_mask, offset=offset, scale=scale, block_q=block_q, block_k=block_k,
                           backend=backend)
    o = o.view(b, hkv, 2, n_rep, tq, o.shape[-1])
    return (o[:, :, 0] - lam * o[:, :, 1]).reshape(b, h, tq, o.shape[-1])


@dataclass(frozen=True)
class DiffDistanceOptions(DistanceOptions, DiffOptions):
    """``diff_distance``'s options: the distance options (:class:`DistanceOptions`) and V1's
    (:class:`DiffOptions`), each checked."""

    def __post_init__(self) -> None:
        DistanceOptions.__post_init__(self)
        DiffOptions.__post_init__(self)


@register("diff_distance", label="DIFF-DA", color="#d62728")
class DiffDistanceAttention(MultiheadDiffAttention):
    """Differential attention V1 whose two maps are distance-aware (DA-Transformer scores).

    Each map has its own (w, v) per diff-head — ``distance_w``, ``distance_v`` (2h,), entry 2i for map 1 and
    2i+1 for map 2, like the query sub-heads — so A1 − λA2 can subtract a broad-range map from a short-range
    one (a band-pass over distance), which one shared profile cannot express; the cost is 2 scalars per head.
    Both maps of a head start from the same value (the spread is over diff-heads). Baseline: ``distance``
    with twice the heads. Maps recorded by ``capture``: logits1, logits2, probs1, probs2, attn, lambda.
    """

    fast_op, ref_op = staticmethod(diff_distance_attention), staticmethod(diff_distance_attention_ref)
    selects_heads = False  # V1's head mask (diff_heads) is V1's own forward; this type's op takes none

    head_split = 2
    baseline = "distance"
    kernel_family = "distance"
    Options = DiffDistanceOptions
    unsupported = {"serve": (
        "its logits are ReLU(QKᵀ)·f(w·|i−j|; v), a score modification vLLM's stock attention kernels have no hook "
        "for: serving it needs a per-layer, per-head score_mod over the paged KV cache (vLLM's FlexAttention "
        "backend takes one score_mod for the whole batch and runs on CUDA only); its KV cache would be "
        "V1's (layout and bytes)")}

    def __init__(self, embed_dim: int, num_heads: int, depth: int, num_kv_heads: int | None = None,
                 lambda_init: float | None = None, lambda_std: float = 0.1, norm_eps: float = 1e-5,
                 bias: bool = False, w_init=0.1, v_init=0.0, block: int = 256, shared_qk: bool = False,
                 head_dim: int | None = None, subln: bool = True, dual_lambda: bool = False, qk_norm: bool = False,
                 heads: HeadOptions | None = None):
        super().__init__(embed_dim, num_heads, depth, num_kv_heads, lambda_init, lambda_std, norm_eps, bias,
                         shared_qk=shared_qk, head_dim=head_dim, subln=subln, dual_lambda=dual_lambda,
                         qk_norm=qk_norm, heads=heads)
        self._distance_args = (w_init, v_init)
        w, v = distance_init(num_heads, w_init, v_init)
        self.distance_w = nn.Parameter(w.repeat_interleave(2))
        self.distance_v = nn.Parameter(v.repeat_interleave(2))
        self.block = block

    def reset_parameters(self) -> None:
        super().reset_parameters()  # λ
        w, v = distance_init(self.num_heads, *self._distance_args)
        self.distance_w.copy_(w.repeat_interleave(2))
        self.distance_v.copy_(v.repeat_interleave(2))

    def op_params(self) -> tuple[Tensor, Tensor]:
        return self.distance_w, self.distance_v

    def fast_kwargs(self) -> dict[str, int]:
        return {"block_q": self.block, "block_k": self.block}

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        o = cfg.options
        return cls(cfg.d_model, cfg.n_heads, layer_idx, cfg.n_kv_heads, norm_eps=cfg.norm_eps, bias=cfg.attn_qkv_bias,
                   w_init=o.distance_w_init, v_init=o.distance_v_init, block=o.distance_block,
                   shared_qk=cfg.shared_qk, head_dim=cfg.head_dim, **v1_kwargs(cfg), heads=head_options(cfg, layer_idx))
