"""A static, preallocated KV cache."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor


class KVCache(nn.Module):
    """Static, preallocated per-layer cache (gpt-fast style): fixed shapes, so compiled decode never recompiles.

    k: (B, Hk, S, Dk), v: (B, Hv, S, Dv); ``update`` writes the new positions in place and returns the buffers.
    """

    def __init__(self, k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype, device=None):
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if k.shape[0] != self.k.shape[0]:
            raise ValueError(f"batch size {k.shape[0]} does not match the cache's {self.k.shape[0]}")
        self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
        self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
        return self.k, self.v
