"""diffattn: differential (V1, V2) and distance-aware attention for transformers.

The public names below load on first use (PEP 562), so ``import diffattn`` and the ``diffattn`` command start
without importing torch or any subpackage; ``from diffattn import TransformerLM`` loads what that name needs.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it ("functional" is a module itself)
_EXPORTS: dict[str, str] = {
    "ATTENTION": "diffattn.attention.registry",
    "DiffV2Attention": "diffattn.attention.diff_v2",
    "ModelConfig": "diffattn.model.config",
    "MultiheadDiffAttention": "diffattn.attention.diff",
    "RMSNorm": "diffattn.ops.norm",
    "StandardAttention": "diffattn.attention.standard",
    "TransformerClassifier": "diffattn.model.transformer",
    "TransformerEncoder": "diffattn.model.transformer",
    "TransformerLM": "diffattn.model.transformer",
    "functional": "diffattn.attention.functional",
    "load_pretrained": "diffattn.checkpoint.model_folders",
    "load_pretrained_tokenizer": "diffattn.checkpoint.model_folders",
    "matched_baseline": "diffattn.model.config",
    "register": "diffattn.attention.registry",
}
__all__ = [  # = _EXPORTS, spelled out for tools that read it statically
    "ATTENTION",
    "DiffV2Attention",
    "ModelConfig",
    "MultiheadDiffAttention",
    "RMSNorm",
    "StandardAttention",
    "TransformerClassifier",
    "TransformerEncoder",
    "TransformerLM",
    "functional",
    "load_pretrained",
    "load_pretrained_tokenizer",
    "matched_baseline",
    "register",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and not name.startswith("_") and importlib.util.find_spec(f"diffattn.{name}") is not None:
        return importlib.import_module(f"diffattn.{name}")  # a subpackage, e.g. diffattn.attention, as before
    if module is None:
        # every registered attention module class by its class name (diffattn.DistanceAttention), so a new
        # variant's file is exported without an edit here
        cls = None if name.startswith("_") else _attention_classes().get(name)
        if cls is None:
            raise AttributeError(f"module 'diffattn' has no attribute {name!r}")
        return cls
    loaded = importlib.import_module(module)
    value = loaded if name == "functional" else getattr(loaded, name)
    globals()[name] = value  # the next lookup is an ordinary attribute
    return value


def _attention_classes() -> dict[str, Any]:
    return importlib.import_module("diffattn.attention.registry").attention_classes()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_attention_classes()))


if TYPE_CHECKING:  # for type checkers and editors: the names as eager imports would give them
    from diffattn.attention import functional
    from diffattn.attention.diff import MultiheadDiffAttention
    from diffattn.attention.diff_v2 import DiffV2Attention
    from diffattn.attention.registry import ATTENTION, register
    from diffattn.attention.standard import StandardAttention
    from diffattn.checkpoint.model_folders import load_pretrained, load_pretrained_tokenizer
    from diffattn.model.config import ModelConfig, matched_baseline
    from diffattn.model.transformer import TransformerClassifier, TransformerEncoder, TransformerLM
    from diffattn.ops.norm import RMSNorm
