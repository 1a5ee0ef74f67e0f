"""What a retrofit needs of an attention layer (``train --retrofit.to``, :mod:`diffattn.train.retrofit`), kept out
of :class:`~diffattn.attention.base.AttentionBase`: the schedule factor s a type anneals from its exact conversion
(s = 0) to the plain type (s = 1), and the head mask of a selective retrofit (``ModelConfig.diff_heads``). A type
takes them by deriving from :class:`Retrofittable` / :class:`HeadSelection` as well as from the base.
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffattn.attention.base import AttentionConfig


def selected_heads_mask(heads: list[int], n: int) -> Tensor:
    """(n,) fp32: 1 for the heads in ``heads`` (their negative map on), 0 for the others (standard heads)."""
    mask = torch.zeros(n)
    mask[list(heads)] = 1.0
    return mask


class Retrofittable:
    """A type with a retrofit schedule: the buffer ``retrofit_s`` (:meth:`init_retrofit`), which its forward reads
    through :meth:`annealed` while ``retrofitting``."""

    #: What a retrofit schedule anneals in this type, as a phrase (from its exact conversion at s = 0 to the plain
    #: type at s = 1; :meth:`set_retrofit`).
    retrofit_anneals: str | None = None
    #: The child module whose input a retrofit measures on a few batches of the source before training
    #: (:meth:`calibrate_retrofit`), or None.
    retrofit_probe: str | None = None
    #: A retrofit schedule in progress (s < 1): the forward reads the buffer ``retrofit_s``.
    retrofitting = False
    retrofit_s: Tensor

    @classmethod
    def retrofit_target(cls, cfg: AttentionConfig, lambda_init: float | None) -> AttentionConfig:
        """The plain config a retrofit anneals to from ``cfg``, this type's exact conversion config;
        ``lambda_init``: the retrofit's target λ_init (None: the paper's per-depth schedule), for the types that
        have one. By default ``cfg`` itself: the conversion is already the plain type."""
        return cfg

    def calibrate_retrofit(self, mean_squares: list[Tensor]) -> None:
        """Set what the plain type adds from the mean squares of ``retrofit_probe``'s input on the source's
        batches (each a scalar tensor); by default nothing."""

    def init_retrofit(self) -> None:
        """The buffer ``retrofit_s`` (the schedule factor s, not saved: the training loop sets it from the step,
        so a resumed run has it back exactly)."""
        self.register_buffer("retrofit_s", torch.ones(()), persistent=False)

    def set_retrofit(self, s: float | None) -> None:
        """Set the schedule factor s in [0, 1] (0: the exact conversion; 1 or None: the plain type, whose forward
        then reads no factor at all)."""
        s = 1.0 if s is None else float(s)
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"retrofit schedule factor must be in [0, 1], got {s}")
        self.retrofit_s.fill_(s)
        self.retrofitting = s < 1.0

    def annealed(self, start: Tensor | float, target: Tensor) -> Tensor:
        """(1 − s)·start + s·target while a retrofit is in progress, else ``target`` itself (the plain type)."""
        if not self.retrofitting:
            return target
        s = self.retrofit_s.to(target.dtype)
        return (1 - s) * start + s * target


class HeadSelection:
    """A type whose layers can turn the negative map on for some heads only (``selects_heads``): the buffer
    ``head_mask`` (:meth:`init_head_mask`)."""

    head_mask: Tensor | None
    selected_heads: list[int] | None

    def init_head_mask(self, heads: list[int] | None, n: int) -> None:
        """The buffer ``head_mask`` (n,), 1 for the heads in ``heads`` (their negative map on), 0 for the others
        (not saved: built from the config); None when every head is selected, so the layer runs as the plain
        type does."""
        self.selected_heads = None
        if heads is not None and list(heads) != list(range(n)):
            if any(not 0 <= j < n for j in heads):
                raise ValueError(f"heads {list(heads)} do not exist: the layer has {n} heads (0 to {n - 1})")
            self.selected_heads = list(heads)
        self.register_buffer("head_mask", None if self.selected_heads is None else torch.empty(n), persistent=False)
        self.reset_head_mask()

    def reset_head_mask(self) -> None:
        """Write ``head_mask`` from the selected heads, in place: at construction, and from ``reset_parameters``
        after ``to_empty`` (a model built on the meta device has a mask of no values, and it is not in the
        checkpoint to be loaded back)."""
        if self.head_mask is not None:
            self.head_mask.copy_(selected_heads_mask(self.selected_heads, len(self.head_mask)))
