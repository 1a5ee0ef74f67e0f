"""The distance-aware (DA-Transformer) score, shared by the reference ops, the block kernel
(:mod:`.distance_block`) and the FlexAttention path (:mod:`.distance_flex`): f, query positions, masks and the
materialized logits. ALiBi and FoX use its positions and masks too.

Wu, Wu & Huang 2021: per head i, scores = ReLU(Q Kᵀ) ⊙ f(w_i·R; v_i) / √d with R_jk = |pos_j − pos_k| and
f(x; v) = (1 + e^v) / (1 + e^(v − x)). Masks are applied *after* the ReLU: a −inf mask turned into 0 by
the ReLU would leave every masked key with weight exp(0) in the softmax.

Shapes and mask conventions as :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from diffattn.ops.core import build_mask, check_mask_dtype, restrict_mask


def distance_f(x: Tensor, v: Tensor | float) -> Tensor:
    """f(x; v) = (1 + e^v) / (1 + e^(v − x)), elementwise.

    Written as σ(x − v) / σ(−v) and evaluated in log space (logsigmoid), so it neither overflows for large |x|
    or |v| nor loses f(0) = 1: it is exactly 1 at x = 0, → 0 as x → −∞, → 1 + e^v as x → +∞, increasing in x.
    """
    v = torch.as_tensor(v, dtype=x.dtype, device=x.device)
    return torch.exp(F.logsigmoid(x - v) - F.logsigmoid(-v))


def distance_positions(tq: int, offset: int | Tensor, device: torch.device | None = None) -> Tensor:
    """Absolute query positions (Tq,) long: ``offset + arange(Tq)``, or ``offset`` itself when it is a (Tq,)
    tensor of positions (the KV-cache path passes ``input_pos``). Keys sit at positions 0..Tk-1."""
    if isinstance(offset, Tensor) and offset.dim() == 1:
        if offset.numel() != tq:
            raise ValueError(f"offset as positions must have length Tq={tq}, got {offset.numel()}")
        pos = offset.to(device=device, dtype=torch.long)
    elif not isinstance(offset, Tensor):
        # checked on the int: no look at tensor data (a host sync on a GPU; impossible on fake tensors, which
        # the memory planner runs the model on)
        if int(offset) < 0:
            raise ValueError("query positions must be >= 0")
        return torch.arange(tq, device=device) + int(offset)
    else:
        pos = torch.arange(tq, device=device) + offset.to(device)
    if tq and int(pos.min()) < 0:
        raise ValueError("query positions must be >= 0")
    return pos


def distance_mask(qpos: Tensor, tk: int, causal: bool, attn_mask: Tensor | None) -> Tensor | None:
    """Like :func:`build_mask` but causal against explicit query positions (keep key j iff j <= qpos_i)."""
    mask = build_mask(len(qpos), tk, causal=False, attn_mask=attn_mask, device=qpos.device)
    if causal:
        mask = restrict_mask(mask, torch.arange(tk, device=qpos.device)[None, :] <= qpos[:, None])
    return mask


def check_distance_params(w: Tensor, v_param: Tensor, h: int, what: str) -> None:
    if w.shape != (h,) or v_param.shape != (h,):
        raise ValueError(f"{what}: w and v_param must have shape ({h},) (one per query head), "
                         f"got {tuple(w.shape)} and {tuple(v_param.shape)}")


def distance_logits(q: Tensor, k: Tensor, w: Tensor, v_param: Tensor, qpos: Tensor, scale: float) -> Tensor:
    """ReLU(QKᵀ) ⊙ f(w·R; v) · scale for q (B, H, Tq, D), k (B, H, Tk, D) -> (B, H, Tq, Tk)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32  # f in (at least) fp32
    r = (qpos[:, None] - torch.arange(k.shape[-2], device=q.device)[None, :]).abs().to(dt)
    fmap = distance_f(w.to(dt).view(-1, 1, 1) * r, v_param.to(dt).view(-1, 1, 1))  # (H, Tq, Tk)
    return (torch.relu(q @ k.transpose(-1, -2)) * fmap.to(q.dtype)) * scale


def mask4(attn_mask: Tensor | None) -> Tensor | None:
    """A user mask as a 4-D tensor broadcastable to (B, H, Tq, Tk) ((B, Tk) is key padding)."""
    if attn_mask is None:
        return None
    check_mask_dtype(attn_mask)
    m = attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask
    while m.dim() < 4:
        m = m[None]
    return m
