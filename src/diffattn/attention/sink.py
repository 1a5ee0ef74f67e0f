"""Attention sinks: each head's softmax gets one more logit, a learned scalar s_h that no value reads, so a head
may give its keys less than all of its attention (gpt-oss; OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card",
arXiv 2508.10925: "a learned bias in the denominator of the softmax, similar to off-by-one attention and
attention sinks"):

    A_ij = exp(l_ij) / (exp(s_h) + Σ_j' exp(l_ij')),   l_ij = q_i·k_j/√d,   out_i = Σ_j A_ij v_j

Why it is worth having beside DIFF and gated attention: all three answer "softmax must put its mass somewhere".
Gu et al. (ICLR 2025, arXiv 2410.10781) find that the sinks language models grow on their first token act as
key biases that store attention without contributing values, and that they come from softmax's normalization;
DIFF cancels such common-mode attention by subtracting a second map, gated attention (Qiu et al. 2025) removes
the sink by gating each head's output (its paper reports sink-free attention), and a learned sink is the direct
fix: a key bias the model does not have to build out of a token. It costs one parameter per head and nothing in
the KV cache, and vLLM serves it natively (gpt-oss). s_h = 0 is Miller's "off-by-one" softmax₁ (2023); StreamingLLM
(Xiao et al., ICLR 2024) trained a learnable sink token instead. ``sink_init`` sets the start (default 0, so
every head starts as softmax₁; gpt-oss's initialisation is not published).

``sink_attention_ref`` materializes the scores with the sink as a last column (the spec); ``sink_attention`` is
one SDPA call in which the sink is one more key: Q and K get one more column, q' = [q | s_h/scale] per query head
and k' = [k | 0] for the real keys, and the sink key (0, ..., 0, 1) with a zero value sits first, so its logit
is exactly s_h and it is visible to every query; widths are zero-padded to a multiple of 8 (fused kernels). On
the plain causal path a zero query row in front keeps SDPA's ``is_causal`` alignment (query i, row i + 1, sees
keys 0..i + 1: the sink and its own prefix), so no mask is built. A query whose real keys are all masked puts
everything on the sink: zeros, as SDPA gives. Shapes and mask conventions: :mod:`diffattn.ops.core`.

Conversion: standard attention is this type at s_h = −∞ exactly, but there the sink's weight and its gradient
vanish together (∂L/∂s_h = −Σ_i p_sink,i·(dO_i·out_i), p_sink = 0), so converted sinks would never train; any
finite s_h changes the function. So, like FoX's, no exact, trainable conversion: ``convert`` refuses it, saying
why (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from diffattn.attention.base import AttentionBase, AttentionConfig, HeadOptions, head_options
from diffattn.attention.registry import register, serves
from diffattn.attention.serving import VllmParts
from diffattn.attention.standard import StandardAttention, StandardServed
from diffattn.ops.core import ScoreMod, build_mask, check_heads, is_plain_causal, masked_softmax, repeat_kv


def _check_sinks(sinks: Tensor, hq: int) -> None:
    if sinks.shape != (hq,):
        raise ValueError(f"sink attention wants one sink logit per query head, ({hq},), got {tuple(sinks.shape)}")


def with_sink_column(mask: Tensor, tq: int, tk: int, *, first: bool) -> Tensor:
    """A mask broadcastable to (B, H, Tq, Tk) as (B', H', Tq, 1 + Tk) with the sink's column, always kept (True,
    or 0 for an additive mask), first or last."""
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(-1, -1, tq, tk)
    col = (torch.ones if m.dtype == torch.bool else torch.zeros)(*m.shape[:3], 1, dtype=m.dtype, device=m.device)
    return torch.cat((col, m) if first else (m, col), dim=-1)


def sink_attention_ref(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, *, causal: bool = True,
                       attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                       score_mod: ScoreMod | None = None, return_maps: bool = False):
    """Attention with a sink per head, materialized: softmax over [q·kᵀ·scale, s_h], the sink column dropped,
    times V. q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv), sinks: (Hq,) logits (on the scaled
    scale; ``score_mod`` rewrites the keys' logits only). Returns (B, Hq, Tq, Dv), plus {"logits", "probs" (the
    keys' weights, each row summing to 1 − sink), "sink" (the sink's weight, (B, Hq, Tq))} when asked."""
    n_rep = check_heads(q.shape[1], k.shape[1], "sink attention")
    _check_sinks(sinks, q.shape[1])
    tq, tk = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    logits = (q @ k.transpose(-1, -2)) * scale
    if score_mod is not None:
        logits = score_mod(logits)
    mask = build_mask(tq, tk, causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    full = masked_softmax(torch.cat((logits, sink), dim=-1),
                          None if mask is None else with_sink_column(mask, tq, tk, first=False))
    probs = full[..., :-1]
    out = probs @ v
    return (out, {"logits": logits, "probs": probs, "sink": full[..., -1]}) if return_maps else out


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, *, causal: bool = True,
                   attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None) -> Tensor:
    """Fast attention with sinks: one SDPA call with the sink as one more key (module docstring). Shapes as
    :func:`sink_attention_ref`."""
    check_heads(q.shape[1], k.shape[1], "sink attention")
    _check_sinks(sinks, q.shape[1])
    (b, hq, tq, d), (hkv, tk), dv = q.shape, k.shape[1:3], v.shape[-1]
    scale = d**-0.5 if scale is None else scale
    w = -(-(max(d, dv) + 1) // 8) * 8  # one more column, rounded up to a multiple of 8
    # a sink of −inf (standard attention) would make −inf·0 = NaN in the real keys' logits: the most negative
    # quarter of the dtype's range gives the sink the same weight, exp(−huge) = 0
    col = (sinks / scale).to(q.dtype).clamp_min(torch.finfo(q.dtype).min / 4).view(1, hq, 1, 1).expand(b, hq, tq, 1)
    qa = F.pad(torch.cat((q, col), dim=-1), (0, w - d - 1))
    ka = torch.cat((F.pad(k.new_ones(b, hkv, 1, 1), (d, w - d - 1)), F.pad(k, (0, w - d))), dim=2)
    va = torch.cat((v.new_zeros(b, hkv, 1, w), F.pad(v, (0, w - dv))), dim=2)
    gqa = hq != hkv
    if is_plain_causal(tq, tk, causal, offset, attn_mask):  # a zero query row in front: is_causal still aligns
        qa = torch.cat((qa.new_zeros(b, hq, 1, w), qa), dim=2)
        out = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale, enable_gqa=gqa)[:, :, 1:]
    else:
        mask = build_mask(tq, tk, causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
        mask = None if mask is None else with_sink_column(mask, tq, tk, first=True)
        out = F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[..., :dv]


@dataclass(frozen=True)
class SinkOptions:
    """Attention sinks' ``ModelConfig.attn_options``. ``sink_init``: every head's sink logit at the start
    (0: off-by-one softmax₁)."""

    sink_init: float = 0.0


@register("sink", label="Sink", color="#393b79")
class SinkAttention(StandardAttention):
    """Standard multi-head (GQA) attention with a learned sink logit per query head, ``sinks`` (H,) (module
    docstring); ``shared_qk`` as standard attention's. H parameters per layer, so its matched baseline is
    standard attention at the same heads. Maps recorded by ``capture``: logits, probs, sink."""

    fast_op, ref_op = staticmethod(sink_attention), staticmethod(sink_attention_ref)

    baseline = "standard"
    Options = SinkOptions
    unsupported = {
        "convert": ("standard attention is a sink model at sink = −∞ exactly, but there the sink's weight and its "
                    "gradient are both 0, so the sinks would never train, and a finite sink changes the function: "
                    "no exact, trainable conversion exists"),
        "export": "transformers' Llama has no attention sinks (its GptOss has them, with a mixture-of-experts FFN "
                  "diffattn does not build)",
    }

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, shared_qk: bool = False, sink_init: float = 0.0, heads: HeadOptions | None = None):
        super().__init__(embed_dim, num_heads, num_kv_heads, head_dim, bias, shared_qk=shared_qk, heads=heads)
        self.sink_init = float(sink_init)
        self.sinks = nn.Parameter(torch.full((num_heads,), self.sink_init))

    def reset_parameters(self) -> None:
        self.sinks.fill_(self.sink_init)

    def op_params(self) -> tuple[Tensor]:
        return (self.sinks,)

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.attn_qkv_bias,
                   shared_qk=cfg.shared_qk, sink_init=cfg.options.sink_init, heads=head_options(cfg, layer_idx))


@serves(SinkAttention)
class SinkServed(StandardServed):
    """vLLM's ``Attention`` takes per-head sinks (its gpt-oss support), on its CPU backend too: the same logit in
    each head's softmax, on the scaled scale. ``sinks`` is split with the query heads across ranks. KV cache:
    standard attention's (the sinks are parameters, not cached)."""

    def attention_extra(self, cfg: AttentionConfig, parts: VllmParts) -> dict[str, Any]:
        n, rank = self.q_heads, parts.tp_rank
        self.sinks = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.sinks.weight_loader = lambda param, full: param.data.copy_(full[rank * n:(rank + 1) * n])
        return {"sinks": self.sinks}
