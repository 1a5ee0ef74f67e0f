"""Standard multi-head (GQA) softmax attention: the baseline.

``attention_ref`` materializes the (Tq, Tk) map (the spec); ``attention`` is one SDPA call (a fused flash kernel
on CPU and CUDA). Shapes and mask conventions: :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.attention.base import (
    AttentionBase,
    AttentionConfig,
    HeadOptions,
    check_positive,
    check_shared_qk,
    head_options,
    out_bias,
)
from diffattn.attention.conversion import Conversion, Getter, SourceLayer
from diffattn.attention.registry import converts, register, serves
from diffattn.attention.serving import AttentionShape, ServedLayer, VllmParts, head_scale, window_extra
from diffattn.ops.core import ScoreMod, build_mask, check_heads, masked_softmax, repeat_kv, sdpa


def attention_ref(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, attn_mask: Tensor | None = None,
                  offset: int | Tensor = 0, scale: float | None = None, score_mod: ScoreMod | None = None,
                  return_maps: bool = False):
    """softmax(QKᵀ·scale)·V, materialized. Returns (B, Hq, Tq, Dv), plus {"logits", "probs"} if asked.

    ``score_mod`` rewrites the scaled logits before masking (used by logit-quantization studies).
    """
    n_rep = check_heads(q.shape[1], k.shape[1], "attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    logits = (q @ k.transpose(-1, -2)) * scale
    if score_mod is not None:
        logits = score_mod(logits)
    mask = build_mask(q.shape[-2], k.shape[-2], causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    probs = masked_softmax(logits, mask)
    out = probs @ v
    return (out, {"logits": logits, "probs": probs}) if return_maps else out


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, attn_mask: Tensor | None = None,
              offset: int | Tensor = 0, scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    """Fast softmax(QKᵀ·scale)·V on SDPA. Shapes as :func:`attention_ref`."""
    check_heads(q.shape[1], k.shape[1], "attention")
    return sdpa(q, k, v, causal=causal, offset=offset, attn_mask=attn_mask, scale=scale, dropout_p=dropout_p)


@register("standard", label="Transformer", color="#ff7f0e")
class StandardAttention(AttentionBase):
    """Multi-head (GQA) softmax attention: the baseline.

    ``shared_qk=True`` (the seeds' "Diff_Symmetry"): there is no ``k_proj`` and K = Q (before RoPE), so the
    pre-softmax logit map QQᵀ/√D is symmetric. With RoPE it stays exactly symmetric: query and key i both get
    the rotation R_i, so logit(i, j) = ⟨R_i q_i, R_j q_j⟩ = logit(j, i). Needs num_kv_heads == num_heads.

    ``bias``: biases on the q, k, v (and, unless ``heads.out_bias`` says otherwise, out) projections; ``heads``:
    the pretrained families' options (:class:`~diffattn.attention.base.HeadOptions`: QK-norm, sliding window,
    logit scale).
    """

    fast_op, ref_op = staticmethod(attention), staticmethod(attention_ref)

    supports_shared_qk = True

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, shared_qk: bool = False, heads: HeadOptions | None = None):
        super().__init__()
        check_positive(embed_dim=embed_dim, num_heads=num_heads)
        if num_kv_heads is not None:
            check_positive(num_kv_heads=num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.shared_qk = check_shared_qk(shared_qk, num_heads, self.num_kv_heads)
        self.head_dim = head_dim or embed_dim // num_heads
        self.rope_dim = self.head_dim
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=bias)
        self.k_proj = None if shared_qk else nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.init_heads(heads, self.head_dim, shared_qk=shared_qk)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=out_bias(heads, bias))

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.attn_qkv_bias,
                   shared_qk=cfg.shared_qk, heads=head_options(cfg, layer_idx))

    def cache_shapes(self, batch_size, max_seq_len):
        shape = (batch_size, self.num_kv_heads, max_seq_len, self.head_dim)
        return shape, shape



@converts(StandardAttention)
class StandardConversion(Conversion):
    """``--to standard``: the source as it is (any family, as read), no tensor created. :attr:`keeps_source`, so
    ``convert`` returns the source model itself rather than a copy."""

    keeps_source = True

    @classmethod
    def weights(cls, src: SourceLayer, new: nn.Module, *, init: str, gen: torch.Generator,
                break_symmetry: float) -> dict[str, Tensor]:
        return dict(src)

    @classmethod
    def created(cls, attn: nn.Module, get: Getter) -> dict[str, Tensor]:
        return {}


@serves(StandardAttention)
class StandardServed(ServedLayer):
    """vLLM's Llama attention: h query heads over hkv KV heads of width d, RoPE on each; the families' options as
    vLLM's Qwen2/Qwen3/Gemma 3 take them (q/k/v biases, QK-norm before RoPE, the layer's window, RoPE base and
    logit scale). KV cache: K and V of width d per KV head, 2·hkv·d values per token and layer. The variants
    that only change what ``Attention`` is given (ALiBi's slopes, sinks) or what happens after it (gated
    attention) build on it: :meth:`attention_extra`, :meth:`heads`."""

    def __init__(self, cfg: AttentionConfig, layer: int, parts: VllmParts):
        d, h = cfg.qk_head_dim, cfg.n_heads
        super().__init__(cfg, parts, head_size=d, q_heads=h, out_width=h * d)
        self.init_qk_norm(cfg, parts, d)
        self.rotary = parts.rope(cfg, d, layer)
        self.attn = parts.attention(self.q_heads, d, head_scale(cfg, d), self.kv_heads, **window_extra(cfg, layer),
                                    **self.attention_extra(cfg, parts))

    def attention_extra(self, cfg: AttentionConfig, parts: VllmParts) -> dict[str, Any]:
        """More keywords for vLLM's ``Attention`` (this rank's ``self.q_heads`` are set); none here."""
        return {}

    @classmethod
    def shape(cls, cfg: AttentionConfig) -> AttentionShape:
        return AttentionShape(((cfg.n_heads, cfg.kv_heads, cfg.qk_head_dim),))

    def heads(self, positions: Tensor, x: Tensor) -> Tensor:
        """x (T, E) -> the heads' outputs (T, heads·d) on this rank."""
        q, k, v = self.qkv(x)
        q, k = self.norm_qk(q, k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.attn(q, k, v)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        return self.out(self.heads(positions, x))
