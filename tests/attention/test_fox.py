"""FoX (Lin et al. 2025): the forget-gate bias against a hand computation that sums the log gates between the two
positions (causal; bidirectional, our −|c_i − c_j|; GQA; padding; cached positions), fast == reference, gradcheck
through the gates, half precision computed in fp32, the initialisation (bias 0, f ≈ ½, no RoPE), the parameter
count, and the conversion refused with its reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffattn.attention.fox import ForgettingAttention, fox_attention, fox_attention_ref
from diffattn.interop.convert import converted_config
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM


def _inputs(b=2, h=4, hkv=2, t=8, d=4):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(b, h, t, d), r(b, hkv, t, d), r(b, hkv, t, d), F.logsigmoid(r(b, h, t) + 1.0)


def _oracle(q, k, v, log_f, causal, key_valid=None):
    """logit(i, j) += Σ log f_l over the positions l after min(i, j) up to max(i, j), summed one by one."""
    b, h, t, d = q.shape
    out = torch.empty_like(q)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // k.shape[1])
            s = q[bi, hi] @ k[bi, g].T / d**0.5
            for i in range(t):
                for j in range(t):
                    lo, hi_ = min(i, j), max(i, j)
                    s[i, j] += sum(float(log_f[bi, hi, m]) for m in range(lo + 1, hi_ + 1))
                    if (causal and j > i) or (key_valid is not None and not key_valid[bi, j]):
                        s[i, j] = float("-inf")
            out[bi, hi] = torch.softmax(s, -1) @ v[bi, g]
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padding", [False, True])
def test_forget_bias_is_the_sum_of_log_gates_between_the_positions(causal, padding):
    q, k, v, log_f = _inputs()
    valid = None
    if padding:
        valid = torch.ones(2, 8, dtype=torch.bool)
        valid[1, 5:] = False
    want = _oracle(q, k, v, log_f, causal, valid)
    torch.testing.assert_close(fox_attention_ref(q, k, v, log_f, causal=causal, attn_mask=valid), want)
    torch.testing.assert_close(fox_attention(q, k, v, log_f, causal=causal, attn_mask=valid), want)


def test_queries_at_cached_positions_and_a_query_past_the_keys():
    q, k, v, log_f = _inputs()
    pos = torch.tensor([5, 6])
    keep = (torch.arange(8)[None, :] <= pos[:, None])[None, None]
    want = fox_attention_ref(q, k, v, log_f, causal=True)[:, :, 5:7]
    for op in (fox_attention, fox_attention_ref):
        torch.testing.assert_close(op(q[:, :, 5:7], k, v, log_f, causal=False, attn_mask=keep, offset=pos), want)
    with pytest.raises(ValueError, match="among the keys"):
        fox_attention(q[:, :, :2], k, v, log_f, offset=7)
    with pytest.raises(ValueError, match="log_f"):
        fox_attention(q, k, v, log_f[:, :2])


def test_gradcheck_through_the_gates_and_half_precision_in_fp32():
    q, k, v, log_f = (x[:1, :2, :5].clone().requires_grad_() for x in _inputs(hkv=2, d=3))
    for causal in (True, False):
        assert torch.autograd.gradcheck(lambda *a, c=causal: fox_attention(*a, causal=c), (q, k, v, log_f))
    q, k, v, log_f = _inputs(t=64)
    log_f = log_f * 20  # a strong decay: c spans hundreds, which a bf16 channel could not hold
    want = fox_attention_ref(q, k, v, log_f)
    got = fox_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_f.float())
    assert got.dtype == torch.bfloat16 and float((got.double() - want).abs().max()) < 0.05


def test_initialisation_no_rope_and_parameter_count():
    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, attention="fox")
    assert cfg.rope == "none"  # FoX takes no position embedding
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    attn = model.blocks[0].attn
    assert isinstance(attn, ForgettingAttention) and torch.equal(attn.fgate_bias, torch.zeros(4))
    assert abs(float(attn.fgate_proj.weight.detach().std()) - cfg.init_std) < 0.004
    caught = []
    attn.capture = caught
    model(torch.randint(0, 50, (2, 16)))
    assert abs(float(caught[0]["forget"].mean()) - 0.5) < 0.02  # σ(0 + small): f ≈ ½ at the start
    longer = TransformerLM(cfg.replace(attn_options={"fox_gate_bias_init": 3.0}))
    assert torch.equal(longer.blocks[1].attn.fgate_bias, torch.full((4,), 3.0))  # not zeroed by the model init
    base = TransformerLM(matched_baseline(cfg))
    assert base.config.attention == "standard"
    assert model.num_params() - base.num_params() == cfg.n_layers * (cfg.d_model + 1) * cfg.n_heads


def test_convert_refuses_fox_saying_why():
    src = ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=4, attention="standard")
    with pytest.raises(ValueError, match="no conversion to 'fox': .*gradient is 0"):
        converted_config(src, "fox")
