"""Shared DIFF (arXiv 2501.17900): the shared-base + low-rank projection against its materialized weights, the
module against V1's op on those projections, the layout, the parameter count and its FFN-matched baseline."""

from __future__ import annotations

import pytest
import torch

from diffattn import functional as AF
from diffattn.attention.shared_diff import (
    SharedDiffAttention,
    interleave_maps,
    shared_projection,
    shared_projection_ref,
)
from diffattn.model.config import ModelConfig, attention_params, matched_baseline
from diffattn.model.transformer import TransformerLM


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention="shared_diff")
    return ModelConfig(**{**base, **kw})


def test_fast_projection_equals_the_materialized_weights_forward_and_backward():
    torch.manual_seed(0)
    e, n, r = 16, 12, 3
    base, down = torch.nn.Linear(e, n, bias=True).double(), torch.nn.Linear(e, 2 * r, bias=False).double()
    ups = [torch.nn.Linear(r, n, bias=False).double() for _ in range(2)]
    x = torch.randn(2, 5, e, dtype=torch.float64, requires_grad=True)
    fast = shared_projection(x, base, down, ups)
    ref = shared_projection_ref(x, base.weight, [down.weight[:r], down.weight[r:]], [u.weight for u in ups],
                                base.bias)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b)
    params = [x, base.weight, base.bias, down.weight, *(u.weight for u in ups)]
    g_fast = torch.autograd.grad(sum((y * (i + 1)).sum() for i, y in enumerate(fast)), params)
    g_ref = torch.autograd.grad(sum((y * (i + 1)).sum() for i, y in enumerate(ref)), params)
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b)
    # the maps differ only by their low-rank updates: with the ups at zero, Q1 = Q2 = the shared base's
    for u in ups:
        torch.nn.init.zeros_(u.weight)
    q1, q2 = shared_projection(x, base, down, ups)
    assert torch.equal(q1, q2) and torch.equal(q1, base(x))


def test_interleave_is_v1s_sub_head_layout():
    a = torch.arange(2 * 3 * 4 * 2).view(2, 3, 8).float()  # (B, T, n·d) with n = 4, d = 2
    b = -a
    out = interleave_maps(a, b, 4)
    assert out.shape == (2, 8, 3, 2)
    torch.testing.assert_close(out[:, 0::2], a.view(2, 3, 4, 2).transpose(1, 2))
    torch.testing.assert_close(out[:, 1::2], b.view(2, 3, 4, 2).transpose(1, 2))


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_module_is_v1_attention_on_the_shared_projections(gqa, causal):
    torch.manual_seed(0)
    attn = SharedDiffAttention(32, 4, depth=2, num_kv_heads=2 if gqa else None, rank=3).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    d, r = attn.head_dim, attn.rank
    w = lambda m: m.weight  # noqa: E731
    qs = shared_projection_ref(x, w(attn.q_proj), [w(attn.q_down)[:r], w(attn.q_down)[r:]],
                               [w(attn.q_up1), w(attn.q_up2)])
    ks = shared_projection_ref(x, w(attn.k_proj), [w(attn.k_down)[:r], w(attn.k_down)[r:]],
                               [w(attn.k_up1), w(attn.k_up2)])
    q = torch.stack([y.view(2, 7, -1, d) for y in qs], dim=3).reshape(2, 7, -1, d).transpose(1, 2)
    k = torch.stack([y.view(2, 7, -1, d) for y in ks], dim=3).reshape(2, 7, -1, d).transpose(1, 2)
    v = attn.v_proj(x).view(2, 7, -1, 2 * d).transpose(1, 2)
    heads = AF.diff_attention_ref(q, k, v, attn.lambda_full(), causal=causal)
    want = attn.out_proj(attn.subln(heads, scale=1 - attn.lambda_init).transpose(1, 2).reshape(2, 7, -1))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, causal=causal), want)
        attn.use_reference = True
        torch.testing.assert_close(attn(x, causal=causal), want)


def test_parameters_rank_option_and_matched_baseline():
    e, n_layers = 32, 2
    cfg = _cfg()
    h_d = cfg.n_heads * cfg.qk_head_dim  # 16
    r = h_d // 8  # the default rank: an eighth of the update's full rank
    assert TransformerLM(cfg).blocks[0].attn.rank == r == 2
    diff = attention_params(cfg.replace(attention="diff"))
    shared = attention_params(cfg)
    # V1's Q and K (E × 2h·d each) become one base (E × h·d) plus two rank-r updates r·(E + h·d) each
    per_layer_q = e * h_d + 2 * r * (e + h_d)
    assert diff - shared == n_layers * 2 * (e * 2 * h_d - per_layer_q)
    assert per_layer_q / (e * 2 * h_d) == pytest.approx(0.6875)  # 0.69× V1's Q (and K) at any shape
    assert attention_params(cfg.replace(attn_options={"shared_rank": 1})) < shared
    with pytest.raises(ValueError, match="shared_rank must be a positive int"):
        cfg.replace(attn_options={"shared_rank": 0})
    # the baseline: standard at twice the heads, its FFN narrowed so the totals match to one hidden unit; a
    # large rank (more parameters than V1) widens it instead
    for opts, wider in (({}, False), ({"shared_rank": 16}, True)):
        c = cfg.replace(attn_options=opts)
        base = matched_baseline(c)
        assert (base.attention, base.n_heads) == ("standard", 4)
        assert (base.ffn_dim > c.ffn_dim) == wider and base.ffn_dim != c.ffn_dim
        assert (attention_params(c) > attention_params(c.replace(attention="diff", attn_options={}))) == wider
        n_shared, n_base = TransformerLM(c).num_params(), TransformerLM(base).num_params()
        assert abs(n_shared - n_base) <= 3 * e * n_layers / 2
    plain = matched_baseline(cfg.replace(attention="diff"))
    assert plain.ffn_hidden is None  # V1's baseline is unchanged: no FFN matching there


def test_shared_qk_has_no_key_projections():
    m = TransformerLM(_cfg(shared_qk=True))
    assert not any(k.startswith("body.blocks.0.attn.k_") for k in m.state_dict())
    ids = torch.randint(0, 40, (1, 9))
    assert torch.isfinite(m(ids)).all()
