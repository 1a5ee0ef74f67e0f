"""Building blocks: RMSNorm, RoPE, SwiGLU, a static KV cache, and the attention modules behind one registry.

An attention module maps ``x: (B, T, E)`` to ``(B, T, E)``. It runs the fast functional op unless an
evaluation probe asks for the attention maps (``capture``) or rewrites the logits (``score_mod``); then it runs
the materialized reference op. A new variant is one functional op + one module here + one ``@register``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from diffattn.attention import functional as AF

if TYPE_CHECKING:
    from diffattn.model.transformer import ModelConfig

RopeFn = Callable[[Tensor], Tensor]


class RMSNorm(nn.Module):
    """x / rms(x) · gain, computed in fp32 (as the official code and HF Llama do)."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """x: (..., dim). ``scale`` multiplies the gain (folding a constant output scale into one pass)."""
        xf = AF.upcast(x)
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if self.weight is None:
            return y * scale if scale != 1.0 else y
        return y * (self.weight * scale if scale != 1.0 else self.weight)


class RotaryEmbedding(nn.Module):
    """RoPE tables for positions 0..max_seq_len-1. ``style``: "interleaved" rotates (x[2i], x[2i+1]) like the
    official DIFF code (GPT-J); "neox" rotates (x[i], x[i+D/2]) like Llama's ``rotate_half``."""

    STYLES = ("interleaved", "neox")

    def __init__(self, dim: int, max_seq_len: int, theta: float = 10000.0, style: str = "interleaved"):
        super().__init__()
        if style not in self.STYLES:
            raise ValueError(f"rope style must be one of {self.STYLES}, got {style!r}")
        if dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {dim}")
        self.style = style
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (S, D/2)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, input_pos: Tensor) -> RopeFn:
        """Return a function rotating (B, H, T, D) tensors whose T positions are ``input_pos`` (T,)."""
        freqs, style = torch.complex(self.cos[input_pos], self.sin[input_pos]), self.style
        return lambda x: _rotate(x, freqs, style)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    """Rotate x: (B, H, T, D) by angle tables cos, sin: (T, D/2)."""
    return _rotate(x, torch.complex(cos, sin), style)


def _rotate(x: Tensor, freqs: Tensor, style: str) -> Tensor:
    # A rotation by θ of the pair (a, b) is the complex product (a + ib)·e^{iθ}: one fused multiply, several
    # times faster fwd+bwd in eager on CPU than the real-arithmetic form. Inductor cannot generate code for
    # complex ops, so compiled graphs take the real form, which it fuses.
    if torch.compiler.is_compiling():
        return _rotate_real(x, freqs.real, freqs.imag, style)
    xf = AF.upcast(x)
    if style == "interleaved":
        xc = torch.view_as_complex(xf.reshape(*xf.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    y = torch.complex(x1, x2) * freqs
    return torch.cat((y.real, y.imag), dim=-1).to(x.dtype)


def _rotate_real(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    xf = AF.upcast(x)
    if style == "interleaved":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KVCache(nn.Module):
    """Static, preallocated per-layer cache (gpt-fast style): fixed shapes, so compiled decode never recompiles.

    k: (B, Hk, S, Dk), v: (B, Hv, S, Dv); ``update`` writes the new positions in place and returns the buffers.
    """

    def __init__(self, k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype, device=None):
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if k.shape[0] != self.k.shape[0]:
            raise ValueError(f"batch size {k.shape[0]} does not match the cache's {self.k.shape[0]}")
        self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
        self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
        return self.k, self.v


# --------------------------------------------------------------------------------------------- attention
ATTENTION: dict[str, type[AttentionBase]] = {}


def register(name: str):
    """Class decorator: make an attention module available as ``ModelConfig(attention=name)``."""

    def deco(cls):
        if name in ATTENTION:
            raise ValueError(f"attention type {name!r} is already registered")
        ATTENTION[name] = cls
        cls.kind = name
        return cls

    return deco


def build_attention(cfg: ModelConfig, layer_idx: int) -> AttentionBase:
    if cfg.attention not in ATTENTION:
        raise ValueError(f"unknown attention {cfg.attention!r}; registered: {sorted(ATTENTION)}")
    return ATTENTION[cfg.attention].from_config(cfg, layer_idx)


class AttentionBase(nn.Module):
    """Shared plumbing: the KV cache, masks for cached decoding, and the evaluation probes.

    Subclasses set ``rope_dim`` (the width RoPE rotates), implement ``from_config``, ``cache_shapes`` and
    ``forward``, and call :meth:`kv` and :meth:`mask_args`.
    """

    kind = "base"
    #: d_model / (head_split · n_heads) is the Q/K head width: 2 for V1-style differential attention.
    head_split = 1
    #: Attention type of the parameter-matched baseline (twice the heads when head_split == 2); None: itself.
    baseline: str | None = None
    #: Whether ``shared_qk`` (K from the query projection, a symmetric logit map) is defined for this type.
    supports_shared_qk = False
    rope_dim: int

    def __init__(self):
        super().__init__()
        self.cache: KVCache | None = None
        self.capture: list[dict[str, Tensor]] | None = None  # set to a list to record reference maps
        self.score_mod: AF.ScoreMod | None = None  # rewrites scaled logits (reference path only)
        self.use_reference = False

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_idx: int) -> AttentionBase:
        raise NotImplementedError

    def cache_shapes(self, batch_size: int, max_seq_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype, device=None) -> None:
        self.cache = KVCache(*self.cache_shapes(batch_size, max_seq_len), dtype=dtype, device=device)

    @property
    def reference_path(self) -> bool:
        return self.use_reference or self.capture is not None or self.score_mod is not None

    def record(self, maps: dict[str, Tensor]) -> None:
        if self.capture is not None:
            self.capture.append({k: t.detach() for k, t in maps.items()})

    def kv(self, k: Tensor, v: Tensor, input_pos: Tensor | None) -> tuple[Tensor, Tensor]:
        if self.cache is None:
            return k, v
        if input_pos is None:
            raise ValueError("a KV cache is set up: pass input_pos, the absolute positions of the new tokens")
        return self.cache.update(input_pos, k, v)

    def mask_args(self, causal: bool, attn_mask: Tensor | None, input_pos: Tensor | None, tk: int) -> dict:
        """Keyword arguments for the functional op. With a cache, keys are the whole static buffer: keep slot j
        for the query at absolute position p when j <= p (unwritten slots lie beyond p)."""
        if self.cache is None:
            return {"causal": causal, "attn_mask": attn_mask}
        keep = (torch.arange(tk, device=input_pos.device)[None, :] <= input_pos[:, None])[None, None]
        if attn_mask is not None:
            keep = AF.build_mask(len(input_pos), tk, causal=False, attn_mask=attn_mask) & keep
        # ops that weigh distance need the queries' absolute positions; the others ignore offset here
        return {"causal": False, "attn_mask": keep, "offset": input_pos}


def _heads(x: Tensor, n: int) -> Tensor:
    """(B, T, n·D) -> (B, n, T, D)."""
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)


def _merge(x: Tensor) -> Tensor:
    """(B, H, T, D) -> (B, T, H·D)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def _check_positive(**values) -> None:
    """A clear error for a zero, negative or non-int size (instead of a ZeroDivisionError further on)."""
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def check_shared_qk(shared_qk: bool, num_heads: int, num_kv_heads: int) -> bool:
    """Validate the ``shared_qk`` flag. K = Q needs one key head per query head: under GQA a key head serves
    several query heads, and no single query head's projection makes every map in the group symmetric."""
    if not isinstance(shared_qk, bool):
        raise ValueError(f"shared_qk must be a bool, got {shared_qk!r}")
    if shared_qk and num_kv_heads != num_heads:
        raise ValueError(f"shared_qk needs num_kv_heads == num_heads (K = Q per head); got {num_heads} heads and "
                         f"{num_kv_heads} KV heads")
    return shared_qk


def shared_qk_keys(q: Tensor, k_proj: nn.Linear | None, x: Tensor, n: int) -> Tensor:
    """The key heads (B, n, T, D): the query heads themselves under ``shared_qk`` (``k_proj`` is None), else
    ``k_proj(x)`` split into n heads."""
    return q if k_proj is None else _heads(k_proj(x), n)


@register("standard")
class StandardAttention(AttentionBase):
    """Multi-head (GQA) softmax attention: the baseline.

    ``shared_qk=True`` (the seeds' "Diff_Symmetry"): there is no ``k_proj`` and K = Q (before RoPE), so the
    pre-softmax logit map QQᵀ/√D is symmetric. With RoPE it stays exactly symmetric: query and key i both get
    the rotation R_i, so logit(i, j) = ⟨R_i q_i, R_j q_j⟩ = logit(j, i). Needs num_kv_heads == num_heads.
    """

    supports_shared_qk = True

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, shared_qk: bool = False):
        super().__init__()
        _check_positive(embed_dim=embed_dim, num_heads=num_heads)
        if num_kv_heads is not None:
            _check_positive(num_kv_heads=num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.shared_qk = check_shared_qk(shared_qk, num_heads, self.num_kv_heads)
        self.head_dim = head_dim or embed_dim // num_heads
        self.rope_dim = self.head_dim
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=bias)
        self.k_proj = None if shared_qk else nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias)

    @classmethod
    def from_config(cls, cfg, layer_idx):
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.bias,
                   shared_qk=cfg.shared_qk)

    def cache_shapes(self, batch_size, max_seq_len):
        shape = (batch_size, self.num_kv_heads, max_seq_len, self.head_dim)
        return shape, shape

    def forward(self, x: Tensor, rope: RopeFn | None = None, input_pos: Tensor | None = None,
                attn_mask: Tensor | None = None, causal: bool = True) -> Tensor:
        q = _heads(self.q_proj(x), self.num_heads)
        k = shared_qk_keys(q, self.k_proj, x, self.num_kv_heads)
        v = _heads(self.v_proj(x), self.num_kv_heads)
        if rope is not None:
            q = rope(q)
            k = q if self.shared_qk else rope(k)
        k, v = self.kv(k, v, input_pos)
        return self.out_proj(_merge(self.core(q, k, v, self.mask_args(causal, attn_mask, input_pos, k.shape[2]))))

    def core(self, q: Tensor, k: Tensor, v: Tensor, margs: dict) -> Tensor:
        """(B, H, Tq, D) heads -> (B, H, Tq, D) attention output; subclasses swap the op."""
        if self.reference_path:
            out, maps = AF.attention_ref(q, k, v, score_mod=self.score_mod, return_maps=True, **margs)
            self.record(maps)
            return out
        return AF.attention(q, k, v, **margs)


@register("diff")
class MultiheadDiffAttention(AttentionBase):
    """Differential attention V1 (Ye et al. 2024), with the official module's parameter names and head layout.

    ``num_heads`` counts diff-heads; each has Q/K sub-heads of width d = embed_dim / (2·num_heads) (or
    ``head_dim``) and a value head of width 2d. λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, one per layer; each
    head's output goes through RMSNorm over 2d (with gain) and × (1 − λ_init) before ``out_proj`` (``subln``;
    without it, straight to ``out_proj``). The buffer ``lambda_scale`` (not saved; 1 by default) multiplies λ:
    a training loop ramps the negative map in with it (``train.lambda_warmup_steps``).

    ``shared_qk=True`` (the seeds' "Diff_Symmetry"): no ``k_proj``; K1 = Q1 and K2 = Q2 (before RoPE), so both
    logit maps are symmetric (exactly, with RoPE too; see :class:`StandardAttention`). Needs
    num_kv_heads == num_heads.
    """

    head_split = 2
    baseline = "standard"
    supports_shared_qk = True

    def __init__(self, embed_dim: int, num_heads: int, depth: int, num_kv_heads: int | None = None,
                 lambda_init: float | None = None, lambda_std: float = 0.1, norm_eps: float = 1e-5,
                 bias: bool = False, shared_qk: bool = False, head_dim: int | None = None, subln: bool = True):
        super().__init__()
        _check_positive(embed_dim=embed_dim, num_heads=num_heads)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"depth (the 0-based layer index) must be an int >= 0, got {depth!r}")
        if head_dim is None and embed_dim % (2 * num_heads):
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by 2·num_heads ({2 * num_heads})")
        if num_kv_heads is not None:
            _check_positive(num_kv_heads=num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.shared_qk = check_shared_qk(shared_qk, num_heads, self.num_kv_heads)
        self.n_rep = num_heads // self.num_kv_heads
        self.head_dim = head_dim or embed_dim // num_heads // 2
        self.rope_dim = self.head_dim
        self.lambda_init = AF.lambda_init_fn(depth) if lambda_init is None else float(lambda_init)
        inner, kv_inner = 2 * num_heads * self.head_dim, 2 * self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.k_proj = None if shared_qk else nn.Linear(embed_dim, kv_inner, bias=bias)
        self.v_proj = nn.Linear(embed_dim, kv_inner, bias=bias)
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.randn(self.head_dim) * lambda_std))
        self.subln = RMSNorm(2 * self.head_dim, eps=norm_eps, elementwise_affine=True) if subln else None
        self.register_buffer("lambda_scale", torch.ones(()), persistent=False)

    @classmethod
    def from_config(cls, cfg, layer_idx):
        return cls(cfg.d_model, cfg.n_heads, layer_idx, cfg.n_kv_heads, lambda_init=cfg.lambda_init,
                   lambda_std=cfg.lambda_std, norm_eps=cfg.norm_eps, bias=cfg.bias, shared_qk=cfg.shared_qk,
                   head_dim=cfg.head_dim, subln=cfg.subln)

    def cache_shapes(self, batch_size, max_seq_len):
        return ((batch_size, 2 * self.num_kv_heads, max_seq_len, self.head_dim),
                (batch_size, self.num_kv_heads, max_seq_len, 2 * self.head_dim))

    def lambda_full(self) -> Tensor:
        """The layer's scalar λ (fp32), times ``lambda_scale``."""
        up = AF.upcast
        l1 = torch.exp(torch.sum(up(self.lambda_q1) * up(self.lambda_k1)))
        l2 = torch.exp(torch.sum(up(self.lambda_q2) * up(self.lambda_k2)))
        return (l1 - l2 + self.lambda_init) * up(self.lambda_scale)

    def forward(self, x: Tensor, rope: RopeFn | None = None, input_pos: Tensor | None = None,
                attn_mask: Tensor | None = None, causal: bool = True) -> Tensor:
        q = _heads(self.q_proj(x), 2 * self.num_heads)
        k = shared_qk_keys(q, self.k_proj, x, 2 * self.num_kv_heads)
        v = _heads(self.v_proj(x), self.num_kv_heads)
        if rope is not None:
            q = rope(q)
            k = q if self.shared_qk else rope(k)
        k, v = self.kv(k, v, input_pos)
        margs = self.mask_args(causal, attn_mask, input_pos, k.shape[2])
        lam = self.lambda_full().to(q.dtype)
        out = self.core(q, k, v, lam, margs)
        if self.subln is not None:
            out = self.subln(out, scale=1 - self.lambda_init)
        return self.out_proj(_merge(out))

    def core(self, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, margs: dict) -> Tensor:
        """Sub-heads (B, 2h, Tq, d), (B, 2hkv, Tk, d), values (B, hkv, Tk, 2d) -> (B, h, Tq, 2d); subclasses swap
        the op."""
        if self.reference_path:
            out, maps = AF.diff_attention_ref(q, k, v, lam, score_mod=self.score_mod, return_maps=True, **margs)
            self.record({**maps, "lambda": lam.detach()})
            return out
        return AF.diff_attention(q, k, v, lam, **margs)


@register("diff_v2")
class DiffV2Attention(AttentionBase):
    """Differential attention V2 (unilm, 2026-01): 2h query heads at the baseline head width share the KV heads;
    out_j = attn_{2j} − sigmoid(W_λ x)_j · attn_{2j+1}; no per-head norm, no λ_init. Not parameter-matched by
    design (the extra query heads and W_λ): its baseline is standard attention at the same n_heads. The buffer
    ``lambda_scale`` (not saved; 1 by default) multiplies sigmoid(W_λ x) (``train.lambda_warmup_steps``).

    ``shared_qk`` is not defined here: pair j's two maps read the same key head with different query heads
    (2j, 2j+1), so K = Q_{2j} would make map 2j symmetric and map 2j+1 not, and K = Q for both would make the
    two maps identical (their difference would cancel). ``ModelConfig(shared_qk=True)`` rejects diff_v2."""

    baseline = "standard"
    supports_shared_qk = False

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.head_dim = head_dim or embed_dim // num_heads
        self.rope_dim = self.head_dim
        self.q_proj = nn.Linear(embed_dim, 2 * num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.lambda_proj = nn.Linear(embed_dim, num_heads, bias=False)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias)
        self.register_buffer("lambda_scale", torch.ones(()), persistent=False)

    @classmethod
    def from_config(cls, cfg, layer_idx):
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.bias)

    def cache_shapes(self, batch_size, max_seq_len):
        shape = (batch_size, self.num_kv_heads, max_seq_len, self.head_dim)
        return shape, shape

    def forward(self, x: Tensor, rope: RopeFn | None = None, input_pos: Tensor | None = None,
                attn_mask: Tensor | None = None, causal: bool = True) -> Tensor:
        q = _heads(self.q_proj(x), 2 * self.num_heads)
        k = _heads(self.k_proj(x), self.num_kv_heads)
        v = _heads(self.v_proj(x), self.num_kv_heads)
        lam_logits = self.lambda_proj(x).transpose(1, 2)  # (B, h, T)
        if rope is not None:
            q, k = rope(q), rope(k)
        k, v = self.kv(k, v, input_pos)
        margs = self.mask_args(causal, attn_mask, input_pos, k.shape[2])
        if self.reference_path:
            out, maps = AF.diff_v2_attention_ref(q, k, v, lam_logits, score_mod=self.score_mod, return_maps=True,
                                                 lam_scale=self.lambda_scale, **margs)
            self.record({**maps, "lambda": (torch.sigmoid(lam_logits) * self.lambda_scale).detach()})
        else:
            out = AF.diff_v2_attention(q, k, v, lam_logits, lam_scale=self.lambda_scale, **margs)
        return self.out_proj(_merge(out))


def init_linear_(module: nn.Module, std: float) -> None:
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


def scaled_init_std(base_std: float, n_layers: int) -> float:
    """GPT-2's residual-projection init: std / sqrt(2·n_layers)."""
    return base_std / math.sqrt(2 * n_layers)


# ------------------------------------------------------------------------------- distance-aware attention
#: ``ModelConfig.attn_options`` keys read by the distance-aware modules, with their defaults.
#:  distance_w_init: float a >= 0 -> w spread evenly over the heads from −a (shortest range) to +a (longest
#:      range), or a list with one w per head. Default 0.1: the most local head's f falls to 1/2 at distance
#:      ln 3 / 0.1 ≈ 11 and to ~0 past ~60 tokens, the middle heads start close to distance-agnostic (f ≈ 1),
#:      and the most global head's f rises to its bound 2 past ~40 tokens: a spread of ranges, which the
#:      paper finds heads learn, without any head starting degenerate. The paper publishes no initialisation.
#:  distance_v_init: float or one per head. Default 0: f(x; 0) = 2σ(x), symmetric bounds (0, 2) around
#:      f(0) = 1, with the largest slope (1/2) at x = 0, so w gets a useful gradient from the start.
#:  distance_block: tile size (queries and keys) of the fast block-wise op.
#: DA-Transformer uses no RoPE: prefer ``rope = "none"`` for these types (the ReLU(QKᵀ) works with RoPE too).
DISTANCE_OPTIONS: dict[str, object] = {"distance_w_init": 0.1, "distance_v_init": 0.0, "distance_block": 256}


def distance_options(opts: dict) -> dict:
    """``attn_options``' distance keys merged over :data:`DISTANCE_OPTIONS`; unknown distance_* keys fail."""
    bad = sorted(k for k in opts if k.startswith("distance_") and k not in DISTANCE_OPTIONS)
    if bad:
        raise ValueError(f"unknown attn_options {bad}; distance options are {sorted(DISTANCE_OPTIONS)}")
    out = {**DISTANCE_OPTIONS, **{k: v for k, v in opts.items() if k in DISTANCE_OPTIONS}}
    block = out["distance_block"]
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"attn_options distance_block must be a positive int, got {block!r}")
    return out


def distance_init(n: int, w_init, v_init) -> tuple[Tensor, Tensor]:
    """Initial (w, v) for n heads, each (n,) fp32. See :data:`DISTANCE_OPTIONS`."""

    def per_head(x, name: str, spread: bool) -> Tensor:
        if isinstance(x, (list, tuple)):
            if len(x) != n or not all(isinstance(e, (int, float)) for e in x):
                raise ValueError(f"attn_options {name}: a list needs {n} numbers (one per head), got {x!r}")
            return torch.tensor([float(e) for e in x])
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
            raise ValueError(f"attn_options {name} must be a number or a list of {n}, got {x!r}")
        if spread:
            if x < 0:
                raise ValueError(f"attn_options {name}: the spread half-width must be >= 0, got {x}")
            return torch.linspace(-float(x), float(x), n) if n > 1 else torch.zeros(1)
        return torch.full((n,), float(x))

    return per_head(w_init, "distance_w_init", True), per_head(v_init, "distance_v_init", False)


@register("distance")
class DistanceAttention(StandardAttention):
    """DA-Transformer attention (Wu, Wu & Huang 2021): softmax(ReLU(QKᵀ) ⊙ f(w_h·|i − j|; v_h) / √d)·V
    with two learnable scalars per head, ``distance_w`` and ``distance_v`` (h,). Positions are absolute, so
    with the KV cache query i sits at ``input_pos[i]``. Maps recorded by ``capture``: logits (post ReLU ⊙ f),
    probs."""

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = False, w_init=0.1, v_init=0.0, block: int = 256,
                 shared_qk: bool = False):
        super().__init__(embed_dim, num_heads, num_kv_heads, head_dim, bias, shared_qk=shared_qk)
        w, v = distance_init(num_heads, w_init, v_init)
        self.distance_w = nn.Parameter(w)
        self.distance_v = nn.Parameter(v)
        self.block = block

    @classmethod
    def from_config(cls, cfg, layer_idx):
        o = distance_options(cfg.attn_options)
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.bias,
                   w_init=o["distance_w_init"], v_init=o["distance_v_init"], block=o["distance_block"],
                   shared_qk=cfg.shared_qk)

    def core(self, q: Tensor, k: Tensor, v: Tensor, margs: dict) -> Tensor:
        w, vp = self.distance_w, self.distance_v
        if self.reference_path:
            out, maps = AF.distance_attention_ref(q, k, v, w, vp, score_mod=self.score_mod, return_maps=True,
                                                  **margs)
            self.record(maps)
            return out
        return AF.distance_attention(q, k, v, w, vp, block_q=self.block, block_k=self.block, **margs)


@register("diff_distance")
class DiffDistanceAttention(MultiheadDiffAttention):
    """Differential attention V1 whose two maps are distance-aware (DA-Transformer scores).

    Each map has its own (w, v) per diff-head — ``distance_w``, ``distance_v`` (2h,), entry 2i for map 1 and
    2i+1 for map 2, like the query sub-heads — so A1 − λA2 can subtract a broad-range map from a short-range
    one (a band-pass over distance), which one shared profile cannot express; the cost is 2 scalars per head.
    Both maps of a head start from the same value (the spread is over diff-heads). Baseline: ``distance``
    with twice the heads. Maps recorded by ``capture``: logits1, logits2, probs1, probs2, attn, lambda.
    """

    head_split = 2
    baseline = "distance"

    def __init__(self, embed_dim: int, num_heads: int, depth: int, num_kv_heads: int | None = None,
                 lambda_init: float | None = None, lambda_std: float = 0.1, norm_eps: float = 1e-5,
                 bias: bool = False, w_init=0.1, v_init=0.0, block: int = 256, shared_qk: bool = False,
                 head_dim: int | None = None, subln: bool = True):
        super().__init__(embed_dim, num_heads, depth, num_kv_heads, lambda_init, lambda_std, norm_eps, bias,
                         shared_qk=shared_qk, head_dim=head_dim, subln=subln)
        w, v = distance_init(num_heads, w_init, v_init)
        self.distance_w = nn.Parameter(w.repeat_interleave(2))
        self.distance_v = nn.Parameter(v.repeat_interleave(2))
        self.block = block

    @classmethod
    def from_config(cls, cfg, layer_idx):
        o = distance_options(cfg.attn_options)
        return cls(cfg.d_model, cfg.n_heads, layer_idx, cfg.n_kv_heads, lambda_init=cfg.lambda_init,
                   lambda_std=cfg.lambda_std, norm_eps=cfg.norm_eps, bias=cfg.bias,
                   w_init=o["distance_w_init"], v_init=o["distance_v_init"], block=o["distance_block"],
                   shared_qk=cfg.shared_qk, head_dim=cfg.head_dim, subln=cfg.subln)

    def core(self, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, margs: dict) -> Tensor:
        w, vp = self.distance_w, self.distance_v
        if self.reference_path:
            out, maps = AF.diff_distance_attention_ref(q, k, v, lam, w, vp, score_mod=self.score_mod,
                                                       return_maps=True, **margs)
            self.record({**maps, "lambda": lam.detach()})
            return out
        return AF.diff_distance_attention(q, k, v, lam, w, vp, block_q=self.block, block_k=self.block, **margs)
