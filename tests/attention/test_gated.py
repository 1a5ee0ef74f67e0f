"""Gated attention (Qiu et al. 2025, G1): the op against a per-head hand computation (elementwise and headwise
gates, GQA, causal and bidirectional), fast == reference, gradcheck, the initialisation, the parameter count and
its matched baseline, and the exact conversion from a standard model."""

from __future__ import annotations

import pytest
import torch

from diffattn.attention.gated import GatedAttention, gated_attention, gated_attention_ref
from diffattn.experiments.study.spec import StudySpec
from diffattn.interop.convert import convert, converted_config, created_tensors
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM
from diffattn.train.plan import flops_per_token


def _inputs(b=2, h=4, hkv=2, t=7, d=6, gate_width=6):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(b, h, t, d), r(b, hkv, t, d), r(b, hkv, t, d), r(b, h, t, gate_width)


def _oracle(q, k, v, gate, causal):
    b, h, t, d = q.shape
    out = torch.empty_like(q)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // k.shape[1])
            s = q[bi, hi] @ k[bi, g].T / d**0.5
            if causal:
                s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = torch.softmax(s, -1) @ v[bi, g]
            out[bi, hi] = y * (1 / (1 + torch.exp(-gate[bi, hi])))  # σ written out
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("width", [6, 1], ids=["elementwise", "headwise"])
def test_gated_attention_is_the_gated_sdpa_output(causal, width):
    q, k, v, gate = _inputs(gate_width=width)
    want = _oracle(q, k, v, gate, causal)
    torch.testing.assert_close(gated_attention_ref(q, k, v, gate, causal=causal), want)
    torch.testing.assert_close(gated_attention(q, k, v, gate, causal=causal), want)


def test_gated_attention_gradcheck_and_gate_shape_error():
    q, k, v, gate = (x[:1, :, :4, :3].clone().requires_grad_() for x in _inputs(d=3, gate_width=3))
    assert torch.autograd.gradcheck(lambda *a: gated_attention(*a, causal=True), (q, k, v, gate))
    with pytest.raises(ValueError, match="gate logits"):
        gated_attention(q, k, v, gate[..., :2])


def test_gate_initialisation_and_parameter_count():
    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, attention="gated")
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    attn = model.blocks[0].attn
    assert isinstance(attn, GatedAttention) and attn.gate_proj.bias is None  # no bias, like the projections
    assert abs(float(attn.gate_proj.weight.detach().std()) - cfg.init_std) < 0.002  # drawn like every projection
    caught = []
    attn.capture = caught
    model(torch.randint(0, 50, (2, 16)))
    assert abs(float(caught[0]["gate"].mean()) - 0.5) < 0.02  # σ(≈0): the gates start near ½
    base = TransformerLM(cfg.replace(attention="standard"))
    assert model.num_params() - base.num_params() == cfg.n_layers * cfg.d_model * cfg.d_model  # W_θ: E × H·d
    headwise = TransformerLM(cfg.replace(attn_options={"gate_headwise": True}))
    assert headwise.num_params() - base.num_params() == cfg.n_layers * cfg.d_model * cfg.n_heads


def test_matched_baseline_and_study_arm_match_the_parameters():
    cfg = ModelConfig(vocab_size=65, d_model=128, n_layers=4, n_heads=4, attention="gated")
    with torch.device("meta"):
        gated = TransformerLM(cfg).num_params()
        base = TransformerLM(matched_baseline(cfg)).num_params()
    assert matched_baseline(cfg).attention == "standard" and abs(gated - base) <= 3 * cfg.d_model * cfg.n_layers
    spec = StudySpec.from_dict({"data": "x", "variants": ["gated+matched"], "head_dims": [32], "steps": 10})
    arms = {a.name: spec.arm_config(a, 65) for a in spec.arms()}
    with torch.device("meta"):
        n = {k: TransformerLM(c).num_params() for k, c in arms.items()}
    assert arms["gated+matched"].ffn_hidden < arms["standard"].ffn_dim
    assert abs(n["gated+matched"] - n["standard"]) / n["standard"] < 0.002
    assert flops_per_token(cfg, 128)["attention"] == flops_per_token(cfg.replace(attention="standard"), 128)[
        "attention"]


def test_convert_to_gated_is_exact_and_the_gate_gets_a_gradient():
    torch.manual_seed(0)
    src = TransformerLM(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    attention="standard", rope="neox")).eval()
    out = convert(src, "gated")
    assert out.config == converted_config(src.config, "gated")
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        assert torch.equal(out(ids), src(ids))  # ×½ and ×2 are exact
    out.train()
    out(ids).square().mean().backward()
    grads = created_tensors(out, grads=True)
    assert all(float(g.abs().max()) > 0 for g in grads.values())
    with pytest.raises(ValueError, match="not parameter-matched"):
        converted_config(src.config, "gated", init="split")
