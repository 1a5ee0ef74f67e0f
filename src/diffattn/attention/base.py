"""The base class every attention module derives from, and the head helpers the variants share.

An attention module maps ``x: (B, T, E)`` to ``(B, T, E)``. It runs the fast functional op unless an
evaluation probe asks for the attention maps (``capture``) or rewrites the logits (``score_mod``); then it runs
the materialized reference op. What the model needs to know about a variant is declared on its class (see
:class:`AttentionBase`); how other tools take it (``convert``, vLLM) is code registered beside the class
(:mod:`.conversion`, :mod:`.serving`); :mod:`diffattn.attention.registry` makes both available by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.ops.core import ScoreMod, build_mask, restrict_mask, window_keep
from diffattn.ops.kv_cache import KVCache
from diffattn.ops.norm import RMSNorm
from diffattn.ops.rope import RopeFn


class AttentionConfig(Protocol):
    """A model's config as this package reads it: the fields and methods of ``diffattn.model.config.ModelConfig``
    that the variants, their conversions and their vLLM layers use (a structural type: the model layer sits above
    this one, so it is named here without being imported). ``options``: the type's typed options (its
    ``Options``); ``replace``: a copy with fields changed."""

    attention: str
    d_model: int
    n_heads: int
    n_kv_heads: int | None
    head_dim: int | None
    norm_eps: float
    norm_unit_offset: bool
    qk_norm: bool
    shared_qk: bool
    attn_options: dict[str, Any]

    @property
    def qk_head_dim(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def attn_qkv_bias(self) -> bool: ...
    @property
    def attn_out_bias(self) -> bool | None: ...
    @property
    def score_scale(self) -> float | None: ...
    @property
    def options(self) -> Any: ...
    def layer_window(self, layer_idx: int) -> int | None: ...
    def layer_heads(self, layer_idx: int) -> list[int] | None: ...
    def replace(self, **changes: Any) -> AttentionConfig: ...


@dataclass(frozen=True)
class HeadOptions:
    """What the pretrained families add to any type's heads, one layer's worth (:func:`head_options` reads it off a
    ``ModelConfig``); the defaults are the plain head. Every variant takes it (``heads=``) and gets it through
    :meth:`AttentionBase.init_heads`, :meth:`~AttentionBase.prepare_qk` and :meth:`~AttentionBase.mask_args`,
    so no variant has a copy of its own.

    ``out_bias``: a bias on the out-projection (None: the same as the constructor's ``bias``, which is the q/k/v
    projections'; Qwen2 biases q, k, v and not o). ``qk_norm``: RMSNorm over every (sub-)head of q and of k, one
    gain shared by the heads, before RoPE (Qwen3, Gemma 3), with ``norm_eps`` and ``norm_unit_offset`` (Gemma's
    (1 + w)). ``window``: sliding-window attention, a query sees the keys less than ``window`` positions back
    (itself included; Mistral, Gemma 3's local layers); None: all. ``scale``: the logits' scale (Gemma 3's
    ``query_pre_attn_scalar``^-½); None: 1/√(head width)."""

    out_bias: bool | None = None
    qk_norm: bool = False
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False
    window: int | None = None
    scale: float | None = None


def with_options(cfg: AttentionConfig, **options: Any) -> AttentionConfig:
    """``cfg`` with these typed options (``attn_options``) set, the others as they are."""
    return cfg.replace(attn_options={**cfg.attn_options, **options})


def out_bias(heads: HeadOptions | None, bias: bool) -> bool:
    """Whether the out-projection has a bias: ``heads.out_bias``, or the q/k/v projections' ``bias``."""
    return bias if heads is None or heads.out_bias is None else heads.out_bias


def head_options(cfg: AttentionConfig, layer_idx: int) -> HeadOptions:
    """Layer ``layer_idx``'s :class:`HeadOptions` from a model's config."""
    return HeadOptions(out_bias=cfg.attn_out_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
                       norm_unit_offset=cfg.norm_unit_offset, window=cfg.layer_window(layer_idx),
                       scale=cfg.score_scale)


@dataclass(frozen=True)
class MaskArgs:
    """What every op takes besides its tensors, as :meth:`AttentionBase.mask_args` builds it for one call:
    ``causal``, ``attn_mask`` (bool, True = attend; :func:`~diffattn.ops.core.build_mask`), ``offset`` (the
    queries' absolute positions under a KV cache, which the ops that weigh distance need) and the logit
    ``scale`` (None: 1/√(head width)). It unpacks as the ops' keywords, ``op(q, k, v, **margs)``, leaving out an
    ``offset`` or ``scale`` at its default (an op without a cache or a scale of its own need not take them)."""

    causal: bool = True
    attn_mask: Tensor | None = None
    offset: int | Tensor = 0
    scale: float | None = None

    def keys(self) -> tuple[str, ...]:
        at_default = {"offset": isinstance(self.offset, int) and self.offset == 0, "scale": self.scale is None}
        return tuple(n for n in ("causal", "attn_mask", "offset", "scale") if not at_default.get(n, False))

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)


class AttentionBase(nn.Module):
    """Shared plumbing: the forward skeleton, the KV cache, masks for cached decoding, and the evaluation probes.

    Subclasses set ``rope_dim`` (the width RoPE rotates) and their ops (``fast_op``, ``ref_op``), implement
    ``from_config`` and ``cache_shapes``, call :meth:`init_heads` in ``__init__`` (the family options of
    :class:`HeadOptions`), and override of :meth:`forward`'s steps only what differs (:meth:`project`,
    :meth:`attend`, :meth:`op_params`). A type with a forward of its own calls :meth:`prepare_qk`, :meth:`kv` and
    :meth:`mask_args` (which carries the window and the logit scale to the op) itself. A retrofit's schedule and
    head mask are mixins of :mod:`.retrofit`.
    """

    #: The registered name (set by ``@register``, which also keeps the report label and plot colour).
    kind = "base"
    #: d_model / (head_split · n_heads) is the Q/K head width: 2 for V1-style differential attention.
    head_split = 1
    #: Attention type of the parameter-matched baseline (twice the heads when head_split == 2); None: itself.
    baseline: str | None = None
    #: True when the attention's parameters differ from its matched baseline's by more than a rounding (Shared
    #: DIFF): :func:`~diffattn.model.config.matched_baseline` then sizes the baseline's FFN to match in total.
    match_baseline_ffn = False
    #: Whether ``shared_qk`` (K from the query projection, a symmetric logit map) is defined for this type.
    supports_shared_qk = False
    #: False for a type that carries its own position signal (ALiBi): ``ModelConfig`` then sets ``rope="none"``.
    uses_rope = True
    #: The :mod:`diffattn.ops.backends` kernel family whose choice the fast op follows ("diff", "distance"), or
    #: None: the fast op is SDPA-based (what ``describe`` and ``doctor`` report for this type).
    kernel_family: str | None = None
    #: A dataclass of the type's own options, checked against ``ModelConfig.attn_options`` (None: takes none);
    #: ``from_config`` reads them as ``cfg.options``.
    Options: type | None = None
    #: The pair :meth:`core` runs: ``fast_op`` (no map materialized) and ``ref_op`` (the materialized spec, which
    #: takes ``score_mod`` and ``return_maps``), each ``op(q, k, v, *per_call, *self.op_params(), **margs)``; set
    #: with ``staticmethod`` in the variant's class.
    fast_op: Callable[..., Tensor]
    ref_op: Callable[..., Any]
    #: The type's pure-function ops that ``diffattn.functional`` exports (it reads them from the registry): by
    #: default the class's own ``fast_op`` and ``ref_op``; a type with more (or other) sets it.
    functional_ops: tuple[Callable[..., Any], ...] = ()
    #: Why a tool cannot take this type, by tool: "convert" (no exact conversion recipe), "serve" (no vLLM
    #: layer), "export" (no transformers counterpart); a tool without an entry gives its generic reason. The
    #: recipes themselves are code registered beside the class (``@converts``, ``@serves``: registry).
    unsupported: Mapping[str, str] = MappingProxyType({})
    #: Why a sliding window (``ModelConfig.sliding_window``) is not defined for this type (None: it is; the
    #: window is a mask every op takes, so a type needs this only when its math reaches past the mask).
    window_note: str | None = None
    #: Whether a layer of this type can turn its negative map on for some heads only (``ModelConfig.diff_heads``:
    #: an unselected head is a standard head on its first map); ``from_config`` then reads
    #: ``cfg.layer_heads(layer_idx)``.
    selects_heads = False
    rope_dim: int

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "fast_op" in vars(cls) and "functional_ops" not in vars(cls):
            cls.functional_ops = (cls.fast_op, cls.ref_op)

    def __init__(self):
        super().__init__()
        self.cache: KVCache | None = None
        self.capture: list[dict[str, Tensor]] | None = None  # set to a list to record reference maps
        self.score_mod: ScoreMod | None = None  # rewrites scaled logits (reference path only)
        self.use_reference = False
        self.window: int | None = None
        self.scale: float | None = None
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None

    def init_heads(self, heads: HeadOptions | None, qk_dim: int, *, shared_qk: bool = False,
                   qk_norm: bool = False, norm_eps: float | None = None) -> None:
        """Take the family options ``heads`` (None: the plain head): the window and the logit scale, and the
        QK-norm modules ``q_norm`` / ``k_norm`` over ``qk_dim``-wide (sub-)heads when ``heads.qk_norm`` or
        ``qk_norm`` (V1's own option, with its ``norm_eps``) asks; no ``k_norm`` under ``shared_qk`` (K is Q).
        Call it where the QK-norm modules are to be created: parameters are numbered in the order they were
        created (an optimizer's state follows it)."""
        h = heads or HeadOptions()
        self.window, self.scale = h.window, h.scale
        if h.qk_norm or qk_norm:
            eps = h.norm_eps if heads is not None or norm_eps is None else norm_eps
            self.q_norm = RMSNorm(qk_dim, eps=eps, unit_offset=h.norm_unit_offset)
            self.k_norm = None if shared_qk else RMSNorm(qk_dim, eps=eps, unit_offset=h.norm_unit_offset)

    def prepare_qk(self, q: Tensor, k: Tensor, rope: RopeFn | None) -> tuple[Tensor, Tensor]:
        """QK-norm (when set), then RoPE (when given), on query and key heads (B, H, T, D); under ``shared_qk``
        (no ``k_norm``, K is Q) the key is the query, before and after."""
        shared = getattr(self, "shared_qk", False)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = q if shared else self.k_norm(k)
        if rope is not None:
            q = rope(q)
            k = q if shared else rope(k)
        return q, k

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        raise NotImplementedError

    @classmethod
    def core_flops_per_token(cls, cfg: AttentionConfig, context: float) -> float:
        """Forward FLOPs per token per layer of the attention core (QKᵀ and P·V, 2 FLOPs per multiply-add), at an
        average of `context` keys per query.

        Standard attention's: h heads of width d (``cfg.n_heads``, ``cfg.qk_head_dim``), one map each, so QKᵀ
        and P·V cost h·d multiply-adds per key. A bias added to the logits (distance, ALiBi) is O(T²) adds, not
        multiply-adds, and is left out. A variant with another head layout overrides this in its own file."""
        h, d = cfg.n_heads, cfg.qk_head_dim
        return 2 * (h * d + h * d) * context

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

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, E) -> query heads (B, H, T, D), key heads (B, Hkv, T, D) (before QK-norm and RoPE), value heads
        (B, Hkv, T, Dv): by default ``q_proj``, ``k_proj`` (K = Q under ``shared_qk``) and ``v_proj`` split into
        ``num_heads``, ``num_kv_heads`` heads; a variant with another head layout overrides it."""
        q = split_heads(self.q_proj(x), self.num_heads)
        k = shared_qk_keys(q, self.k_proj, x, self.num_kv_heads)
        return q, k, split_heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, x: Tensor, rope: RopeFn | None = None, input_pos: Tensor | None = None,
                attn_mask: Tensor | None = None, causal: bool = True) -> Tensor:
        """x (B, T, E) -> (B, T, E): :meth:`project`, :meth:`prepare_qk` (RoPE unless the type carries its own
        position signal, ``uses_rope``), the KV cache (:meth:`kv`), :meth:`mask_args`, :meth:`attend`, then
        ``out_proj`` over the merged heads. ``input_pos`` (Tq,): the new tokens' absolute positions (with a
        cache); ``attn_mask``: bool, True = attend (:func:`~diffattn.ops.core.build_mask`)."""
        q, k, v = self.project(x)
        q, k = self.prepare_qk(q, k, rope if self.uses_rope else None)
        k, v = self.kv(k, v, input_pos)
        margs = self.mask_args(causal, attn_mask, input_pos, k.shape[2])
        return self.out_proj(merge_heads(self.attend(x, q, k, v, margs)))

    def attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, margs: MaskArgs) -> Tensor:
        """The heads' outputs (B, H, Tq, Dv) from the prepared heads: :meth:`core`; a variant whose op takes more
        (a gate from ``x``, V1's λ) or that post-processes each head overrides it."""
        return self.core(q, k, v, margs)

    def op_params(self) -> tuple[Any, ...]:
        """The op's arguments that the layer holds (ALiBi's slopes, the sinks, DA's w and v), after the per-call
        ones; none by default."""
        return ()

    def fast_kwargs(self) -> dict[str, Any]:
        """Keywords only the fast op takes (DA's block sizes); none by default."""
        return {}

    def extra_maps(self, *args: Any, **kw: Any) -> dict[str, Tensor]:
        """What the reference path records besides the op's maps, from :meth:`core`'s per-call arguments (V1's
        λ, FoX's forget gates); nothing by default."""
        return {}

    def core(self, q: Tensor, k: Tensor, v: Tensor, margs: MaskArgs, *args: Any, **kw: Any) -> Tensor:
        """Prepared heads (B, H, Tq, D), keys and values (B, Hkv, Tk, ·) -> the heads' outputs: ``fast_op``, or on
        the reference path (:attr:`reference_path`) ``ref_op``, its maps recorded for ``capture``. ``args`` and
        ``kw``: the call's own op arguments (V1's λ, a gate), before :meth:`op_params`."""
        args = (*args, *self.op_params())
        if self.reference_path:
            out, maps = self.ref_op(q, k, v, *args, score_mod=self.score_mod, return_maps=True, **kw, **margs)
            self.record({**maps, **self.extra_maps(*args, **kw)})
            return out
        return self.fast_op(q, k, v, *args, **kw, **self.fast_kwargs(), **margs)

    def kv(self, k: Tensor, v: Tensor, input_pos: Tensor | None) -> tuple[Tensor, Tensor]:
        if self.cache is None:
            return k, v
        if input_pos is None:
            raise ValueError("a KV cache is set up: pass input_pos, the absolute positions of the new tokens")
        return self.cache.update(input_pos, k, v)

    def mask_args(self, causal: bool, attn_mask: Tensor | None, input_pos: Tensor | None, tk: int) -> MaskArgs:
        """The op's :class:`MaskArgs`. With a cache, keys are the whole static buffer: keep slot j for the query
        at absolute position p when j <= p (unwritten slots lie beyond p). A sliding window (``window``) narrows
        the keys to the band :func:`~diffattn.ops.core.window_keep` (without a cache the queries are the keys, so
        only when the window is shorter than the sequence); the layer's logit ``scale`` rides along."""
        window = self.window
        if self.cache is None:
            if window is not None and window < tk:
                device = attn_mask.device if attn_mask is not None else self._device(input_pos)
                band = window_keep(torch.arange(tk, device=device), tk, window, causal=causal)
                attn_mask = restrict_mask(build_mask(tk, tk, causal=False, attn_mask=attn_mask), band)
            return MaskArgs(causal, attn_mask, scale=self.scale)
        keep = (torch.arange(tk, device=input_pos.device)[None, :] <= input_pos[:, None])[None, None]
        if window is not None:
            keep = keep & window_keep(input_pos, tk, window, causal=True)
        if attn_mask is not None:
            keep = build_mask(len(input_pos), tk, causal=False, attn_mask=attn_mask) & keep
        return MaskArgs(False, keep, input_pos, self.scale)

    def _device(self, input_pos: Tensor | None) -> torch.device:
        if input_pos is not None:
            return input_pos.device
        return next(iter(self.parameters())).device


def split_heads(x: Tensor, n: int) -> Tensor:
    """(B, T, n·D) -> (B, n, T, D)."""
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, D) -> (B, T, H·D)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def check_positive(**values) -> None:
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
    return q if k_proj is None else split_heads(k_proj(x), n)
