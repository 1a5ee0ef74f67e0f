"""The transformers config class of the ``diffattn`` model type, so that vLLM (which reads every model's
config through ``transformers.AutoConfig``) reads the config.json of a ``diffattn export --to vllm`` folder.

That config.json is a ``save_pretrained`` one (``diffattn_class``, ``config``: the :class:`ModelConfig`), so
``diffattn.load_pretrained`` reads the same folder, plus ``model_type``, ``architectures`` and the sizes
vLLM reads. Those sizes are derived here from the nested ``config`` again, so the two cannot disagree.
Imported only by the plugin (:func:`diffattn.interop.vllm.register`) and the vLLM model code.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from diffattn.interop.vllm import MODEL_TYPE
from diffattn.interop.vllm.served import hf_fields
from diffattn.model.config import ModelConfig


class DiffattnConfig(PretrainedConfig):
    """config.json of a diffattn vLLM folder: ``config`` (a :class:`ModelConfig` as a dict, the served one) and
    ``diffattn_class``; the transformers-style sizes follow from them."""

    model_type = MODEL_TYPE

    def __init__(self, config: dict[str, Any] | None = None, diffattn_class: str = "TransformerLM",
                 **kwargs: Any) -> None:
        self.diffattn_class = diffattn_class
        self.diffattn_model = dict(config or {})
        if self.diffattn_model:
            kwargs.update(hf_fields(ModelConfig.from_dict(self.diffattn_model)))
        kwargs.setdefault("architectures", ["DiffattnForCausalLM"])
        super().__init__(**kwargs)

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` this folder serves."""
        return ModelConfig.from_dict(self.diffattn_model)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["config"] = d.pop("diffattn_model", {})
        return d
