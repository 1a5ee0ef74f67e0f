"""model/parts.py: one classifier of parameter names behind `diffattn info`'s components and the gradient
diagnostics' groups."""

from __future__ import annotations

import pytest

from diffattn.attention.registry import ATTENTION
from diffattn.checkpoint.tied import tied_aliases
from diffattn.model.config import ModelConfig
from diffattn.model.parts import COMPONENTS, component_of, param_counts, parameter_part
from diffattn.model.transformer import TransformerClassifier, TransformerLM


@pytest.mark.parametrize("name, expected", [
    ("body.blocks.3.attn.q_proj.weight", (3, "q")),
    ("body.blocks.0.attn.out_proj.weight", (0, "out")),
    ("body.blocks.1.attn.lambda_q1", (1, "lambda")),
    ("body.blocks.1.attn.lambda_proj.weight", (1, "lambda")),
    ("body.blocks.2.attn.subln.weight", (2, "norm")),
    ("body.blocks.2.attn_norm.weight", (2, "norm")),
    ("body.blocks.0.attn.distance_w", (0, "attention")),
    ("body.blocks.0.attn.q_up1.weight", (0, "attention")),
    ("body.blocks.4.ffn.gate_proj.weight", (4, "ffn")),
    ("body.tok_emb.weight", (None, "embeddings")),
    ("body.norm.weight", (None, "norm")),
    ("lm_head.weight", (None, "lm_head")),
    ("head.bias", (None, "classifier_head")),
    ("encoder.body.blocks.5.attn.k_proj.weight", (5, "k")),
])
def test_parameter_part(name, expected):
    assert parameter_part(name) == expected


def test_every_parameter_of_every_type_has_a_component_and_counts_add_up():
    for attention in ATTENTION:
        cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention=attention)
        for model in (TransformerLM(cfg), TransformerClassifier(cfg, 3, "mean")):
            sd = model.state_dict()
            assert {component_of(n) for n in sd} <= set(COMPONENTS)
            counts = param_counts(sd, tied_aliases(sd))
            assert counts["attention"] > 0 and counts["embeddings"] > 0, attention
            # the tied embedding and head are stored once: the total is the model's own count of parameters
            assert counts["total"] == sum(p.numel() for p in model.parameters()), attention
