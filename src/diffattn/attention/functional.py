"""Attention math as pure functions: the spec in code (``diffattn.functional``).

Every op has a ``*_ref`` version that materializes the (Tq, Tk) map (slow, plain, the definition) and a fast
version that never builds the map. Each lives in its variant's file (:mod:`diffattn.attention.standard`,
``diff``, ``diff_v2``, ``distance``, ``diff_distance``, and the rivals ``gated``, ``grouped_diff``, ``fox``) and
the shared math in :mod:`diffattn.ops`; this module gathers them under one name. Shapes, GQA and mask
conventions: :mod:`diffattn.ops.core`.
"""

from diffattn.attention.diff import diff_attention, diff_attention_ref, lambda_init_fn
from diffattn.attention.diff_distance import diff_distance_attention, diff_distance_attention_ref
from diffattn.attention.diff_v2 import diff_v2_attention, diff_v2_attention_ref
from diffattn.attention.distance import distance_attention, distance_attention_ref
from diffattn.attention.fox import fox_attention, fox_attention_ref
from diffattn.attention.gated import gated_attention, gated_attention_ref
from diffattn.attention.grouped_diff import grouped_diff_attention, grouped_diff_attention_ref
from diffattn.attention.standard import attention, attention_ref
from diffattn.ops.core import ScoreMod, build_mask, masked_softmax, repeat_kv, upcast
from diffattn.ops.distance_kernel import distance_f, distance_positions

__all__ = [
    "ScoreMod",
    "attention",
    "attention_ref",
    "build_mask",
    "diff_attention",
    "diff_attention_ref",
    "diff_distance_attention",
    "diff_distance_attention_ref",
    "diff_v2_attention",
    "diff_v2_attention_ref",
    "distance_attention",
    "distance_attention_ref",
    "distance_f",
    "distance_positions",
    "fox_attention",
    "fox_attention_ref",
    "gated_attention",
    "gated_attention_ref",
    "grouped_diff_attention",
    "grouped_diff_attention_ref",
    "lambda_init_fn",
    "masked_softmax",
    "repeat_kv",
    "upcast",
]
