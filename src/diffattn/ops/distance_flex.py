"""Distance-aware attention on FlexAttention (:func:`flex_distance`): the DA score (:mod:`.distance_score`) as a
``score_mod``, causality and boolean masks as the block mask; compiled on CUDA, eager on CPU (forward only).
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F
from torch import Tensor

from diffattn.ops.distance_score import distance_positions, mask4


@functools.lru_cache(maxsize=1)
def flex_module():
    """torch.nn.attention.flex_attention, or None where this torch has none."""
    try:
        return importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return None


@functools.lru_cache(maxsize=1)
def compiled_flex():
    """flex_attention under torch.compile (shared by every FlexAttention path)."""
    # flex_attention run eagerly materializes the score map; compiled it is a fused kernel with a backward
    return torch.compile(flex_module().flex_attention, dynamic=False)


def flex_unsupported(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> str | None:
    """Why FlexAttention cannot take this distance-attention call, or None when it can."""
    if flex_module() is None:
        return "this torch has no torch.nn.attention.flex_attention"
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return "it takes boolean masks only (a float attn_mask goes to the block path)"
    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return "torch's FlexAttention has no backward on CPU (use backend='block', or no_grad)"
    if q.dtype == torch.float64 and q.is_cuda:
        return "fp64 is not supported by the compiled FlexAttention kernel"
    return None


def flex_distance(q: Tensor, k: Tensor, v: Tensor, w: Tensor, v_param: Tensor, *, causal: bool,
                  attn_mask: Tensor | None, offset: int | Tensor, scale: float) -> Tensor:
    """DA attention on FlexAttention: q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv).

    Flex is called with scale 1, and the score_mod returns ReLU(s)·f(w_h·|qpos_i − j|; v_h)·scale, the same
    placement as :func:`distance_logits` (so a scale <= 0 stays exact too). w and v_param are captured by
    the score_mod, and flex differentiates through captured tensors, so they get gradients. Causality and
    boolean masks form the block mask: masked entries never enter the softmax, after the ReLU by construction.
    GQA goes through flex's enable_gqa (query head i reads KV head i // n_rep, as repeat_kv).
    """
    fx = flex_module()
    b, hq, tq, _ = q.shape
    tk = k.shape[-2]
    qpos = distance_positions(tq, offset, q.device)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32  # f in (at least) fp32, as the reference
    wf, vf = w.to(cdt), v_param.to(cdt)
    log_norm = F.logsigmoid(-vf)  # f(x; v) = σ(x − v) / σ(−v), in log space as distance_f

    def score_mod(s, bi, hi, qi, ki):
        x = wf[hi] * (qpos[qi] - ki).abs()
        return torch.relu(s) * torch.exp(F.logsigmoid(x - vf[hi]) - log_norm[hi]) * scale

    m4 = mask4(attn_mask)
    block_mask = None
    if causal or m4 is not None:
        def mask_mod(bi, hi, qi, ki):
            keep = ki <= qpos[qi] if causal else ki >= 0
            if m4 is not None:
                keep = keep & m4[bi if m4.shape[0] > 1 else 0, hi if m4.shape[1] > 1 else 0,
                                 qi if m4.shape[2] > 1 else 0, ki if m4.shape[3] > 1 else 0]
            return keep

        mb = None if m4 is None or m4.shape[0] == 1 else b
        mh = None if m4 is None or m4.shape[1] == 1 else hq
        block_mask = fx.create_block_mask(mask_mod, mb, mh, tq, tk, device=q.device)
    # inside a compiled model flex is compiled with it; called eagerly on CUDA it needs its own compile
    fn = compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else fx.flex_attention
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0, enable_gqa=k.shape[1] != hq)


def flex_available(device: torch.device) -> str | None:
    return "this torch has no torch.nn.attention.flex_attention" if flex_module() is None else None
