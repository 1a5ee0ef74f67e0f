"""Differential attention V2 (unilm, 2026-01): 2h query heads share the KV heads, one standard attention call,
then out_j = attn_{2j} − sigmoid(λ_j)·attn_{2j+1} with λ = W_λ x per token and head. Shapes and mask conventions:
:mod:`diffattn.ops.core`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.attention.base import (
    AttentionBase,
    AttentionConfig,
    HeadOptions,
    MaskArgs,
    head_options,
    out_bias,
    split_heads,
)
from diffattn.attention.conversion import Conversion, Getter, SourceLayer, carried, projection, repeat_heads
from diffattn.attention.registry import converts, register, serves
from diffattn.attention.retrofit import HeadSelection, Retrofittable
from diffattn.attention.serving import AttentionShape, ServedLayer, VllmParts, check_split, head_scale, window_extra
from diffattn.attention.standard import attention_ref
from diffattn.ops.core import ScoreMod, check_heads, sdpa


def diff_v2_attention_ref(q: Tensor, k: Tensor, v: Tensor, lam_logits: Tensor, *, causal: bool = True,
                          attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                          score_mod: ScoreMod | None = None, return_maps: bool = False,
                          lam_scale: Tensor | float = 1.0):
    """Differential attention V2: out_j = attn_{2j} − s·sigmoid(λ_j)·attn_{2j+1}, materialized (``lam_scale``
    s = 1 is the paper's; a training loop may ramp it in).

    q: (B, 2h, Tq, D) query heads at the baseline head width, pair j = heads (2j, 2j+1), which sit in one GQA
    group; k, v: (B, hkv, Tk, D); lam_logits: (B, h, Tq) = W_λ x (before the sigmoid), per token and head.
    Returns (B, h, Tq, D), plus {"logits", "probs", "attn" (effective map)} when asked.
    """
    h = q.shape[1] // 2
    if q.shape[1] % 2:
        raise ValueError(f"diff_v2 wants an even number of query heads, got {q.shape[1]}")
    check_heads(h, k.shape[1], "diff_v2 attention (pairs must stay inside one GQA group)")
    out, maps = attention_ref(q, k, v, causal=causal, attn_mask=attn_mask, offset=offset, scale=scale,
                              score_mod=score_mod, return_maps=True)
    w = (torch.sigmoid(lam_logits) * lam_scale)[..., None].to(out.dtype)
    attn = maps["probs"][:, 0::2] - w * maps["probs"][:, 1::2]
    out = out[:, 0::2] - w * out[:, 1::2]
    if not return_maps:
        return out
    maps["attn"] = attn
    return out, maps


def diff_v2_attention(q: Tensor, k: Tensor, v: Tensor, lam_logits: Tensor, *, causal: bool = True,
                      attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                      lam_scale: Tensor | float = 1.0) -> Tensor:
    """Fast differential attention V2: one SDPA call, then the per-token difference of adjacent heads
    (the odd head weighted by ``lam_scale``·sigmoid(λ))."""
    h = q.shape[1] // 2
    if q.shape[1] % 2:
        raise ValueError(f"diff_v2 wants an even number of query heads, got {q.shape[1]}")
    check_heads(h, k.shape[1], "diff_v2 attention (pairs must stay inside one GQA group)")
    o = sdpa(q, k, v, causal=causal, offset=offset, attn_mask=attn_mask, scale=scale)
    return o[:, 0::2] - (torch.sigmoid(lam_logits) * lam_scale)[..., None].to(o.dtype) * o[:, 1::2]


@register("diff_v2", label="DIFF-V2", color="#2ca02c")
class DiffV2Attention(Retrofittable, HeadSelection, AttentionBase):
    """Differential attention V2 (unilm, 2026-01): 2h query heads at the baseline head width share the KV heads;
    out_j = attn_{2j} − sigmoid(W_λ x)_j · attn_{2j+1}; no per-head norm, no λ_init. Not parameter-matched by
    design (the extra query heads and W_λ): its baseline is standard attention at the same n_heads. The buffer
    ``lambda_scale`` (not saved; 1 by default) multiplies sigmoid(W_λ x) (``train.lambda_warmup_steps``).

    ``shared_qk`` is not defined here: pair j's two maps read the same key head with different query heads
    (2j, 2j+1), so K = Q_{2j} would make map 2j symmetric and map 2j+1 not, and K = Q for both would make the
    two maps identical (their difference would cancel). ``ModelConfig(shared_qk=True)`` rejects diff_v2.
    ``heads``: the pretrained families' options (:class:`~diffattn.attention.base.HeadOptions`); QK-norm runs over
    every query head and key head of width d, as in the source model a V2 conversion starts from.
    ``selected_heads`` (``ModelConfig.diff_heads``; None: all): the pairs whose negative map is on (the buffer
    ``head_mask`` m): out_j = attn_2j − m_j·σ_j·attn_2j+1, so an unselected pair is a standard head (its even
    query head's attention)."""

    fast_op, ref_op = staticmethod(diff_v2_attention), staticmethod(diff_v2_attention_ref)

    baseline = "standard"
    supports_shared_qk = False
    unsupported = {"export": "transformers has no Differential Transformer V2 model"}
    retrofit_anneals = "the negative map's weight, from the conversion's constant σ = ½ to the learned σ(W_λ x)"
    selects_heads = True

    @classmethod
    def core_flops_per_token(cls, cfg: AttentionConfig, context: float) -> float:
        """2h query heads of width d, each its own map times V of width d: twice standard attention's (with a head
        mask too: an unselected pair still computes its odd map, weighted 0)."""
        h, d = cfg.n_heads, cfg.qk_head_dim
        return 2 * (2 * h * d + 2 * h * d) * context

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, heads: HeadOptions | None = None, selected_heads: list[int] | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.head_dim = head_dim or embed_dim // num_heads
        self.rope_dim = self.head_dim
        self.q_proj = nn.Linear(embed_dim, 2 * num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.init_heads(heads, self.head_dim)
        self.lambda_proj = nn.Linear(embed_dim, num_heads, bias=False)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=out_bias(heads, bias))
        self.register_buffer("lambda_scale", torch.ones(()), persistent=False)
        self.init_retrofit()
        self.init_head_mask(selected_heads, num_heads)

    def reset_parameters(self) -> None:
        self.lambda_scale.fill_(1.0)
        self.retrofit_s.fill_(1.0)
        self.reset_head_mask()

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.attn_qkv_bias,
                   heads=head_options(cfg, layer_idx), selected_heads=cfg.layer_heads(layer_idx))

    def cache_shapes(self, batch_size, max_seq_len):
        shape = (batch_size, self.num_kv_heads, max_seq_len, self.head_dim)
        return shape, shape

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, E) -> 2h query heads, hkv key and value heads, all of width d."""
        q = split_heads(self.q_proj(x), 2 * self.num_heads)
        return q, split_heads(self.k_proj(x), self.num_kv_heads), split_heads(self.v_proj(x), self.num_kv_heads)

    def attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, margs: MaskArgs) -> Tensor:
        """The core with λ's logits W_λ x (B, h, T) and their scale (``lambda_scale``, times the head mask)."""
        lam_logits = self.lambda_proj(x).transpose(1, 2)  # (B, h, T)
        if self.retrofitting:  # σ_eff = (1 − s)·½ + s·σ(W_λ x): ½ (the conversion's) at s = 0, whatever W_λ is
            lam_logits = torch.logit(self.annealed(0.5, torch.sigmoid(lam_logits)))
        on, scale = self.head_mask, self.lambda_scale
        if on is not None:  # an unselected pair's weight is 0: out_h = attn_2h, a standard head on its even map
            scale = scale * on[:, None]  # (h, 1), against σ's (B, h, T)
        return self.core(q, k, v, margs, lam_logits, lam_scale=scale)

    def extra_maps(self, lam_logits: Tensor, lam_scale: Tensor) -> dict[str, Tensor]:
        """λ = σ(W_λ x) times its scale (B, h, T), and the head mask ("heads")."""
        heads = {} if self.head_mask is None else {"heads": self.head_mask.bool()}
        return {"lambda": (torch.sigmoid(lam_logits) * lam_scale).detach(), **heads}


@converts(DiffV2Attention)
class DiffV2Conversion(Conversion):
    """``--to diff_v2 --init exact`` (function-preserving). 2h query heads at width d sharing the source KV heads;
    out_j = attn_2j − σ(W_λ x)_j·attn_2j+1. Query heads 2j and 2j+1 are both q_j (both read KV head j // n_rep,
    the source's grouping), so out_j = (1 − σ)·A_j v_g; W_λ = 0 gives σ = ½ everywhere, and the out-projection
    is 2·W_o (multiplying by 2 and by ½ is exact in floating point). W_λ = 0 is not a saddle:
    ∂L/∂W_λ = Σ_t (∂L/∂σ)·σ(1 − σ)·x_tᵀ ≠ 0; the odd query heads get −σ times the even heads' gradient, so the
    copies separate from the first step. No ``--init split``: V2 is not parameter-matched by design (twice its
    baseline's query heads). The exactness rests on σ = ½ at ``lambda_scale`` 1 (the ×2 out-projection): a
    λ warm-up (``train.lambda_warmup_steps``) would start a V2 conversion at twice the source's attention
    output, so it does not suit one. A layer with a head mask (``diff_heads``) doubles only its selected heads'
    out-projection columns: an unselected pair's output is attn_2j = A_j v_g, the source head's, as it is."""

    @classmethod
    def weights(cls, src: SourceLayer, new: nn.Module, *, init: str, gen: torch.Generator,
                break_symmetry: float) -> dict[str, Tensor]:
        on = getattr(new, "head_mask", None)
        factor = 2.0 if on is None else (1.0 + on.float().cpu()).repeat_interleave(new.head_dim)  # (h·d,) columns
        return {**projection(src, "q_proj", lambda rows: repeat_heads(rows, new.head_dim)),
                **projection(src, "k_proj"), **projection(src, "v_proj"),
                **carried(src, factor * src["out_proj.weight"]),
                "lambda_proj.weight": torch.zeros_like(new.lambda_proj.weight)}

    @classmethod
    def created(cls, attn: nn.Module, get: Getter) -> dict[str, Tensor]:
        """The even and odd query heads, W_λ and the out-projection."""
        q = get(attn.q_proj.weight).view(-1, 2, attn.head_dim, attn.out_proj.out_features)
        return {"q_even": q[:, 0], "q_odd": q[:, 1], "lambda_proj": get(attn.lambda_proj.weight),
                "out_proj": get(attn.out_proj.weight)}


@serves(DiffV2Attention)
class DiffV2Served(ServedLayer):
    """2h query heads over the KV heads in one ``Attention`` call (the cache of a standard model: 2·hkv·d values
    per token and layer), then out_j = attn_2j − sigmoid(W_λ x)_j · attn_2j+1. Tensor parallelism keeps each
    pair on one rank (it splits the h pairs), and W_λ is split with them."""

    def __init__(self, cfg: AttentionConfig, layer: int, parts: VllmParts):
        d, h = cfg.qk_head_dim, cfg.n_heads
        check_split("diff_v2 head pairs", h, parts.tp_size)
        super().__init__(cfg, parts, head_size=d, q_heads=2 * h, out_width=h * d)
        self.d = d
        self.lambda_proj = parts.column(cfg.d_model, h, bias=False, name="lambda_proj")
        self.init_qk_norm(cfg, parts, d)
        self.rotary = parts.rope(cfg, d, layer)
        self.attn = parts.attention(self.q_heads, d, head_scale(cfg, d), self.kv_heads, **window_extra(cfg, layer))
        self.init_head_mask(cfg, layer, parts, self.q_heads // 2)

    @classmethod
    def shape(cls, cfg: AttentionConfig) -> AttentionShape:
        return AttentionShape(((2 * cfg.n_heads, cfg.kv_heads, cfg.qk_head_dim),))

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        q, k = self.norm_qk(q, k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v).view(x.shape[0], self.q_heads // 2, 2, self.d)
        return self.out(o[:, :, 0] - self.odd_weight(x).to(o.dtype) * o[:, :, 1])

    def odd_weight(self, x: Tensor) -> Tensor:
        """x (T, E) -> σ(W_λ x) (T, pairs, 1), each pair's weight on its odd head, on this rank's pairs; with a
        head mask m (``diff_heads``) m_j·σ_j: an unselected pair is a standard head (its even one)."""
        lam, _ = self.lambda_proj(x)
        w = torch.sigmoid(lam)
        return (w if self.head_mask is None else w * self.head_mask.to(w.dtype))[..., None]
