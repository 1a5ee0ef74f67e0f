"""DINT (arXiv 2501.17486): the reference op against an oracle written here per head, the fast op against the
reference (forward and gradients; causal, bidirectional, key padding; GQA), the causal prefix mean (no output
depends on a later token, unlike a mean over all rows), rows summing to 1, the row cache, conversion."""

from __future__ import annotations

import pytest
import torch

from diffattn import functional as AF
from diffattn.attention.dint import DINTAttention, dint_attention, dint_attention_ref, prefix_mean
from diffattn.interop.convert import convert, targets
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM


def _inputs(b=2, h=2, hkv=1, t=9, d=8, lam=0.55):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return [r(b, 2 * h, t, d), r(b, 2 * hkv, t, d), r(b, hkv, t, 2 * d), torch.tensor(lam, dtype=torch.float64)]


def _oracle(q, k, v, lam, causal, key_valid=None):
    """Per diff-head, from the paper: A1 − λA2 + λG with G_ij = mean of A1_i'j over the rows i' query i sees
    (i' ≤ i when causal; the valid positions under key padding)."""
    b, h2, t, d = q.shape
    h, hkv = h2 // 2, v.shape[1]
    out = torch.empty(b, h, t, v.shape[-1], dtype=q.dtype)
    for bi in range(b):
        for i in range(h):
            g = i // (h // hkv)
            keep = torch.ones(t, t, dtype=torch.bool)
            if causal:
                keep = torch.tril(keep)
            if key_valid is not None:
                keep = keep & key_valid[bi][None, :]
            a = []
            for m in (0, 1):
                s = (q[bi, 2 * i + m] @ k[bi, 2 * g + m].T) / d**0.5
                a.append(torch.softmax(s.masked_fill(~keep, float("-inf")), -1))
            gmap = torch.stack([a[0][keep[r]].mean(0) for r in range(t)])
            out[bi, i] = (a[0] - lam * a[1] + lam * gmap) @ v[bi, g]
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_reference_matches_the_oracle_and_fast_matches_the_reference(causal, gqa, padding):
    q, k, v, lam = _inputs(h=2, hkv=1 if gqa else 2)
    valid = None
    mask = None
    if padding:
        valid = torch.ones(2, 9, dtype=torch.bool)
        valid[1, 6:] = False
        mask = valid
    ref = dint_attention_ref(q, k, v, lam, causal=causal, attn_mask=mask)
    torch.testing.assert_close(ref, _oracle(q, k, v, lam, causal, valid), rtol=1e-12, atol=1e-12)

    leaves_r = [x.clone().requires_grad_() for x in (q, k, v, lam)]
    leaves_f = [x.clone().requires_grad_() for x in (q, k, v, lam)]
    out_r = dint_attention_ref(*leaves_r, causal=causal, attn_mask=mask)
    out_f = dint_attention(*leaves_f, causal=causal, attn_mask=mask)
    torch.testing.assert_close(out_f, out_r, rtol=1e-12, atol=1e-12)
    go = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for a, b, n in zip(torch.autograd.grad(out_f, leaves_f, go), torch.autograd.grad(out_r, leaves_r, go),
                       ("dq", "dk", "dv", "dlam")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=n)


def test_fp32_fast_matches_float64_reference():
    q, k, v, lam = _inputs(t=33)
    exact = dint_attention_ref(q, k, v, lam)
    got = dint_attention(*(x.float() for x in (q, k, v)), lam.float())
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=2e-5)


def test_rows_sum_to_one_and_the_causal_g_is_the_prefix_mean():
    q, k, v, lam = _inputs()
    for causal in (True, False):
        _, maps = dint_attention_ref(q, k, v, lam, causal=causal, return_maps=True)
        torch.testing.assert_close(maps["attn"].sum(-1), torch.ones(2, 2, 9, dtype=torch.float64))
        g, a1 = maps["G"], maps["probs1"]
        if causal:  # G_ij = (1/i)·Σ_{i' ≤ i} A1_i'j (1-based i): a prefix mean, lower triangular like A1
            torch.testing.assert_close(g, a1.cumsum(-2) / torch.arange(1, 10, dtype=torch.float64)[:, None])
            assert (g.triu(1) == 0).all()
        else:  # the paper's column means, the same for every row
            torch.testing.assert_close(g, a1.mean(-2, keepdim=True).expand_as(g))
    # λ = 0 is V1 at λ = 0, i.e. plain A1·V
    torch.testing.assert_close(dint_attention(q, k, v, 0.0), AF.diff_attention(q, k, v, 0.0))
    torch.testing.assert_close(prefix_mean(v)[:, :, 4], v[:, :, :5].mean(-2))


def test_the_causal_form_does_not_leak_and_a_mean_over_all_rows_would():
    q, k, v, lam = _inputs()
    base = dint_attention(q, k, v, lam, causal=True)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, 6:] = torch.randn(x[:, :, 6:].shape, dtype=torch.float64)
    changed = dint_attention(q2, k2, v2, lam, causal=True)
    torch.testing.assert_close(changed[:, :, :6], base[:, :, :6], rtol=0, atol=0)
    assert (changed[:, :, 6:] - base[:, :, 6:]).abs().max() > 1e-3

    def leaky(q, k, v):  # the public re-implementation's form: G = column means over ALL rows of causal A1
        _, maps = AF.diff_attention_ref(q, k, v, lam, causal=True, return_maps=True)
        g = maps["probs1"].mean(-2, keepdim=True)
        return (maps["attn"] + lam * g) @ v

    assert (leaky(q2, k2, v2)[:, :, :6] - leaky(q, k, v)[:, :, :6]).abs().max() > 1e-3


def test_full_sequence_is_required_without_the_cache():
    q, k, v, lam = _inputs()
    with pytest.raises(ValueError, match="needs the whole sequence"):
        dint_attention(q[:, :, 3:], k, v, lam)
    with pytest.raises(ValueError, match="needs the whole sequence"):
        dint_attention_ref(q, k, v, lam, offset=2)


def test_module_parameters_options_and_baseline_are_v1s():
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention="dint")
    diff = TransformerLM(cfg.replace(attention="diff"))
    dint = TransformerLM(cfg)
    assert {n: p.shape for n, p in dint.named_parameters()} == {n: p.shape for n, p in diff.named_parameters()}
    base = matched_baseline(cfg)
    assert (base.attention, base.n_heads) == ("standard", 4)
    assert isinstance(dint.blocks[0].attn, DINTAttention)
    dual = TransformerLM(cfg.replace(attn_options={"dual_lambda": True, "qk_norm": True}))
    assert dual.blocks[0].attn.lambda_a.shape == () and dual.blocks[0].attn.q_norm is not None


def test_convert_to_dint_is_exact():
    assert "dint" in targets()
    torch.manual_seed(0)
    src = TransformerLM(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                                    attention="standard", rope="neox", init_std=0.2)).eval()
    model = convert(src, to="dint")
    assert model.config.attention == "dint"
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), src(ids), rtol=1e-5, atol=1e-5)
