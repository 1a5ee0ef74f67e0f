"""RMSNorm in fp32."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.ops.core import upcast


class RMSNorm(nn.Module):
    """x / rms(x) · gain, computed in fp32 (as the official code and HF Llama do)."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """x: (..., dim). ``scale`` multiplies the gain (folding a constant output scale into one pass)."""
        xf = upcast(x)
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if self.weight is None:
            return y * scale if scale != 1.0 else y
        return y * (self.weight * scale if scale != 1.0 else self.weight)
