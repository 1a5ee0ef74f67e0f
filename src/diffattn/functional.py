"""Attention math as pure functions: the spec in code.

Every op has a ``*_ref`` version that materializes the (Tq, Tk) map (slow, plain, the definition) and a
fast version that never builds the map: it runs on ``torch.nn.functional.scaled_dot_product_attention``
(a fused flash kernel on CPU and CUDA).

Layout is heads-first, as SDPA wants it::

    q: (B, Hq, Tq, D)    k: (B, Hkv, Tk, D)    v: (B, Hkv, Tk, Dv)

GQA: query head i reads KV head ``i // (Hq // Hkv)``.

Masks: queries sit at absolute positions ``offset .. offset+Tq-1`` and keys at ``0 .. Tk-1`` (so queries can
come after cached keys); ``causal`` keeps key j for query i when ``j <= offset + i``. ``attn_mask`` is either
boolean (True = attend) or additive float, broadcastable to (B, H, Tq, Tk); a 2-D (B, Tk) mask is read as key
padding. A query row with every key masked yields zeros, as SDPA does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

ScoreMod = Callable[[Tensor], Tensor]


# ----------------------------------------------------------------------------------------------- masks
def build_mask(
    tq: int,
    tk: int,
    *,
    causal: bool,
    offset: int | Tensor = 0,
    attn_mask: Tensor | None = None,
    device: torch.device | None = None,
) -> Tensor | None:
    """Combine causality and a user mask into one mask broadcastable to (B, H, Tq, Tk), or None."""
    mask = attn_mask
    if mask is not None:
        if mask.dim() == 2:  # (B, Tk) key padding
            mask = mask[:, None, None, :]
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool or floating point, got {mask.dtype}")
    if causal:
        qpos = torch.arange(tq, device=device) + offset
        kpos = torch.arange(tk, device=device)
        keep = kpos[None, :] <= qpos[:, None]
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
    return mask


def _is_plain_causal(tq: int, tk: int, causal: bool, offset: int | Tensor, attn_mask: Tensor | None) -> bool:
    return causal and attn_mask is None and tq == tk and isinstance(offset, int) and offset == 0


def upcast(x: Tensor) -> Tensor:
    """fp16/bf16 -> fp32 for reductions; fp32 and fp64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def masked_softmax(scores: Tensor, mask: Tensor | None) -> Tensor:
    """softmax over the last dim in (at least) fp32 with masked keys removed; all-masked rows give zeros."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(upcast(scores), dim=-1)
    return torch.nan_to_num(probs, nan=0.0).to(scores.dtype)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D), KV head g serving query heads g*n_rep .. g*n_rep+n_rep-1."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, offset, attn_mask, scale, dropout_p=0.0) -> Tensor:
    tq, tk = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if _is_plain_causal(tq, tk, causal, offset, attn_mask):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
        )
    mask = build_mask(tq, tk, causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
    )


def _check_heads(hq: int, hkv: int, what: str) -> int:
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{what}: query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return hq // hkv


# -------------------------------------------------------------------------------------------- standard
def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    return_maps: bool = False,
):
    """softmax(QKᵀ·scale)·V, materialized. Returns (B, Hq, Tq, Dv), plus {"logits", "probs"} if asked.

    ``score_mod`` rewrites the scaled logits before masking (used by logit-quantization studies).
    """
    n_rep = _check_heads(q.shape[1], k.shape[1], "attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    logits = (q @ k.transpose(-1, -2)) * scale
    if score_mod is not None:
        logits = score_mod(logits)
    mask = build_mask(q.shape[-2], k.shape[-2], causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    probs = masked_softmax(logits, mask)
    out = probs @ v
    return (out, {"logits": logits, "probs": probs}) if return_maps else out


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Fast softmax(QKᵀ·scale)·V on SDPA. Shapes as :func:`attention_ref`."""
    _check_heads(q.shape[1], k.shape[1], "attention")
    return _sdpa(q, k, v, causal=causal, offset=offset, attn_mask=attn_mask, scale=scale, dropout_p=dropout_p)


# ------------------------------------------------------------------------------------ differential V1
def lambda_init_fn(depth: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·depth), depth 0-based (paper, official code)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def diff_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor | float,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    return_maps: bool = False,
):
    """Differential attention V1: (softmax(Q1K1ᵀ/√d) − λ·softmax(Q2K2ᵀ/√d))·V, materialized.

    Official layout: diff-head i owns query sub-heads 2i (Q1) and 2i+1 (Q2); KV diff-head g owns key sub-heads
    2g (K1), 2g+1 (K2) and one value head of width 2d. Under GQA diff-head i reads KV diff-head i // n_rep
    for *both* halves.

    q: (B, 2h, Tq, d), k: (B, 2hkv, Tk, d), v: (B, hkv, Tk, 2d), lam: scalar.
    Returns (B, h, Tq, 2d) — before the per-head norm — plus maps {"logits1", "logits2", "probs1",
    "probs2", "attn" (the effective map A1 − λA2)} when asked.
    """
    h, hkv = q.shape[1] // 2, v.shape[1]
    if q.shape[1] % 2 or k.shape[1] != 2 * hkv:
        raise ValueError(f"diff attention wants q (B, 2h, T, d), k (B, 2hkv, T, d), v (B, hkv, T, 2d); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    n_rep = _check_heads(h, hkv, "diff attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = build_mask(q.shape[-2], k.shape[-2], causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    maps: dict[str, Tensor] = {}
    probs = []
    for s in (0, 1):  # s = 0: (Q1, K1); s = 1: (Q2, K2)
        logits = (q[:, s::2] @ repeat_kv(k[:, s::2], n_rep).transpose(-1, -2)) * scale
        if score_mod is not None:
            logits = score_mod(logits)
        maps[f"logits{s + 1}"] = logits
        probs.append(masked_softmax(logits, mask))
    attn = probs[0] - lam * probs[1]
    out = attn @ repeat_kv(v, n_rep)
    if not return_maps:
        return out
    maps.update(probs1=probs[0], probs2=probs[1], attn=attn)
    return out, maps


def diff_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor | float,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
) -> Tensor:
    """Fast differential attention V1 in one SDPA call over the 2h sub-heads. Shapes as :func:`diff_attention_ref`.

    Both maps share V, so one call with V of width 2d computes A1·V and A2·V together (QKᵀ once per sub-head,
    1.5× the FLOPs of a standard core of 2h heads of width d). SDPA's GQA maps query i to KV i // n_rep, so the
    query sub-heads are reordered from (hkv, n_rep, 2) to (hkv, 2, n_rep) and each value head is repeated once
    for its two key sub-heads.
    """
    b, h2, tq, d = q.shape
    h, hkv = h2 // 2, v.shape[1]
    if h2 % 2 or k.shape[1] != 2 * hkv:
        raise ValueError(f"diff attention wants q (B, 2h, T, d), k (B, 2hkv, T, d), v (B, hkv, T, 2d); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    n_rep = _check_heads(h, hkv, "diff attention")
    q = q.view(b, hkv, n_rep, 2, tq, d).transpose(2, 3).reshape(b, h2, tq, d)
    o = _sdpa(q, k, v.repeat_interleave(2, dim=1), causal=causal, offset=offset, attn_mask=attn_mask, scale=scale)
    o = o.view(b, hkv, 2, n_rep, tq, o.shape[-1])
    return (o[:, :, 0] - lam * o[:, :, 1]).reshape(b, h, tq, o.shape[-1])


# ------------------------------------------------------------------------------------ differential V2
def diff_v2_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam_logits: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    return_maps: bool = False,
):
    """Differential attention V2: out_j = attn_{2j} − sigmoid(λ_j)·attn_{2j+1}, materialized.

    q: (B, 2h, Tq, D) query heads at the baseline head width, pair j = heads (2j, 2j+1), which sit in one GQA
    group; k, v: (B, hkv, Tk, D); lam_logits: (B, h, Tq) = W_λ x (before the sigmoid), per token and head.
    Returns (B, h, Tq, D), plus {"logits", "probs", "attn" (effective map)} when asked.
    """
    h = q.shape[1] // 2
    if q.shape[1] % 2:
        raise ValueError(f"diff_v2 wants an even number of query heads, got {q.shape[1]}")
    _check_heads(h, k.shape[1], "diff_v2 attention (pairs must stay inside one GQA group)")
    out, maps = attention_ref(q, k, v, causal=causal, attn_mask=attn_mask, offset=offset, scale=scale,
                              score_mod=score_mod, return_maps=True)
    w = torch.sigmoid(lam_logits)[..., None].to(out.dtype)
    attn = maps["probs"][:, 0::2] - w * maps["probs"][:, 1::2]
    out = out[:, 0::2] - w * out[:, 1::2]
    if not return_maps:
        return out
    maps["attn"] = attn
    return out, maps


def diff_v2_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam_logits: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
) -> Tensor:
    """Fast differential attention V2: one SDPA call, then the per-token difference of adjacent heads."""
    h = q.shape[1] // 2
    if q.shape[1] % 2:
        raise ValueError(f"diff_v2 wants an even number of query heads, got {q.shape[1]}")
    _check_heads(h, k.shape[1], "diff_v2 attention (pairs must stay inside one GQA group)")
    o = _sdpa(q, k, v, causal=causal, offset=offset, attn_mask=attn_mask, scale=scale)
    return o[:, 0::2] - torch.sigmoid(lam_logits)[..., None].to(o.dtype) * o[:, 1::2]
