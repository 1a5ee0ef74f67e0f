"""Which part of the model a parameter is, read from its name: one classifier for the components ``diffattn info``
and ``diffattn plan`` count (:func:`component_of`, :func:`param_counts`) and the groups the gradient diagnostics
measure (:func:`diffattn.train.diagnostics.grad_group_norms`)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

COMPONENTS = ("embeddings", "attention", "lambda", "ffn", "norms", "lm_head", "classifier_head", "other")
# the attention projections that have a part of their own; an attention's other parameters (distance w and v,
# Shared DIFF's low-rank factors) are "attention"
_PROJECTIONS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "out"}
_COMPONENT = {"norm": "norms", "q": "attention", "k": "attention", "v": "attention", "out": "attention"}


def parameter_part(name: str) -> tuple[int | None, str]:
    """(the block index or None outside the blocks, the part) of a parameter or state-dict name such as
    ``body.blocks.3.attn.q_proj.weight`` -> (3, "q"). Parts: "embeddings", "lm_head", "classifier_head",
    "lambda" (λ vectors, V2's W_λ), "norm" (RMSNorm gains, V1's sub-layer norm), "q", "k", "v", "out" (the
    attention projections), "attention" (its other parameters), "ffn", "other"."""
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
    layer = None
    if "blocks" in parts[:-1] and parts[parts.index("blocks") + 1].isdigit():
        layer = int(parts[parts.index("blocks") + 1])
    if "tok_emb" in parts:
        return layer, "embeddings"
    if parts[0] == "lm_head":
        return layer, "lm_head"
    if parts[0] == "head":
        return layer, "classifier_head"
    if leaf.startswith("lambda"):
        return layer, "lambda"
    if "norm" in leaf or leaf == "subln":
        return layer, "norm"
    if "attn" in parts:
        return layer, _PROJECTIONS.get(leaf, "attention")
    if "ffn" in parts:
        return layer, "ffn"
    return layer, "other"


def component_of(name: str) -> str:
    """Which of :data:`COMPONENTS` a parameter belongs to (``diffattn info``, ``diffattn plan``)."""
    part = parameter_part(name)[1]
    return _COMPONENT.get(part, part)


def param_counts(state_dict: Mapping[str, Tensor], tied: Mapping[str, str] | None = None) -> dict[str, int]:
    """Parameter count per component; tied aliases are counted once (under the stored name)."""
    tied = tied or {}
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, t in state_dict.items():
        if name in tied:
            continue
        counts[component_of(name)] += t.numel()
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    return counts
