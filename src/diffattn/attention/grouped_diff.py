"""Grouped Differential Attention (GDA; Lim et al., Motif Technologies, arXiv 2510.06949; Motif 2.6B and 12.7B):
differential attention whose signal and noise maps get unequal numbers of heads. The 2h query sub-heads of V1
(width d) are split r : 1 into n_s = 2h·r/(r+1) signal heads and n_n = 2h/(r+1) noise heads, in groups of r
signal heads and the one noise head they share (as GQA shares a KV head):

    out_i = (softmax(Q1_i K1ᵀ/√d) − λ·softmax(Q2_{⌊i/r⌋} K2ᵀ/√d))·V,   i = 0..n_s−1

Each KV head holds K1, K2 (width d) and one V of width 2d, as V1; signal head i reads KV head i // (n_s/hkv),
noise head m reads KV head m // (n_n/hkv), so a group stays on one KV head (hkv must divide n_n; the default,
n_kv_heads None, is hkv = n_n). λ, the per-head RMSNorm over 2d × (1 − λ_init) and their options are V1's
(the Motif implementation in vLLM keeps all three); W_O maps the n_s signal outputs (2d each) to E. The
query projection's sub-heads come group by group, [S_1 .. S_r, N] per group, so r = 1 is V1 exactly (same
parameters, same state dict, same outputs).

Head counts: ``n_heads`` counts V1's diff-heads h as for ``diff`` (2h sub-heads of width d = E/(2h)), the
paper's fixed attention budget: the same number of maps as V1 at h, split unevenly (vLLM's Motif code likewise
splits a fixed number of query heads into Q1 and Q2 heads). ``gda_ratio`` r defaults to 3, the moderate
ratio the paper found best (3:1 and 4:1 over 1:1 and 5:1). At the study's tiny shape (h = 2, d = 32) that is
3 signal heads and 1 noise head over 1 KV head; W_O then takes 3·2d = 192 inputs, and the attention has
3.8% fewer parameters than standard attention at 4 heads, so the matched baseline's FFN is narrowed to match
(``match_baseline_ffn``) and ``study --variants grouped_diff+matched`` widens GDA's instead.

``convert --to grouped_diff`` is V1's exact recipe with the source heads as signal heads (a GQA source whose KV
heads divide its heads / r; :class:`GroupedDiffConversion`); vLLM serves it on V1's cache
(:class:`GroupedDiffServed`).

``grouped_diff_attention_ref`` materializes both maps (the spec); ``grouped_diff_attention`` is two calls
(signal heads over K1, noise heads over K2, each a GQA call over V of width 2d in V1's core layout: by default Q
and K zero-padded to 2d so CPU SDPA stays fused, as V1's SDPA path), then the difference with each noise output
broadcast to its r signal heads. Shapes and mask conventions: :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.attention.base import AttentionBase, AttentionConfig, check_positive, head_options, with_options
from diffattn.attention.conversion import Getter
from diffattn.attention.diff import DiffOptions, MultiheadDiffAttention, v1_kwargs
from diffattn.attention.diff_recipes import DiffConversion, DiffServed
from diffattn.attention.registry import converts, register, serves
from diffattn.attention.serving import VllmParts, check_split
from diffattn.ops import wide_v
from diffattn.ops.core import ScoreMod, build_mask, check_heads, masked_softmax, repeat_kv
from diffattn.ops.wide_v import attend_wide_v


def group_heads(subheads: int, ratio: int) -> tuple[int, int]:
    """(signal heads, noise heads) of ``subheads`` query sub-heads split ``ratio`` : 1."""
    check_positive(ratio=ratio)
    if subheads % (ratio + 1):
        raise ValueError(f"grouped diff attention splits the {subheads} query sub-heads {ratio}:1 into groups of "
                         f"{ratio + 1}: their number must be a multiple of {ratio + 1}")
    n_noise = subheads // (ratio + 1)
    return subheads - n_noise, n_noise


def split_groups(q: Tensor, ratio: int) -> tuple[Tensor, Tensor]:
    """Query sub-heads (B, n_s + n_n, T, d) in group order [S_1 .. S_r, N] -> signal (B, n_s, T, d), noise
    (B, n_n, T, d)."""
    b, s, t, d = q.shape
    n_s, n_n = group_heads(s, ratio)
    qg = q.view(b, n_n, ratio + 1, t, d)
    return qg[:, :, :ratio].reshape(b, n_s, t, d), qg[:, :, ratio]


def _shapes(q: Tensor, k: Tensor, v: Tensor, ratio: int) -> tuple[int, int, int]:
    """(n_s, n_n, hkv), checking q (B, n_s + n_n, T, d), k (B, 2hkv, T, d), v (B, hkv, T, 2d)."""
    n_s, n_n = group_heads(q.shape[1], ratio)
    hkv = v.shape[1]
    if k.shape[1] != 2 * hkv:
        raise ValueError(f"grouped diff attention wants k (B, 2hkv, T, d) and v (B, hkv, T, 2d); got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    check_heads(n_n, hkv, "grouped diff attention (each group of signal heads and its noise head on one KV head)")
    return n_s, n_n, hkv


def _combine(o1: Tensor, o2: Tensor, lam: Tensor | float, ratio: int) -> Tensor:
    """o1 (B, n_s, ..) − λ·o2 (B, n_n, ..) with noise head m subtracted from signal heads m·r .. m·r + r − 1."""
    b, n_n = o2.shape[:2]
    return (o1.view(b, n_n, ratio, *o1.shape[2:]) - lam * o2[:, :, None]).view(o1.shape)


def grouped_diff_attention_ref(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, ratio: int, *,
                               causal: bool = True, attn_mask: Tensor | None = None, offset: int | Tensor = 0,
                               scale: float | None = None, score_mod: ScoreMod | None = None,
                               return_maps: bool = False):
    """Grouped differential attention, materialized (module docstring).

    q: (B, n_s + n_n, Tq, d) in group order; k: (B, 2hkv, Tk, d) (K1, K2 of KV head g at 2g, 2g+1); v: (B, hkv,
    Tk, 2d); lam: scalar; ratio r = n_s / n_n. Returns (B, n_s, Tq, 2d) (before the per-head norm), plus
    {"logits1", "logits2", "probs1" (signal), "probs2" (noise), "attn" (each signal head's A1 − λ·A2)} when
    asked.
    """
    n_s, n_n, hkv = _shapes(q, k, v, ratio)
    qs, qn = split_groups(q, ratio)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = build_mask(q.shape[-2], k.shape[-2], causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    logits = [(x @ repeat_kv(k[:, s::2], n // hkv).transpose(-1, -2)) * scale
              for s, x, n in ((0, qs, n_s), (1, qn, n_n))]
    if score_mod is not None:
        logits = [score_mod(x) for x in logits]
    probs = [masked_softmax(x, mask) for x in logits]
    attn = _combine(probs[0], probs[1], lam, ratio)
    out = attn @ repeat_kv(v, n_s // hkv)
    if not return_maps:
        return out
    return out, {"logits1": logits[0], "logits2": logits[1], "probs1": probs[0], "probs2": probs[1], "attn": attn}


def grouped_diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, ratio: int, *,
                           causal: bool = True, attn_mask: Tensor | None = None, offset: int | Tensor = 0,
                           scale: float | None = None, backend: str = "auto") -> Tensor:
    """Fast grouped differential attention: two calls in V1's core layout (:func:`~diffattn.ops.wide_v.v1_layout`:
    the dispatch table's pick under ``backend="auto"``; Triton's kernel is V1's alone, so it means the padded SDPA
    call here), O(T) memory (module docstring). Shapes as :func:`grouped_diff_attention_ref`."""
    _shapes(q, k, v, ratio)
    layout = wide_v.v1_layout(backend, q, k, v, attn_mask, offset)
    kw = dict(causal=causal, offset=offset, attn_mask=attn_mask, scale=q.shape[-1] ** -0.5 if scale is None else scale)
    o1, o2 = (attend_wide_v(x, k[:, s::2], v, layout=layout, **kw) for s, x in enumerate(split_groups(q, ratio)))
    return _combine(o1, o2, lam, ratio)


@dataclass(frozen=True)
class GroupedDiffOptions(DiffOptions):
    """GDA's ``ModelConfig.attn_options``: V1's (:class:`~diffattn.attention.diff.DiffOptions`) and ``gda_ratio``,
    signal heads per noise head (default 3; 1 is V1)."""

    gda_ratio: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.gda_ratio, bool) or not isinstance(self.gda_ratio, int) or self.gda_ratio < 1:
            raise ValueError(f"gda_ratio must be a positive int, got {self.gda_ratio!r}")


@register("grouped_diff", label="GDA", color="#aec7e8")
class GroupedDiffAttention(MultiheadDiffAttention):
    """Grouped differential attention (Lim et al. 2025) on V1's parameters, except W_O: ``out_proj`` maps the
    n_s signal heads' 2d outputs to E (module docstring). ``num_kv_heads`` None: n_n KV heads (one per noise
    head); it must divide n_n. ``shared_qk`` is not defined (signal and noise heads read different keys of a
    shared KV head). Maps recorded by ``capture``: logits1, logits2, probs1, probs2, attn, lambda."""

    fast_op, ref_op = staticmethod(grouped_diff_attention), staticmethod(grouped_diff_attention_ref)
    selects_heads = False  # V1's head mask (diff_heads) is V1's own forward; this type's op takes none

    supports_shared_qk = False
    kernel_family = "diff"  # V1's core layouts (its Triton kernel, V1's alone, means the padded SDPA call here)
    Options = GroupedDiffOptions
    match_baseline_ffn = True
    unsupported = {"export": "transformers has no grouped differential attention model"}

    def __init__(self, embed_dim: int, num_heads: int, depth: int, num_kv_heads: int | None = None, ratio: int = 3,
                 **v1):
        check_positive(num_heads=num_heads)
        n_signal, n_noise = group_heads(2 * num_heads, ratio)
        kv = n_noise if num_kv_heads is None else num_kv_heads
        check_positive(num_kv_heads=kv)
        check_heads(n_noise, kv, "grouped diff attention (the KV heads must divide the noise heads)")
        if v1.get("shared_qk"):
            raise ValueError("grouped diff attention does not define shared_qk")
        super().__init__(embed_dim, num_heads, depth, kv, **v1)
        self.ratio, self.n_signal, self.n_noise = ratio, n_signal, n_noise
        self.out_proj = nn.Linear(2 * n_signal * self.head_dim, embed_dim, bias=self.out_proj.bias is not None)

    def reset_subtree(self) -> None:
        """Initialise in place as the constructor did, drawing the same random numbers in the same order (see
        :func:`diffattn.model.init.replay_init`): V1's constructor first, whose out-projection (V1's shape) this
        one replaced (drawn again here and dropped), then this one's own."""
        e, bias = self.v_proj.in_features, self.out_proj.bias is not None
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.reset_parameters()
        nn.Linear(2 * self.num_heads * self.head_dim, e, bias=bias, device="cpu")  # V1's out_proj
        super().reset_parameters()  # λ
        for norm in (self.q_norm, self.k_norm, self.subln):
            if norm is not None:
                norm.reset_parameters()
        self.out_proj.reset_parameters()

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        o = cfg.options
        return cls(cfg.d_model, cfg.n_heads, layer_idx, cfg.n_kv_heads, ratio=o.gda_ratio, norm_eps=cfg.norm_eps,
                   bias=cfg.attn_qkv_bias, head_dim=cfg.head_dim, **v1_kwargs(cfg), heads=head_options(cfg, layer_idx))

    def op_params(self) -> tuple[int]:
        return (self.ratio,)

    @classmethod
    def core_flops_per_token(cls, cfg: AttentionConfig, context: float) -> float:
        """V1's: 2h maps (n_s + n_n), each QKᵀ over d and P·V over 2d."""
        h, d = cfg.n_heads, cfg.qk_head_dim
        return 2 * (2 * h * d + 2 * h * 2 * d) * context


@converts(GroupedDiffAttention)
class GroupedDiffConversion(DiffConversion):
    """``--to grouped_diff --init exact`` (GDA at its default ratio r = 3, function-preserving): V1's recipe
    (:class:`~diffattn.attention.diff_recipes.DiffConversion`) with the source's H heads as the signal heads and,
    per group of r, a copy of the group's first head as its noise head (the group reads the source head's KV
    head, so the source's KV heads must divide the H/r noise heads: a GQA source, r dividing H); λ = 0 exactly,
    no per-head norm, V = [v; v], out columns [½W_o,i ± Δ_i] as V1's. No ``--init split`` (GDA is not
    parameter-matched by design)."""

    inits = ("exact",)

    @classmethod
    def config(cls, cfg: AttentionConfig, to: str, init: str) -> AttentionConfig:
        r = GroupedDiffOptions().gda_ratio
        h, kv = cfg.n_heads, cfg.kv_heads
        if h % r or (h // r) % kv:
            raise ValueError(f"convert: --to {to} turns the {h} source heads into signal heads with one noise head "
                             f"per {r}, on the source's KV heads: it needs {r} to divide the heads and the KV heads "
                             f"({kv}) to divide the {h / r:g} noise heads")
        return with_options(cfg.replace(attention=to, n_heads=(h + h // r) // 2, n_kv_heads=kv,
                                         head_dim=cfg.qk_head_dim), subln=False, lambda_init=0.0)

    @classmethod
    def queries(cls, wq: Tensor, new: nn.Module) -> Tensor:
        """Source query rows (H·d, E) in GDA's group order: per group, its r source heads, then a copy of the
        first as the noise head ((H + H/r)·d, E)."""
        heads = wq.reshape(-1, new.ratio, new.head_dim, wq.shape[1])
        return torch.cat((heads, heads[:, :1]), dim=1).reshape(-1, wq.shape[1])

    @classmethod
    def created(cls, attn: nn.Module, get: Getter) -> dict[str, Tensor]:
        d, e = attn.head_dim, attn.out_proj.out_features
        q = get(attn.q_proj.weight).view(-1, attn.ratio + 1, d, e)
        k = get(attn.k_proj.weight).view(-1, 2, d, e)
        return {"q_signal": q[:, :attn.ratio], "q_noise": q[:, attn.ratio], "k1": k[:, 0], "k2": k[:, 1],
                **cls.shared_parts(attn, get)}


@serves(GroupedDiffAttention)
class GroupedDiffServed(DiffServed):
    """V1's layer with r = ``gda_ratio`` signal heads per noise head; out_proj takes the n_s signal heads. Its 2h
    query sub-heads come group by group, r signal heads and the noise head they share, a group on one KV head:
    signal heads become [Q1 | 0], noise heads [0 | Q2], in that order, so GQA's contiguous head-to-KV-head
    mapping is GDA's; each noise output is then subtracted from its group's r signal outputs (the only thing
    repeated, in registers, not in the cache). KV cache: V1's, 4·hkv·d values with hkv KV heads (n_n by
    default): the floor. Tensor parallelism must keep whole groups on a rank (it divides the noise heads)."""

    def __init__(self, cfg: AttentionConfig, layer: int, parts: VllmParts):
        check_split("grouped_diff noise heads", 2 * cfg.n_heads // (cfg.options.gda_ratio + 1), parts.tp_size)
        super().__init__(cfg, layer, parts)

    @staticmethod
    def signal_per_noise(cfg: AttentionConfig) -> int:
        return cfg.options.gda_ratio

    @classmethod
    def config(cls, cfg: AttentionConfig) -> AttentionConfig:
        """V1's served config, with GDA's default KV heads (one per noise head) written out."""
        served = super().config(cfg)
        if cfg.n_kv_heads is None:
            served = served.replace(n_kv_heads=group_heads(2 * cfg.n_heads, served.options.gda_ratio)[1])
        return served
