"""Attention math as pure functions: the spec in code (``diffattn.functional``).

Every op has a ``*_ref`` version that materializes the (Tq, Tk) map (slow, plain, the definition) and a fast
version that never builds the map. Each lives in its variant's file, which names them on its class
(``functional_ops``, :class:`~diffattn.attention.base.AttentionBase`); this module gathers the ops of every
registered type from the registry, so a new variant's file is exported here with no edit, and adds the shared
math of :mod:`diffattn.ops`. Shapes, GQA and mask conventions: :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diffattn.attention.registry import ATTENTION
from diffattn.ops.core import ScoreMod, build_mask, masked_softmax, repeat_kv, upcast
from diffattn.ops.distance_score import distance_f, distance_positions

# The math the variants share (ops/), exported beside each variant's own ops.
SHARED: dict[str, Any] = {"ScoreMod": ScoreMod, "build_mask": build_mask, "distance_f": distance_f,
                          "distance_positions": distance_positions, "masked_softmax": masked_softmax,
                          "repeat_kv": repeat_kv, "upcast": upcast}


def variant_ops() -> dict[str, Callable]:
    """{name: op} of every registered attention type's ``functional_ops``, read from the registry when asked
    (a variant registered later is included)."""
    return {fn.__name__: fn for cls in ATTENTION.values() for fn in cls.functional_ops}


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return sorted({*SHARED, *variant_ops()})
    ops = variant_ops()
    if name in ops:
        return ops[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(variant_ops()))
