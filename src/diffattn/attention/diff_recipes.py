"""Differential attention V1's recipes for other tools (:mod:`.diff` is the maths): its conversion from a standard
model (``diffattn convert --to diff``) and its vLLM layer. The types built on V1's parameters reuse them (GDA,
DINT, Shared DIFF: their own files)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from diffattn.attention.base import AttentionConfig, with_options
from diffattn.attention.conversion import (
    Conversion,
    Getter,
    SourceLayer,
    carried,
    head_dim_field,
    projection,
    repeat_heads,
)
from diffattn.attention.diff import LAMBDA_NAMES, MultiheadDiffAttention, diff_lambda, lambda_init_fn
from diffattn.attention.registry import converts, serves
from diffattn.attention.serving import AttentionShape, ServedLayer, VllmParts, head_scale, window_extra
from diffattn.ops.norm import RMSNorm

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


@converts(MultiheadDiffAttention)
class DiffConversion(Conversion):
    """``--to diff --init exact`` (function-preserving). One diff-head per source head, Q/K sub-heads of width d
    (``ModelConfig.head_dim = d``; the derived width would be d/2), value heads of width 2d:

    * Q1_i = Q2_i = q_i, K1_g = K2_g = k_g, so A1_i = A2_i = A_i. The official GQA pairing (diff-head i reads KV
      diff-head i // n_rep) is the source's grouping, so GQA needs nothing else.
    * λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init with λ_init = 0 (``lambda_init = 0.0``), λq1 = λq2 = u,
      λk1 = λk2 = w, u and w drawn like a fresh model's (N(0, lambda_std²)): the two exponentials are the same
      floating-point computation, so λ = 0 exactly. The head computes (A1 − λA2)·V = (1 − λ)·A·V = A·V.
      u, w ≠ 0 is what keeps λ off a saddle: ∂λ/∂λq1 = w·e^{u·w} = −∂λ/∂λq2 (and likewise for k) are non-zero,
      whereas u = w = 0 would give every λ vector a zero gradient forever.
    * No per-head norm (``subln = False``): RMSNorm over 2d is not an identity (it rescales each token), so the
      only exact choice is to drop it (and its (1 − λ_init) factor, which is 1 here anyway).
    * V_g = [v_g ; v_g] (both halves of the 2d-wide value head), and diff-head i's 2d out-projection columns
      are [½W_o,i + Δ_i | ½W_o,i − Δ_i]. Since both halves of the head output equal A_i v_g,
      (½W_o,i + Δ_i)·A v + (½W_o,i − Δ_i)·A v = W_o,i·A v: exact (up to rounding) for any Δ_i.
      Δ breaks a symmetry: with Δ = 0 the two value halves get identical gradients (both read ½W_o,i) and the
      two column halves get identical gradients (both see the same head output), so under AdamW they would stay
      equal forever and the doubled value width would be wasted; Δ ≠ 0 gives the halves different gradients
      from the first step. Δ ~ N(0, (s·std(W_o))²) with s = ``break_symmetry`` (default 0.5; 0 reproduces the
      tie).
    * Gradients at the start: Q2/K2 rows get ∂L/∂(Q2,K2) ∝ λ = 0 at step 0, but the λ vectors do get a
      gradient, so after one optimizer step λ ≠ 0 and every tensor conversion created has a non-zero gradient.

    ``--init split`` (parameter-matched, NOT function-preserving). The paper's parameter-matched layout: source
    heads 2j and 2j+1 become diff-head j (Q1 = q_2j, Q2 = q_2j+1, K1/K2 = k_2g/k_2g+1, V = [v_2g ; v_2g+1], out
    columns [W_o,2j | W_o,2j+1]). In our layout that is every projection copied as it is, with h/2 diff-heads at
    the source width (so hkv must be even), the paper's λ_init schedule, fresh λ vectors and the per-head norm
    (gain 1). Parameters equal the source's plus 6d per layer (λ vectors and norm gains). Each head now mixes two
    maps into one value head and subtracts λ·A2, so the function changes: a starting point for fine-tuning, not
    a converted model.

    The model's ``lambda_scale`` buffers (``train.lambda_warmup_steps``) ramp the negative map in from 0:
    λ_eff = s·λ; the converted model is exact at every s (λ = 0), the ramp only slows λ's growth at first."""

    inits = ("exact", "split")

    @classmethod
    def config(cls, cfg: AttentionConfig, to: str, init: str) -> AttentionConfig:
        d, h, kv = cfg.qk_head_dim, cfg.n_heads, cfg.kv_heads
        if init == "exact":
            return with_options(cfg.replace(attention=to, head_dim=d), subln=False, lambda_init=0.0)
        if h % 2 or kv % 2:
            raise ValueError(f"convert: --init split pairs heads, so n_heads ({h}) and the KV heads ({kv}) must be "
                             "even")
        split = cfg.replace(attention=to, n_heads=h // 2, n_kv_heads=None if kv == h else kv // 2,
                            head_dim=head_dim_field(cfg))
        return with_options(split, subln=True, lambda_init=None)

    @classmethod
    def queries(cls, wq: Tensor, new: nn.Module) -> Tensor:
        """The query rows of the exact recipe: each source head as both sub-heads, [q_i; q_i]."""
        return repeat_heads(wq, new.head_dim)

    @classmethod
    def weights(cls, src: SourceLayer, new: nn.Module, *, init: str, gen: torch.Generator,
                break_symmetry: float) -> dict[str, Tensor]:
        if init == "split":  # the official layout already pairs adjacent heads: copy, keep fresh λ and norm
            fresh = {n: t for n, t in new.state_dict().items() if n.split(".")[0] in ("subln", *LAMBDA_NAMES)}
            return {**src, **fresh}
        wo = src["out_proj.weight"]
        d, e = new.head_dim, wo.shape[0]
        half = 0.5 * wo.reshape(e, -1, 1, d)
        delta = torch.randn(half.shape, generator=gen) * (break_symmetry * float(wo.std()))
        u, w = new.lambda_q1.detach(), new.lambda_k1.detach()
        return {**projection(src, "q_proj", lambda rows: cls.queries(rows, new)),
                **projection(src, "k_proj", lambda rows: repeat_heads(rows, d)),
                **projection(src, "v_proj", lambda rows: repeat_heads(rows, d)),
                **carried(src, torch.cat((half + delta, half - delta), dim=2).reshape(e, -1)),
                "lambda_q1": u, "lambda_q2": u.clone(), "lambda_k1": w, "lambda_k2": w.clone()}

    @classmethod
    def created(cls, attn: nn.Module, get: Getter) -> dict[str, Tensor]:
        """The Q1/Q2 and K1/K2 sub-head rows, both value halves, both out-projection column halves, the λ vectors
        (and the norm gain when ``subln``)."""
        d, e = attn.head_dim, attn.out_proj.out_features
        q, k = get(attn.q_proj.weight).view(-1, 2, d, e), get(attn.k_proj.weight).view(-1, 2, d, e)
        return {"q1": q[:, 0], "q2": q[:, 1], "k1": k[:, 0], "k2": k[:, 1], **cls.shared_parts(attn, get)}

    @classmethod
    def shared_parts(cls, attn: nn.Module, get: Getter) -> dict[str, Tensor]:
        """What V1 and the recipes built on it (GDA) create alike: value halves, out halves, λ vectors, norm."""
        d, e = attn.head_dim, attn.out_proj.out_features
        v, o = get(attn.v_proj.weight).view(-1, 2, d, e), get(attn.out_proj.weight).view(e, -1, 2, d)
        out = {"v_half1": v[:, 0], "v_half2": v[:, 1], "out_half1": o[:, :, 0], "out_half2": o[:, :, 1]}
        out.update({n: get(getattr(attn, n)) for n in LAMBDA_NAMES})
        if attn.subln is not None:
            out["subln"] = get(attn.subln.weight)
        return out


@serves(MultiheadDiffAttention)
class DiffServed(ServedLayer):
    """``diff`` (V1). QKVParallelLinear at head size 2d with h diff-heads and hkv KV heads: diff-head i's query
    is [Q1_i | Q2_i], KV head g's key [K1_g | K2_g] and value V_g (the official layout's rows, as they are).
    RoPE (and ``qk_norm``) act on each d-wide sub-head; then each diff-head becomes the two query heads
    [Q1 | 0], [0 | Q2] of one ``Attention`` call at scale 1/√d over hkv KV heads of width 2d, whose outputs are
    A1·V and A2·V. Then (A1 − λA2)·V, the per-head RMSNorm × (1 − λ_init), out_proj.

    KV cache: hkv KV heads of width 2d, each key [K1 | K2] (both maps' keys side by side, RoPE applied to each
    half) and one value V of width 2d; [Q1|0]·[K1|K2] = Q1·K1 and [0|Q2]·[K1|K2] = Q2·K2, and both maps read one
    V. 4·hkv·d values: the floor (K1, K2 of width d and V of width 2d per KV diff-head, the matched baseline's
    bytes) with stock kernels on CPU and CUDA alike; vLLM's ``head_size_v`` is not needed (and the CPU backend
    has none): keys and values are equally wide here. The zeros cost 2x the QK multiply-adds, not bytes.

    ``signal_per_noise`` r generalises the query side to GDA's groups (V1 is r = 1): the 2h sub-heads come in
    groups of r signal heads, padded [Q | 0], and one noise head, [0 | Q]."""

    def __init__(self, cfg: AttentionConfig, layer: int, parts: VllmParts):
        d, h = cfg.qk_head_dim, cfg.n_heads
        r = self.signal_per_noise(cfg)
        super().__init__(cfg, parts, head_size=2 * d, q_heads=h, out_width=2 * h * r // (r + 1) * 2 * d)
        self.d, self.ratio = d, r
        opts = cfg.options
        self.lambda_init = lambda_init_fn(layer) if opts.lambda_init is None else float(opts.lambda_init)
        self.dual_lambda = opts.dual_lambda
        names = ("lambda_a", "lambda_b") if opts.dual_lambda else LAMBDA_NAMES
        for name in names:  # replicated on every rank: λ is one scalar per layer
            setattr(self, name, nn.Parameter(torch.zeros(() if opts.dual_lambda else (d,)), requires_grad=False))
        self.init_qk_norm(cfg, parts, d, own=opts.qk_norm)
        self.subln = RMSNorm(2 * d, eps=cfg.norm_eps) if opts.subln else None
        self.rotary = parts.rope(cfg, d, layer)
        # pads each signal sub-head to [Q | 0], the noise sub-head to [0 | Q]: (r + 1, 2 halves), exact (x·1, x·0)
        self.register_buffer("pad", torch.eye(2)[[0] * r + [1]][:, :, None], persistent=False)
        self.attn = parts.attention(2 * self.q_heads, 2 * d, head_scale(cfg, d), self.kv_heads,
                                    **window_extra(cfg, layer))
        self.init_head_mask(cfg, layer, parts, self.q_heads)

    @classmethod
    def shape(cls, cfg: AttentionConfig) -> AttentionShape:
        """2h query sub-heads (GDA: n_s + n_n), padded to 2d, over hkv KV heads of width 2d."""
        return AttentionShape(((2 * cfg.n_heads, cfg.kv_heads, 2 * cfg.qk_head_dim),))

    @staticmethod
    def signal_per_noise(cfg: AttentionConfig) -> int:
        """r: signal sub-heads per noise sub-head (V1: 1)."""
        return 1

    def maps(self, positions: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (T, E) -> (A1·V (T, groups, r, 2d), A2·V (T, groups, 1, 2d)) on this rank's groups (V1: diff-heads)."""
        t, d = x.shape[0], self.d
        q, k, v = self.qkv(x)
        q, k = self.norm_qk(q, k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        group = self.ratio + 1
        q = (q.view(t, -1, group, 1, d) * self.pad.to(q.dtype)).view(t, -1)
        o = self.attn(q, k, v).view(t, -1, group, 2 * d)
        return o[:, :, :self.ratio], o[:, :, self.ratio:]

    def head_lambda(self, dtype: torch.dtype) -> Tensor:
        """λ as it multiplies A2·V (T, groups, 1, 2d) on this rank: the layer's scalar, or with a head mask m
        (``diff_heads``) λ_h = m_h·λ, shaped (groups, 1, 1)."""
        lam = diff_lambda(self).to(dtype)
        return lam if self.head_mask is None else lam * self.head_mask.to(dtype)[:, None, None]

    def combine(self, out: Tensor) -> Tensor:
        """(T, groups, r, 2d) head outputs -> the per-head norm × (1 − λ_init) (with ``subln``; with a head mask
        only on the heads it keeps differential, the others pass as they are: standard heads), out_proj."""
        if self.subln is not None:
            normed = self.subln(out, scale=1 - self.lambda_init)
            out = normed if self.head_mask is None else torch.where(self.head_mask.bool()[:, None, None], normed, out)
        return self.out(out)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        o1, o2 = self.maps(positions, x)
        return self.combine(o1 - self.head_lambda(o1.dtype) * o2)
