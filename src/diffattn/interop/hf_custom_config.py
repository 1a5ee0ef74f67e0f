"""The transformers configuration of a diffattn model of any attention type: ``configuration_diffattn.py`` in a
custom-code folder (``diffattn export RUN --to hf`` for the types transformers does not ship).

This module is copied into the folder as it is (:mod:`diffattn.interop.hf_snapshot`), so it imports nothing of
diffattn: ``AutoConfig.from_pretrained(folder, trust_remote_code=True)`` reads it without our package. The
diffattn :class:`~diffattn.model.config.ModelConfig` travels whole, as a dict under ``diffattn``; the fields
transformers and its tools read by their usual names (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
``num_attention_heads``, ``max_position_embeddings``, ``tie_word_embeddings``) are copied from it.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class DiffattnConfig(PretrainedConfig):
    """``diffattn``: the ModelConfig dict (what builds the network) and its sizes under transformers' names."""

    model_type = "diffattn"

    def __init__(self, diffattn: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.diffattn = dict(diffattn or {})
        d = self.diffattn
        # the names transformers' tools read (lm-eval's max length, generate's defaults), from the one source
        self.vocab_size = d.get("vocab_size")
        self.hidden_size = d.get("d_model")
        self.num_hidden_layers = d.get("n_layers")
        self.num_attention_heads = d.get("n_heads")
        self.max_position_embeddings = d.get("max_seq_len")
        kwargs["tie_word_embeddings"] = bool(d.get("tie_embeddings", False))
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings"):
            kwargs.pop(k, None)  # written back by to_dict: derived, never read back over the dict
        super().__init__(**kwargs)
