"""Attention whose values are wider than its queries and keys (V1's core: Q/K at d, V at 2d), in the layouts a
kernel class can take, and which SDPA backend a call lands on.

    attend_wide_v(q, k, v, layout=...)    q (B, Hq, Tq, d), k (B, Hkv, Tk, d), v (B, Hkv, Tk, dv), dv >= d
                                          -> (B, Hq, Tq, dv); GQA: query head i reads KV head i // (Hq // Hkv)

Every layout computes softmax(q·kᵀ·scale)·v exactly (up to rounding); they differ in which kernels can run them:

* ``"pad"``: q and k zero-padded to dv, one call with equal widths (q·kᵀ unchanged, the scale stays the caller's):
  any fused kernel takes it, at dv/d times the q·kᵀ work;
* ``"wide"``: one call with v wider than q/k: SDPA's memory-efficient and cuDNN backends take it on CUDA (the flash
  backend wants equal widths; CPU SDPA falls back to its math kernel, which materializes the map);
* ``"split"``: v cut into d-wide slices (the last one zero-padded), one equal-width call per slice, outputs
  concatenated: the flash-friendly layout of the official ``multihead_flashdiff_2.py`` (q·kᵀ computed once per
  slice, so ~2x the FLOPs at dv = 2d, at flash speed);
* ``"flex"``: FlexAttention (its Triton template takes v wider than q/k), compiled on CUDA; on CPU torch runs it
  eagerly, forward only (no backward there).

Mask conventions (``causal``, ``offset``, ``attn_mask``): :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from diffattn.ops import backends
from diffattn.ops.core import sdpa
from diffattn.ops.distance_flex import compiled_flex, flex_module

LAYOUTS = ("pad", "wide", "split", "flex")
#: V1's core layouts by backend name (the ``diff`` kernel family) -> the layout each runs.
BACKEND_LAYOUTS = {"sdpa": "pad", "sdpa_wide": "wide", "sdpa_split": "split", "flex_wide": "flex"}
V1_BACKENDS = ("auto", *BACKEND_LAYOUTS, "triton")


def attend_wide_v(q: Tensor, k: Tensor, v: Tensor, *, layout: str, causal: bool = True, offset: int | Tensor = 0,
                  attn_mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """softmax(q·kᵀ·scale)·v with v (B, Hkv, Tk, dv) at least as wide as q (B, Hq, Tq, d) and k (B, Hkv, Tk, d),
    in ``layout`` (module docstring); scale defaults to 1/√d. Returns (B, Hq, Tq, dv)."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        raise ValueError(f"attend_wide_v wants v at least as wide as q/k, got q width {d}, v width {dv}")
    scale = d**-0.5 if scale is None else scale
    kw = dict(causal=causal, offset=offset, attn_mask=attn_mask, scale=scale)
    if layout == "pad":
        pad = dv - d
        return sdpa(F.pad(q, (0, pad)), F.pad(k, (0, pad)), v, **kw) if pad else sdpa(q, k, v, **kw)
    if layout == "wide":
        return sdpa(q, k, v, **kw)
    if layout == "split":
        parts = []
        for piece in v.split(d, dim=-1):
            w = piece.shape[-1]
            out = sdpa(q, k, F.pad(piece, (0, d - w)) if w < d else piece, **kw)
            parts.append(out[..., :w] if w < d else out)
        return torch.cat(parts, dim=-1)
    if layout == "flex":
        return flex_wide_v(q, k, v, **kw)
    raise ValueError(f"unknown wide-V layout {layout!r}; known: {', '.join(LAYOUTS)}")


# --------------------------------------------------------------------------------------------- FlexAttention
def flex_available(device: torch.device) -> str | None:
    """Why FlexAttention cannot run V1's wide-V layout on ``device``, or None."""
    if flex_module() is None:
        return "this torch has no torch.nn.attention.flex_attention"
    return None


def flex_unsupported(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, offset: int | Tensor) -> str | None:
    """Why the flex layout cannot take this call, or None when it can."""
    if flex_module() is None:
        return "this torch has no torch.nn.attention.flex_attention"
    if attn_mask is not None:
        return "it takes no attn_mask here (causal or not, an int offset)"
    if not isinstance(offset, int):
        return f"it takes an int offset, got {type(offset).__name__}"
    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return "torch's FlexAttention has no backward on CPU"
    if q.dtype == torch.float64 and q.is_cuda:
        return "fp64 is not supported by the compiled FlexAttention kernel"
    return None


def flex_wide_v(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, offset: int | Tensor,
                attn_mask: Tensor | None, scale: float) -> Tensor:
    """The flex layout: one FlexAttention call, v wider than q/k, causality as the block mask."""
    why = flex_unsupported(q, k, v, attn_mask, offset)
    if why is not None:
        raise ValueError(f"wide-V layout 'flex': {why}")
    fx = flex_module()
    tq, tk = q.shape[-2], k.shape[-2]
    block_mask = None
    if causal:
        shift = int(offset)

        def mask_mod(bi, hi, qi, ki):
            return ki <= qi + shift

        block_mask = fx.create_block_mask(mask_mod, None, None, tq, tk, device=q.device)
    fn = compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else fx.flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


# ------------------------------------------------------------------------------------------ SDPA's choice
def sdpa_choice(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = True, attn_mask: Tensor | None = None) -> str:
    """The SDPA backend torch would run for this call ("flash", "efficient", "cudnn", "math", ...), as its own
    dispatcher decides (``torch._fused_sdp_choice``, under any ``sdpa_kernel`` context in force); "unknown"
    where this torch does not say."""
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return "unknown"
    try:
        idx = choice(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal and attn_mask is None,
                     enable_gqa=q.shape[1] != k.shape[1])
        name = torch.nn.attention.SDPBackend(int(idx)).name
    except Exception as e:  # no kernel can take it, or an older signature: say so instead of failing the record
        return f"none ({type(e).__name__})"
    return {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn",
            "MATH": "math"}.get(name, name.lower())


def v1_layout(backend: str, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, offset: int | Tensor,
                  chosen: str | None = None) -> str:
    """The :mod:`diffattn.ops.wide_v` layout a V1-core call runs for ``backend`` (one of :data:`V1_BACKENDS`;
    "auto": the dispatch table's pick, ``chosen`` when the caller already asked). Triton returns no separate
    maps, so it means "pad" here; a flex call it cannot take (a mask, tensor offsets, a CPU backward) goes to
    "pad" under auto and is a ValueError when named."""
    if backend not in V1_BACKENDS:
        raise ValueError(f"diff attention backend must be one of {', '.join(V1_BACKENDS)}, got {backend!r}")
    if backend == "auto":
        chosen = chosen or backends.choose("diff", q.device, q.dtype)
    else:
        chosen = backend
    layout = BACKEND_LAYOUTS.get(chosen, "pad")
    if layout == "flex":
        why = flex_unsupported(q, k, v, attn_mask, offset)
        if why is not None:
            if backend == "flex_wide":
                raise ValueError(f"diff attention backend 'flex_wide': {why}")
            layout = "pad"
    return layout


def everywhere(device: torch.device) -> str | None:
    """A layout every device runs: no reason it cannot (a kernel's ``available``)."""
    return None


def flex_trains_here(device: torch.device) -> str | None:
    """Why FlexAttention cannot train on ``device`` (no backward off CUDA), or None."""
    why = flex_available(device)
    if why is None and device.type != "cuda":
        why = f"FlexAttention has no backward on {device.type} (torch runs it there forward only)"
    return why
