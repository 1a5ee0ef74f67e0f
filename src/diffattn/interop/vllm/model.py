"""The vLLM models the plugin registers, built as vLLM's own Llama is: a body of decoder blocks (RMSNorm with the
fused residual add, the attention type's served layer, registered in its own file and built on vLLM's parts
(:mod:`.layers`), SwiGLU or GeGLU on ``MergedColumnParallelLinear`` + vLLM's activation-and-mul +
``RowParallelLinear``) compiled as one graph by vLLM (``support_torch_compile``), and a vocabulary-parallel LM
head. The families' options go where vLLM's Qwen2/Qwen3/Gemma 3 files put them: Gemma's (1 + w) norms
(``GemmaRMSNorm``), its norms after attention and MLP, √d_model embeddings. Parameter names follow diffattn's own
(``body.blocks.N.attn.q_proj`` ...), so a ``diffattn export --to vllm`` folder's weights load by name; only the
fused projections take shards.

* :class:`DiffattnForCausalLM`: config.json of model type ``diffattn`` (:mod:`.hf_config`).
* :class:`DiffLlamaForCausalLM`: a transformers DiffLlama folder, its config and weights translated to ours
  as ``diffattn.interop.hf`` does (sub-head order, NeoX RoPE, a norm without gain).

Imported only inside vLLM.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import get_act_and_mul_fn
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from diffattn.checkpoint.hf_family_table import DIFF
from diffattn.interop.hf import from_hf_config
from diffattn.interop.vllm.layers import norm_layer, served_attention
from diffattn.interop.vllm.served import config_problems, served_type, stored_types
from diffattn.interop.vllm.weights import STACKED, diffllama_weights
from diffattn.model.config import ModelConfig


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)) on ``MergedColumnParallelLinear``: SwiGLU (``SiluAndMul``) or Gemma's GeGLU
    (``GeluAndMul`` with the tanh approximation), as ``mlp_activation`` says."""

    def __init__(self, cfg: ModelConfig, quant_config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.d_model, [cfg.ffn_dim] * 2, bias=cfg.bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act = get_act_and_mul_fn(ACTIVATIONS[cfg.mlp_activation])

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.gate_up_proj(x)
        y, _ = self.down_proj(self.act(h))
        return y


#: diffattn's ``mlp_activation`` -> vLLM's name of the gated activation (``get_act_and_mul_fn``).
ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


class Block(nn.Module):
    """Y = X + Attn(RMSNorm(X)); X' = Y + MLP(RMSNorm(Y)), with the residual carried as vLLM's Llama does; Gemma's
    norms on the attention's and the MLP's outputs (``post_attn_norm``, ``post_ffn_norm``) before the add."""

    def __init__(self, cfg: ModelConfig, layer: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        quant = vllm_config.quant_config
        norm = functools.partial(norm_layer, cfg.d_model, cfg.norm_eps, cfg.norm_unit_offset)
        self.attn_norm = norm()
        self.attn = served_attention(cfg, layer, vllm_config.cache_config, quant, f"{prefix}.attn")
        self.post_attn_norm = norm() if cfg.post_attn_norm else None
        self.ffn_norm = norm()
        self.ffn = GatedMLP(cfg, quant, f"{prefix}.ffn")
        self.post_ffn_norm = norm() if cfg.post_ffn_norm else None

    def forward(self, positions: Tensor, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, x = x, self.attn_norm(x)
        else:
            x, residual = self.attn_norm(x, residual)
        x = self.attn(positions, x)
        if self.post_attn_norm is not None:
            x = self.post_attn_norm(x)
        x, residual = self.ffn_norm(x, residual)
        x = self.ffn(x)
        if self.post_ffn_norm is not None:
            x = self.post_ffn_norm(x)
        return x, residual


def served_model_config(hf_config) -> ModelConfig:
    """The :class:`ModelConfig` vLLM serves for a config.json: a diffattn folder's own, or a DiffLlama's as
    diffattn reads it. Raises ValueError (one line) for what cannot be served here."""
    if getattr(hf_config, "model_type", None) == DIFF.model_type:
        cfg = from_hf_config(hf_config, rope="neox")
    else:
        cfg = hf_config.model_config()
    problems = config_problems(cfg, cpu=_on_cpu())
    for t in stored_types(cfg):
        problems.append(f"it holds {t!r}, not the served type {served_type(t)!r} (export it with diffattn export "
                        "--to vllm)")
    if problems:
        raise ValueError("diffattn cannot serve this folder with vLLM: " + "; ".join(problems))
    return cfg


def _on_cpu() -> bool:
    return current_platform.is_cpu()


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class Body(nn.Module):
    """Token embeddings (× √d_model with ``scale_embeddings``) -> blocks -> final RMSNorm (diffattn's
    ``TransformerBody``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = served_model_config(vllm_config.model_config.hf_config)
        self.cfg = cfg
        self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, quant_config=vllm_config.quant_config,
                                              prefix=f"{prefix}.tok_emb")
        self.blocks = nn.ModuleList(Block(cfg, i, vllm_config, f"{prefix}.blocks.{i}") for i in range(cfg.n_layers))
        self.norm = norm_layer(cfg.d_model, cfg.norm_eps, cfg.norm_unit_offset)
        # Gemma's √d_model, rounded to the model's dtype as diffattn (and transformers) round it
        self.register_buffer("emb_scale", torch.tensor(math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0,
                                                        dtype=torch.float32),
                             persistent=False)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        x = self.tok_emb(input_ids)
        return x * self.emb_scale.to(x.dtype) if self.cfg.scale_embeddings else x

    def forward(self, input_ids: Tensor | None, positions: Tensor, intermediate_tensors: IntermediateTensors | None,
                inputs_embeds: Tensor | None = None) -> Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for block in self.blocks:
            x, residual = block(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class DiffattnForCausalLM(nn.Module):
    """A diffattn language model in vLLM (the served recipe of each layer from the folder's config)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.body = Body(vllm_config=vllm_config, prefix=_join(prefix, "body"))
        cfg = self.cfg = self.body.cfg
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.d_model, quant_config=vllm_config.quant_config,
                                      prefix=_join(prefix, "lm_head"))
        if cfg.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.body.tok_emb)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.body.embed_input_ids(input_ids)

    def forward(self, input_ids: Tensor | None, positions: Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: Tensor | None = None) -> Tensor:
        return self.body(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def translate(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The folder's weights under diffattn's names (a diffattn folder's are already)."""
        return iter(weights)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in self.translate(weights):
            if name == "lm_head.weight" and self.cfg.tie_embeddings:
                name = "body.tok_emb.weight"  # one tensor: a folder may name it either way
            target, shard = name, None
            for ours, fused, shard_id in STACKED:
                if ours in name:
                    target, shard = name.replace(ours, fused), shard_id
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r}: the folder does not match its config")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(target)
        return loaded


class DiffLlamaForCausalLM(DiffattnForCausalLM):
    """A transformers DiffLlama folder, served with the ``diff`` recipe: its weights re-laid out to ours as
    they stream in (:func:`.weights.diffllama_weights`); its per-head norm has no gain, so ours stays 1."""

    def translate(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        return diffllama_weights(weights, self.cfg)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith(".subln.weight"):
                    param.fill_(1.0)
                    loaded.add(name)
        return loaded


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
