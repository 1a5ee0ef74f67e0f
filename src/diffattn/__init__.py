"""diffattn: differential (V1, V2) and distance-aware attention for transformers."""

from diffattn.attention import functional
from diffattn.attention.diff import MultiheadDiffAttention
from diffattn.attention.diff_v2 import DiffV2Attention
from diffattn.attention.registry import ATTENTION, attention_classes, register
from diffattn.attention.standard import StandardAttention
from diffattn.interop.hub import load_pretrained, load_pretrained_tokenizer
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerClassifier, TransformerEncoder, TransformerLM
from diffattn.ops.norm import RMSNorm

__all__ = [
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
__version__ = "0.1.0"


def __getattr__(name: str):
    """Every registered attention module class by its class name (``diffattn.DistanceAttention``), so a new
    variant's file is exported without an edit here."""
    cls = attention_classes().get(name)
    if cls is None:
        raise AttributeError(f"module 'diffattn' has no attribute {name!r}")
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), *attention_classes()})
