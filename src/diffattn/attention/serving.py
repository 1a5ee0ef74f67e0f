"""The vLLM layer a variant registers beside its class (``@serves(Cls)``, :mod:`.registry`): how vLLM serves that
type, as code.

A served layer is written against vLLM's own layers (``QKVParallelLinear``, ``RowParallelLinear``, its rotary
embedding and its ``Attention`` layer with the paged KV cache, so continuous batching, prefix caching and
chunked prefill work as for any vLLM model), which it receives as a :class:`VllmParts` when vLLM builds the
model: attention/ imports neither vLLM nor interop/, and :mod:`diffattn.interop.vllm` calls in. Its forward
reproduces the diffattn module's on vLLM's flat (tokens, features) tensors, with the model's own maths (λ from
the variant's file, :class:`~diffattn.ops.norm.RMSNorm`).

What is decided without vLLM is on the same class, as classmethods: the served config (``as_type``: a type
served as another one computing the same function, Shared DIFF as V1), its weights as the served type names
them, and the shape of its ``Attention`` layers (:class:`AttentionShape`: the KV-cache layout and bytes, the
head widths vLLM's CPU build must take). :mod:`diffattn.interop.vllm.served` reads those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn

from diffattn.attention.registry import carry_options


@dataclass(frozen=True)
class AttentionShape:
    """The vLLM ``Attention`` layers one block of a served model builds: (query heads, KV heads, head size) of
    each, over the whole model (before tensor parallelism splits heads)."""

    layers: tuple[tuple[int, int, int], ...]

    def kv_values_per_token(self) -> int:
        return sum(2 * kv * size for _, kv, size in self.layers)

    def head_sizes(self) -> set[int]:
        return {size for _, _, size in self.layers}


class VllmParts(Protocol):
    """vLLM's building blocks as :mod:`diffattn.interop.vllm.layers` hands them to a served layer, with the
    layer's weight-name prefix, cache and quantisation settings bound (``name``: the child's attribute name)."""

    tp_rank: int  # this rank, and the tensor-parallel world size
    tp_size: int

    def qkv(self, hidden: int, head_size: int, q_heads: int, kv_heads: int, bias: bool) -> nn.Module:
        """``QKVParallelLinear`` as ``qkv_proj``: loads q_proj, k_proj, v_proj as its shards."""

    def row(self, in_features: int, out_features: int, bias: bool, name: str = "out_proj") -> nn.Module:
        """``RowParallelLinear`` (input split across ranks)."""

    def column(self, in_features: int, out_features: int, bias: bool, name: str) -> nn.Module:
        """``ColumnParallelLinear`` with each rank's share of the outputs (``gather_output=False``)."""

    def attention(self, heads: int, head_size: int, scale: float, kv_heads: int, name: str = "attn",
                  **extra: Any) -> nn.Module:
        """vLLM's ``Attention`` (paged KV cache) with this rank's heads; ``extra``: its other keywords
        (``alibi_slopes``, ``sinks``)."""

    def rope(self, cfg: Any, width: int) -> nn.Module | None:
        """vLLM's rotary embedding over ``width``-wide (sub-)heads in ``cfg``'s style, or None without RoPE."""


def check_split(what: str, n: int, tp: int) -> None:
    """Tensor parallelism must split ``n`` ``what`` evenly."""
    if n % tp:
        raise ValueError(f"tensor parallelism {tp} must divide the {what} ({n})")


class ServedLayer(nn.Module):
    """The base of every served layer: the fused QKV projection and the out-projection, split by heads across
    ranks. A subclass is built by vLLM as ``Layer(cfg, layer_index, parts)`` (``cfg``: the served
    ``ModelConfig``) and implements ``forward(positions (T,), x (T, E)) -> (T, E)`` and :meth:`shape`."""

    #: The registered type this one is served as (its layer and shape do the work), or None: itself.
    as_type: str | None = None

    def __init__(self, cfg: Any, parts: VllmParts, *, head_size: int, q_heads: int, out_width: int):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = parts.qkv(cfg.d_model, head_size, q_heads, cfg.kv_heads, bias=cfg.attn_qkv_bias)
        self.out_proj = parts.row(out_width, cfg.d_model, bias=cfg.attn_out_bias)
        self.q_heads, self.kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # on this rank
        self.sizes = [self.q_heads * head_size, self.kv_heads * head_size, self.kv_heads * head_size]

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qkv, _ = self.qkv_proj(x)
        return qkv.split(self.sizes, dim=-1)

    def out(self, heads: Tensor) -> Tensor:
        y, _ = self.out_proj(heads.reshape(heads.shape[0], -1))
        return y

    @classmethod
    def shape(cls, cfg: Any) -> AttentionShape:
        """The ``Attention`` layers of one block of served config ``cfg``."""
        raise NotImplementedError

    @classmethod
    def config(cls, cfg: Any) -> Any:
        """The configuration vLLM serves for ``cfg``: :attr:`as_type` (or the type itself), K = Q written out as a
        key projection (``shared_qk`` off), no dropout; options the served type declares carried over."""
        to = cls.as_type or cfg.attention
        opts = cfg.attn_options if to == cfg.attention else carry_options(cfg.attn_options, to)
        return cfg.replace(attention=to, shared_qk=False, attn_options=dict(opts), dropout=0.0)

    @classmethod
    def weights(cls, module: nn.Module) -> dict[str, Tensor]:
        """The diffattn ``module``'s weights as the module of the served type names them (what ``export --to
        vllm`` writes for this layer): ``shared_qk`` (K = Q) becomes a key projection equal to the query
        projection, so the served model computes the same function."""
        sd = dict(module.state_dict())
        if getattr(module, "shared_qk", False):
            for name in [n for n in sd if n.startswith(("q_proj.", "q_norm."))]:
                sd["k" + name[1:]] = sd[name]
        return sd
