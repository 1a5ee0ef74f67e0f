"""vLLM's building blocks, handed to the attention types' served layers (:class:`Parts`, the
:class:`~diffattn.attention.serving.VllmParts` they are written against): ``QKVParallelLinear`` /
``RowParallelLinear`` / ``ColumnParallelLinear`` (tensor parallelism splits heads), its rotary embedding, and its
``Attention`` layer with the paged KV cache. Each type's layer, its KV layout and its forward are in the type's own
file (``@serves``); this module only binds a layer's weight-name prefix, cache and quantisation settings.

Imported only inside vLLM (the plugin's model classes), so vLLM is imported at the top.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.config import CacheConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope

from diffattn.attention.registry import serving_of
from diffattn.model.config import ModelConfig


class Parts:
    """vLLM's layers for the served attention layer at weight-name ``prefix`` (``body.blocks.N.attn``)."""

    def __init__(self, cache_config: CacheConfig | None, quant_config: QuantizationConfig | None, prefix: str):
        self.cache_config, self.quant_config, self.prefix = cache_config, quant_config, prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()

    def qkv(self, hidden: int, head_size: int, q_heads: int, kv_heads: int, bias: bool) -> nn.Module:
        return QKVParallelLinear(hidden, head_size, q_heads, kv_heads, bias=bias, quant_config=self.quant_config,
                                 prefix=f"{self.prefix}.qkv_proj")

    def row(self, in_features: int, out_features: int, bias: bool, name: str = "out_proj") -> nn.Module:
        return RowParallelLinear(in_features, out_features, bias=bias, quant_config=self.quant_config,
                                 prefix=f"{self.prefix}.{name}")

    def column(self, in_features: int, out_features: int, bias: bool, name: str) -> nn.Module:
        return ColumnParallelLinear(in_features, out_features, bias=bias, gather_output=False,
                                    quant_config=self.quant_config, prefix=f"{self.prefix}.{name}")

    def attention(self, heads: int, head_size: int, scale: float, kv_heads: int, name: str = "attn",
                  **extra: Any) -> nn.Module:
        return Attention(heads, head_size, scale, num_kv_heads=kv_heads, cache_config=self.cache_config,
                         quant_config=self.quant_config, prefix=f"{self.prefix}.{name}", **extra)

    def rope(self, cfg: ModelConfig, width: int, layer: int) -> nn.Module | None:
        if cfg.rope == "none":
            return None
        return get_rope(width, max_position=cfg.max_seq_len, is_neox_style=cfg.rope == "neox",
                        rope_parameters=rope_parameters(cfg, layer))

    def norm(self, width: int, eps: float, unit_offset: bool) -> nn.Module:
        return norm_layer(width, eps, unit_offset)


def rope_parameters(cfg: ModelConfig, layer: int) -> dict[str, Any]:
    """vLLM's ``rope_parameters`` for layer ``layer``: a local layer's base (``rope_local_theta``, unscaled), else
    ``rope_theta`` with the linear ``rope_factor`` (transformers' ``rope_type="linear"``), as diffattn's tables."""
    if cfg.local_rope(layer):
        return {"rope_type": "default", "rope_theta": float(cfg.rope_local_theta)}
    if cfg.rope_factor != 1.0:
        return {"rope_type": "linear", "rope_theta": float(cfg.rope_theta), "factor": float(cfg.rope_factor)}
    return {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}


def norm_layer(width: int, eps: float, unit_offset: bool) -> nn.Module:
    """vLLM's RMSNorm (x̂ cast, then × w: Llama's) or GemmaRMSNorm (x̂·(1 + w) in fp32, then cast: Gemma's, and
    diffattn's ``norm_unit_offset``); both take the fused residual add."""
    return (GemmaRMSNorm if unit_offset else RMSNorm)(width, eps=eps)


def served_attention(cfg: ModelConfig, layer: int, cache_config: CacheConfig | None,
                     quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
    """Layer ``layer``'s attention for served config ``cfg``: its type's registered layer (``cfg.layer_config``:
    a model whose layers mix types builds each from its own), built on vLLM's parts. Inference only: its
    parameters (the model's own norms among them) take no gradient."""
    layer_cfg = cfg.layer_config(layer)
    attn = serving_of(layer_cfg.attention)(layer_cfg, layer, Parts(cache_config, quant_config, prefix))
    return attn.requires_grad_(False)
