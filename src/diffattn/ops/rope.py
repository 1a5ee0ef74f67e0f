"""Rotary position embeddings (RoPE), interleaved (GPT-J, the official DIFF code) or NeoX (Llama) style."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.ops.core import upcast

#: Rotates (B, H, T, D) heads whose T positions were fixed when it was made (:meth:`RotaryEmbedding.forward`).
RopeFn = Callable[[Tensor], Tensor]


class RotaryEmbedding(nn.Module):
    """RoPE tables for positions 0..max_seq_len-1. ``style``: "interleaved" rotates (x[2i], x[2i+1]) like the
    official DIFF code (GPT-J); "neox" rotates (x[i], x[i+D/2]) like Llama's ``rotate_half``. ``factor``: linear
    scaling (position interpolation; transformers' ``rope_type="linear"``): every angle divided by it."""

    STYLES = ("interleaved", "neox")

    def __init__(self, dim: int, max_seq_len: int, theta: float = 10000.0, style: str = "interleaved",
                 factor: float = 1.0):
        super().__init__()
        if style not in self.STYLES:
            raise ValueError(f"rope style must be one of {self.STYLES}, got {style!r}")
        if dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {dim}")
        self.style, self.dim, self.max_seq_len, self.theta = style, dim, max_seq_len, theta
        self.factor = float(factor)
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)  # (S, D/2)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[Tensor, Tensor]:
        inv_freq = self.theta ** (-torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim) / self.factor
        angles = torch.arange(self.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        return angles.cos().float(), angles.sin().float()

    def reset_parameters(self) -> None:
        """Recompute the tables in place (after ``to_empty``: built on the meta device, they hold no values)."""
        with torch.device("cpu"):  # the tables are computed in float64 on the CPU, as in the constructor
            cos, sin = self._tables()
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, input_pos: Tensor) -> RopeFn:
        """Return a function rotating (B, H, T, D) tensors whose T positions are ``input_pos`` (T,)."""
        # float(): a model cast with .to(torch.bfloat16) casts these tables too, and complex numbers need fp32
        freqs, style = torch.complex(self.cos[input_pos].float(), self.sin[input_pos].float()), self.style
        return lambda x: _rotate(x, freqs, style)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    """Rotate x: (B, H, T, D) by angle tables cos, sin: (T, D/2)."""
    return _rotate(x, torch.complex(cos, sin), style)


def _rotate(x: Tensor, freqs: Tensor, style: str) -> Tensor:
    # A rotation by θ of the pair (a, b) is the complex product (a + ib)·e^{iθ}: one fused multiply, several
    # times faster fwd+bwd in eager on CPU than the real-arithmetic form. Inductor cannot generate code for
    # complex ops, so compiled graphs take the real form, which it fuses.
    if torch.compiler.is_compiling():
        return _rotate_real(x, freqs.real, freqs.imag, style)
    xf = upcast(x)
    if style == "interleaved":
        xc = torch.view_as_complex(xf.reshape(*xf.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    y = torch.complex(x1, x2) * freqs
    return torch.cat((y.real, y.imag), dim=-1).to(x.dtype)


def _rotate_real(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    xf = upcast(x)
    if style == "interleaved":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
