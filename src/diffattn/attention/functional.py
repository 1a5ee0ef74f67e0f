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

Backends: ``diff_attention`` can run a fused Triton kernel (:mod:`diffattn.ops.triton_diff`, CUDA), and
``distance_attention`` / ``diff_distance_attention`` FlexAttention (CUDA); ``backend="auto"`` picks them on CUDA
when they apply and passed their self-check there (:mod:`diffattn.ops.backends`, which also reads
``DIFFATTN_BACKEND``), and the SDPA / block-loop paths everywhere else.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from diffattn.ops import backends

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
    logits = [(q[:, s::2] @ repeat_kv(k[:, s::2], n_rep).transpose(-1, -2)) * scale for s in (0, 1)]
    return _diff_combine_ref(logits, mask, lam, repeat_kv(v, n_rep), score_mod, return_maps)


def _diff_combine_ref(logits: list[Tensor], mask: Tensor | None, lam: Tensor | float, v: Tensor,
                      score_mod: ScoreMod | None, return_maps: bool):
    """(softmax(logits[0]) − λ·softmax(logits[1]))·v from the two maps' scaled logits (B, h, Tq, Tk)."""
    if score_mod is not None:
        logits = [score_mod(x) for x in logits]
    probs = [masked_softmax(x, mask) for x in logits]
    attn = probs[0] - lam * probs[1]
    out = attn @ v
    if not return_maps:
        return out
    return out, {"logits1": logits[0], "logits2": logits[1], "probs1": probs[0], "probs2": probs[1], "attn": attn}


# The availability checks are constants to torch.compile (evaluated once while tracing, no graph break).
@torch.compiler.assume_constant_result
def _triton_interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@torch.compiler.assume_constant_result
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=1)
def _triton_import_ok() -> bool:
    if not _triton_installed():
        return False
    try:
        importlib.import_module("diffattn.ops.triton_diff")
    except Exception:  # a broken triton install: the SDPA path still works
        return False
    return True


@torch.compiler.assume_constant_result
def _triton_importable() -> bool:
    return _triton_import_ok()


def _triton_unsupported(q: Tensor, lam: Tensor | float, attn_mask: Tensor | None, offset: int | Tensor) -> str | None:
    """Why the fused Triton kernel cannot take this call, or None when it can."""
    if not _triton_installed():
        return "triton is not installed (pip install triton)"
    if attn_mask is not None:
        return "it takes no attn_mask (only causal / non-causal with an int offset)"
    if not isinstance(offset, int):
        return f"it takes an int offset, got {type(offset).__name__}"
    if isinstance(lam, Tensor) and lam.numel() != 1:
        return f"it takes a scalar λ, got shape {tuple(lam.shape)}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"it supports fp32/bf16/fp16, got {q.dtype}"
    if q.shape[-2] == 0 or q.numel() == 0:
        return "the input is empty"
    if not q.is_cuda and not _triton_interpret_requested():
        return (f"it needs a CUDA device, got {q.device.type} (on CPU it runs only under Triton's interpreter, "
                f"TRITON_INTERPRET=1, for tests)")
    return None


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
    backend: str = "auto",
) -> Tensor:
    """Fast differential attention V1. Shapes as :func:`diff_attention_ref`.

    ``backend``: ``"triton"`` runs the fused kernel of :mod:`diffattn.ops.triton_diff` (both maps in one pass,
    1.5x the FLOPs of a standard core; CUDA, or Triton's interpreter on CPU; no ``attn_mask``, int ``offset``,
    scalar λ — anything else is a ValueError naming the problem); ``"sdpa"`` the one-call SDPA path below;
    ``"auto"`` the kernel on CUDA when triton imports, the kernel passed its self-check there and the call is
    supported, SDPA otherwise (:mod:`diffattn.ops.backends`; ``DIFFATTN_BACKEND`` overrides it).

    The SDPA path: one call over the 2h sub-heads.

    Both maps share V, so one call with V of width 2d computes A1·V and A2·V together. The fused kernels (CPU
    flash, FA2) want V as wide as Q/K: handed a wider V, CPU SDPA silently falls back to the math kernel, which
    materializes every (Tq, Tk) map (3-4x slower, quadratic memory). So Q and K are zero-padded to width 2d —
    QKᵀ is unchanged and the scale stays 1/√d — and one fused call does it all in O(N) memory. Measured faster
    than two calls over the V halves (benchmarks/bench_attention.py). SDPA's GQA maps query i to KV i // n_rep,
    so the query sub-heads are reordered from (hkv, n_rep, 2) to (hkv, 2, n_rep) and each value head is
    repeated once for its two key sub-heads.
    """
    b, h2, tq, d = q.shape
    h, hkv = h2 // 2, v.shape[1]
    if h2 % 2 or k.shape[1] != 2 * hkv:
        raise ValueError(f"diff attention wants q (B, 2h, T, d), k (B, 2hkv, T, d), v (B, hkv, T, 2d); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    n_rep = _check_heads(h, hkv, "diff attention")
    if backend not in ("auto", "sdpa", "triton"):
        raise ValueError(f"diff attention backend must be 'auto', 'sdpa' or 'triton', got {backend!r}")
    chosen = backends.choose("diff", q.device, q.dtype) if backend == "auto" else backend
    if chosen == "triton":
        why = _triton_unsupported(q, lam, attn_mask, offset)
        if why is None:
            from diffattn.ops.triton_diff import diff_attention_triton  # triton is optional: imported on use

            return diff_attention_triton(q, k, v, lam, causal=causal, offset=offset, scale=scale)
        if backend == "triton":
            raise ValueError(f"diff attention backend 'triton': {why}")
    q = q.view(b, hkv, n_rep, 2, tq, d).transpose(2, 3)
    pad = v.shape[-1] - d
    if pad > 0:  # reorder and pad in one copy
        qp = q.new_zeros(b, hkv, 2, n_rep, tq, d + pad)
        qp[..., :d] = q
        q, k = qp.view(b, h2, tq, d + pad), F.pad(k, (0, pad))
    else:
        q = q.reshape(b, h2, tq, d)
    scale = d**-0.5 if scale is None else scale
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
    lam_scale: Tensor | float = 1.0,
):
    """Differential attention V2: out_j = attn_{2j} − s·sigmoid(λ_j)·attn_{2j+1}, materialized (``lam_scale``
    s = 1 is the paper's; a training loop may ramp it in).

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
    w = (torch.sigmoid(lam_logits) * lam_scale)[..., None].to(out.dtype)
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
    lam_scale: Tensor | float = 1.0,
) -> Tensor:
    """Fast differential attention V2: one SDPA call, then the per-token difference of adjacent heads
    (the odd head weighted by ``lam_scale``·sigmoid(λ))."""
    h = q.shape[1] // 2
    if q.shape[1] % 2:
        raise ValueError(f"diff_v2 wants an even number of query heads, got {q.shape[1]}")
    _check_heads(h, k.shape[1], "diff_v2 attention (pairs must stay inside one GQA group)")
    o = _sdpa(q, k, v, causal=causal, offset=offset, attn_mask=attn_mask, scale=scale)
    return o[:, 0::2] - (torch.sigmoid(lam_logits) * lam_scale)[..., None].to(o.dtype) * o[:, 1::2]


# --------------------------------------------------------------------------- distance-aware (DA-Transformer)
# Wu, Wu & Huang 2021: per head i, scores = ReLU(Q Kᵀ) ⊙ f(w_i·R; v_i) / √d with R_jk = |pos_j − pos_k| and
# f(x; v) = (1 + e^v) / (1 + e^(v − x)). Masks are applied *after* the ReLU: a −inf mask turned into 0 by
# the ReLU would leave every masked key with weight exp(0) in the softmax.
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
    else:
        shift = offset.to(device) if isinstance(offset, Tensor) else int(offset)
        pos = torch.arange(tq, device=device) + shift
    if tq and int(pos.min()) < 0:
        raise ValueError("query positions must be >= 0")
    return pos


def _distance_mask(qpos: Tensor, tk: int, causal: bool, attn_mask: Tensor | None) -> Tensor | None:
    """Like :func:`build_mask` but causal against explicit query positions (keep key j iff j <= qpos_i)."""
    mask = build_mask(len(qpos), tk, causal=False, attn_mask=attn_mask, device=qpos.device)
    if causal:
        keep = torch.arange(tk, device=qpos.device)[None, :] <= qpos[:, None]
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
    return mask


def _check_distance_params(w: Tensor, v_param: Tensor, h: int, what: str) -> None:
    if w.shape != (h,) or v_param.shape != (h,):
        raise ValueError(f"{what}: w and v_param must have shape ({h},) (one per query head), "
                         f"got {tuple(w.shape)} and {tuple(v_param.shape)}")


def _distance_logits(q: Tensor, k: Tensor, w: Tensor, v_param: Tensor, qpos: Tensor, scale: float) -> Tensor:
    """ReLU(QKᵀ) ⊙ f(w·R; v) · scale for q (B, H, Tq, D), k (B, H, Tk, D) -> (B, H, Tq, Tk)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32  # f in (at least) fp32
    r = (qpos[:, None] - torch.arange(k.shape[-2], device=q.device)[None, :]).abs().to(dt)
    fmap = distance_f(w.to(dt).view(-1, 1, 1) * r, v_param.to(dt).view(-1, 1, 1))  # (H, Tq, Tk)
    return (torch.relu(q @ k.transpose(-1, -2)) * fmap.to(q.dtype)) * scale


def distance_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor,
    v_param: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    return_maps: bool = False,
):
    """DA-Transformer attention, materialized: softmax(ReLU(QKᵀ) ⊙ f(w_h·R; v_h) · scale) · V.

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv), w, v_param: (Hq,) per query head.
    R_ij = |qpos_i − j| with qpos from :func:`distance_positions` (``offset``: int, or (Tq,) positions).
    ``score_mod`` rewrites the final scores before masking. Returns (B, Hq, Tq, Dv), plus {"logits" (the
    post-ReLU ⊙ f scores), "probs"} when asked.
    """
    n_rep = _check_heads(q.shape[1], k.shape[1], "distance attention")
    _check_distance_params(w, v_param, q.shape[1], "distance attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    qpos = distance_positions(q.shape[-2], offset, q.device)
    logits = _distance_logits(q, k, w, v_param, qpos, scale)
    if score_mod is not None:
        logits = score_mod(logits)
    probs = masked_softmax(logits, _distance_mask(qpos, k.shape[-2], causal, attn_mask))
    out = probs @ v
    return (out, {"logits": logits, "probs": probs}) if return_maps else out


def _mask4(attn_mask: Tensor | None) -> Tensor | None:
    """A user mask as a 4-D tensor broadcastable to (B, H, Tq, Tk) ((B, Tk) is key padding)."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    m = attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask
    while m.dim() < 4:
        m = m[None]
    return m


def _mask_block(m: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    if m.shape[-2] != 1:
        m = m[..., qs:qe, :]
    return m[..., ks:ke] if m.shape[-1] != 1 else m


def _distance_tables(w: Tensor, v_param: Tensor, length: int, scale: float) -> tuple[Tensor, Tensor]:
    """Per head and distance r < length: scale·f(w·r; v) as (H, L), and (σ(v − w·r)·r, σ(v − w·r)) as (2H, L).

    f depends on (head, distance) only, so the block loops gather from these tables instead of recomputing f.
    With s = ReLU(raw)·f·scale and E = dS ⊙ s: ∂L/∂w = Σ E·σ(v − x)·r and ∂L/∂v = Σ E·(σ(v) − σ(v − x)),
    because d log f / dx = σ(v − x) and d log f / dv = σ(v) − σ(v − x) (x = w·r).
    """
    r = torch.arange(length, device=w.device, dtype=w.dtype)
    x = w[:, None] * r
    vv = v_param[:, None]
    sig = torch.sigmoid(vv - x)
    return distance_f(x, vv) * scale, torch.cat((sig * r, sig))


# Scores at most this large are exponentiated directly (no running max): e^60 · 2^31 keys is still finite
# in fp32, and every unmasked score is >= 0 (ReLU · f · scale, scale > 0): exp(score) >= 1 cannot underflow.
_EXP_SAFE = 60.0


class _DistanceAttnFn(torch.autograd.Function):
    """Block-wise distance-aware attention with O(T) memory (flash-attention style, pure PyTorch).

    Forward: softmax over key blocks for each query block; saves only the output and the per-row logsumexp.
    Backward: recomputes each block's scores, dS = P ⊙ (dP − rowsum(dO ⊙ O)); through the product
    s = ReLU(raw)·f the raw-score gradient is dS·f·[raw > 0], and the (w, v) gradients are contractions of
    E = dS ⊙ s with per-distance tables (:func:`_distance_tables`). Causal: key blocks entirely after a query
    block's last position are skipped; only blocks crossing the diagonal are masked elementwise.
    All heads equal (GQA is expanded by the caller); q, k, v in fp32/fp64.

    Speed (CPU, where every elementwise pass over a tile and every fresh allocation counts):
    - keys are visited in reverse order inside each block (K, V reversed once per call), so for contiguous
      query positions a tile's distance R_ij' = |c + i + j'| is a Hankel pattern: its f-tile, the causal
      mask and the gradient tables are zero-copy strided views of 1-D per-distance tables, not gathers;
    - when Cauchy–Schwarz bounds every score by :data:`_EXP_SAFE` (and masks are boolean) the softmax needs
      no running max: P = exp(s)·exp(−lse), and the backward folds the row factor exp(−lse) into dO and
      rowsum(dO ⊙ O) once per call; otherwise the online-softmax path with a running max runs;
    - f·[raw > 0] is one fused op (threshold_backward) reused for s and for dS; E is accumulated per block
      diagonal (tiles on one diagonal share their distances) and contracted with the tables once at the end;
    - tiles live in reused scratch buffers, and dK/dV accumulate in one contiguous buffer per key block.
    """

    @staticmethod
    def _blocks(qpos_l, tk, causal, bq, bk):
        """Yield (qs, qe, [(ks, ke, needs_causal_mask)]) for the non-skipped blocks."""
        tq = len(qpos_l)
        for qs in range(0, tq, bq):
            qe = min(tq, qs + bq)
            lo, hi = min(qpos_l[qs:qe]), max(qpos_l[qs:qe])
            kend = min(tk, hi + 1) if causal else tk
            ends = [(ks, min(kend, ks + bk)) for ks in range(0, kend, bk)]
            yield qs, qe, [(ks, ke, causal and ke - 1 > lo) for ks, ke in ends]

    @staticmethod
    def _setup(q, k, w, v_param, qpos, mask, scale):
        """Per-call state shared by forward and backward: query positions, the distance tables (plain (N, L)
        and mirrored around distance 0, ext[L − 1 + r] = tab[|r|]), the mirrored "signed distance < 0" mask
        and whether the bounded (no running max) softmax applies."""
        qpos_l = qpos.tolist()
        contiguous = all(qpos_l[i + 1] == qpos_l[i] + 1 for i in range(len(qpos_l) - 1))
        length = max(max(qpos_l, default=0), k.shape[2] - 1) + 1
        fs, dtab = _distance_tables(w.detach(), v_param.detach(), length, scale)
        bounded = False
        if scale > 0 and (mask is None or mask.dtype == torch.bool) and q.numel() and k.numel():
            # ReLU(q·k)·f·scale <= |q|·|k|·max(f·scale); a NaN/inf bound compares False -> online path
            bound = q.norm(dim=-1).amax() * k.norm(dim=-1).amax() * fs.amax()
            bounded = bool(bound <= _EXP_SAFE)
        st = {"qpos_l": qpos_l, "contiguous": contiguous, "length": length, "bounded": bounded,
              "fs": fs, "dtab": dtab}
        if contiguous:
            st["fs_ext"], st["dtab_ext"] = (torch.cat((t.flip(-1), t[:, 1:]), -1) for t in (fs, dtab))
            keep = torch.arange(2 * length - 1, device=q.device) >= length - 1  # signed distance >= 0
            # causal masks as multiplicative (on exp(s)) / additive (on s) factors: a broadcast multiply by a
            # strided float view is several times faster than masked_fill_ with a strided bool view
            st["keep"] = keep.to(q.dtype)
            st["addneg"] = torch.zeros_like(st["keep"]).masked_fill_(~keep, float("-inf"))
        return st

    @staticmethod
    def _tiles(n, like, bq, bk):
        """n flat scratch buffers for (B·H·bq·bk) tiles, reused by every block (views of their prefixes)."""
        size = like.shape[0] * like.shape[1] * max(1, bq) * max(1, bk)
        return [torch.empty(size, dtype=like.dtype, device=like.device) for _ in range(n)]

    @staticmethod
    def _key(st, qpos, qs, qe, ks, ke):
        """What fixes a tile's distances with keys reversed (column j' is key ke − 1 − j'): for contiguous
        positions (c, bq, bk) with R_ij' = |c + i + j'|, c = qpos[qs] − ke + 1; else the flat index
        (bq·bk,)."""
        if st["contiguous"]:
            return (st["qpos_l"][qs] - ke + 1, qe - qs, ke - ks)
        kpos = torch.arange(ke - 1, ks - 1, -1, device=qpos.device)
        return (qpos[qs:qe, None] - kpos[None, :]).abs().flatten()

    @staticmethod
    def _gather(st, name, key, bq, bk):
        """Table ``name`` (N, L) at the tile's distances: (N, bq, bk), a strided view when key is a tuple."""
        if isinstance(key, tuple):
            ext = st[name + "_ext"]
            off = ext.storage_offset() + st["length"] - 1 + key[0]
            return ext.as_strided((ext.shape[0], bq, bk), (ext.shape[1], 1, 1), off)
        tab = st[name]
        return tab.index_select(1, key).view(tab.shape[0], bq, bk)

    @staticmethod
    def _mask_tile(st, t, fill, cut, key, qpos_b, qs, qe, ks, ke, mask):
        """Masked entries of a key-reversed tile set to ``fill`` (−inf on scores, 0 on exp(scores)); a float
        user mask is added instead (scores only)."""
        if cut and isinstance(key, tuple):  # key after query <=> signed distance c + i + j' < 0
            tab = st["keep"] if fill == 0.0 else st["addneg"]
            off = tab.storage_offset() + st["length"] - 1 + key[0]
            view = tab.as_strided((t.shape[-2], t.shape[-1]), (1, 1), off)
            t = t.mul_(view) if fill == 0.0 else t.add_(view)
        elif cut:
            kpos = torch.arange(ke - 1, ks - 1, -1, device=t.device)
            t = t.masked_fill_(kpos[None, :] > qpos_b[:, None], fill)
        if mask is not None:
            mb = _mask_block(mask, qs, qe, ks, ke)
            mb = mb.flip(-1) if mb.shape[-1] != 1 else mb
            t = t.masked_fill_(~mb, fill) if mb.dtype == torch.bool else t.add_(mb.to(t.dtype))
        return t

    @staticmethod
    def forward(ctx, q, k, v, w, v_param, qpos, mask, causal, scale, block_q, block_k):
        b, h, tq, d = q.shape
        tk, dv = k.shape[2], v.shape[-1]
        F_ = _DistanceAttnFn
        st = F_._setup(q, k, w, v_param, qpos, mask, scale)
        bounded = st["bounded"]
        q3 = q.view(b * h, tq, d)
        kr3, vr3 = k.view(b * h, tk, d).flip(1), v.view(b * h, tk, dv).flip(1)  # key j at row tk − 1 − j
        out = torch.zeros(b, h, tq, dv, dtype=q.dtype, device=q.device)
        lse = torch.full((b, h, tq), float("-inf"), dtype=q.dtype, device=q.device)
        (sbuf,) = F_._tiles(1, q, min(block_q, tq), min(block_k, tk))
        for qs, qe, kblocks in F_._blocks(st["qpos_l"], tk, causal, block_q, block_k):
            bq = qe - qs
            qb3, qpos_b = q3[:, qs:qe], qpos[qs:qe]
            m = torch.full((b, h, bq), 0.0 if bounded else float("-inf"), dtype=q.dtype, device=q.device)
            lsum = torch.zeros_like(m)
            acc = torch.zeros(b * h, bq, dv, dtype=q.dtype, device=q.device)
            for ks, ke, cut in kblocks:
                bk = ke - ks
                key = F_._key(st, qpos, qs, qe, ks, ke)
                fb = F_._gather(st, "fs", key, bq, bk)
                s = torch.bmm(qb3, kr3[:, tk - ke:tk - ks].transpose(1, 2),
                              out=sbuf[:b * h * bq * bk].view(b * h, bq, bk))
                s = s.view(b, h, bq, bk).clamp_min_(0).mul_(fb)
                if bounded:  # scores <= _EXP_SAFE: no running max, no rescaling
                    p = s.exp_()
                    if cut or mask is not None:
                        p = F_._mask_tile(st, p, 0.0, cut, key, qpos_b, qs, qe, ks, ke, mask)
                else:
                    s = F_._mask_tile(st, s, float("-inf"), cut, key, qpos_b, qs, qe, ks, ke, mask)
                    m_new = torch.maximum(m, s.amax(-1))
                    m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)  # all masked so far: exp() finite
                    p = s.sub_(m_safe[..., None]).exp_()
                    alpha = (m - m_safe).exp_()
                    lsum.mul_(alpha)
                    acc.mul_(alpha.view(-1, bq, 1))
                    m = m_new
                lsum.add_(p.sum(-1))
                acc.baddbmm_(p.view(-1, bq, bk), vr3[:, tk - ke:tk - ks])
            empty = lsum == 0  # every key masked: output zeros, as SDPA does
            torch.div(acc.view(b, h, bq, dv), lsum.masked_fill(empty, 1.0)[..., None], out=out[:, :, qs:qe])
            lse[:, :, qs:qe] = torch.where(empty, float("-inf"), m + lsum.clamp_min(1e-38).log())
        ctx.save_for_backward(q, k, v, w, v_param, qpos, out, lse)
        ctx.mask, ctx.causal, ctx.scale, ctx.block = mask, causal, scale, (block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, w, v_param, qpos, out, lse = ctx.saved_tensors
        mask, causal, scale = ctx.mask, ctx.causal, ctx.scale
        want_wv = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        b, h, tq, d = q.shape
        tk, dvw = k.shape[2], v.shape[-1]
        F_ = _DistanceAttnFn
        st = F_._setup(q, k, w, v_param, qpos, mask, scale)
        bounded = st["bounded"]
        dout = dout.to(q.dtype).contiguous()
        delta = (dout * out).sum(-1)  # rowsum(dO ⊙ O): (B, H, Tq)
        if bounded:  # P = exp(s)·exp(−lse): fold the row factor into dO and delta once (all-masked rows: 0)
            inv = torch.exp(-lse).masked_fill_(torch.isinf(lse), 0.0)
            dout, delta = dout * inv[..., None], delta.mul_(inv)
        else:
            lse_safe = lse.masked_fill(torch.isinf(lse), float("inf"))  # all-masked rows: P = 0
        q3, do3 = q.view(b * h, tq, d), dout.view(b * h, tq, dvw)
        kr3, vr3 = k.view(b * h, tk, d).flip(1), v.view(b * h, tk, dvw).flip(1)  # key j at row tk − 1 − j
        dq = torch.zeros_like(q)
        dq3 = dq.view(b * h, tq, d)
        # dK, dV (key-reversed rows) accumulate per key block in contiguous buffers: baddbmm_ into a strided
        # slice of a (B·H, Tk, D) tensor falls back to one GEMM per batch entry, several times slower
        bk_max = ctx.block[1]
        kbl = [(ks, min(tk, ks + bk_max)) for ks in range(0, tk, bk_max)]
        dkb = [k.new_zeros(b * h, ke - ks, d) for ks, ke in kbl]
        dvb = [v.new_zeros(b * h, ke - ks, dvw) for ks, ke in kbl]
        e_acc: dict = {}  # per distance pattern: (Σ_batch E (H, bq, bk), key)
        thr_bw = torch.ops.aten.threshold_backward.grad_input
        bufs = F_._tiles(4, q, min(ctx.block[0], tq), min(bk_max, tk))
        for qs, qe, kblocks in F_._blocks(st["qpos_l"], tk, causal, *ctx.block):
            bq = qe - qs
            qb3, qpos_b, dob3 = q3[:, qs:qe], qpos[qs:qe], do3[:, qs:qe]
            delta_b = delta[:, :, qs:qe, None]
            dqb = q3.new_zeros(b * h, bq, d)
            for ks, ke, cut in kblocks:
                bk = ke - ks
                kb3, vb3 = kr3[:, tk - ke:tk - ks], vr3[:, tk - ke:tk - ks]
                key = F_._key(st, qpos, qs, qe, ks, ke)
                fb = F_._gather(st, "fs", key, bq, bk)
                rawb, fposb, pb, dsb = (x[: b * h * bq * bk].view(b, h, bq, bk) for x in bufs)
                raw = torch.bmm(qb3, kb3.transpose(1, 2), out=rawb.view(b * h, bq, bk)).view(b, h, bq, bk)
                fpos = thr_bw(fb, raw, 0.0, grad_input=fposb)  # f·[raw > 0] = ∂s/∂raw; s = raw·fpos
                s = torch.mul(raw, fpos, out=pb)  # raw is kept: E = dS ⊙ s = (dS ⊙ fpos) ⊙ raw below
                if bounded:
                    p = s.exp_()
                    if cut or mask is not None:
                        p = F_._mask_tile(st, p, 0.0, cut, key, qpos_b, qs, qe, ks, ke, mask)
                else:
                    s = s.sub_(lse_safe[:, :, qs:qe, None])
                    p = F_._mask_tile(st, s, float("-inf"), cut, key, qpos_b, qs, qe, ks, ke, mask).exp_()
                p3 = p.view(b * h, bq, bk)
                j = ks // bk_max
                dkj, dvj = dkb[j], dvb[j]
                if dkj.shape[1] != bk:  # causal cut shorter than the block: its last keys are the first rows
                    cut_rows = kbl[j][1] - ke
                    dkj, dvj = dkj[:, cut_rows:cut_rows + bk], dvj[:, cut_rows:cut_rows + bk]
                dvj.baddbmm_(p3.transpose(1, 2), dob3)
                ds = torch.bmm(dob3, vb3.transpose(1, 2), out=dsb.view(b * h, bq, bk)).view(b, h, bq, bk)
                draw = ds.sub_(delta_b).mul_(p).mul_(fpos)  # ∂L/∂raw = dS ⊙ f ⊙ [raw > 0]
                if want_wv:  # E = dS ⊙ s = draw ⊙ raw
                    slot = e_acc.get(key) if isinstance(key, tuple) else None
                    if slot is None:
                        e = draw * raw if b == 1 else (draw * raw).sum(0, keepdim=True)
                        e_acc[key if isinstance(key, tuple) else len(e_acc)] = (e.view(h, bq, bk), key)
                    elif b == 1:
                        slot[0].view(1, h, bq, bk).addcmul_(draw, raw)
                    else:
                        slot[0].add_((draw * raw).sum(0))
                draw3 = draw.view(b * h, bq, bk)
                dqb.baddbmm_(draw3, kb3)
                dkj.baddbmm_(draw3.transpose(1, 2), qb3)
            dq3[:, qs:qe] = dqb
        gw = torch.zeros(h, dtype=q.dtype, device=q.device)
        gv = torch.zeros_like(gw)
        for e, key in e_acc.values():  # ∂/∂w = Σ E·σ(v−x)·r, ∂/∂v = σ(v)·Σ E − Σ E·σ(v−x)
            tab = F_._gather(st, "dtab", key, e.shape[1], e.shape[2]).view(2, h, e.shape[1], e.shape[2])
            prod = [torch.mul(tab[i], e, out=bufs[i][: e.numel()].view(e.shape)) for i in (0, 1)]  # no alloc
            gw += prod[0].sum((-2, -1))  # Σ E·σ(v−x)·r
            gv += torch.sigmoid(v_param.detach()) * e.sum((-2, -1)) - prod[1].sum((-2, -1))
        # block j of the reversed layout holds keys kbl[j] last-first; the blocks go last-first too
        dk = torch.cat(dkb[::-1], 1).flip(1).view(k.shape) if dkb else torch.zeros_like(k)
        dv = torch.cat(dvb[::-1], 1).flip(1).view(v.shape) if dvb else torch.zeros_like(v)
        return dq, dk, dv, gw.to(w.dtype), gv.to(v_param.dtype), None, None, None, None, None, None


# ------------------------------------------------------------------------ distance-aware on FlexAttention
@functools.lru_cache(maxsize=1)
def _flex_module():
    """torch.nn.attention.flex_attention, or None where this torch has none."""
    try:
        return importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return None


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # flex_attention run eagerly materializes the score map; compiled it is a fused kernel with a backward
    return torch.compile(_flex_module().flex_attention, dynamic=False)


def _flex_unsupported(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> str | None:
    """Why FlexAttention cannot take this distance-attention call, or None when it can."""
    if _flex_module() is None:
        return "this torch has no torch.nn.attention.flex_attention"
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return "it takes boolean masks only (a float attn_mask goes to the block path)"
    if not q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return "torch's FlexAttention has no backward on CPU (use backend='block', or no_grad)"
    if q.dtype == torch.float64 and q.is_cuda:
        return "fp64 is not supported by the compiled FlexAttention kernel"
    return None


def _flex_distance(q: Tensor, k: Tensor, v: Tensor, w: Tensor, v_param: Tensor, *, causal: bool,
                   attn_mask: Tensor | None, offset: int | Tensor, scale: float) -> Tensor:
    """DA attention on FlexAttention: q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv).

    Flex is called with scale 1, and the score_mod returns ReLU(s)·f(w_h·|qpos_i − j|; v_h)·scale, the same
    placement as :func:`_distance_logits` (so a scale <= 0 stays exact too). w and v_param are captured by
    the score_mod, and flex differentiates through captured tensors, so they get gradients. Causality and
    boolean masks form the block mask: masked entries never enter the softmax, after the ReLU by construction.
    GQA goes through flex's enable_gqa (query head i reads KV head i // n_rep, as repeat_kv).
    """
    fx = _flex_module()
    b, hq, tq, _ = q.shape
    tk = k.shape[-2]
    qpos = distance_positions(tq, offset, q.device)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32  # f in (at least) fp32, as the reference
    wf, vf = w.to(cdt), v_param.to(cdt)
    log_norm = F.logsigmoid(-vf)  # f(x; v) = σ(x − v) / σ(−v), in log space as distance_f

    def score_mod(s, bi, hi, qi, ki):
        x = wf[hi] * (qpos[qi] - ki).abs()
        return torch.relu(s) * torch.exp(F.logsigmoid(x - vf[hi]) - log_norm[hi]) * scale

    m4 = _mask4(attn_mask)
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
    fn = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else fx.flex_attention
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0, enable_gqa=k.shape[1] != hq)


def distance_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor,
    v_param: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
    block_q: int = 256,
    block_k: int = 256,
    backend: str = "auto",
) -> Tensor:
    """Fast DA-Transformer attention, O(T) memory, exact backward. Same math and shapes as
    :func:`distance_attention_ref`.

    ``backend``: ``"block"`` is a block-wise online softmax in PyTorch with a recomputing backward (every
    device; only (B, H, block_q, block_k) tiles; ``block_q``/``block_k`` trade Python overhead for tile memory;
    fp16/bf16 computed in fp32). ``"flex"`` is FlexAttention with a distance score_mod (:func:`_flex_distance`;
    compiled on CUDA; on CPU torch runs it eagerly, forward only); ``"auto"`` takes flex on CUDA for boolean or
    no masks once it passed its self-check there (:mod:`diffattn.ops.backends`; ``DIFFATTN_BACKEND`` overrides
    it), the block path otherwise.
    """
    n_rep = _check_heads(q.shape[1], k.shape[1], "distance attention")
    _check_distance_params(w, v_param, q.shape[1], "distance attention")
    if backend not in ("auto", "block", "flex"):
        raise ValueError(f"distance attention backend must be 'auto', 'block' or 'flex', got {backend!r}")
    chosen = backends.choose("distance", q.device, q.dtype) if backend == "auto" else backend
    if chosen == "flex":
        why = _flex_unsupported(q, k, v, attn_mask)
        if why is None:
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            return _flex_distance(q, k, v, w, v_param, causal=causal, attn_mask=attn_mask, offset=offset,
                                  scale=float(scale))
        if backend == "flex":
            raise ValueError(f"distance attention backend 'flex': {why}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got {block_q}, {block_k}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt = q.dtype
    cdt = torch.float64 if dt == torch.float64 else torch.float32
    qpos = distance_positions(q.shape[-2], offset, q.device)
    mask = _mask4(attn_mask)
    out = _DistanceAttnFn.apply(
        *(x.to(cdt).contiguous() for x in (q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))), w.to(cdt),
        v_param.to(cdt),
        qpos, mask, causal, float(scale), int(block_q), int(block_k),
    )
    return out.to(dt)


def _check_diff_shapes(q: Tensor, k: Tensor, v: Tensor, what: str) -> tuple[int, int]:
    h, hkv = q.shape[1] // 2, v.shape[1]
    if q.shape[1] % 2 or k.shape[1] != 2 * hkv:
        raise ValueError(f"{what} wants q (B, 2h, T, d), k (B, 2hkv, T, d), v (B, hkv, T, 2d); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return h, _check_heads(h, hkv, what)


def diff_distance_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor | float,
    w: Tensor,
    v_param: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    return_maps: bool = False,
):
    """Differential V1 attention with distance-aware maps, materialized:
    (softmax(ReLU(Q1K1ᵀ) ⊙ f(w1·R; v1)/√d) − λ·softmax(ReLU(Q2K2ᵀ) ⊙ f(w2·R; v2)/√d))·V.

    Layout as :func:`diff_attention_ref` (q (B, 2h, Tq, d), k (B, 2hkv, Tk, d), v (B, hkv, Tk, 2d)).
    w, v_param: (2h,) in the query sub-head order — entry 2i belongs to map 1 of diff-head i, 2i+1 to map 2 —
    so each map has its own distance profile (the difference of two profiles can express band-pass ranges,
    which one shared profile cannot). Returns (B, h, Tq, 2d) (before the per-head norm), plus {"logits1",
    "logits2", "probs1", "probs2", "attn"} when asked.
    """
    h, n_rep = _check_diff_shapes(q, k, v, "diff distance attention")
    _check_distance_params(w, v_param, 2 * h, "diff distance attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qpos = distance_positions(q.shape[-2], offset, q.device)
    mask = _distance_mask(qpos, k.shape[-2], causal, attn_mask)
    logits = [_distance_logits(q[:, s::2], repeat_kv(k[:, s::2], n_rep), w[s::2], v_param[s::2], qpos, scale)
              for s in (0, 1)]
    return _diff_combine_ref(logits, mask, lam, repeat_kv(v, n_rep), score_mod, return_maps)


def diff_distance_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor | float,
    w: Tensor,
    v_param: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    offset: int | Tensor = 0,
    scale: float | None = None,
    block_q: int = 256,
    block_k: int = 256,
    backend: str = "auto",
) -> Tensor:
    """Fast differential distance attention: one :func:`distance_attention` call over the 2h sub-heads (as
    :func:`diff_attention` does with SDPA: sub-heads reordered to (hkv, 2, n_rep), V repeated for its two key
    sub-heads), then A1·V − λ·A2·V. Shapes as :func:`diff_distance_attention_ref`; ``backend`` as
    :func:`distance_attention` ("auto": FlexAttention on CUDA)."""
    b, h2, tq, d = q.shape
    h, n_rep = _check_diff_shapes(q, k, v, "diff distance attention")
    _check_distance_params(w, v_param, h2, "diff distance attention")
    hkv = v.shape[1]

    def order(x: Tensor) -> Tensor:  # query sub-head (g, r, s) -> (g, s, r)
        return x.view(hkv, n_rep, 2).transpose(1, 2).reshape(h2)

    q = q.view(b, hkv, n_rep, 2, tq, d).transpose(2, 3).reshape(b, h2, tq, d)
    o = distance_attention(q, k, v.repeat_interleave(2, dim=1), order(w), order(v_param), causal=causal,
                           attn_mask=attn_mask, offset=offset, scale=scale, block_q=block_q, block_k=block_k,
                           backend=backend)
    o = o.view(b, hkv, 2, n_rep, tq, o.shape[-1])
    return (o[:, :, 0] - lam * o[:, :, 1]).reshape(b, h, tq, o.shape[-1])


# ------------------------------------------------------------------------------ backend self-check registry
def _triton_available(device: torch.device) -> str | None:
    if not _triton_importable():
        return "triton is not installed or does not import (pip install triton)"
    if device.type != "cuda" and not _triton_interpret_requested():
        return f"the Triton kernel needs a CUDA device, got {device.type} (or TRITON_INTERPRET=1, for tests)"
    return None


def _flex_available(device: torch.device) -> str | None:
    return "this torch has no torch.nn.attention.flex_attention" if _flex_module() is None else None


backends.register(backends.Kernel(
    name="triton", safe="sdpa", family="diff", available=_triton_available,
    run=lambda backend, x: diff_attention(*x, causal=True, backend=backend)))
backends.register(backends.Kernel(
    name="flex", safe="block", family="distance", available=_flex_available,
    run=lambda backend, x: distance_attention(*x, causal=True, backend=backend)))
