"""ALiBi (Press et al. 2022): the paper's slopes (powers of two and the rule for other head counts), the reference
op against a per-head oracle, the fast SDPA op against the reference (forward and gradients; causal,
bidirectional, padding; GQA), positions under the KV cache, and no RoPE in the model."""

from __future__ import annotations

import pytest
import torch

from diffattn.attention.alibi import ALiBiAttention, alibi_attention, alibi_attention_ref, alibi_slopes
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM


def test_slopes_are_the_papers():
    # H = 8: 1/2, 1/4, ..., 1/256 (start 2^(−8/H), ratio 2^(−8/H))
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)], dtype=torch.float64))
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2.0 ** -k for k in (2, 4, 6, 8)], dtype=torch.float64))
    # H = 6: the 4 slopes of 4 heads, then the first 2 of the odd-position slopes of 8 heads (1/2, 1/8)
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2.0 ** -k for k in (2, 4, 6, 8, 1, 3)],
                                                             dtype=torch.float64))
    twelve = alibi_slopes(12)  # 8 heads' slopes, then 2^(−0.5), 2^(−1.5), 2^(−2.5), 2^(−3.5) from 16 heads
    torch.testing.assert_close(twelve[8:], torch.tensor([2.0 ** -(k / 2) for k in (1, 3, 5, 7)], dtype=torch.float64))
    assert alibi_slopes(1).tolist() == [2.0 ** -8]
    with pytest.raises(ValueError, match="positive int"):
        alibi_slopes(0)


def _inputs(b=2, h=4, hkv=2, t=9, d=8):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(b, h, t, d), r(b, hkv, t, d), r(b, hkv, t, d)


def _oracle(q, k, v, slopes, causal, key_valid=None):
    b, h, t, d = q.shape
    out = torch.empty_like(q)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // k.shape[1])
            s = q[bi, hi] @ k[bi, g].T / d**0.5 - slopes[hi] * (i - j).abs()
            keep = torch.ones(t, t, dtype=torch.bool)
            if causal:
                keep = j <= i
            if key_valid is not None:
                keep = keep & key_valid[bi][None, :]
            out[bi, hi] = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v[bi, g]
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_reference_matches_the_oracle_and_fast_matches_the_reference(causal, gqa, padding):
    q, k, v = _inputs(hkv=2 if gqa else 4)
    slopes = alibi_slopes(4)
    valid = None
    if padding:
        valid = torch.ones(2, 9, dtype=torch.bool)
        valid[0, 5:] = False
    ref = alibi_attention_ref(q, k, v, slopes, causal=causal, attn_mask=valid)
    torch.testing.assert_close(ref, _oracle(q, k, v, slopes, causal, valid), rtol=1e-12, atol=1e-12)
    lr = [x.clone().requires_grad_() for x in (q, k, v)]
    lf = [x.clone().requires_grad_() for x in (q, k, v)]
    out_r = alibi_attention_ref(*lr, slopes, causal=causal, attn_mask=valid)
    out_f = alibi_attention(*lf, slopes, causal=causal, attn_mask=valid)
    torch.testing.assert_close(out_f, out_r, rtol=1e-12, atol=1e-12)
    go = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out_f, lf, go), torch.autograd.grad(out_r, lr, go)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fp32_and_positions_with_an_offset():
    q, k, v = _inputs(t=12)
    slopes = alibi_slopes(4)
    exact = alibi_attention_ref(q, k, v, slopes)
    torch.testing.assert_close(alibi_attention(q.float(), k.float(), v.float(), slopes).double(), exact,
                               rtol=0, atol=2e-5)
    # the last 3 queries against all 12 keys, by int offset and by explicit positions (the KV cache path)
    tail = alibi_attention_ref(q[:, :, 9:], k, v, slopes, offset=9)
    torch.testing.assert_close(tail, exact[:, :, 9:])
    pos = torch.arange(9, 12)
    keep = (torch.arange(12)[None, :] <= pos[:, None])[None, None]
    torch.testing.assert_close(alibi_attention(q[:, :, 9:], k, v, slopes, causal=False, attn_mask=keep,
                                               offset=pos), exact[:, :, 9:])


def test_the_bias_is_minus_slope_times_distance():
    q, k, v = _inputs(h=2, hkv=2, t=6)
    slopes = alibi_slopes(2)
    _, maps = alibi_attention_ref(q, k, v, slopes, return_maps=True)
    dist = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs()
    bias = maps["logits"] - q @ k.transpose(-1, -2) / 8**0.5
    torch.testing.assert_close(bias, (-slopes[None, :, None, None] * dist).expand_as(bias))


def test_model_takes_no_rope_and_is_compared_at_the_standard_heads():
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=4, max_seq_len=16, attention="alibi")
    assert cfg.rope == "none"  # whatever the template said: the bias is the position signal
    model = TransformerLM(cfg)
    assert model.body.rope is None and isinstance(model.blocks[0].attn, ALiBiAttention)
    standard = TransformerLM(cfg.replace(attention="standard", rope="interleaved"))
    assert model.num_params() == standard.num_params()  # no parameters of its own; slopes are not saved
    assert "alibi_slopes" not in "".join(model.state_dict())
    assert matched_baseline(cfg) is cfg  # like DA: compared with standard attention at the same heads
    # without any position embedding, ALiBi still tells positions apart (a permutation changes the output)
    enc_ids = torch.randint(0, 40, (1, 8))
    perm = torch.randperm(8)
    with torch.no_grad():
        assert (model(enc_ids)[:, perm] - model(enc_ids[:, perm])).abs().max() > 1e-4
