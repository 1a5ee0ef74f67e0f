"""diffattn: differential (V1, V2) and distance-aware attention for transformers."""

from . import functional
from .layers import ATTENTION, DiffV2Attention, MultiheadDiffAttention, RMSNorm, StandardAttention, register
from .model import ModelConfig, TransformerClassifier, TransformerEncoder, TransformerLM, matched_baseline

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
    "matched_baseline",
    "register",
]
__version__ = "0.1.0"
