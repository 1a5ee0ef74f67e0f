"""The transformer block: Y = X + Attn(RMSNorm(X)); X' = Y + SwiGLU(RMSNorm(Y)), and weight initialisation."""

from __future__ import annotations

import math

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from diffattn.attention.registry import build_attention
from diffattn.model.config import ModelConfig
from diffattn.ops.norm import RMSNorm


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = build_attention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, rope=None, input_pos: Tensor | None = None, attn_mask: Tensor | None = None,
                causal: bool = True) -> Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope, input_pos, attn_mask, causal))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


def init_linear_(module: nn.Module, std: float) -> None:
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


def scaled_init_std(base_std: float, n_layers: int) -> float:
    """GPT-2's residual-projection init: std / sqrt(2·n_layers)."""
    return base_std / math.sqrt(2 * n_layers)
