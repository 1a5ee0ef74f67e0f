"""diffattn: differential (V1, V2) and distance-aware attention for transformers."""

from diffattn.attention import functional
from diffattn.attention.diff import MultiheadDiffAttention
from diffattn.attention.diff_v2 import DiffV2Attention
from diffattn.attention.registry import ATTENTION, register
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
