"""Grouped differential attention (Lim et al. 2025): the op against a per-head hand computation (signal heads,
the noise head each group shares, GQA, causal and bidirectional), fast == reference, gradcheck, ratio 1 is V1
exactly, the head-count rules, the parameter count and its matched baseline, the FLOPs the planner counts, and the
exact conversion from a GQA standard model."""

from __future__ import annotations

import pytest
import torch

from diffattn.attention.diff import MultiheadDiffAttention
from diffattn.attention.grouped_diff import (
    GroupedDiffAttention,
    group_heads,
    grouped_diff_attention,
    grouped_diff_attention_ref,
)
from diffattn.experiments.study.spec import StudySpec
from diffattn.interop.convert import convert, converted_config, created_tensors
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM
from diffattn.train.plan import flops_per_token


def _inputs(n_s=6, n_n=2, hkv=2, t=7, d=4, b=2):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(b, n_s + n_n, t, d), r(b, 2 * hkv, t, d), r(b, hkv, t, 2 * d)


def _oracle(q, k, v, lam, ratio, causal):
    """Signal head i = group i // r's i % r-th query sub-head; its noise head is the group's last sub-head."""
    b, s, t, d = q.shape
    n_n, hkv = s // (ratio + 1), v.shape[1]
    n_s = s - n_n
    out = torch.empty(b, n_s, t, 2 * d, dtype=q.dtype)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1) if causal else torch.zeros(t, t, dtype=torch.bool)

    def probs(qh, kh):
        return torch.softmax((qh @ kh.T / d**0.5).masked_fill(mask, float("-inf")), -1)

    for bi in range(b):
        for i in range(n_s):
            grp = i // ratio
            sig = q[bi, grp * (ratio + 1) + i % ratio]
            noise = q[bi, grp * (ratio + 1) + ratio]
            g_s, g_n = i // (n_s // hkv), grp // (n_n // hkv)
            assert g_s == g_n  # a group stays on one KV head
            a = probs(sig, k[bi, 2 * g_s]) - lam * probs(noise, k[bi, 2 * g_n + 1])
            out[bi, i] = a @ v[bi, g_s]
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("ratio", "n_s", "n_n", "hkv"), [(3, 6, 2, 2), (3, 6, 2, 1), (1, 4, 4, 2), (2, 4, 2, 1)])
def test_grouped_diff_attention_is_the_grouped_difference(causal, ratio, n_s, n_n, hkv):
    q, k, v = _inputs(n_s, n_n, hkv)
    want = _oracle(q, k, v, 0.7, ratio, causal)
    torch.testing.assert_close(grouped_diff_attention_ref(q, k, v, 0.7, ratio, causal=causal), want)
    torch.testing.assert_close(grouped_diff_attention(q, k, v, 0.7, ratio, causal=causal), want)


def test_gradcheck_and_shape_rules():
    q, k, v = (x[:1, :, :4].clone().requires_grad_() for x in _inputs(3, 1, 1, d=2))
    lam = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: grouped_diff_attention(*a, 3, causal=True), (q, k, v, lam))
    assert group_heads(8, 3) == (6, 2) and group_heads(4, 1) == (2, 2)
    with pytest.raises(ValueError, match="multiple of 4"):
        group_heads(6, 3)
    with pytest.raises(ValueError, match="KV heads"):
        GroupedDiffAttention(64, 4, 0, num_kv_heads=4, ratio=3)  # 2 noise heads cannot spread over 4 KV heads


def test_ratio_one_is_v1_exactly():
    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, attention="diff")
    torch.manual_seed(0)
    v1 = TransformerLM(cfg).eval()
    gda = TransformerLM(cfg.replace(attention="grouped_diff", attn_options={"gda_ratio": 1})).eval()
    gda.load_state_dict(v1.state_dict(), strict=True)  # the same parameters, names and shapes
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(gda(ids), v1(ids), rtol=1e-6, atol=1e-6)


def test_heads_parameters_matched_baseline_and_flops():
    cfg = ModelConfig(vocab_size=65, d_model=128, n_layers=4, n_heads=2, attention="grouped_diff")
    torch.manual_seed(0)
    a = TransformerLM(cfg).blocks[0].attn
    assert (a.n_signal, a.n_noise, a.num_kv_heads, a.head_dim) == (3, 1, 1, 32)  # the paper's 3:1, default hkv
    assert tuple(a.out_proj.weight.shape) == (128, 3 * 2 * 32) and a.subln is not None
    v1 = TransformerLM(cfg.replace(attention="diff")).blocks[0].attn
    assert tuple(a.q_proj.weight.shape) == tuple(v1.q_proj.weight.shape)  # the same 2h query sub-heads
    with torch.device("meta"):
        gda_n = TransformerLM(cfg).num_params()
        base_n = TransformerLM(matched_baseline(cfg)).num_params()
    assert matched_baseline(cfg).n_heads == 4 and abs(gda_n - base_n) <= 3 * 128 * 4
    spec = StudySpec.from_dict({"data": "x", "variants": ["grouped_diff+matched"], "head_dims": [32], "steps": 10})
    arms = {x.name: spec.arm_config(x, 65) for x in spec.arms()}
    with torch.device("meta"):
        n = {k: TransformerLM(c).num_params() for k, c in arms.items()}
    assert abs(n["grouped_diff+matched"] - n["standard"]) / n["standard"] < 0.002
    assert isinstance(a, MultiheadDiffAttention)
    assert flops_per_token(cfg, 128)["attention"] == flops_per_token(cfg.replace(attention="diff"), 128)["attention"]


def test_convert_to_gda_is_exact_and_every_created_tensor_trains():
    torch.manual_seed(0)
    src = TransformerLM(ModelConfig(vocab_size=40, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                                    attention="standard", rope="neox")).eval()
    out = convert(src, "grouped_diff")
    a = out.blocks[0].attn
    assert (a.n_signal, a.n_noise, a.num_kv_heads, a.head_dim) == (6, 2, 2, 8)  # the source heads as signal heads
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(out(ids), src(ids), rtol=1e-5, atol=1e-5)
    out.train()
    opt = torch.optim.AdamW(out.parameters(), lr=1e-3)
    for _ in range(2):  # λ = 0 at the start: the noise heads get a gradient once λ moved
        opt.zero_grad()
        out(ids).square().mean().backward()
        opt.step()
    assert all(float(g.abs().max()) > 0 for g in created_tensors(out, grads=True).values())
    with pytest.raises(ValueError, match="KV heads .* to divide"):
        converted_config(src.config.replace(n_kv_heads=None), "grouped_diff")  # MHA: 6 KV heads, 2 noise heads
