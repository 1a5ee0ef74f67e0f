"""ModelConfig, the shape and options of a model, as plain data checked on construction, and its
parameter-matched baseline. The attention types and their properties come from the registry
(:mod:`diffattn.attention.registry`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from diffattn.attention.registry import ATTENTION, build_attention, carry_options, check_options


@dataclass
class ModelConfig:
    """Shape and options of a model. ``n_heads`` counts the attention module's heads: for ``diff`` these are
    diff-heads (Q/K sub-heads of width d_model / (2·n_heads), V of width 2d); for ``diff_v2``, output heads
    (each with two query heads of width d_model / n_heads); otherwise ordinary heads.

    ``head_dim``: the Q/K (sub-)head width d when it is not the one derived from d_model above (e.g. a model
    converted from a Llama keeps the source's head width, see :mod:`diffattn.interop.convert`); the projections are
    then sized from it (``diff``: Q 2h·d, K 2hkv·d, V hkv·2d, output h·2d -> d_model). None: derived.
    ``subln``: V1's per-head RMSNorm over 2d and its (1 − λ_init) factor (the paper's). False drops both, so a
    head's output goes to the out-projection as it is; conversion needs this (the norm is not an identity).
    ``lambda_init``: None is the paper's 0.8 − 0.6·exp(−0.3·depth); a number in [0, 1) is that constant.
    ``attn_options``: the attention type's own options (its ``Options`` dataclass, declared in its file; e.g.
    V1's ``qk_norm``, DA's ``distance_w_init``), checked on construction; ``options`` is the typed view, with the
    defaults filled in. Options another type declares are accepted and unused (one template, several arms).
    ``rope``: a type that carries its own position signal (ALiBi) takes none; its config reads ``rope="none"``.
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    attention: str = "diff"
    max_seq_len: int = 512
    rope: str = "interleaved"  # "interleaved" (official DIFF code), "neox" (Llama), or "none"
    rope_theta: float = 10000.0
    ffn_hidden: int | None = None  # default: 8/3·d_model rounded up to a multiple of 64
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    dropout: float = 0.0
    bias: bool = False
    lambda_init: float | None = None  # None: 0.8 − 0.6·exp(−0.3·depth); a number: that constant
    head_dim: int | None = None  # Q/K (sub-)head width; None: d_model / (head_split · n_heads)
    subln: bool = True  # V1 per-head RMSNorm (× (1 − λ_init)); False: none
    lambda_std: float = 0.1
    init_std: float = 0.02
    causal: bool = True
    # K from the query projection (the seeds' "Diff_Symmetry"): no k_proj, a symmetric logit map. Defined for
    # standard, diff, distance and diff_distance with n_kv_heads == n_heads; not for diff_v2.
    shared_qk: bool = False
    # The attention type's own options (see the class docstring); only what was set, so configs round-trip.
    attn_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        need(self.attention in ATTENTION, f"unknown attention {self.attention!r}; registered: {sorted(ATTENTION)}")
        need(self.rope in ("interleaved", "neox", "none"), f"rope must be interleaved|neox|none, got {self.rope!r}")
        if not ATTENTION[self.attention].uses_rope:
            self.rope = "none"  # the type's own bias is its position signal (e.g. ALiBi): no RoPE tables either
        try:
            check_options(self.attention, self.attn_options)
        except (TypeError, ValueError) as e:  # a dataclass's own check may raise either
            need(False, f"attn_options: {e}")
        kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
        need(isinstance(kv, int) and kv > 0 and self.n_heads % kv == 0,
             f"n_heads ({self.n_heads}) must be a positive multiple of n_kv_heads ({self.n_kv_heads})")
        split = ATTENTION[self.attention].head_split
        width = split * self.n_heads
        if self.head_dim is None:
            need(self.d_model % width == 0,
                 f"d_model ({self.d_model}) must be divisible by {'2·n_heads' if split == 2 else 'n_heads'}"
                 f" ({width}) for attention {self.attention!r} (or set head_dim)")
        else:
            need(isinstance(self.head_dim, int) and not isinstance(self.head_dim, bool) and self.head_dim > 0,
                 f"head_dim must be a positive int or None, got {self.head_dim!r}")
        if self.rope != "none":
            need(self.qk_head_dim % 2 == 0, f"RoPE needs an even head dim, got {self.qk_head_dim}")
        for name in ("rope_theta", "norm_eps", "init_std", "lambda_std", "dropout"):  # NaN passes every comparison
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                 f"{name} must be a finite number >= 0, got {v!r}")
        need(self.rope == "none" or self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta!r}")
        need(isinstance(self.subln, bool), f"subln must be a bool, got {self.subln!r}")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        need(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        if self.ffn_hidden is not None:
            need(isinstance(self.ffn_hidden, int) and self.ffn_hidden > 0,
                 f"ffn_hidden must be a positive int, got {self.ffn_hidden!r}")
        if self.lambda_init is not None:
            need(0.0 <= self.lambda_init < 1.0, f"lambda_init must be in [0, 1), got {self.lambda_init}")
        need(isinstance(self.shared_qk, bool), f"shared_qk must be true or false, got {self.shared_qk!r}")
        if self.shared_qk:
            need(ATTENTION[self.attention].supports_shared_qk,
                 f"shared_qk is not defined for attention {self.attention!r}; it is for "
                 f"{sorted(n for n, c in ATTENTION.items() if c.supports_shared_qk)}")
            need(kv == self.n_heads, f"shared_qk needs n_kv_heads == n_heads (K = Q per head), got n_heads "
                 f"{self.n_heads} and n_kv_heads {kv}")

    @property
    def options(self) -> Any:
        """The attention type's typed options (an instance of its ``Options``; None when it declares none)."""
        return check_options(self.attention, self.attn_options)

    @property
    def qk_head_dim(self) -> int:
        """The Q/K (sub-)head width: ``head_dim``, or the one derived from d_model."""
        if self.head_dim is not None:
            return self.head_dim
        return self.d_model // (ATTENTION[self.attention].head_split * self.n_heads)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-(8 * self.d_model // 3) // 64) * 64

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def matched_baseline(cfg: ModelConfig) -> ModelConfig:
    """The paper's parameter-matched baseline of a DIFF config: twice the heads at half the head width, so the
    projections are the same size (parameters differ only by DIFF's λ vectors and norm gains, < 0.1%).

    ``diff_v2`` keeps the baseline's head width, so its baseline has the same ``n_heads`` (V2 has the extra
    query projection and W_λ; it is not parameter-matched by design). A type without a baseline is returned as is.
    Every other field carries over, ``shared_qk`` included: a symmetric DIFF model's baseline is a symmetric
    Transformer (both drop their key projection); of ``attn_options``, those the baseline type declares.
    A type whose attention has materially fewer or more parameters than the baseline's (``match_baseline_ffn``,
    e.g. Shared DIFF's shared projections) gets a baseline whose FFN width makes the totals match (to within one
    hidden unit per layer: 3·d_model parameters, see :func:`ffn_width_matching`).
    """
    cls = ATTENTION[cfg.attention]
    if cls.baseline is None:
        return cfg
    k = cls.head_split
    kv = None if cfg.n_kv_heads is None else k * cfg.n_kv_heads
    base = cfg.replace(attention=cls.baseline, n_heads=k * cfg.n_heads, n_kv_heads=kv,
                       attn_options=carry_options(cfg.attn_options, cls.baseline))
    if cls.match_baseline_ffn:
        base = base.replace(ffn_hidden=ffn_width_matching(base, attention_params(cfg) - attention_params(base)))
    return base


def attention_params(cfg: ModelConfig) -> int:
    """The parameters of ``cfg``'s attention modules over all layers (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for i in range(cfg.n_layers) for p in build_attention(cfg, i).parameters())


def ffn_width_matching(cfg: ModelConfig, extra_params: int) -> int:
    """The FFN width that gives ``cfg`` ``extra_params`` more parameters (fewer when negative), to the nearest
    hidden unit: a SwiGLU hidden unit holds 3·d_model weights (+2 biases with ``bias``) in each layer."""
    per_unit = cfg.n_layers * (3 * cfg.d_model + (2 if cfg.bias else 0))
    return max(1, cfg.ffn_dim + round(extra_params / per_unit))
