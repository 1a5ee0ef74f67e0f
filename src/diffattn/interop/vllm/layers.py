"""The attention recipes vLLM serves, on vLLM's own layers: ``QKVParallelLinear`` / ``RowParallelLinear`` (tensor
parallelism splits heads, diff-heads or V2's head pairs), its rotary embedding, and its ``Attention`` layer with
the paged KV cache. One class per recipe (``serve_as`` of the attention classes, :mod:`.served`); each
reproduces its diffattn module's forward (:mod:`diffattn.attention`) on vLLM's flat (tokens, features) tensors.
The cache layouts and their bytes are :mod:`.served`'s docstring.

Imported only inside vLLM (the plugin's model classes), so vLLM is imported at the top.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from vllm.config import CacheConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope

from diffattn.attention.alibi import alibi_slopes
from diffattn.attention.diff import lambda_init_fn
from diffattn.model.config import ModelConfig


def _rope(cfg: ModelConfig, width: int) -> nn.Module | None:
    """vLLM's rotary embedding over ``width``-wide (sub-)heads in ``cfg``'s style, or None without RoPE."""
    if cfg.rope == "none":
        return None
    return get_rope(width, max_position=cfg.max_seq_len, is_neox_style=cfg.rope == "neox",
                    rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)})


def _check_split(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(f"tensor parallelism {tp} must divide the {what} ({n})")


class Served(nn.Module):
    """What every recipe shares: the fused QKV projection, the out-projection and RoPE."""

    def __init__(self, cfg: ModelConfig, *, head_size: int, q_heads: int, out_width: int,
                 quant_config: QuantizationConfig | None, prefix: str):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = QKVParallelLinear(cfg.d_model, head_size, q_heads, cfg.kv_heads, bias=cfg.bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.out_proj = RowParallelLinear(out_width, cfg.d_model, bias=cfg.bias, quant_config=quant_config,
                                          prefix=f"{prefix}.out_proj")
        self.q_heads, self.kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # on this rank
        self.sizes = [self.q_heads * head_size, self.kv_heads * head_size, self.kv_heads * head_size]

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qkv, _ = self.qkv_proj(x)
        return qkv.split(self.sizes, dim=-1)

    def out(self, heads: Tensor) -> Tensor:
        y, _ = self.out_proj(heads.reshape(heads.shape[0], -1))
        return y


class StandardServed(Served):
    """``standard`` and ``alibi``: vLLM's Llama attention (ALiBi: the per-head slopes, no RoPE)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str):
        d, h = cfg.qk_head_dim, cfg.n_heads
        super().__init__(cfg, head_size=d, q_heads=h, out_width=h * d, quant_config=quant_config, prefix=prefix)
        self.rotary = _rope(cfg, d)
        slopes = None
        if cfg.attention == "alibi":
            rank = get_tensor_model_parallel_rank()
            slopes = alibi_slopes(h)[rank * self.q_heads:(rank + 1) * self.q_heads].tolist()
        self.attn = Attention(self.q_heads, d, d**-0.5, num_kv_heads=self.kv_heads, alibi_slopes=slopes,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.out(self.attn(q, k, v))


class DiffServed(Served):
    """``diff`` (V1). QKVParallelLinear at head size 2d with h diff-heads and hkv KV heads: diff-head i's query
    is [Q1_i | Q2_i], KV head g's key [K1_g | K2_g] and value V_g (the official layout's rows, as they are).
    RoPE (and ``qk_norm``) act on each d-wide sub-head; then each diff-head becomes the two query heads
    [Q1 | 0], [0 | Q2] of one ``Attention`` call at scale 1/√d over hkv KV heads of width 2d (:mod:`.served`),
    whose outputs are A1·V and A2·V. Then (A1 − λA2)·V, the per-head RMSNorm × (1 − λ_init), out_proj."""

    def __init__(self, cfg: ModelConfig, layer: int, *, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str):
        d, h = cfg.qk_head_dim, cfg.n_heads
        super().__init__(cfg, head_size=2 * d, q_heads=h, out_width=h * 2 * d, quant_config=quant_config,
                         prefix=prefix)
        self.d = d
        opts = cfg.options
        self.lambda_init = lambda_init_fn(layer) if cfg.lambda_init is None else float(cfg.lambda_init)
        self.dual_lambda = opts.dual_lambda
        names = ("lambda_a", "lambda_b") if opts.dual_lambda else ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
        for name in names:  # replicated on every rank: λ is one scalar per layer
            setattr(self, name, nn.Parameter(torch.zeros(() if opts.dual_lambda else (d,)), requires_grad=False))
        self.q_norm = RMSNorm(d, eps=cfg.norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(d, eps=cfg.norm_eps) if opts.qk_norm else None
        self.subln = _HeadNorm(2 * d, cfg.norm_eps, 1 - self.lambda_init) if cfg.subln else None
        self.rotary = _rope(cfg, d)
        # pads Q1 to [Q1 | 0] and Q2 to [0 | Q2]: (2 maps, 2 halves), exact (x·1, x·0)
        self.register_buffer("pad", torch.eye(2)[:, :, None], persistent=False)
        self.attn = Attention(2 * self.q_heads, 2 * d, d**-0.5, num_kv_heads=self.kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

    def lambda_full(self) -> Tensor:
        """λ in fp32, as :meth:`diffattn.attention.diff.MultiheadDiffAttention.lambda_full` computes it."""
        if self.dual_lambda:
            l1, l2 = torch.exp(self.lambda_a.float()), torch.exp(self.lambda_b.float())
        else:
            l1 = torch.exp(torch.sum(self.lambda_q1.float() * self.lambda_k1.float()))
            l2 = torch.exp(torch.sum(self.lambda_q2.float() * self.lambda_k2.float()))
        return l1 - l2 + self.lambda_init

    def maps(self, positions: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (T, E) -> (A1·V, A2·V), each (T, h, 2d) on this rank's diff-heads."""
        t, d = x.shape[0], self.d
        q, k, v = self.qkv(x)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, d)).view(t, -1)
            k = self.k_norm(k.reshape(-1, d)).view(t, -1)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        q = (q.view(t, self.q_heads, 2, 1, d) * self.pad.to(q.dtype)).view(t, -1)
        o = self.attn(q, k, v).view(t, self.q_heads, 2, 2 * d)
        return o[:, :, 0], o[:, :, 1]

    def combine(self, out: Tensor) -> Tensor:
        return self.out(out if self.subln is None else self.subln(out))

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        o1, o2 = self.maps(positions, x)
        return self.combine(o1 - self.lambda_full().to(o1.dtype) * o2)


class DintServed(DiffServed):
    """``dint``: V1's maps, then (A1 − λA2 + λG)·V with G·V the running mean of A1·V over the positions each
    query sees: a second ``Attention`` layer whose queries and keys are zeros (uniform weights over the visible
    positions) and whose values are A1·V. Its cache holds each position's A1·V (and zero keys, as wide)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str):
        super().__init__(cfg, layer, cache_config=cache_config, quant_config=quant_config, prefix=prefix)
        self.mean = Attention(self.q_heads, 2 * self.d, 1.0, num_kv_heads=self.q_heads, cache_config=cache_config,
                              quant_config=quant_config, prefix=f"{prefix}.mean")

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        o1, o2 = self.maps(positions, x)
        rows = o1.reshape(o1.shape[0], -1)
        zeros = torch.zeros_like(rows)
        g = self.mean(zeros, zeros, rows).view(o1.shape)
        lam = self.lambda_full().to(o1.dtype)
        return self.combine(o1 - lam * o2 + lam * g)


class DiffV2Served(Served):
    """``diff_v2``: 2h query heads over the KV heads in one ``Attention`` call (the cache of a standard model),
    then out_j = attn_2j − sigmoid(W_λ x)_j · attn_2j+1. Tensor parallelism keeps each pair on one rank (it
    splits the h pairs), and W_λ is split with them."""

    def __init__(self, cfg: ModelConfig, layer: int, *, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str):
        d, h = cfg.qk_head_dim, cfg.n_heads
        _check_split("diff_v2 head pairs", h, get_tensor_model_parallel_world_size())
        super().__init__(cfg, head_size=d, q_heads=2 * h, out_width=h * d, quant_config=quant_config,
                         prefix=prefix)
        self.d = d
        self.lambda_proj = ColumnParallelLinear(cfg.d_model, h, bias=False, gather_output=False,
                                                quant_config=quant_config, prefix=f"{prefix}.lambda_proj")
        self.rotary = _rope(cfg, d)
        self.attn = Attention(self.q_heads, d, d**-0.5, num_kv_heads=self.kv_heads, cache_config=cache_config,
                              quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v).view(x.shape[0], self.q_heads // 2, 2, self.d)
        lam, _ = self.lambda_proj(x)
        return self.out(o[:, :, 0] - torch.sigmoid(lam)[..., None].to(o.dtype) * o[:, :, 1])


class _HeadNorm(nn.Module):
    """V1's per-head RMSNorm over 2d with its gain (``weight``), times ``scale`` = 1 − λ_init, in fp32 as
    :class:`diffattn.ops.norm.RMSNorm` computes it."""

    def __init__(self, dim: int, eps: float, scale: float):
        super().__init__()
        self.eps, self.scale = eps, scale
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y * (self.weight * self.scale if self.scale != 1.0 else self.weight)


RECIPE_CLASSES = {"standard": StandardServed, "alibi": StandardServed, "diff": DiffServed, "dint": DintServed,
                  "diff_v2": DiffV2Served}
