"""Gated attention (Qiu et al., "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
Attention-Sink-Free", arXiv 2505.06708; used in Qwen3-Next): each head's SDPA output is multiplied, before the
output projection, by a sigmoid gate computed from the block's pre-normed input x:

    Y'_h = Y_h ⊙ σ(x·W_θ,h),   out = W_O [Y'_1; ...; Y'_H]

The paper's best of its ~30 variants (position G1, after SDPA; head-specific; elementwise): W_θ is a (E → H·d)
projection, one gate per head and channel, with no bias when the attention projections have none (the
authors' code fuses it into the query projection, initialised like every projection). ``gate_headwise``
gives the paper's cheaper variant, one scalar gate per head and token (E → H).

Shapes and mask conventions as :mod:`diffattn.attention.standard` (GQA, causal and bidirectional, the KV cache:
the gate depends on the current token only, so the cache holds K and V as in standard attention).

Parameter matching: W_θ adds E·H·d parameters per layer (+E² at H·d = E; 7.6% at the study's tiny shape), so
the matched baseline is standard attention at the same heads with an FFN widened to match
(``match_baseline_ffn``), and ``study --variants gated+matched`` trains gated attention with an FFN narrowed to
match instead.

Conversion (``convert --to gated``, exact: :class:`GatedConversion`) and serving (:class:`GatedServed`: vLLM's
stock attention, then the gate) are below. The FLOPs of its core are standard attention's (the gate is a linear
layer, counted with the matmuls, and an elementwise product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.attention.base import AttentionBase, AttentionConfig, HeadOptions, MaskArgs, head_options, split_heads
from diffattn.attention.conversion import Conversion, Getter, SourceLayer, carried, projection
from diffattn.attention.registry import converts, register, serves
from diffattn.attention.retrofit import Retrofittable
from diffattn.attention.serving import VllmParts
from diffattn.attention.standard import StandardAttention, StandardServed, attention, attention_ref
from diffattn.ops.core import ScoreMod


def _check_gate(out_shape: torch.Size, gate: Tensor) -> None:
    b, h, t, d = out_shape
    if gate.dim() != 4 or tuple(gate.shape[:3]) != (b, h, t) or gate.shape[3] not in (1, d):
        raise ValueError(f"gated attention wants gate logits (B, Hq, Tq, D) or (B, Hq, Tq, 1) = "
                         f"({b}, {h}, {t}, {d} or 1), got {tuple(gate.shape)}")


def gated_attention_ref(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, *, causal: bool = True,
                        attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                        score_mod: ScoreMod | None = None, return_maps: bool = False):
    """Gated attention, materialized: (softmax(QKᵀ·scale)·V) ⊙ σ(gate).

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv); gate: the gate logits x·W_θ per query head,
    (B, Hq, Tq, Dv) (elementwise) or (B, Hq, Tq, 1) (headwise). Returns (B, Hq, Tq, Dv), plus {"logits",
    "probs", "gate" (σ(gate))} when asked.
    """
    out, maps = attention_ref(q, k, v, causal=causal, attn_mask=attn_mask, offset=offset, scale=scale,
                              score_mod=score_mod, return_maps=True)
    _check_gate(out.shape, gate)
    g = torch.sigmoid(gate)
    out = out * g
    return (out, {**maps, "gate": g}) if return_maps else out


def gated_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, *, causal: bool = True,
                    attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None) -> Tensor:
    """Fast gated attention: one SDPA call (:func:`~diffattn.attention.standard.attention`), then the gate.
    Shapes as :func:`gated_attention_ref`."""
    out = attention(q, k, v, causal=causal, attn_mask=attn_mask, offset=offset, scale=scale)
    _check_gate(out.shape, gate)
    return out * torch.sigmoid(gate)


@dataclass(frozen=True)
class GatedOptions:
    """Gated attention's ``ModelConfig.attn_options``. ``gate_headwise``: one gate per head and token (W_θ:
    E → H) instead of the paper's best, elementwise (E → H·d)."""

    gate_headwise: bool = False


@register("gated", label="Gated", color="#e377c2")
class GatedAttention(Retrofittable, StandardAttention):
    """Gated attention (Qiu et al. 2025, G1): standard multi-head (GQA) attention whose heads' outputs are
    multiplied by σ(``gate_proj``(x)) before ``out_proj`` (module docstring). ``gate_proj``: E → H·d
    (elementwise, default) or E → H (``gate_headwise``); bias when the model's projections have one.
    Maps recorded by ``capture``: logits, probs, gate."""

    fast_op, ref_op = staticmethod(gated_attention), staticmethod(gated_attention_ref)

    baseline = "standard"
    match_baseline_ffn = True
    supports_shared_qk = False
    Options = GatedOptions
    unsupported = {"export": "transformers' Llama has no attention output gate"}
    retrofit_anneals = "each gate, from the conversion's constant σ = ½ to the learned σ(x·W_θ)"

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, headwise: bool = False, heads: HeadOptions | None = None):
        super().__init__(embed_dim, num_heads, num_kv_heads, head_dim, bias, heads=heads)
        self.headwise = headwise
        self.gate_proj = nn.Linear(embed_dim, num_heads * (1 if headwise else self.head_dim), bias=bias)
        self.init_retrofit()

    def reset_parameters(self) -> None:
        self.retrofit_s.fill_(1.0)

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.attn_qkv_bias,
                   headwise=cfg.options.gate_headwise, heads=head_options(cfg, layer_idx))

    def attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, margs: MaskArgs) -> Tensor:
        """The core with the gate logits of x (B, H, T, d or 1)."""
        gate = split_heads(self.gate_proj(x), self.num_heads)
        if self.retrofitting:  # σ_eff = (1 − s)·½ + s·σ(x·W_θ): ½ (the conversion's) at s = 0
            gate = torch.logit(self.annealed(0.5, torch.sigmoid(gate)))
        return self.core(q, k, v, margs, gate)


@converts(GatedAttention)
class GatedConversion(Conversion):
    """``--to gated --init exact`` (function-preserving). Q, K, V copied; the gate projection W_θ = 0, so every
    gate is σ(0) = ½, and the out-projection is 2·W_o (×½ and ×2 are exact in floating point). W_θ = 0 is no
    saddle: ∂L/∂W_θ = Σ_t (∂L/∂g_t ⊙ σ'(0))·x_tᵀ is not zero, so the gate trains from the first step."""

    @classmethod
    def weights(cls, src: SourceLayer, new: nn.Module, *, init: str, gen: torch.Generator,
                break_symmetry: float) -> dict[str, Tensor]:
        gate = {n: torch.zeros_like(t) for n, t in new.gate_proj.state_dict().items()}
        return {**projection(src, "q_proj"), **projection(src, "k_proj"), **projection(src, "v_proj"),
                **carried(src, 2.0 * src["out_proj.weight"]), **{f"gate_proj.{n}": t for n, t in gate.items()}}

    @classmethod
    def created(cls, attn: nn.Module, get: Getter) -> dict[str, Tensor]:
        return {"gate_proj": get(attn.gate_proj.weight), "out_proj": get(attn.out_proj.weight)}


@serves(GatedAttention)
class GatedServed(StandardServed):
    """Standard attention, then each head's output times σ(``gate_proj``(x)) before out_proj, elementwise
    (E → h·d) or one gate per head (``gate_headwise``, E → h). ``gate_proj`` is split by heads with the query
    heads. KV cache: standard attention's (the gate depends on the current token only)."""

    def __init__(self, cfg: AttentionConfig, layer: int, parts: VllmParts):
        super().__init__(cfg, layer, parts)
        per_head = 1 if cfg.options.gate_headwise else cfg.qk_head_dim
        self.gate_proj = parts.column(cfg.d_model, cfg.n_heads * per_head, bias=cfg.attn_qkv_bias, name="gate_proj")

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        o = self.heads(positions, x).view(x.shape[0], self.q_heads, -1)
        gate, _ = self.gate_proj(x)
        return self.out(o * torch.sigmoid(gate.view(x.shape[0], self.q_heads, -1)).to(o.dtype))
