"""The official microsoft/unilm Diff-Transformer module APIs, as thin adapters over diffattn's modules.

Drop-in replacements for code written against the official repository:

- :class:`MultiheadDiffAttn` — ``Diff-Transformer/multihead_diffattn.py``: ``MultiheadDiffAttn(embed_dim, depth,
  num_heads, num_kv_heads=None)``, ``forward(x, rel_pos, attn_mask=None)``. Parameter names ``q_proj, k_proj,
  v_proj, out_proj, lambda_q1, lambda_k1, lambda_q2, lambda_k2, subln.weight``: official state_dicts load with
  ``strict=True``. A subclass of :class:`diffattn.attention.diff.MultiheadDiffAttention` (same math, same weights).
- :class:`MultiheadFlashDiffV2` — ``Diff-Transformer/Diff-Transformer-V2/multihead_flashdiffv2.py``:
  ``MultiheadFlashDiffV2(use_diff_v2, d_model, num_heads, num_kv_heads, head_dim)``, ``forward(x, rel_pos)``.
  Parameter names ``q_proj, k_proj, v_proj, o_proj, lambda_proj``. With ``use_diff_v2=True`` it is a
  :class:`diffattn.attention.diff_v2.DiffV2Attention`; with ``False`` (the official baseline switch) a
  :class:`diffattn.attention.standard.StandardAttention` with ``o_proj``, and no ``lambda_proj``, as in the
  official module.

Conventions, as in the official code:

- ``rel_pos = (cos, sin)``, each (T, head_dim/2) (more rows are fine; the first T are used), applied
  interleaved (GPT-J style: pairs (x[2i], x[2i+1])) to every head — for V1 to each d-wide Q/K sub-head.
  ``rel_pos=None`` means no rotary embedding (an extension: the official code always rotates).
- ``attn_mask``: an additive float (T, T) mask (0 keeps, −inf drops), added to the logits *instead of* the
  causal mask; ``None`` means causal. ``MultiheadFlashDiffV2`` takes it too (an extension; the official V2 is
  always causal).
- GQA in V1: both halves of diff-head j read KV head j // n_rep, the pairing of the authors' recommended
  ``multihead_flashdiff_1.py``. The naive ``multihead_diffattn.py`` repeats K before splitting the halves, which
  pairs differently when num_kv_heads < num_heads; with num_kv_heads=None (MHA) the two agree exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from diffattn.attention.diff import MultiheadDiffAttention
from diffattn.attention.diff_v2 import DiffV2Attention
from diffattn.attention.standard import StandardAttention
from diffattn.ops.rope import RopeFn, apply_rope

__all__ = ["MultiheadDiffAttn", "MultiheadFlashDiffV2", "MultiheadFlashAttnBaseline"]


def _int(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


def _kv_heads(num_heads: int, num_kv_heads) -> None:
    if num_kv_heads is None:
        return
    _int("num_kv_heads", num_kv_heads, 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def official_rope(rel_pos: Sequence[Tensor] | None, seq_len: int, head_dim: int) -> RopeFn | None:
    """The official ``rel_pos = (cos, sin)`` (each (≥T, head_dim/2)) as diffattn's rotation function (interleaved)."""
    if rel_pos is None:
        return None
    if not isinstance(rel_pos, (tuple, list)) or len(rel_pos) != 2 or not all(isinstance(t, Tensor) for t in rel_pos):
        raise ValueError("rel_pos must be a (cos, sin) pair of tensors")
    cos, sin = rel_pos
    want = head_dim // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[0] < seq_len or t.shape[1] != want:
            raise ValueError(f"rel_pos {name} must have shape (T, head_dim/2) = ({seq_len}, {want}), "
                             f"got {tuple(t.shape)}")
    # the rotation multiplies in complex fp32 (fp64 stays fp64); half-precision tables are upcast
    cos, sin = (t[:seq_len] if t.dtype == torch.float64 else t[:seq_len].float() for t in (cos, sin))
    return lambda x: apply_rope(x, cos.to(x.device), sin.to(x.device), "interleaved")


def official_mask(attn_mask: Tensor | None, seq_len: int) -> tuple[bool, Tensor | None]:
    """The official additive (T, T) mask as diffattn's (causal, attn_mask) arguments. None: causal."""
    if attn_mask is None:
        return True, None
    if not isinstance(attn_mask, Tensor) or not attn_mask.is_floating_point():
        raise ValueError("attn_mask must be an additive float tensor (0 keeps, -inf drops), "
                         f"got {getattr(attn_mask, 'dtype', type(attn_mask).__name__)}")
    if attn_mask.shape != (seq_len, seq_len):
        raise ValueError(f"attn_mask must have shape (T, T) = ({seq_len}, {seq_len}), got {tuple(attn_mask.shape)}")
    # a 2-D mask means (B, T) key padding to diffattn's ops: make it (1, 1, T, T)
    return False, attn_mask[None, None]


class MultiheadDiffAttn(MultiheadDiffAttention):
    """Differential attention V1 with the official constructor and forward.

    ``MultiheadDiffAttn(embed_dim, depth, num_heads, num_kv_heads=None)``: ``depth`` is the 0-based layer index
    (λ_init = 0.8 − 0.6·exp(−0.3·depth)); ``num_heads`` counts diff-heads (half a baseline's heads);
    ``num_kv_heads`` half the baseline's KV heads under GQA, None for MHA. ``forward(x, rel_pos, attn_mask=None)``:
    x (B, T, embed_dim) -> (B, T, embed_dim).
    """

    def __init__(self, embed_dim: int, depth: int, num_heads: int, num_kv_heads: int | None = None):
        _int("embed_dim", embed_dim, 1)
        _int("depth", depth, 0)
        _int("num_heads", num_heads, 1)
        _kv_heads(num_heads, num_kv_heads)
        if embed_dim % (2 * num_heads):
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by 2·num_heads ({2 * num_heads})")
        super().__init__(embed_dim, num_heads, depth, num_kv_heads)
        self.embed_dim = embed_dim
        self.scaling = self.head_dim**-0.5

    def forward(self, x: Tensor, rel_pos: Sequence[Tensor] | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """x: (B, T, E); rel_pos: (cos, sin), each (T, head_dim/2); attn_mask: additive (T, T) or None (causal)."""
        t = x.shape[1]
        causal, mask = official_mask(attn_mask, t)
        return super().forward(x, official_rope(rel_pos, t, self.head_dim), None, mask, causal)


class _OProj:
    """Registers the output projection under the official V2 name ``o_proj``; ``out_proj`` (which our modules'
    forward reads) is an alias, so state_dicts carry only ``o_proj`` and there is one weight."""

    _official_order = ("q_proj", "k_proj", "v_proj", "o_proj", "lambda_proj")

    @property
    def out_proj(self):
        return self.o_proj

    def _rename_out_proj(self) -> None:
        self.o_proj = self._modules.pop("out_proj")
        for name in self._official_order:  # the official module's registration (and state_dict) order
            if name in self._modules:
                self._modules[name] = self._modules.pop(name)

    def _official_forward(self, x: Tensor, rel_pos, attn_mask: Tensor | None) -> Tensor:
        t = x.shape[1]
        causal, mask = official_mask(attn_mask, t)
        return super().forward(x, official_rope(rel_pos, t, self.head_dim), None, mask, causal)


def _check_v2(use_diff_v2, d_model, num_heads, num_kv_heads, head_dim) -> None:
    if not isinstance(use_diff_v2, bool):
        raise ValueError(f"use_diff_v2 must be True or False, got {use_diff_v2!r}")
    _int("d_model", d_model, 1)
    _int("num_heads", num_heads, 1)
    _kv_heads(num_heads, num_kv_heads)
    _int("head_dim", head_dim, 1)


class MultiheadFlashAttnBaseline(_OProj, StandardAttention):
    """The official V2 module with ``use_diff_v2=False``: standard attention, names q/k/v/o_proj."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None, head_dim: int):
        _check_v2(False, d_model, num_heads, num_kv_heads, head_dim)
        super().__init__(d_model, num_heads, num_kv_heads, head_dim)
        self._rename_out_proj()
        self.use_diff_v2 = False
        self.d_model = d_model
        self.num_q_heads = num_heads
        self.lambda_proj = None

    def forward(self, x: Tensor, rel_pos: Sequence[Tensor] | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """x: (B, T, d_model); rel_pos: (cos, sin), each (T, head_dim/2) -> (B, T, d_model)."""
        return self._official_forward(x, rel_pos, attn_mask)


class MultiheadFlashDiffV2(_OProj, DiffV2Attention):
    """Differential attention V2 with the official constructor and forward.

    ``MultiheadFlashDiffV2(use_diff_v2, d_model, num_heads, num_kv_heads, head_dim)``: ``num_heads`` output heads
    (2·num_heads query heads of width ``head_dim``), ``num_kv_heads`` KV heads (None: num_heads). With
    ``use_diff_v2=False`` the constructor returns a :class:`MultiheadFlashAttnBaseline` (the official switch to a
    baseline Transformer attention). ``forward(x, rel_pos, attn_mask=None)``: (B, T, d_model) -> (B, T, d_model).
    """

    def __new__(cls, use_diff_v2: bool, d_model: int, num_heads: int, num_kv_heads: int | None, head_dim: int):
        _check_v2(use_diff_v2, d_model, num_heads, num_kv_heads, head_dim)
        if not use_diff_v2:
            return MultiheadFlashAttnBaseline(d_model, num_heads, num_kv_heads, head_dim)
        return super().__new__(cls)

    def __init__(self, use_diff_v2: bool, d_model: int, num_heads: int, num_kv_heads: int | None, head_dim: int):
        super().__init__(d_model, num_heads, num_kv_heads, head_dim)
        self._rename_out_proj()
        self.use_diff_v2 = True
        self.d_model = d_model
        self.num_q_heads = 2 * num_heads

    def forward(self, x: Tensor, rel_pos: Sequence[Tensor] | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """x: (B, T, d_model); rel_pos: (cos, sin), each (T, head_dim/2) -> (B, T, d_model)."""
        return self._official_forward(x, rel_pos, attn_mask)
