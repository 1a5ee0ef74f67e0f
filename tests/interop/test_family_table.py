"""One record per transformers family (issue 50): reading a family's config.json and writing a model back as that
family both derive from its record in :mod:`diffattn.checkpoint.hf_family_table`, so every record is tested here
without naming it: a config with each of the record's options turned on is written as the family (its config keys,
its weights) and read back unchanged; with transformers installed, the family's own classes build it and compute
its logits. Adding a family is one record, and these tests cover it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from diffattn.checkpoint.hf_families import family_config, weight_layout
from diffattn.checkpoint.hf_family_table import TABLE, Family
from diffattn.checkpoint.hf_folder import build_from_hf
from diffattn.interop.hf import export_family, export_problems, export_state_dict, hf_config_dict
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM

_PROPERTIES = ("attn_qkv_bias", "attn_out_bias")  # ModelConfig properties (of qkv_bias, out_bias and bias)


def example(f: Family) -> ModelConfig:
    """A small config of family ``f`` with every option the record gives it turned on (and off what it fixes):
    biases, a window on some layers or all, a head width that is not d_model / heads, RoPE scaling, Gemma's
    options."""
    kw = {k: v for k, v in f.fixed().items() if k not in _PROPERTIES}  # what it fixes, fields only
    kw.update(vocab_size=64, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, rope="neox",
              rope_theta=5e4, init_std=0.05, norm_eps=1e-5, tie_embeddings=False,
              attention="diff" if f.diff else "standard", family=f.model_type if f.named else None)
    if f.bias == "attention_mlp":
        kw.update(bias=True)
    elif f.bias == "attention":
        kw.update(qkv_bias=True, out_bias=True)
    elif f.bias == "qkv":
        kw.update(qkv_bias=True)
    if f.window == "every_layer":
        kw.update(sliding_window=8)
    elif f.window != "none":
        kw.update(sliding_window=8, window_layers=[0, 2])
    if f.local_rope:
        kw.update(rope_local_theta=1e3)
    if f.scores_scalar:
        kw.update(query_pre_attn_scalar=20.0)
    if f.head_dim_key and not f.diff:
        kw.update(head_dim=24)
    if f.rope_scaling:
        kw.update(rope_factor=2.0)
    if f.diff:
        kw.update(attn_options={"lambda_std": 0.05})
    return ModelConfig(**kw)


@pytest.mark.parametrize("f", TABLE, ids=lambda f: f.model_type)
def test_every_record_round_trips_its_config(f: Family) -> None:
    """Written as the family's config keys and read back: the same config, and the family is the one written."""
    cfg = example(f)
    assert export_problems(cfg) == [] and export_family(cfg) == f.model_type
    written = {"model_type": f.model_type, **hf_config_dict(cfg)}
    assert family_config(written) == cfg
    assert family_config(written, rope="interleaved") == cfg.replace(rope="interleaved")


@pytest.mark.parametrize("f", TABLE, ids=lambda f: f.model_type)
def test_every_record_round_trips_its_weights(f: Family) -> None:
    """Every weight written under the family's names (Phi-3's fused, DiffLlama's sub-heads reordered) is read back
    into the same place."""
    torch.manual_seed(0)
    model = TransformerLM(example(f)).eval()
    with torch.no_grad():  # gains and biases off their init: ones and zeros would hide a wrong mapping
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    if f.diff:  # DiffLlama's per-head norm has no gain (folded into o_proj on writing, 1 on reading)
        for name, p in model.named_parameters():
            if name.endswith("subln.weight"):
                p.data.fill_(1.0)
    state = export_state_dict(model)
    assert {e.hf for e in weight_layout(model.config.replace(family=f.model_type))} <= set(state)
    assert any("qkv_proj" in k for k in state) == f.fused
    back = build_from_hf(model.config, state.keys(), state.__getitem__, "neox")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("f", TABLE, ids=lambda f: f.model_type)
def test_every_record_is_its_transformers_class(f: Family, one_thread) -> None:
    """transformers builds the record's classes from what is written, they read back as the same config and
    compute the same logits."""
    transformers = pytest.importorskip("transformers")
    from diffattn.interop.hf import to_hf, to_hf_config

    cfg = example(f)
    hf_cfg = to_hf_config(cfg)
    assert type(hf_cfg).__name__ == f.config_class and hf_cfg.model_type == f.model_type
    assert family_config(hf_cfg.to_dict()) == cfg
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    hf = to_hf(model, attn_implementation="eager")
    assert type(hf).__name__ == f.model_class and hasattr(transformers, f.model_class)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4


def test_a_misspelt_style_is_refused() -> None:
    """A style no reader or writer knows would silently read and write as another: the record is refused."""
    for field, value in (("window", "qwn"), ("bias", "qkv_o"), ("activation", "gelu")):
        with pytest.raises(ValueError, match=f"{field} '{value}'"):
            dataclasses.replace(TABLE[0], **{field: value})


def test_no_family_is_named_outside_the_table() -> None:
    """A family's facts live in its record only: no other module of src names a family's model_type."""
    src = Path(__file__).resolve().parents[2] / "src" / "diffattn"
    names = "|".join(re.escape(f.model_type) for f in TABLE)
    literal = re.compile(rf"""["']({names})["']""")
    found = [f"{p.relative_to(src)}: {m.group(0)}" for p in sorted(src.rglob("*.py"))
             if p.name != "hf_family_table.py" for m in literal.finditer(p.read_text(encoding="utf-8"))]
    assert found == []
