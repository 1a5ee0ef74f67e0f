"""Weight names for the vLLM models, without vLLM: which of diffattn's weights load into a fused vLLM projection
(and as which shard), and a transformers DiffLlama folder's weights translated to diffattn's names one tensor
at a time (the layout facts are :mod:`diffattn.interop.hf`'s)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from torch import Tensor

from diffattn.checkpoint.hf_families import halves_to_pairs
from diffattn.model.config import ModelConfig

#: (diffattn name part, fused vLLM parameter part, shard id): Q, K, V into ``qkv_proj``; the SwiGLU's gate and
#: up projections into ``gate_up_proj``.
STACKED = ((".attn.q_proj.", ".attn.qkv_proj.", "q"), (".attn.k_proj.", ".attn.qkv_proj.", "k"),
           (".attn.v_proj.", ".attn.qkv_proj.", "v"), (".ffn.gate_proj.", ".ffn.gate_up_proj.", 0),
           (".ffn.up_proj.", ".ffn.gate_up_proj.", 1))

_GLOBAL = {"model.embed_tokens.weight": "body.tok_emb.weight", "model.norm.weight": "body.norm.weight",
           "lm_head.weight": "lm_head.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate_proj.weight": "ffn.gate_proj.weight", "mlp.up_proj.weight": "ffn.up_proj.weight",
          "mlp.down_proj.weight": "ffn.down_proj.weight", "self_attn.o_proj.weight": "attn.out_proj.weight",
          **{f"self_attn.lambda_{n}": f"attn.lambda_{n}" for n in ("q1", "k1", "q2", "k2")}}
_SUBHEADS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def diffllama_weights(weights: Iterable[tuple[str, Tensor]], cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """A DiffLlama folder's (name, tensor) pairs as diffattn's V1 names them (``cfg``: its config as
    ``from_hf_config(rope="neox")`` reads it): DiffLlama's halves-first sub-head order of q/k/v rows becomes
    the official pairs (each diff-head's Q1, Q2 adjacent; each KV head's K1, K2 and its 2d-wide V). Rotary
    buffers are skipped; any other name is an error naming it."""
    for name, tensor in weights:
        if name in _GLOBAL:
            yield _GLOBAL[name], tensor
            continue
        if "rotary_emb" in name:
            continue
        m = _LAYER_NAME.fullmatch(name)
        if m is None:
            raise ValueError(f"unexpected DiffLlama weight {name!r}")
        layer, rest = m.groups()
        if rest in _SUBHEADS:
            yield f"body.blocks.{layer}.attn.{rest.split('.')[1]}.weight", halves_to_pairs(tensor, cfg.qk_head_dim)
        elif rest in _LAYER:
            yield f"body.blocks.{layer}.{_LAYER[rest]}", tensor
        else:
            raise ValueError(f"unexpected DiffLlama weight {name!r}")
