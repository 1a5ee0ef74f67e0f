"""Differential attention V1 (Ye et al. 2024): (softmax(Q1K1ᵀ/√d) − λ·softmax(Q2K2ᵀ/√d))·V.

``diff_attention_ref`` materializes both maps (the spec); ``diff_attention`` computes them without the map in one
of V1's core layouts, each a named backend (kernel) of the ``diff`` family (:mod:`diffattn.ops.backends`):

* ``"sdpa"`` (the safe path): one SDPA call over the 2h sub-heads, Q/K zero-padded to V's width 2d;
* ``"sdpa_wide"``: one SDPA call, Q/K at d and V at 2d (GQA over 2h query heads): cuDNN or memory-efficient SDPA;
* ``"sdpa_split"``: V cut into its two d-wide halves, one equal-width call each (flash), outputs side by side;
* ``"flex_wide"``: one FlexAttention call, V at 2d (compiled on CUDA; forward only on CPU);
* ``"triton"``: the fused kernel of :mod:`diffattn.ops.triton_diff` (opt-in: slower than ``sdpa`` on an H200).

``backend="auto"`` runs what the measured dispatch table names for the device and dtype, else the safe path. The
layouts themselves live in :mod:`diffattn.ops.wide_v`, which the types built on V1's core (Shared DIFF, DINT, GDA)
reach through :func:`diff_attention_parts` and :func:`~diffattn.ops.wide_v.v1_layout`. The epilogue (λ, the
subtraction, the per-head RMSNorm and the (1 − λ_init) scale) runs as one compiled region where the table's row
says so (:func:`diffattn.ops.norm.diff_epilogue`). Shapes and mask conventions: :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from diffattn.attention.base import (
    AttentionBase,
    AttentionConfig,
    HeadOptions,
    MaskArgs,
    check_positive,
    check_shared_qk,
    head_options,
    out_bias,
    shared_qk_keys,
    split_heads,
    with_options,
)
from diffattn.attention.registry import register
from diffattn.attention.retrofit import HeadSelection, Retrofittable
from diffattn.ops import backends, triton_support, wide_v
from diffattn.ops.core import ScoreMod, build_mask, check_diff_shapes, masked_softmax, repeat_kv, sdpa, upcast
from diffattn.ops.norm import RMSNorm, fused_diff_epilogue

LAMBDA_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def lambda_init_fn(depth: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·depth), depth 0-based (paper, official code)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def diff_lambda(m: nn.Module, init: Tensor | float | None = None) -> Tensor:
    """λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, or exp(λa) − exp(λb) + λ_init (``dual_lambda``), in fp32, of a
    module holding V1's λ parameters, ``dual_lambda`` and ``lambda_init``: the attention module, or its vLLM
    layer (:mod:`.diff_recipes`). ``init``: the λ_init to add instead of ``m.lambda_init`` (a retrofit's)."""
    up = upcast
    if m.dual_lambda:
        l1, l2 = torch.exp(up(m.lambda_a)), torch.exp(up(m.lambda_b))
    else:
        l1 = torch.exp(torch.sum(up(m.lambda_q1) * up(m.lambda_k1)))
        l2 = torch.exp(torch.sum(up(m.lambda_q2) * up(m.lambda_k2)))
    return l1 - l2 + (m.lambda_init if init is None else init)


def diff_attention_ref(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, *, causal: bool = True,
                       attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                       score_mod: ScoreMod | None = None, return_maps: bool = False):
    """Differential attention V1: (softmax(Q1K1ᵀ/√d) − λ·softmax(Q2K2ᵀ/√d))·V, materialized.

    Official layout: diff-head i owns query sub-heads 2i (Q1) and 2i+1 (Q2); KV diff-head g owns key sub-heads
    2g (K1), 2g+1 (K2) and one value head of width 2d. Under GQA diff-head i reads KV diff-head i // n_rep
    for *both* halves.

    q: (B, 2h, Tq, d), k: (B, 2hkv, Tk, d), v: (B, hkv, Tk, 2d), lam: scalar.
    Returns (B, h, Tq, 2d) — before the per-head norm — plus maps {"logits1", "logits2", "probs1",
    "probs2", "attn" (the effective map A1 − λA2)} when asked.
    """
    h, n_rep = check_diff_shapes(q, k, v, "diff attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = build_mask(q.shape[-2], k.shape[-2], causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    logits = [(q[:, s::2] @ repeat_kv(k[:, s::2], n_rep).transpose(-1, -2)) * scale for s in (0, 1)]
    return diff_combine_ref(logits, mask, lam, repeat_kv(v, n_rep), score_mod, return_maps)


def diff_combine_ref(logits: list[Tensor], mask: Tensor | None, lam: Tensor | float, v: Tensor,
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


def diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, *, causal: bool = True,
                   attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                   backend: str = "auto") -> Tensor:
    """Fast differential attention V1. Shapes as :func:`diff_attention_ref`.

    ``backend``: one of :data:`wide_v.V1_BACKENDS` (the module docstring's layouts). ``"triton"`` runs the fused kernel
    of :mod:`diffattn.ops.triton_diff` (both maps in one pass; CUDA, or Triton's interpreter on CPU; no
    ``attn_mask``, int ``offset``, scalar λ — anything else is a ValueError naming the problem); ``"sdpa"``,
    ``"sdpa_wide"``, ``"sdpa_split"``, ``"flex_wide"`` the layouts of :func:`diff_attention_parts`; ``"auto"``
    what the measured dispatch table names here, else ``"sdpa"`` (:mod:`diffattn.ops.backends`;
    ``DIFFATTN_BACKEND`` names one). On CPU the safe ``"sdpa"`` is the fastest: measured faster than two calls
    over the V halves and than the wide call, which CPU SDPA runs on its math kernel
    (benchmarks/bench_attention.py).
    """
    check_diff_shapes(q, k, v, "diff attention")
    if backend not in wide_v.V1_BACKENDS:
        raise ValueError(f"diff attention backend must be one of {', '.join(wide_v.V1_BACKENDS)}, got {backend!r}")
    chosen = backends.choose("diff", q.device, q.dtype) if backend == "auto" else backend
    if chosen == "triton":
        why = triton_support.unsupported(q, lam, attn_mask, offset)
        if why is None:
            from diffattn.ops.triton_diff import diff_attention_triton  # triton is optional: imported on use

            return diff_attention_triton(q, k, v, lam, causal=causal, offset=offset, scale=scale)
        if backend == "triton":
            raise ValueError(f"diff attention backend 'triton': {why}")
    o1, o2 = diff_attention_parts(q, k, v, causal=causal, attn_mask=attn_mask, offset=offset, scale=scale,
                                  backend=backend if backend != "triton" else "sdpa", chosen=chosen)
    return o1 - lam * o2


def diff_attention_parts(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, attn_mask: Tensor | None = None,
                         offset: int | Tensor = 0, scale: float | None = None, backend: str = "auto",
                         chosen: str | None = None) -> tuple[Tensor, Tensor]:
    """(A1·V, A2·V), each (B, h, Tq, 2d), in the layout ``backend`` names
    (:func:`~diffattn.ops.wide_v.v1_layout`; shapes as :func:`diff_attention_ref`). Variants that combine the two
    maps otherwise (DINT) start from here.

    Every layout is one pass over the 2h sub-heads: SDPA's GQA maps query i to KV i // n_rep, so the query
    sub-heads are reordered from (hkv, n_rep, 2) to (hkv, 2, n_rep) and each value head is repeated once for its
    two key sub-heads. The safe layout ("pad") zero-pads Q and K to 2d in the same copy as the reorder (QKᵀ is
    unchanged, the scale stays 1/√d): the fused kernels (CPU flash, FA2) want V as wide as Q/K, and handed a
    wider V, CPU SDPA falls back to its math kernel, which materializes every (Tq, Tk) map."""
    b, h2, tq, d = q.shape
    h, n_rep = check_diff_shapes(q, k, v, "diff attention")
    hkv = v.shape[1]
    layout = wide_v.v1_layout(backend, q, k, v, attn_mask, offset, chosen)
    q = q.view(b, hkv, n_rep, 2, tq, d).transpose(2, 3)
    pad = v.shape[-1] - d
    scale = d**-0.5 if scale is None else scale
    if layout == "pad" and pad > 0:  # reorder and pad in one copy
        qp = q.new_zeros(b, hkv, 2, n_rep, tq, d + pad)
        qp[..., :d] = q
        q, k = qp.view(b, h2, tq, d + pad), F.pad(k, (0, pad))
    else:
        q = q.reshape(b, h2, tq, d)
    v2 = v.repeat_interleave(2, dim=1)
    kw = dict(causal=causal, offset=offset, attn_mask=attn_mask, scale=scale)
    o = sdpa(q, k, v2, **kw) if layout == "pad" else wide_v.attend_wide_v(q, k, v2, layout=layout, **kw)
    o = o.view(b, hkv, 2, n_rep, tq, o.shape[-1])
    return o[:, :, 0].reshape(b, h, tq, o.shape[-1]), o[:, :, 1].reshape(b, h, tq, o.shape[-1])


def _check_case(device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """The self-check's small causal case: q (1, 4, 40, 16), k (1, 2, 40, 16), v (1, 1, 40, 32) in ``dtype``,
    λ 0.65 in fp32 (as under autocast): 2 diff-heads over 1 KV head (GQA)."""
    qkv = backends.random_inputs(device, dtype, [(1, 4, 40, 16), (1, 2, 40, 16), (1, 1, 40, 32)])
    return [*qkv, torch.tensor(0.65, device=device)]


backends.register(backends.Kernel(
    name="triton", safe="sdpa", family="diff", available=triton_support.available,
    run=lambda backend, x: diff_attention(*x, causal=True, backend=backend),
    make_inputs=_check_case, grad_names=("out", "dq", "dk", "dv", "dlam"),
    opt_in="slower than the SDPA path on an H200 (fwd+bwd 3.4-3.7x the standard core against 1.6-3.0x, "
           "T = 2k-16k; docs/results/gpu/)"))


@backends.assume_constant_result
def _epilogue_choice(device: str, dtype: torch.dtype) -> str:
    return backends.epilogue("diff", torch.device(device), dtype)


for _name, _avail in (("sdpa_wide", wide_v.everywhere), ("sdpa_split", wide_v.everywhere),
                     ("flex_wide", wide_v.flex_trains_here)):
    backends.register(backends.Kernel(
        name=_name, safe="sdpa", family="diff", available=_avail,
        run=lambda backend, x: diff_attention(*x, causal=True, backend=backend),
        make_inputs=_check_case, grad_names=("out", "dq", "dk", "dv", "dlam")))


@dataclass(frozen=True)
class DiffOptions:
    """V1's ``ModelConfig.attn_options``, which the types on V1's parameters (DINT, GDA, Shared DIFF,
    diff_distance) take too; the defaults are the paper's.

    ``lambda_init``: None is the paper's 0.8 − 0.6·exp(−0.3·depth); a number in [0, 1) is that constant.
    ``subln``: the per-head RMSNorm over 2d and its (1 − λ_init) factor; False drops both, so a head's output goes
    to the out-projection as it is (an exact conversion needs this: the norm is not an identity).
    ``lambda_std``: the λ vectors' init, N(0, lambda_std²).
    ``dual_lambda`` (timm's ``layers/diff_attention.py``, off by default): λ = exp(λa) − exp(λb) + λ_init from two
    learnable scalars (``lambda_a``, ``lambda_b``, initialised to 0, so λ starts at λ_init), instead of the
    paper's vectors λq1, λk1, λq2, λk2 ∈ R^d. ``qk_norm`` (timm's, off): RMSNorm (learnable gain, shared by the
    heads) over each d-wide Q and K sub-head, before RoPE.

    The first three were ``ModelConfig`` fields once: an older config's top-level ``lambda_init``, ``subln``,
    ``lambda_std`` (a checkpoint's config.json, a TOML file, ``--model.subln``) is read as these options
    (:func:`diffattn.model.config.migrate_fields`)."""

    lambda_init: float | None = None
    subln: bool = True
    lambda_std: float = 0.1
    dual_lambda: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        lam, std = self.lambda_init, self.lambda_std
        if lam is not None and not 0.0 <= lam < 1.0:
            raise ValueError(f"lambda_init must be in [0, 1) (or None: per depth), got {lam!r}")
        if not (math.isfinite(std) and std >= 0):  # NaN passes every comparison
            raise ValueError(f"lambda_std must be a finite number >= 0, got {std!r}")


def v1_kwargs(cfg: AttentionConfig) -> dict[str, Any]:
    """V1's constructor options from ``cfg``'s typed options (:class:`DiffOptions`), for the types on V1's
    parameters."""
    o = cfg.options
    return dict(lambda_init=o.lambda_init, lambda_std=o.lambda_std, subln=o.subln, dual_lambda=o.dual_lambda,
                qk_norm=o.qk_norm)


@register("diff", label="DIFF", color="#1f77b4")
class MultiheadDiffAttention(Retrofittable, HeadSelection, AttentionBase):
    """Differential attention V1 (Ye et al. 2024), with the official module's parameter names and head layout.

    ``num_heads`` counts diff-heads; each has Q/K sub-heads of width d = embed_dim / (2·num_heads) (or
    ``head_dim``) and a value head of width 2d. λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, one per layer; each
    head's output goes through RMSNorm over 2d (with gain) and × (1 − λ_init) before ``out_proj`` (``subln``;
    without it, straight to ``out_proj``). The buffer ``lambda_scale`` (not saved; 1 by default) multiplies λ:
    a training loop ramps the negative map in with it (``train.lambda_warmup_steps``). A retrofit
    (``retrofit_anneals``) adds s·λ_init instead of λ_init and blends the per-head norm in, (1 − s)·o +
    s·RMSNorm(o)·(1 − λ_init): at s = 0 the exact conversion (λ = 0, no norm), at s = 1 this module as it is.

    ``shared_qk=True`` (the seeds' "Diff_Symmetry"): no ``k_proj``; K1 = Q1 and K2 = Q2 (before RoPE), so both
    logit maps are symmetric (exactly, with RoPE too; see :class:`StandardAttention`). Needs
    num_kv_heads == num_heads.

    ``selected_heads`` (``ModelConfig.diff_heads``; None: all): the heads whose negative map is on, the buffer
    ``head_mask`` m. Head h computes (A1 − m_h·λ·A2)·V and m_h·RMSNorm(o_h)·(1 − λ_init) + (1 − m_h)·o_h, so an
    unselected head is a standard head on its first map (A1·V, no norm); a retrofit anneals the selected heads'
    norm only. A masked layer's λ is per head, so the fused Triton kernel (one λ) leaves it to the SDPA path.

    ``dual_lambda`` and ``qk_norm``: timm's options (:class:`DiffOptions`, ``ModelConfig.attn_options``); V1's
    ``qk_norm`` is the same RMSNorm as the model-wide ``ModelConfig.qk_norm`` (either turns it on). ``heads``: the
    pretrained families' options (:class:`~diffattn.attention.base.HeadOptions`), as every type takes them.
    """

    functional_ops = (diff_attention, diff_attention_ref, lambda_init_fn)
    fast_op, ref_op = staticmethod(diff_attention), staticmethod(diff_attention_ref)

    head_split = 2
    baseline = "standard"
    supports_shared_qk = True
    kernel_family = "diff"
    Options = DiffOptions
    retrofit_anneals = "λ_init from 0 to its target, the per-head norm from the identity to RMSNorm × (1 − λ_init)"
    retrofit_probe = "subln"
    selects_heads = True

    @classmethod
    def core_flops_per_token(cls, cfg: AttentionConfig, context: float) -> float:
        """V1's layout: 2h Q/K sub-heads of width d (QKᵀ: 2h·d multiply-adds per key) and two maps times V of
        width 2d (P·V: 2h·2d); the subclasses on V1's parameters share it (DINT's G·V is a running mean of A1·V,
        O(T·d): left out). A head mask (``diff_heads``) changes nothing here: an unselected head still computes
        its second map (λ_h = 0 drops it after the one attention call), and this counts what runs."""
        h, d = cfg.n_heads, cfg.qk_head_dim
        return 2 * (2 * h * d + 2 * h * 2 * d) * context

    def __init__(self, embed_dim: int, num_heads: int, depth: int, num_kv_heads: int | None = None,
                 lambda_init: float | None = None, lambda_std: float = 0.1, norm_eps: float = 1e-5,
                 bias: bool = False, shared_qk: bool = False, head_dim: int | None = None, subln: bool = True,
                 dual_lambda: bool = False, qk_norm: bool = False, heads: HeadOptions | None = None,
                 selected_heads: list[int] | None = None):
        super().__init__()
        check_positive(embed_dim=embed_dim, num_heads=num_heads)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"depth (the 0-based layer index) must be an int >= 0, got {depth!r}")
        if head_dim is None and embed_dim % (2 * num_heads):
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by 2·num_heads ({2 * num_heads})")
        if num_kv_heads is not None:
            check_positive(num_kv_heads=num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.shared_qk = check_shared_qk(shared_qk, num_heads, self.num_kv_heads)
        self.n_rep = num_heads // self.num_kv_heads
        self.head_dim = head_dim or embed_dim // num_heads // 2
        self.rope_dim = self.head_dim
        self.lambda_init = lambda_init_fn(depth) if lambda_init is None else float(lambda_init)
        inner, kv_inner = 2 * num_heads * self.head_dim, 2 * self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.k_proj = None if shared_qk else nn.Linear(embed_dim, kv_inner, bias=bias)
        self.v_proj = nn.Linear(embed_dim, kv_inner, bias=bias)
        self.out_proj = nn.Linear(inner, embed_dim, bias=out_bias(heads, bias))
        self.lambda_std = lambda_std
        self.dual_lambda = dual_lambda
        if dual_lambda:  # timm: two scalars from 0, so λ starts at λ_init
            self.lambda_a, self.lambda_b = nn.Parameter(torch.zeros(())), nn.Parameter(torch.zeros(()))
        else:
            for name in LAMBDA_NAMES:
                setattr(self, name, nn.Parameter(torch.randn(self.head_dim) * lambda_std))
        self.init_heads(heads, self.head_dim, shared_qk=shared_qk, qk_norm=qk_norm, norm_eps=norm_eps)
        self.subln = RMSNorm(2 * self.head_dim, eps=norm_eps, elementwise_affine=True) if subln else None
        self.register_buffer("lambda_scale", torch.ones(()), persistent=False)
        self.init_retrofit()
        self.init_head_mask(selected_heads, num_heads)

    def reset_parameters(self) -> None:
        """The λ vectors ~ N(0, lambda_std) (``dual_lambda``: the two scalars = 0) and ``lambda_scale`` = 1, in
        place, drawing as the constructor does (the projections and the norms reset themselves)."""
        if self.dual_lambda:
            self.lambda_a.zero_()
            self.lambda_b.zero_()
        else:
            for name in LAMBDA_NAMES:
                getattr(self, name).normal_().mul_(self.lambda_std)  # = randn(d) * std, bit for bit
        self.lambda_scale.fill_(1.0)
        self.retrofit_s.fill_(1.0)
        self.reset_head_mask()

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        return cls(cfg.d_model, cfg.n_heads, layer_idx, cfg.n_kv_heads, norm_eps=cfg.norm_eps,
                   bias=cfg.attn_qkv_bias, shared_qk=cfg.shared_qk, head_dim=cfg.head_dim, **v1_kwargs(cfg),
                   heads=head_options(cfg, layer_idx), selected_heads=cfg.layer_heads(layer_idx))

    @classmethod
    def retrofit_target(cls, cfg: AttentionConfig, lambda_init: float | None) -> AttentionConfig:
        """The exact conversion's config with the per-head norm and the target λ_init (None: per depth)."""
        return with_options(cfg, subln=True, lambda_init=lambda_init)

    @torch.no_grad()
    def calibrate_retrofit(self, mean_squares):
        """The per-head norm's gain g = RMS(o) / (1 − λ_init), o the conversion's head outputs on the source's
        batches: RMSNorm rescales each head's output to unit RMS, which next to a pretrained model's head outputs
        (often far smaller or larger) would jolt the function as the norm is blended in; with this gain its output
        has their scale (a learnable gain: the plain type's, only started elsewhere than 1)."""
        if self.subln is not None and mean_squares:
            rms = float(torch.stack([m.float() for m in mean_squares]).mean().sqrt())
            self.subln.weight.fill_(rms / (1 - self.lambda_init))

    def cache_shapes(self, batch_size, max_seq_len):
        return ((batch_size, 2 * self.num_kv_heads, max_seq_len, self.head_dim),
                (batch_size, self.num_kv_heads, max_seq_len, 2 * self.head_dim))

    def lambda_full(self) -> Tensor:
        """The layer's scalar λ (fp32), times ``lambda_scale``; a retrofit in progress adds s·λ_init."""
        init = self.retrofit_s * self.lambda_init if self.retrofitting else None
        return diff_lambda(self, init) * upcast(self.lambda_scale)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, E) -> Q sub-heads (B, 2h, T, d), K sub-heads (B, 2hkv, T, d) (before RoPE and QK-norm),
        V (B, hkv, T, 2d); subclasses swap the projections."""
        q = split_heads(self.q_proj(x), 2 * self.num_heads)
        k = shared_qk_keys(q, self.k_proj, x, 2 * self.num_kv_heads)
        return q, k, split_heads(self.v_proj(x), self.num_kv_heads)

    def attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, margs: MaskArgs) -> Tensor:
        """The core with λ (per head under a head mask), then each head's RMSNorm × (1 − λ_init) (``subln``): as
        one compiled region where :meth:`fuses_epilogue` says so."""
        lam, on = self.lambda_full().to(q.dtype), self.head_mask
        if on is not None:  # λ_h = m_h·λ: an unselected head computes A1·V, a standard head on its first map
            lam = lam * on.to(lam.dtype).view(-1, 1, 1)
        if self.fuses_epilogue(q, on):
            o1, o2 = diff_attention_parts(q, k, v, **margs)
            gain = self.subln.weight * (1 - self.lambda_init)
            return fused_diff_epilogue(o1, o2, lam, gain, self.subln.eps)
        out = self.core(q, k, v, margs, lam)
        if self.subln is not None:
            normed = self.annealed(out, self.subln(out, scale=1 - self.lambda_init))
            out = normed if on is None else torch.where(on.bool().view(-1, 1, 1), normed, out)
        return out

    def extra_maps(self, lam: Tensor, *args: object) -> dict[str, Tensor]:
        """λ as the op took it (per head under a head mask), and the mask itself ("heads")."""
        heads = {} if getattr(self, "head_mask", None) is None else {"heads": self.head_mask.bool()}
        return {"lambda": lam.detach(), **heads}

    def fuses_epilogue(self, q: Tensor, head_mask: Tensor | None) -> bool:
        """Whether this call runs λ, the subtraction, the per-head norm and the scale as one compiled region
        (:func:`~diffattn.ops.norm.fused_diff_epilogue`): where the dispatch table's row (or DIFFATTN_EPILOGUE)
        says so, on V1's own core (the subclasses that swap it combine the maps otherwise), with the norm, and
        with nothing that changes the epilogue (a head mask, a retrofit in progress, the reference path)."""
        if (self.subln is None or head_mask is not None or self.retrofitting or self.reference_path
                or self.fast_op is not diff_attention or type(self).core is not AttentionBase.core
                or self.subln.unit_offset):
            return False
        if _epilogue_choice(str(q.device), q.dtype) != "compiled":
            return False
        return backends.choose("diff", q.device, q.dtype) != "triton"
