"""RMSNorm in fp32, with the gain used as it is (Llama) or as (1 + w) (Gemma)."""

from __future__ import annotations

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
