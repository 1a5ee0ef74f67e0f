"""Shared attention math: masks, the fp32 softmax, GQA head repetition, the SDPA wrapper and head checks.

Layout is heads-first, as SDPA wants it::

    q: (B, Hq, Tq, D)    k: (B, Hkv, Tk, D)    v: (B, Hkv, Tk, Dv)

GQA: query head i reads KV head ``i // (Hq // Hkv)``.

Masks: queries sit at absolute positions ``offset .. offset+Tq-1`` and keys at ``0 .. Tk-1`` (so queries can
come after cached keys); ``causal`` keeps key j for query i when ``j <= offset + i``. ``attn_mask`` is either
boolean (True = attend) or additive float, broadcastable to (B, H, Tq, Tk); a 2-D (B, Tk) mask is read as key
padding. A query row with every key masked yields zeros, as SDPA does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

#: Rewrites the scaled logits (B, H, Tq, Tk) before masking (logit-quantization studies); reference ops only.
ScoreMod = Callable[[Tensor], Tensor]


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
        check_mask_dtype(mask)
    if causal:
        qpos = torch.arange(tq, device=device) + offset
        kpos = torch.arange(tk, device=device)
        mask = restrict_mask(mask, kpos[None, :] <= qpos[:, None])
    return mask


def window_keep(qpos: Tensor, tk: int, window: int, *, causal: bool) -> Tensor:
    """Sliding-window attention's band, (1, 1, Tq, Tk) bool (4-D: a 2-D mask would read as key padding): the
    query at absolute position ``qpos[i]`` keeps key j when qpos[i] − j < ``window`` (the window counts the query
    itself, as transformers' ``sliding_window``); bidirectional (``causal=False``), when |qpos[i] − j| < window.
    Causality itself is not in it: combine with :func:`build_mask`."""
    dist = qpos[:, None] - torch.arange(tk, device=qpos.device)[None, :]
    keep = dist < window
    if not causal:
        keep &= dist > -window
    return keep[None, None]


def check_mask_dtype(mask: Tensor) -> None:
    """A mask is bool (True = keep) or additive floating point; any other dtype is a clear TypeError."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or floating point, got {mask.dtype}")


def restrict_mask(mask: Tensor | None, keep: Tensor) -> Tensor:
    """``mask`` (bool: True = keep, or additive float; None: keep all) further limited to where ``keep`` (bool,
    broadcastable) is True: a bool mask is and-ed, an additive one gets -inf outside ``keep``."""
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.expand(torch.broadcast_shapes(mask.shape, keep.shape)).masked_fill(~keep, float("-inf"))


def is_plain_causal(tq: int, tk: int, causal: bool, offset: int | Tensor, attn_mask: Tensor | None) -> bool:
    """Whether a call is causal over its own positions only (queries = keys from 0, no mask): SDPA's
    ``is_causal`` case, which needs no mask tensor."""
    return causal and attn_mask is None and tq == tk and isinstance(offset, int) and offset == 0


def upcast(x: Tensor) -> Tensor:
    """fp16/bf16 -> fp32 for reductions; fp32 and fp64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def masked_softmax(scores: Tensor, mask: Tensor | None) -> Tensor:
    """softmax over the last dim in (at least) fp32 with masked keys removed; all-masked rows give zeros."""
    if mask is not None:
        if mask.dtype != torch.bool:
            # an additive -inf becomes a masked_fill, whose backward drops the gradient there: otherwise a
            # fully-masked row's NaN softmax backpropagates NaN into the logits (SDPA gives zeros)
            scores = scores + mask
            mask = mask != float("-inf")
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(upcast(scores), dim=-1)
    return torch.nan_to_num(probs, nan=0.0).to(scores.dtype)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D), KV head g serving query heads g*n_rep .. g*n_rep+n_rep-1."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, offset: int | Tensor, attn_mask: Tensor | None,
         scale: float | None, dropout_p: float = 0.0) -> Tensor:
    """SDPA with this module's mask conventions: (B, Hq, Tq, D), GQA keys/values -> (B, Hq, Tq, Dv). The plain
    causal case takes SDPA's ``is_causal`` path (no mask tensor)."""
    tq, tk = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if is_plain_causal(tq, tk, causal, offset, attn_mask):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
        )
    mask = build_mask(tq, tk, causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
    )


def check_heads(hq: int, hkv: int, what: str) -> int:
    """n_rep = hq // hkv, or a ValueError naming ``what`` when hq is not a multiple of hkv."""
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{what}: query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return hq // hkv


def check_diff_shapes(q: Tensor, k: Tensor, v: Tensor, what: str) -> tuple[int, int]:
    """(h, n_rep) of a V1-layout call: q (B, 2h, T, d), k (B, 2hkv, T, d), v (B, hkv, T, 2d); a ValueError
    otherwise."""
    h, hkv = q.shape[1] // 2, v.shape[1]
    if q.shape[1] % 2 or k.shape[1] != 2 * hkv:
        raise ValueError(f"{what} wants q (B, 2h, T, d), k (B, 2hkv, T, d), v (B, hkv, T, 2d); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return h, check_heads(h, hkv, what)
