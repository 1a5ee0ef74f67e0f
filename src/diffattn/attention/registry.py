"""The attention registry: every attention type by name, its label and colour, its typed options, and the recipes
other tools follow for it.

A variant is one file in this package (:mod:`diffattn.attention` imports every module in it): its reference op,
its fast op, and its module class decorated with ``@register(name, label=..., color=...)``. What the model needs
is declared on the class (see :class:`~diffattn.attention.base.AttentionBase`): the kernel family its fast op
follows (``diffattn doctor`` and the backend log list every registered type), its typed options (``Options``, a
dataclass that ``ModelConfig.attn_options`` is checked against), whether it takes RoPE, how its
parameter-matched baseline is built. How other tools take it is code in the same file (or a sibling module),
registered here by the class it is for: ``@converts(Cls)`` a :class:`~diffattn.attention.conversion.Conversion`
(``diffattn convert``: a standard model's weights to this type's, exactly) and ``@serves(Cls)`` a
:class:`~diffattn.attention.serving.ServedLayer` (its vLLM layer: KV layout and forward). The layers above look
recipes up by type name (:func:`conversion_of`, :func:`serving_of`) and name no type themselves.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from diffattn.attention.base import AttentionBase, AttentionConfig
from diffattn.ops import backends

ATTENTION: dict[str, type[AttentionBase]] = {}
_LOOKS: dict[str, tuple[str, str | None]] = {}  # name -> (report label, plot colour)
#: Type name -> its conversion recipe (a :class:`~diffattn.attention.conversion.Conversion` subclass).
CONVERSIONS: dict[str, type] = {}
#: Type name -> its vLLM layer (a :class:`~diffattn.attention.serving.ServedLayer` subclass).
SERVINGS: dict[str, type] = {}


def register(name: str, *, label: str | None = None, color: str | None = None):
    """Class decorator: make an attention module available as ``ModelConfig(attention=name)``.

    ``label``: how reports name the variant (default: ``name``); ``color``: its colour in plots (a matplotlib
    colour; default: one picked from a spare palette by position); both live here, not on the class. The class's
    ``kernel_family`` is declared to :mod:`diffattn.ops.backends`, so the backend choice, its log line and
    ``doctor`` list it."""

    def deco(cls):
        if name in ATTENTION:
            raise ValueError(f"attention type {name!r} is already registered")
        if cls.Options is not None and not dataclasses.is_dataclass(cls.Options):
            raise TypeError(f"attention {name!r}: Options must be a dataclass, got {cls.Options!r}")
        ATTENTION[name] = cls
        _LOOKS[name] = (label or name, color)
        cls.kind = name
        backends.declare_attention(name, cls.kernel_family)
        return cls

    return deco


def unregister(name: str) -> None:
    """Remove attention type ``name`` and its recipes from the registry (and from the backends' list); tests use
    this."""
    for table in (ATTENTION, _LOOKS, CONVERSIONS, SERVINGS):
        table.pop(name, None)
    backends.forget_attention(name)


def _recipe(table: dict[str, type], what: str, attention: type[AttentionBase]):
    def deco(recipe: type) -> type:
        name = attention.__dict__.get("kind")
        if ATTENTION.get(name) is not attention:
            raise ValueError(f"{what}({attention.__name__}): register the attention class (@register) first")
        if name in table:
            raise ValueError(f"attention type {name!r} already has a {what} recipe ({table[name].__name__})")
        table[name] = recipe
        return recipe

    return deco


def converts(attention: type[AttentionBase]):
    """Class decorator: ``recipe`` (a :class:`~diffattn.attention.conversion.Conversion`) turns a standard model
    into registered attention class ``attention`` (``diffattn convert --to NAME``). A type has at most one; a
    subclass does not inherit its parent's (register it again when the same recipe is exact for it)."""
    return _recipe(CONVERSIONS, "converts", attention)


def serves(attention: type[AttentionBase]):
    """Class decorator: ``layer`` (a :class:`~diffattn.attention.serving.ServedLayer`) is how vLLM serves
    registered attention class ``attention``. Never inherited, so a subclass that changes the maths is never
    served by its parent's layer."""
    return _recipe(SERVINGS, "serves", attention)


def conversion_of(name: str) -> type | None:
    """The conversion recipe of attention type ``name``, or None (not registered, or not convertible)."""
    return CONVERSIONS.get(name)


def serving_of(name: str) -> type | None:
    """The vLLM layer of attention type ``name``, or None (not registered, or not servable)."""
    return SERVINGS.get(name)


def attention_classes() -> dict[str, type[AttentionBase]]:
    """{class name: class} of every registered attention module (what ``diffattn.attention`` exports)."""
    return {cls.__name__: cls for cls in ATTENTION.values()}


def attention_label(name: str) -> str:
    """The report label of attention type ``name`` (``name`` itself when it is not registered)."""
    return _LOOKS.get(name, (name, None))[0]


def attention_color(name: str) -> str | None:
    """The plot colour of attention type ``name``, or None when it has none (or is not registered)."""
    return _LOOKS.get(name, (name, None))[1]


def unsupported_note(name: str, tool: str) -> str | None:
    """Why attention type ``name`` declares ``tool`` ("convert", "serve", "export") cannot take it, or None."""
    cls = ATTENTION.get(name)
    return None if cls is None else cls.unsupported.get(tool)


def build_attention(cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
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
