"""V1's typed options from timm's ``layers/diff_attention.py``: ``dual_lambda`` (λ from two scalars) and
``qk_norm`` (RMSNorm over each Q/K sub-head before RoPE); their spelling as study arms; HF export refusing them."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn.attention.diff import DiffOptions, MultiheadDiffAttention
from diffattn.experiments.study.spec import StudyError, StudySpec, parse_variant
from diffattn.interop.hf import to_hf_config
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.ops.rope import RotaryEmbedding


def _cfg(**opts) -> ModelConfig:
    return ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attn_options=opts)


def test_dual_lambda_is_two_scalars_starting_at_lambda_init():
    plain, dual = TransformerLM(_cfg()), TransformerLM(_cfg(dual_lambda=True))
    a = dual.blocks[1].attn
    assert not hasattr(a, "lambda_q1") and a.lambda_a.shape == a.lambda_b.shape == ()
    d = a.head_dim
    assert plain.num_params() - dual.num_params() == 2 * (4 * d - 2)  # per layer: 4 vectors of d -> 2 scalars
    assert a.lambda_full().item() == pytest.approx(a.lambda_init)  # exp(0) − exp(0) + λ_init
    with torch.no_grad():
        a.lambda_a.fill_(0.3)
        a.lambda_b.fill_(-0.2)
    assert a.lambda_full().item() == pytest.approx(math.exp(0.3) - math.exp(-0.2) + a.lambda_init)
    dual(torch.randint(0, 40, (2, 9))).square().mean().backward()
    assert a.lambda_a.grad != 0 and a.lambda_b.grad != 0


@pytest.mark.parametrize("rope", ["none", "interleaved"])
def test_qk_norm_makes_the_maps_invariant_to_the_qk_scale(rope):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    for qk_norm in (False, True):
        attn = MultiheadDiffAttention(32, 2, depth=1, num_kv_heads=1, qk_norm=qk_norm)
        assert (attn.q_norm is not None) == qk_norm and (attn.k_norm is not None) == qk_norm
        model_rope = None
        if rope != "none":
            model_rope = RotaryEmbedding(attn.rope_dim, 16, 10000.0, rope)(torch.arange(7))
        with torch.no_grad():
            out = attn(x, model_rope)
            attn.q_proj.weight.mul_(10.0)
            attn.k_proj.weight.mul_(10.0)
            scaled = attn(x, model_rope)
        if qk_norm:  # each sub-head is normalized before RoPE: the scale is gone (up to the norm's eps)
            torch.testing.assert_close(scaled, out, rtol=0, atol=2e-4)
        else:
            assert (scaled - out).abs().max() > 1e-2


def test_qk_norm_with_shared_qk_normalizes_once():
    attn = MultiheadDiffAttention(32, 2, depth=0, shared_qk=True, qk_norm=True)
    assert attn.k_proj is None and attn.k_norm is None and attn.q_norm is not None
    assert torch.isfinite(attn(torch.randn(1, 5, 32))).all()


def test_options_are_typed_and_spelled_as_study_arms(tmp_path):
    assert _cfg(qk_norm=True).options == DiffOptions(qk_norm=True)
    with pytest.raises(ValueError, match="dual_lambda must be bool"):
        _cfg(dual_lambda="yes")
    assert parse_variant("diff+qk_norm+dual_lambda") == ("diff", ("dual_lambda", "qk_norm"))  # canonical order
    assert parse_variant("diff_distance+qk_norm") == ("diff_distance", ("qk_norm",))
    with pytest.raises(StudyError, match="unknown or repeated option"):
        parse_variant("standard+qk_norm")
    spec = StudySpec.from_dict(dict(data=str(tmp_path / "x.txt"), d_model=32, n_layers=1, heads=[2],
                               variants=["diff+qk_norm"],
                     seq_len=16))
    arm = spec.arm("diff+qk_norm")
    assert arm.label.startswith("DIFF+qk_norm")
    cfg = spec.arm_config(arm)
    assert cfg.attention == "diff" and cfg.options.qk_norm and not cfg.options.dual_lambda


def test_hf_export_refuses_the_options():
    with pytest.raises(ValueError, match="attn_options"):
        to_hf_config(_cfg(qk_norm=True))
