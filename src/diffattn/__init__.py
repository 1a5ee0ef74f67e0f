"""diffattn: differential (V1, V2) and distance-aware attention for transformers."""

from diffattn.attention import functional
from diffattn.attention.layers import (
    ATTENTION,
    DiffV2Attention,
    MultiheadDiffAttention,
    RMSNorm,
    StandardAttention,
    register,
)
from diffattn.interop.hub import load_pretrained, load_pretrained_tokenizer
from diffattn.model.transformer import (
    ModelConfig,
    TransformerClassifier,
    TransformerEncoder,
    TransformerLM,
    matched_baseline,
)

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
