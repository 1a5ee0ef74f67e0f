"""RMSNorm in fp32, with the gain used as it is (Llama) or as (1 + w) (Gemma)."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.ops.core import upcast


class RMSNorm(nn.Module):
    """x / rms(x) · gain, computed in fp32 (as the official code and HF Llama do).

    ``unit_offset`` (Gemma): the stored weight w is centred on 0 and the gain is (1 + w), applied in fp32 before
    the cast back (Gemma's order; Llama casts first, then multiplies), so a Gemma checkpoint's weights load as
    they are and compute what Gemma computes in every dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        if elementwise_affine:
            self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        else:
            self.weight = None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            (nn.init.zeros_ if self.unit_offset else nn.init.ones_)(self.weight)

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """x: (..., dim). ``scale`` multiplies the gain (folding a constant output scale into one pass)."""
        xf = upcast(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset and self.weight is not None:
            return (y * ((1.0 + upcast(self.weight)) * scale)).to(x.dtype)
        y = y.to(x.dtype)
        if self.weight is None:
            return y * scale if scale != 1.0 else y
        return y * (self.weight * scale if scale != 1.0 else self.weight)


def diff_epilogue(o1: Tensor, o2: Tensor, lam: Tensor, gain: Tensor, eps: float) -> Tensor:
    """Differential attention V1's epilogue: RMSNorm(o1 − λ·o2)·gain over the last dim, the same operations and
    casts as ``o1 − λ·o2`` followed by :class:`RMSNorm` (``gain`` = its weight × (1 − λ_init), computed by the
    caller so that every layer shares one compiled graph). o1, o2: (B, h, T, 2d); lam: a scalar or (h, 1, 1)."""
    x = o1 - lam * o2
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gain


@functools.lru_cache(maxsize=1)
def _compiled_epilogue():
    return torch.compile(diff_epilogue)


def fused_diff_epilogue(o1: Tensor, o2: Tensor, lam: Tensor, gain: Tensor, eps: float) -> Tensor:
    """:func:`diff_epilogue` as one compiled region (inside a model that is compiled already, its plain code:
    the model's graph fuses it)."""
    if torch.compiler.is_compiling():
        return diff_epilogue(o1, o2, lam, gain, eps)
    return _compiled_epilogue()(o1, o2, lam, gain, eps)
