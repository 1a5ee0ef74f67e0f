"""The transformers families diffattn reads and writes, one :class:`Family` record each: the only place a family
is named. Reading a ``config.json`` and laying out its weights (:mod:`diffattn.checkpoint.hf_families`) and writing
a model back as its family's class (:mod:`diffattn.interop.hf`) both derive from these records, so adding a family
is one record (``tests/interop/test_family_table.py`` round-trips every record). Each family is Llama plus options
of ``ModelConfig``, as read off transformers 5.x's modeling files; the fields of :class:`Family` name them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_COMMON = {"hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02, "head_dim": None,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0}
_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
                "max_position_embeddings": 32768}
#: What each bias style fixes of a ModelConfig (properties included): another value cannot be written.
_BIAS_FIXED: dict[str, dict[str, bool]] = {
    "attention_mlp": {}, "attention": {"bias": False},
    "qkv": {"bias": False, "attn_qkv_bias": True, "attn_out_bias": False},
    "none": {"bias": False, "attn_qkv_bias": False, "attn_out_bias": False}}
_WINDOWS = ("none", "every_layer", "qwen", "gemma")
#: Our MLP activation -> transformers' name for it.
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class Family:
    """One transformers family: its names, its config's defaults, and the options of ours it has."""

    model_type: str
    model_class: str
    config_class: str
    defaults: Mapping[str, Any] = field(repr=False)  # transformers' config defaults (5.x) for the keys read
    # "attention_mlp": attention_bias (q, k, v, o) and mlp_bias (Llama); "attention": attention_bias only; "qkv":
    # q, k, v always, o and the MLP never (Qwen2); "none": no switch
    bias: str = "attention_mlp"
    # "none"; "every_layer": sliding_window on each layer; "qwen": only with use_sliding_window, the layers
    # layer_types names (older configs: those from max_window_layers on); "gemma": layer_types (older configs:
    # every sliding_window_pattern-th layer global)
    window: str = "none"
    qk_norm: bool = False  # RMSNorm over each q and k head, before RoPE
    norm_unit_offset: bool = False  # RMSNorm as x̂·(1 + w) (Gemma)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too (Gemma's four)
    scale_embeddings: bool = False  # embeddings × √hidden_size
    activation: str = "silu"  # ours (mlp_activation), written under activation_key
    activation_key: str = "hidden_act"
    scores_scalar: bool = False  # logits × query_pre_attn_scalar^-½
    local_rope: bool = False  # a RoPE base per layer type (rope_parameters per type; older: rope_local_base_freq)
    fused: bool = False  # q, k, v in one qkv_proj and gate, up in gate_up_proj, in that order (Phi-3)
    head_dim_key: bool = True  # the config has head_dim (Phi-3's is hidden_size / heads, always)
    rope_scaling: bool = True  # the class applies rope_type "linear"
    diff: bool = False  # DiffLlama, transformers' V1: sub-heads counted (its layout: diffattn.interop.hf)
    by_features: bool = True  # a model of no family may be written as it (BY_FEATURES)

    def __post_init__(self) -> None:  # a misspelt style would read and write as another
        if self.bias not in _BIAS_FIXED or self.window not in _WINDOWS or self.activation not in HF_ACTIVATIONS:
            raise ValueError(f"family {self.model_type}: unknown bias {self.bias!r}, window {self.window!r} or "
                             f"activation {self.activation!r}")

    def fixed(self) -> dict[str, Any]:
        """What the family's class computes, as ModelConfig values (properties included): a model whose config
        has another value cannot be written as this class."""
        out: dict[str, Any] = {"post_attn_norm": self.sandwich_norms, "post_ffn_norm": self.sandwich_norms,
                               "norm_unit_offset": self.norm_unit_offset, "mlp_activation": self.activation,
                               "scale_embeddings": self.scale_embeddings}
        if not self.scores_scalar:
            out["query_pre_attn_scalar"] = None
        if not self.local_rope:
            out["rope_local_theta"] = None
        out["qk_norm"] = self.qk_norm
        out.update(_BIAS_FIXED[self.bias])
        if self.window == "none":
            out["sliding_window"] = None
        elif self.window == "every_layer":
            out["window_layers"] = None
        if not self.rope_scaling:
            out["rope_factor"] = 1.0
        return out

    @property
    def named(self) -> bool:
        """Whether a config read as this family keeps its name (``ModelConfig.family``): not the base's (a model of
        no family is one), nor DiffLlama's (``attention="diff"`` says it)."""
        return self is not TABLE[0] and not self.diff

    @property
    def one_attention_bias(self) -> bool:
        """Whether one ``attention_bias`` switch sets q, k, v and o together."""
        return self.bias in ("attention", "attention_mlp")


#: Every family, the base first (a model of no family has its weight names, and is written as it when no other
#: family expresses it); then in the order a model of no family is tried as.
TABLE: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "LlamaConfig",
           {**_COMMON, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False}),
    Family("mistral", "MistralForCausalLM", "MistralConfig",
           {**_COMMON, "max_position_embeddings": 131072, "sliding_window": 4096}, bias="none", window="every_layer"),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", {**_COMMON, **_QWEN_WINDOW}, bias="qkv", window="qwen"),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config",
           {**_COMMON, **_QWEN_WINDOW, "head_dim": 128, "attention_bias": False}, bias="attention", window="qwen",
           qk_norm=True),
    Family("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig",
           {**_COMMON, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
            "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False},
           bias="attention", window="gemma", qk_norm=True, norm_unit_offset=True, sandwich_norms=True,
           scale_embeddings=True, activation="gelu_tanh", activation_key="hidden_activation", scores_scalar=True,
           local_rope=True),
    Family("phi3", "Phi3ForCausalLM", "Phi3Config",
           {**_COMMON, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": None},
           bias="none", window="every_layer", fused=True, head_dim_key=False, rope_scaling=False, by_features=False),
    Family("diffllama", "DiffLlamaForCausalLM", "DiffLlamaConfig",
           {**_COMMON, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "lambda_std_dev": 0.1}, bias="none",
           rope_scaling=False, diff=True, by_features=False),
)
FAMILIES: dict[str, Family] = {f.model_type: f for f in TABLE}
BASE = TABLE[0]
DIFF = next(f for f in TABLE if f.diff)  # the family a V1 (diff) model is written as
BY_FEATURES = tuple(f for f in TABLE if f.by_features)  # what a model of no family is tried as, in this order
#: The transformers model class of every family (what ``export --to hf`` writes back).
HF_CLASSES = {f.model_type: f.model_class for f in TABLE}


def family_of(model_type: Any) -> Family | None:
    """The record of ``model_type`` (None: not a family here)."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None
