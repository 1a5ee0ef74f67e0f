"""The attention registry, the base class every attention module derives from, and their shared helpers.

An attention module maps ``x: (B, T, E)`` to ``(B, T, E)``. It runs the fast functional op unless an
evaluation probe asks for the attention maps (``capture``) or rewrites the logits (``score_mod``); then it runs
the materialized reference op.

A variant is one file in this package (:mod:`diffattn.attention` imports every module in it): its reference op,
its fast op, and its module class decorated with ``@register(name, label=..., color=...)``. Everything else the
rest of the package needs is declared on the class (see :class:`AttentionBase`): the kernel family its fast op
follows (``diffattn doctor`` and the backend log list every registered type), its typed options (``Options``, a
dataclass that ``ModelConfig.attn_options`` is checked against), whether it takes RoPE, how its parameter-matched
baseline is built, and whether and how it converts from a standard model or exports to transformers.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.ops import backends
from diffattn.ops.core import ScoreMod, build_mask
from diffattn.ops.kv_cache import KVCache

ATTENTION: dict[str, type[AttentionBase]] = {}


def register(name: str, *, label: str | None = None, color: str | None = None):
    """Class decorator: make an attention module available as ``ModelConfig(attention=name)``.

    ``label``: how reports name the variant (default: ``name``); ``color``: its colour in plots (a matplotlib
    colour; default: one picked from a spare palette by position). The class's ``kernel_family`` / ``op`` are
    declared to :mod:`diffattn.ops.backends`, so the backend choice, its log line and ``doctor`` list it."""

    def deco(cls):
        if name in ATTENTION:
            raise ValueError(f"attention type {name!r} is already registered")
        if cls.Options is not None and not dataclasses.is_dataclass(cls.Options):
            raise TypeError(f"attention {name!r}: Options must be a dataclass, got {cls.Options!r}")
        ATTENTION[name] = cls
        cls.kind = name
        cls.label = label or name
        cls.color = color
        backends.declare_attention(name, cls.kernel_family, cls.op)
        return cls

    return deco


def unregister(name: str) -> None:
    """Remove attention type ``name`` from the registry (and from the backends' list); tests use this."""
    ATTENTION.pop(name, None)
    backends.forget_attention(name)


def attention_classes() -> dict[str, type[AttentionBase]]:
    """{class name: class} of every registered attention module (what ``diffattn.attention`` exports)."""
    return {cls.__name__: cls for cls in ATTENTION.values()}


def attention_label(name: str) -> str:
    """The report label of attention type ``name`` (``name`` itself when it is not registered)."""
    cls = ATTENTION.get(name)
    return cls.label if cls is not None else name


def attention_color(name: str) -> str | None:
    """The plot colour of attention type ``name``, or None when it has none (or is not registered)."""
    cls = ATTENTION.get(name)
    return cls.color if cls is not None else None


def build_attention(cfg: Any, layer_idx: int) -> AttentionBase:
    """The attention module of layer ``layer_idx`` for ``cfg`` (a :class:`diffattn.model.config.ModelConfig`;
    typed loosely because the model layer sits above this one)."""
    if cfg.attention not in ATTENTION:
        raise ValueError(f"unknown attention {cfg.attention!r}; registered: {sorted(ATTENTION)}")
    return ATTENTION[cfg.attention].from_config(cfg, layer_idx)


# ------------------------------------------------------------------------------------------- typed options
def option_fields(attention: str) -> dict[str, Any]:
    """{option name: its type} of attention type ``attention``'s ``Options`` ({} when it declares none)."""
    opts = ATTENTION[attention].Options
    return {} if opts is None else {f.name: typing.get_type_hints(opts)[f.name] for f in dataclasses.fields(opts)}


def _fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` (a TOML/JSON value) is of the annotated type ``tp`` (bool, int, float, str, None,
    list[...], unions of these); an int is a float, a bool is neither."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp in (int, float):
        return isinstance(value, (int, float) if tp is float else int) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_fits(v, args[0]) for v in value)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def check_options(attention: str, given: Mapping[str, Any]) -> Any:
    """The typed options of attention type ``attention`` from ``ModelConfig.attn_options`` (``given``): an
    instance of its ``Options`` dataclass (defaults for what is not given), or None when it declares none.

    Every key must be an option of some registered type and of that type's declared type; keys another type
    declares (a config template shared by several arms, an old run folder) are accepted and not used here.
    Raises ValueError (one line) naming the key and what is expected; the dataclass's own checks run too."""
    if not isinstance(given, Mapping):
        raise ValueError(f"attn_options must be a table of options, got {given!r}")
    mine = option_fields(attention)
    known = {n for a in ATTENTION for n in option_fields(a)}
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        where = f"its options: {sorted(mine)}" if mine else "it takes none"
        raise ValueError(f"unknown option(s) {unknown} for attention {attention!r} ({where}; every type's: "
                         f"{sorted(known)})")
    for k, v in given.items():
        if k in mine and not _fits(v, mine[k]):
            raise ValueError(f"{k} must be {_type_name(mine[k])}, got {v!r}")
    opts = ATTENTION[attention].Options
    return None if opts is None else opts(**{k: v for k, v in given.items() if k in mine})


def carry_options(given: Mapping[str, Any], attention: str) -> dict[str, Any]:
    """The entries of ``given`` that attention type ``attention`` declares (e.g. for its matched baseline)."""
    mine = option_fields(attention)
    return {k: v for k, v in given.items() if k in mine}


class AttentionBase(nn.Module):
    """Shared plumbing: the KV cache, masks for cached decoding, and the evaluation probes.

    Subclasses set ``rope_dim`` (the width RoPE rotates), implement ``from_config``, ``cache_shapes`` and
    ``forward``, and call :meth:`kv` and :meth:`mask_args`.
    """

    kind = "base"
    #: Set by :func:`register`: the report label and plot colour.
    label = "base"
    color: str | None = None
    #: d_model / (head_split · n_heads) is the Q/K head width: 2 for V1-style differential attention.
    head_split = 1
    #: Attention type of the parameter-matched baseline (twice the heads when head_split == 2); None: itself.
    baseline: str | None = None
    #: Whether ``shared_qk`` (K from the query projection, a symmetric logit map) is defined for this type.
    supports_shared_qk = False
    #: The :mod:`diffattn.ops.backends` kernel family whose choice the fast op follows ("diff", "distance"), or
    #: None: the fast op always runs ``op`` (what ``describe`` and ``doctor`` report for this type).
    kernel_family: str | None = None
    op: str = "sdpa"
    #: A dataclass of the type's own options, checked against ``ModelConfig.attn_options`` (None: takes none);
    #: ``from_config`` reads them as ``cfg.options``.
    Options: type | None = None
    #: False for a type that carries its own position signal (ALiBi): ``ModelConfig`` then sets ``rope="none"``.
    uses_rope = True
    #: True when the attention's parameters differ from its matched baseline's by more than a rounding (Shared
    #: DIFF): :func:`~diffattn.model.config.matched_baseline` then sizes the baseline's FFN to match in total.
    match_baseline_ffn = False
    #: The :mod:`diffattn.interop.convert` recipe that turns a standard model into this type ("diff", "diff_v2",
    #: or None: not convertible). A type whose parameters and exactness argument are V1's says "diff".
    convert_as: str | None = None
    #: Why ``export --to hf`` has no transformers counterpart for this type (None: the generic reason).
    export_note: str | None = None
    rope_dim: int

    def __init__(self):
        super().__init__()
        self.cache: KVCache | None = None
        self.capture: list[dict[str, Tensor]] | None = None  # set to a list to record reference maps
        self.score_mod: ScoreMod | None = None  # rewrites scaled logits (reference path only)
        self.use_reference = False

    @classmethod
    def from_config(cls, cfg: Any, layer_idx: int) -> AttentionBase:
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
            keep = build_mask(len(input_pos), tk, causal=False, attn_mask=attn_mask) & keep
        # ops that weigh distance need the queries' absolute positions; the others ignore offset here
        return {"causal": False, "attn_mask": keep, "offset": input_pos}


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
