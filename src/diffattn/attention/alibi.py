"""ALiBi (Press, Smith & Lewis, ICLR 2022, "Train Short, Test Long"): softmax(QKᵀ/√d − m_h·|i − j|)·V with no
position embedding. The additive linear distance bias is the peer that DA's multiplicative re-weighting
(:mod:`diffattn.attention.distance`) has to beat: the ALiBi paper reports that multiplying the scores by its bias
did worse than adding it.

Slopes (the paper's): for H heads, H a power of two, m_h = 2^(−8h/H), h = 1..H (a geometric sequence that starts
at 2^(−8/H) with that ratio). Otherwise, with n the largest power of two below H, the n slopes of n heads followed
by the first H − n of the odd-position slopes of 2n heads (2^(−8(2k−1)/(2n)), k = 1, 2, ...). Slopes are fixed,
not learned. Causal: query i and key j ≤ i (absolute positions, also under the KV cache) get −m_h·(i − j).
Bidirectional (the paper has only causal LMs; our choice): −m_h·|i − j|, symmetric.

``alibi_attention_ref`` materializes the map (the spec); ``alibi_attention`` is one SDPA call with the bias as a
float mask: it builds the (1, H, Tq, Tk) bias in the inputs' dtype, the causal mask folded in (O(T²) memory, but
never the attention map itself; a FlexAttention score_mod would avoid even the bias and is not built here). The
mask must be 4-D: CPU SDPA ran a 3-D one 2.2x slower (its fused kernel declined it). A masked call cannot skip the
tiles above the diagonal as ``is_causal`` does, so it costs about 2x a causal standard core on CPU. Shapes and
mask conventions: :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from diffattn.attention.base import AttentionConfig, HeadOptions
from diffattn.attention.registry import register, serves
from diffattn.attention.serving import VllmParts
from diffattn.attention.standard import StandardAttention, StandardServed
from diffattn.ops.core import ScoreMod, check_heads, masked_softmax, repeat_kv, sdpa
from diffattn.ops.distance_score import distance_mask, distance_positions


def alibi_slopes(n_heads: int) -> Tensor:
    """The paper's fixed slopes m_h for ``n_heads`` heads (module docstring), (H,) float64."""
    if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
        raise ValueError(f"alibi needs a positive int number of heads, got {n_heads!r}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    n = 2 ** int(math.floor(math.log2(n_heads)))
    extra = power_of_two(2 * n)[0::2][: n_heads - n]  # 2n heads' slopes at odd h = 1, 3, 5, ...
    return torch.tensor(power_of_two(n) + extra, dtype=torch.float64)


def alibi_bias(slopes: Tensor, qpos: Tensor, tk: int, dtype: torch.dtype, causal: bool = False) -> Tensor:
    """−m_h·|i − j| for queries at absolute positions ``qpos`` (Tq,) and keys 0..tk−1: (H, Tq, Tk) in ``dtype``,
    computed in fp32 (float64 for float64) and rounded once: distances are exact integers in fp32 up to 2^24.
    ``causal``: −inf for the keys after each query (the causal mask folded in, one (H, Tq, Tk) tensor)."""
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    dist = (qpos[:, None] - torch.arange(tk, device=qpos.device)[None, :]).to(ct)
    dist = dist.masked_fill(dist < 0, float("inf")) if causal else dist.abs()
    return (slopes.to(device=qpos.device, dtype=ct).neg()[:, None, None] * dist).to(dtype)


def _check(q: Tensor, k: Tensor, slopes: Tensor) -> int:
    n_rep = check_heads(q.shape[1], k.shape[1], "alibi attention")
    if slopes.shape != (q.shape[1],):
        raise ValueError(f"alibi attention wants one slope per query head ({q.shape[1]},), got {tuple(slopes.shape)}")
    return n_rep


def alibi_attention_ref(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, *, causal: bool = True,
                        attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                        score_mod: ScoreMod | None = None, return_maps: bool = False):
    """ALiBi attention, materialized: softmax(QKᵀ·scale − m_h·|qpos_i − j|)·V.

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv), slopes: (Hq,) per query head; query positions
    ``offset + arange(Tq)`` or ``offset`` itself as (Tq,) positions (the KV cache). ``score_mod`` rewrites the
    final (biased) scores before masking. Returns (B, Hq, Tq, Dv), plus {"logits" (the biased scores), "probs"}
    when asked.
    """
    n_rep = _check(q, k, slopes)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    qpos = distance_positions(q.shape[-2], offset, q.device)
    logits = (q @ k.transpose(-1, -2)) * scale + alibi_bias(slopes, qpos, k.shape[-2], q.dtype)
    if score_mod is not None:
        logits = score_mod(logits)
    probs = masked_softmax(logits, distance_mask(qpos, k.shape[-2], causal, attn_mask))
    out = probs @ v
    return (out, {"logits": logits, "probs": probs}) if return_maps else out


def alibi_attention(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, *, causal: bool = True,
                    attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None) -> Tensor:
    """Fast ALiBi attention: one SDPA call (GQA, fused kernels) with the bias as its float mask, the user's mask
    folded in (boolean: −inf where False; float: added). Shapes as :func:`alibi_attention_ref`."""
    _check(q, k, slopes)
    qpos = distance_positions(q.shape[-2], offset, q.device)
    bias = alibi_bias(slopes, qpos, k.shape[-2], q.dtype, causal=causal)[None]  # 4-D: CPU SDPA's flash kernel
    mask = distance_mask(qpos, k.shape[-2], False, attn_mask)  # the user's mask (key padding: (B, 1, 1, Tk))
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else bias + mask
    return sdpa(q, k, v, causal=False, offset=0, attn_mask=bias, scale=scale)


@register("alibi", label="ALiBi", color="#bcbd22")
class ALiBiAttention(StandardAttention):
    """ALiBi (Press et al. 2022): standard multi-head (GQA) attention with the fixed per-head linear distance
    bias and no position embedding (``uses_rope = False``: a ``ModelConfig`` of this type reads ``rope="none"``).
    ``alibi_slopes`` (Hq,) is a buffer derived from the head count (not saved). Compared with standard
    attention at the same heads (like DA): no parameters of its own. Maps recorded by ``capture``: logits
    (biased), probs."""

    fast_op, ref_op = staticmethod(alibi_attention), staticmethod(alibi_attention_ref)

    uses_rope = False
    unsupported = {"export": "transformers' Llama applies RoPE and has no ALiBi bias"}

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, shared_qk: bool = False, heads: HeadOptions | None = None):
        super().__init__(embed_dim, num_heads, num_kv_heads, head_dim, bias, shared_qk=shared_qk, heads=heads)
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).float(), persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the slopes in place (built on the meta device, the buffer holds no values)."""
        self.alibi_slopes.copy_(alibi_slopes(self.num_heads).float())

    def op_params(self) -> tuple[Tensor]:
        return (self.alibi_slopes,)


@serves(ALiBiAttention)
class ALiBiServed(StandardServed):
    """vLLM's ``Attention`` takes per-head ALiBi slopes (this rank's heads' share); no RoPE (the served config has
    ``rope="none"``). KV cache: standard attention's."""

    def attention_extra(self, cfg: AttentionConfig, parts: VllmParts) -> dict[str, Any]:
        n, rank = self.q_heads, parts.tp_rank
        return {"alibi_slopes": alibi_slopes(cfg.n_heads)[rank * n:(rank + 1) * n].tolist()}
