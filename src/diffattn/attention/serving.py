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

from diffattn.attention.base import AttentionConfig
from diffattn.attention.registry import carry_options
from diffattn.attention.retrofit import selected_heads_mask


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
        (``alibi_slopes``, ``sinks``, ``per_layer_sliding_window``)."""

    def rope(self, cfg: AttentionConfig, width: int, layer: int) -> nn.Module | None:
        """vLLM's rotary embedding over ``width``-wide (sub-)heads in ``cfg``'s style for layer ``layer`` (its
        RoPE base: ``rope_local_theta`` on a local layer, else ``rope_theta`` with the linear ``rope_factor``), or
        None without RoPE."""

    def norm(self, width: int, eps: float, unit_offset: bool) -> nn.Module:
        """vLLM's RMSNorm over the last ``width`` features: x̂·w, or Gemma's x̂·(1 + w) (``unit_offset``)."""


def check_split(what: str, n: int, tp: int) -> None:
    """Tensor parallelism must split ``n`` ``what`` evenly."""
    if n % tp:
        raise ValueError(f"tensor parallelism {tp} must divide the {what} ({n})")


def head_scale(cfg: AttentionConfig, width: int) -> float:
    """The logits' scale of ``width``-wide (sub-)heads: Gemma 3's ``query_pre_attn_scalar``^-½, else 1/√width
    (the diffattn module's, :class:`~diffattn.attention.base.HeadOptions`)."""
    return cfg.score_scale if cfg.score_scale is not None else width**-0.5


def window_extra(cfg: AttentionConfig, layer: int) -> dict[str, Any]:
    """``Attention``'s keyword for layer ``layer``'s sliding window (none: every earlier position). vLLM's window
    w keeps the keys at most w − 1 positions back, the query's own included: diffattn's (and transformers')."""
    window = cfg.layer_window(layer)
    return {} if window is None else {"per_layer_sliding_window": window}


class ServedLayer(nn.Module):
    """The base of every served layer: the fused QKV projection and the out-projection, split by heads across
    ranks, and the families' QK-norm (:meth:`init_qk_norm`, :meth:`norm_qk`). A subclass is built by vLLM as
    ``Layer(cfg, layer_index, parts)`` (``cfg``: the served ``ModelConfig``) and implements
    ``forward(positions (T,), x (T, E)) -> (T, E)`` and :meth:`shape`. The window and the logit scale go to
    ``Attention`` (:func:`window_extra`, :func:`head_scale`), the layer's RoPE base to ``parts.rope``."""

    #: The registered type this one is served as (its layer and shape do the work), or None: itself.
    as_type: str | None = None

    def __init__(self, cfg: AttentionConfig, parts: VllmParts, *, head_size: int, q_heads: int, out_width: int):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = parts.qkv(cfg.d_model, head_size, q_heads, cfg.kv_heads, bias=cfg.attn_qkv_bias)
        self.out_proj = parts.row(out_width, cfg.d_model, bias=cfg.attn_out_bias)
        self.q_heads, self.kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # on this rank
        self.sizes = [self.q_heads * head_size, self.kv_heads * head_size, self.kv_heads * head_size]

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qkv, _ = self.qkv_proj(x)
        return qkv.split(self.sizes, dim=-1)

    def init_qk_norm(self, cfg: AttentionConfig, parts: VllmParts, width: int, own: bool = False) -> None:
        """``q_norm`` / ``k_norm`` over each ``width``-wide (sub-)head when the family's ``qk_norm`` or the type's
        own option (``own``) asks, as the diffattn module's (one gain shared by the heads, ``norm_eps``, Gemma's
        (1 + w) with ``norm_unit_offset``); else None."""
        self.qk_width = width
        if cfg.qk_norm or own:
            self.q_norm = parts.norm(width, cfg.norm_eps, cfg.norm_unit_offset)
            self.k_norm = parts.norm(width, cfg.norm_eps, cfg.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None

    def norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm (when set) on flat (T, heads·width) queries and keys, before RoPE."""
        if self.q_norm is None:
            return q, k
        t, w = q.shape[0], self.qk_width
        return self.q_norm(q.reshape(-1, w)).view(t, -1), self.k_norm(k.reshape(-1, w)).view(t, -1)

    def init_head_mask(self, cfg: AttentionConfig, layer: int, parts: VllmParts, local: int) -> None:
        """``head_mask`` (local,): this rank's slice of layer ``layer``'s head mask (``ModelConfig.diff_heads``: 1
        where a head's negative map is on, 0 where the head is a standard one), or None when every head's is on
        (the plain type). ``local``: the heads (V1: diff-heads, V2: query pairs) on this rank."""
        heads = cfg.layer_heads(layer)
        lo = parts.tp_rank * local
        mask = None if heads is None else selected_heads_mask(heads, cfg.n_heads)[lo:lo + local]
        self.register_buffer("head_mask", mask, persistent=False)

    def out(self, heads: Tensor) -> Tensor:
        y, _ = self.out_proj(heads.reshape(heads.shape[0], -1))
        return y

    @classmethod
    def shape(cls, cfg: AttentionConfig) -> AttentionShape:
        """The ``Attention`` layers of one block of served config ``cfg``."""
        raise NotImplementedError

    @classmethod
    def config(cls, cfg: AttentionConfig) -> AttentionConfig:
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
        state = dict(module.state_dict())
        if getattr(module, "shared_qk", False):
            for name in [n for n in state if n.startswith(("q_proj.", "q_norm."))]:
                state["k" + name[1:]] = state[name]
        return state
