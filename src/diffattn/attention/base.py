"""The base class every attention module derives from, and the head helpers the variants share.

An attention module maps ``x: (B, T, E)`` to ``(B, T, E)``. It runs the fast functional op unless an
evaluation probe asks for the attention maps (``capture``) or rewrites the logits (``score_mod``); then it runs
the materialized reference op. What the model needs to know about a variant is declared on its class (see
:class:`AttentionBase`); how other tools take it (``convert``, vLLM) is code registered beside the class
(:mod:`.conversion`, :mod:`.serving`); :mod:`diffattn.attention.registry` makes both available by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.ops.core import ScoreMod, build_mask
from diffattn.ops.kv_cache import KVCache


class AttentionBase(nn.Module):
    """Shared plumbing: the KV cache, masks for cached decoding, and the evaluation probes.

    Subclasses set ``rope_dim`` (the width RoPE rotates), implement ``from_config``, ``cache_shapes`` and
    ``forward``, and call :meth:`kv` and :meth:`mask_args`.
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
    #: The type's pure-function ops, fast and reference (``*_ref``), that ``diffattn.functional`` exports (it
    #: reads them from the registry): set in the variant's file, next to the functions.
    functional_ops: tuple[Callable[..., Any], ...] = ()
    #: Why a tool cannot take this type, by tool: "convert" (no exact conversion recipe), "serve" (no vLLM
    #: layer), "export" (no transformers counterpart); a tool without an entry gives its generic reason. The
    #: recipes themselves are code registered beside the class (``@converts``, ``@serves``: registry).
    unsupported: Mapping[str, str] = MappingProxyType({})
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

    @classmethod
    def core_flops_per_token(cls, cfg: Any, context: float) -> float:
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
