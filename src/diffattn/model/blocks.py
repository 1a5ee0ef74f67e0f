"""The transformer block: Y = X + Attn(RMSNorm(X)); X' = Y + SwiGLU(RMSNorm(Y)) (Gemma's: a norm after each of the
two as well, and GeGLU), its activation checkpointing, and weight initialisation."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from diffattn.attention.registry import build_attention
from diffattn.model.config import ModelConfig
from diffattn.ops.norm import RMSNorm


class SwiGLU(nn.Module):
    """down(act(gate(x)) · up(x)): SwiGLU with ``activation="silu"``, GeGLU with ``"gelu_tanh"`` (GELU's tanh
    approximation, Gemma's ``gelu_pytorch_tanh``)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = _ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


#: Activation checkpointing modes of a block (:func:`set_activation_checkpointing`).
CHECKPOINTING = ("none", "full", "selective")

# Ops whose outputs selective checkpointing keeps: the matmuls and the attention kernels, the work that is
# expensive to recompute. Everything else in a block (RMSNorm's fp32 up-casts, RoPE, SiLU and the gate product,
# the λ combine, dropout, residual adds) is element-wise: cheap to redo, yet it holds most of the saved bytes.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default}
def keeps_output(op) -> bool:
    """Whether selective checkpointing keeps the output of ``op``: the matmuls, the attention kernels, and the
    package's own registered kernels (the ``diffattn::`` custom ops, :mod:`diffattn.ops.triton_diff`)."""
    return op in _SAVE_OPS or getattr(op, "namespace", None) == "diffattn"


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if keeps_output(op) else CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    """``checkpointing``: "none"; "full" (keep only the block's input, recompute its whole forward in the
    backward); "selective" (keep the outputs of matmuls and attention kernels, recompute the element-wise ops).
    Set it with :func:`set_activation_checkpointing`; it applies only to a training forward with gradients."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        norm = functools.partial(RMSNorm, cfg.d_model, cfg.norm_eps, unit_offset=cfg.norm_unit_offset)
        self.attn_norm = norm()
        self.attn = build_attention(cfg.layer_config(layer_idx), layer_idx)
        # Gemma's norms on the attention's and the MLP's outputs, before the residual add (only when asked, so
        # every other model's parameters are what they were)
        self.post_attn_norm = norm() if cfg.post_attn_norm else None
        self.ffn_norm = norm()
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_dim, bias=cfg.bias, activation=cfg.mlp_activation)
        self.post_ffn_norm = norm() if cfg.post_ffn_norm else None
        self.drop = nn.Dropout(cfg.dropout)
        self.checkpointing = "none"

    def forward(self, x: Tensor, rope=None, input_pos: Tensor | None = None, attn_mask: Tensor | None = None,
                causal: bool = True) -> Tensor:
        """x: (B, T, d_model) -> (B, T, d_model)."""
        if self.checkpointing == "none" or not (self.training and torch.is_grad_enabled()):
            return self._forward(x, rope, input_pos, attn_mask, causal)
        # torch's non-reentrant checkpoint: works under DDP, FSDP2, autocast and torch.compile, and restores
        # the RNG state for the recompute, so dropout draws the same mask twice.
        extra = {"context_fn": _SELECTIVE} if self.checkpointing == "selective" else {}
        return checkpoint(self._forward, x, rope, input_pos, attn_mask, causal, use_reentrant=False, **extra)

    def _forward(self, x: Tensor, rope, input_pos: Tensor | None, attn_mask: Tensor | None, causal: bool) -> Tensor:
        a = self.attn(self.attn_norm(x), rope, input_pos, attn_mask, causal)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = x + self.drop(a)
        f = self.ffn(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            f = self.post_ffn_norm(f)
        return x + self.drop(f)


_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)


def set_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Set activation checkpointing ``mode`` (one of :data:`CHECKPOINTING`) on every :class:`Block` of
    ``model``; returns how many. Parameter names and the state dict are unchanged (no wrapper modules)."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"activation checkpointing must be one of {CHECKPOINTING}, got {mode!r}")
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for b in blocks:
        b.checkpointing = mode
    return len(blocks)


def init_linear_(module: nn.Module, std: float) -> None:
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


def scaled_init_std(base_std: float, n_layers: int) -> float:
    """GPT-2's residual-projection init: std / sqrt(2·n_layers)."""
    return base_std / math.sqrt(2 * n_layers)
