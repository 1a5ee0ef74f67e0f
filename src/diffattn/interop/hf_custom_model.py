"""The transformers model of a diffattn language model of any attention type: ``modeling_diffattn.py`` in a
custom-code folder (``diffattn export RUN --to hf`` for the types transformers does not ship).

A thin :class:`transformers.PreTrainedModel` around diffattn's own
:class:`~diffattn.model.transformer.TransformerLM`: the network is ours, built from the ModelConfig the
:class:`~diffattn.interop.hf_custom_config.DiffattnConfig` carries, so transformers computes exactly what
diffattn computes. The export copies this module, the model and attention modules it imports and the modules of
the attention types the model uses into the folder (:mod:`diffattn.interop.hf_snapshot` rewrites their
``diffattn.`` imports to relative ones): the same code, not a second copy, and the folder needs no diffattn.

transformers' cache and ``generate`` map onto ours: the first forward with ``use_cache`` sets up our static KV
cache (every layer's, :meth:`TransformerLM.setup_cache`, for the model's whole context) and returns a
:class:`DiffattnCache` that counts the tokens it holds; each later forward given it writes the new tokens at the
next positions. transformers' 2-D ``attention_mask`` (1: a token, 0: padding, e.g. a left-padded batch) becomes our
key mask. The weights are ours under ``model.`` (``model.body.blocks.0.attn.q_proj.weight``, ...).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from diffattn.interop.hf_custom_config import DiffattnConfig
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM

_CACHE_ARGS = ("cache", "past_key_values")  # transformers 5.24 names it `cache`; earlier 5.x `past_key_values`


class DiffattnCache(Cache):
    """What ``generate`` carries between steps: the number of tokens our static KV cache holds, for one model
    and one batch. The keys and values themselves live in the model's attention layers."""

    is_compileable = False
    is_croppable = False

    def __init__(self, model: TransformerLM, batch_size: int) -> None:
        super().__init__(layers=[])
        self.lm, self.rows, self.seen = model, batch_size, 0

    @property
    def is_linear(self) -> list[bool]:  # not a linear-attention (recurrent) cache: generate slices inputs by length
        return [False]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return int(self.lm.config.max_seq_len)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0

    @torch.no_grad()
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i of every layer's cache becomes row ``beam_idx[i]`` (every buffer of our caches,
        keys, values and a type's own, e.g. DINT's rows or FoX's gates, is batch-first)."""
        for block in self.lm.blocks:
            for buf in block.attn.cache.buffers():
                buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a diffattn model's cache is not cropped (assisted decoding): generate without "
                                  "an assistant model")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a diffattn model's cache is set up for one batch: generate without it")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a diffattn model's cache is set up for one batch: generate without it")


class DiffattnForCausalLM(PreTrainedModel, GenerationMixin):
    """``AutoModelForCausalLM`` of a diffattn export: ``model(input_ids).logits`` are diffattn's logits."""

    config_class = DiffattnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: DiffattnConfig) -> None:
        super().__init__(config)
        cfg = ModelConfig.from_dict(config.diffattn)
        # Built on the CPU even inside transformers' meta-device loading: the buffers computed here (RoPE tables,
        # head masks, ALiBi slopes) are in no checkpoint, so they must hold their values, not meta tensors.
        with torch.device("cpu") if _on_meta() else contextlib.nullcontext():
            self.model = TransformerLM(cfg)
        self._live: DiffattnCache | None = None
        # transformers' loading replaces every buffer in no checkpoint with an uninitialised one (it expects
        # _init_weights to recompute them): these are the values to put back (from_pretrained)
        saved = set(self.model.state_dict())
        self._computed = {n: b.detach().clone() for n, b in self.model.named_buffers() if n not in saved}
        self._tied_weights_keys = ({"model.lm_head.weight": "model.body.tok_emb.weight"}
                                   if cfg.tie_embeddings else {})
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> DiffattnForCausalLM:
        """transformers' loading, then the computed buffers (RoPE tables, head masks, ...) as built."""
        model = super().from_pretrained(*args, **kwargs)
        with torch.no_grad():
            for name, value in model._computed.items():
                buf = model.model.get_buffer(name)
                buf.copy_(value.to(device=buf.device, dtype=buf.dtype))
        return model

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is ours (DiffattnCache, made by forward), not transformers' DynamicCache

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: TransformerLM initialised itself, and from_pretrained loads every weight."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.body.tok_emb

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        """input_ids (B, T) -> logits (B, T, vocab); with ``use_cache`` (or a cache given) the tokens go into our
        KV cache after the ones it holds and the cache comes back under transformers' name for it."""
        cache = next((kwargs[k] for k in _CACHE_ARGS if kwargs.get(k) is not None), None)
        lm = self.model
        if cache is not None or use_cache:
            cache = self._cache(cache, input_ids.shape[0])
            pos = torch.arange(cache.seen, cache.seen + input_ids.shape[1], device=input_ids.device)
            logits = lm(input_ids, input_pos=pos, attn_mask=_key_mask(attention_mask, lm.config.max_seq_len))
            cache.seen += input_ids.shape[1]
        else:
            lm.clear_cache()
            logits = lm(input_ids, attn_mask=_key_mask(attention_mask, input_ids.shape[1]))
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        if cache is not None:
            out[_cache_field()] = cache
        return out

    def _cache(self, cache: DiffattnCache | None, batch_size: int) -> DiffattnCache:
        """The cache a step continues, or a new one (our KV cache set up afresh)."""
        if cache is None:
            p = self.model.lm_head.weight
            self.model.setup_cache(batch_size, dtype=p.dtype)
            self._live = DiffattnCache(self.model, batch_size)
            return self._live
        if not isinstance(cache, DiffattnCache) or cache is not self._live:
            raise ValueError("this model continues only the DiffattnCache its own last forward returned (its keys "
                             "and values live in the model's layers); start again without a cache")
        return cache


def _on_meta() -> bool:
    return torch.empty(0).device.type == "meta"


def _cache_field() -> str:
    fields = CausalLMOutputWithPast.__dataclass_fields__
    return next(k for k in _CACHE_ARGS if k in fields)


def _key_mask(attention_mask: Tensor | None, width: int) -> Tensor | None:
    """transformers' (B, S) 0/1 mask over the tokens so far -> our (B, width) bool key mask (slots after S are
    kept: the causal mask already hides them); None when nothing is padding."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    keep = torch.ones(attention_mask.shape[0], width, dtype=torch.bool, device=attention_mask.device)
    keep[:, :attention_mask.shape[1]] = attention_mask.bool()
    return keep
