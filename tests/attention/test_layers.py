"""The attention modules (diffattn.attention.*) and their building blocks (diffattn.ops.*): λ parameterisation, the
DIFF module against a from-scratch reimplementation using its own weights, the official state-dict layout,
V2/standard modules, RoPE properties, the KV cache buffer and the evaluation probes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from diffattn import functional as AF
from diffattn.attention.diff import MultiheadDiffAttention
from diffattn.attention.diff_v2 import DiffV2Attention
from diffattn.attention.registry import build_attention
from diffattn.attention.standard import StandardAttention
from diffattn.model.config import ModelConfig
from diffattn.ops.rope import RotaryEmbedding

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


# ------------------------------------------------------------------------------------------------- λ
def test_lambda_init_schedule_matches_formula_and_paper_numbers():
    paper = (0.2, 0.3555, 0.4707, 0.5561)  # rounded values printed in the paper for depths 0..3
    for depth, rounded in enumerate(paper):
        exact = 0.8 - 0.6 * math.exp(-0.3 * depth)
        assert AF.lambda_init_fn(depth) == pytest.approx(exact, abs=1e-15)
        assert round(AF.lambda_init_fn(depth), 4) == rounded
    assert AF.lambda_init_fn(60) == pytest.approx(0.8, abs=1e-7)  # → 0.8 with depth


def test_lambda_init_per_layer_and_constant_option():
    cfg = ModelConfig(vocab_size=10, d_model=32, n_layers=4, n_heads=2, attention="diff")
    for i in range(4):
        assert build_attention(cfg, i).lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * i))
    const = cfg.replace(attn_options={"lambda_init": 0.5})
    assert {build_attention(const, i).lambda_init for i in range(4)} == {0.5}
    with pytest.raises(ValueError, match="lambda_init"):
        cfg.replace(attn_options={"lambda_init": 1.5})


def test_lambda_vectors_are_normal_with_std_0_1():
    # head_dim 512: 4·512 samples, so the sample std is 0.1 ± ~0.0016 and a 10% tolerance is ~6 sigma
    m = MultiheadDiffAttention(embed_dim=1024, num_heads=1, depth=0)
    vals = torch.cat([getattr(m, n).detach() for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")])
    assert vals.numel() == 4 * 512
    assert abs(vals.std().item() - 0.1) < 0.01
    assert abs(vals.mean().item()) < 0.01
    assert len({getattr(m, n).detach().sum().item() for n in LAMBDAS}) == 4  # independent draws


def test_lambda_full_formula():
    m = MultiheadDiffAttention(embed_dim=32, num_heads=2, depth=3)
    with torch.no_grad():
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(m, name).copy_(torch.randn(8) * 0.5)
    dot = lambda a, b: float((getattr(m, a).detach().double() * getattr(m, b).detach().double()).sum())
    want = (math.exp(dot("lambda_q1", "lambda_k1")) - math.exp(dot("lambda_q2", "lambda_k2"))
            + AF.lambda_init_fn(3))
    assert m.lambda_full().item() == pytest.approx(want, rel=1e-5)
    # λ is a learned scalar: its gradient reaches all four vectors
    m.lambda_full().backward()
    assert all(getattr(m, n).grad.abs().sum() > 0 for n in LAMBDAS)


# ------------------------------------------------------------------------------------ state-dict layout
@pytest.mark.parametrize("n_kv", [None, 2, 1])
def test_diff_state_dict_matches_official_names_and_shapes(n_kv):
    e, h = 64, 4
    m = MultiheadDiffAttention(embed_dim=e, num_heads=h, depth=1, num_kv_heads=n_kv)
    n_rep = h // (n_kv or h)
    d = e // h // 2
    want = {
        "q_proj.weight": (e, e), "k_proj.weight": (e // n_rep, e), "v_proj.weight": (e // n_rep, e),
        "out_proj.weight": (e, e), "lambda_q1": (d,), "lambda_k1": (d,), "lambda_q2": (d,), "lambda_k2": (d,),
        "subln.weight": (2 * d,),
    }
    sd = m.state_dict()
    assert set(sd) == set(want)
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert m.subln.eps == 1e-5


def test_module_constructor_errors():
    with pytest.raises(ValueError, match="divisible by 2·num_heads"):
        MultiheadDiffAttention(embed_dim=30, num_heads=4, depth=0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        MultiheadDiffAttention(embed_dim=48, num_heads=3, depth=0, num_kv_heads=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        DiffV2Attention(embed_dim=48, num_heads=3, num_kv_heads=2)


# ------------------------------------------------------------------------------- from-scratch forwards
def _rope_interleaved_complex(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """GPT-J/official RoPE written as complex multiplication: (x[2i] + i·x[2i+1]) · e^{i·pos·θ^(-2i/D)}.
    x: (B, T, D), pos: (T,)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), pos[:, None].double() * freqs[None])
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


def _randomize(m: torch.nn.Module) -> None:
    """Non-trivial values everywhere (gains ≠ 1, λ vectors large enough to matter)."""
    with torch.no_grad():
        for p in m.parameters():
            gain_like = p.dim() == 1 and p.numel() > 8  # subln gain (2d) vs λ vectors (d = 8 here)
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.2) + (1.0 if gain_like else 0.0))


def diff_module_from_scratch(m: MultiheadDiffAttention, x: torch.Tensor, use_rope: bool) -> torch.Tensor:
    """DIFF V1 (paper + official flashdiff code) from the module's weights, head by head. x: (B, T, E)."""
    b, t, e = x.shape
    h, hkv, d = m.num_heads, m.num_kv_heads, m.head_dim
    n_rep = h // hkv
    q, k, v = x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T
    pos = torch.arange(t)
    lam_init = m.lambda_init
    lam = torch.exp((m.lambda_q1 * m.lambda_k1).sum()) - torch.exp((m.lambda_q2 * m.lambda_k2).sum())
    lam = lam + lam_init
    keep = torch.ones(t, t).tril().bool()

    def sub(z, i):  # sub-head i of width d, rotated per d-wide sub-head like the official code
        s = z[..., i * d: (i + 1) * d]
        return _rope_interleaved_complex(s, pos) if use_rope else s

    heads = []
    for j in range(h):
        g = j // n_rep
        a = [torch.softmax((sub(q, 2 * j + s) @ sub(k, 2 * g + s).transpose(-1, -2) / math.sqrt(d))
                           .masked_fill(~keep, float("-inf")), -1) for s in (0, 1)]
        o = (a[0] - lam * a[1]) @ v[..., 2 * g * d: 2 * g * d + 2 * d]  # (B, T, 2d)
        o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * m.subln.weight  # RMSNorm over 2d, gain
        heads.append(o * (1 - lam_init))
    return torch.cat(heads, dim=-1) @ m.out_proj.weight.T


@pytest.mark.parametrize("n_kv", [None, 1])
@pytest.mark.parametrize("use_rope", [False, True])
def test_diff_module_matches_from_scratch(n_kv, use_rope):
    m = MultiheadDiffAttention(embed_dim=32, num_heads=2, depth=2, num_kv_heads=n_kv).double()
    _randomize(m)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    rope = RotaryEmbedding(m.rope_dim, 16, style="interleaved").double() if use_rope else None
    rope_fn = rope(torch.arange(7)) if use_rope else None
    want = diff_module_from_scratch(m, x, use_rope)
    torch.testing.assert_close(m(x, rope_fn), want, atol=1e-5, rtol=1e-5)  # RoPE tables are stored in fp32
    if not use_rope:
        torch.testing.assert_close(m(x), want, atol=1e-10, rtol=0)
    # the reference path (probes) gives the same output
    m.capture = []
    torch.testing.assert_close(m(x, rope_fn), want, atol=1e-5, rtol=1e-5)
    assert len(m.capture) == 1


def test_diff_module_scales_by_one_minus_lambda_init():
    # λ_full ≠ λ_init here (random λ vectors), so both "(1 − λ_full)" and a dropped scale would fail this
    m = MultiheadDiffAttention(embed_dim=32, num_heads=2, depth=0, lambda_init=0.3).double()
    _randomize(m)
    assert abs(m.lambda_full().item() - 0.3) > 1e-2
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    base = m(x)
    # rebuild the output from the recorded effective map: out_proj(concat_heads(RMSNorm(A·V)) · (1 − λ_init))
    m.capture = []
    m(x)
    attn = m.capture[0]["attn"]  # (B, h, T, T) effective map
    v = (x @ m.v_proj.weight.T).view(1, 5, 2, 16).transpose(1, 2)
    o = m.subln(attn @ v)
    merged = o.transpose(1, 2).reshape(1, 5, 32) * (1 - 0.3)
    torch.testing.assert_close(merged @ m.out_proj.weight.T, base, atol=1e-10, rtol=0)


def test_diff_capture_maps_are_consistent():
    m = MultiheadDiffAttention(embed_dim=32, num_heads=2, depth=1).double()
    _randomize(m)
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    fast = m(x)
    m.capture = []
    ref = m(x)
    torch.testing.assert_close(ref, fast, atol=1e-10, rtol=0)
    maps = m.capture[0]
    assert {"logits1", "logits2", "probs1", "probs2", "attn", "lambda"} <= set(maps)
    torch.testing.assert_close(maps["attn"], maps["probs1"] - maps["lambda"] * maps["probs2"])
    torch.testing.assert_close(maps["probs1"].sum(-1), torch.ones(1, 2, 6, dtype=torch.float64))
    assert torch.all(maps["probs1"].triu(1) == 0)  # causal
    # score_mod rewrites logits on the reference path: a constant shift changes nothing, a rescale does
    m.capture = None
    m.score_mod = lambda s: s + 3.0
    torch.testing.assert_close(m(x), fast, atol=1e-10, rtol=0)
    m.score_mod = lambda s: 0 * s
    assert (m(x) - fast).abs().max() > 1e-3


def test_v2_module_matches_from_scratch():
    m = DiffV2Attention(embed_dim=32, num_heads=4, num_kv_heads=2).double()
    _randomize(m)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    b, t, _ = x.shape
    dh = 8
    q, k, v = x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T
    w = torch.sigmoid(x @ m.lambda_proj.weight.T)  # (B, T, h)
    keep = torch.ones(t, t).tril().bool()

    def head(i):  # query head i (of 8) reads KV head i // 4
        g = i // 4
        qi, kg, vg = q[..., i * dh:(i + 1) * dh], k[..., g * dh:(g + 1) * dh], v[..., g * dh:(g + 1) * dh]
        s = (qi @ kg.transpose(-1, -2) / math.sqrt(dh)).masked_fill(~keep, float("-inf"))
        return torch.softmax(s, -1) @ vg

    out = torch.cat([head(2 * j) - w[..., j: j + 1] * head(2 * j + 1) for j in range(4)], dim=-1)
    torch.testing.assert_close(m(x), out @ m.out_proj.weight.T, atol=1e-10, rtol=0)
    assert set(m.state_dict()) == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "lambda_proj.weight",
                                   "out_proj.weight"}
    assert m.q_proj.weight.shape == (2 * 4 * dh, 32) and m.lambda_proj.weight.shape == (4, 32)


def test_standard_module_matches_sdpa_math():
    m = StandardAttention(embed_dim=32, num_heads=4, num_kv_heads=2).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    q = x @ m.q_proj.weight.T
    k = (x @ m.k_proj.weight.T).view(2, 6, 2, 8).repeat_interleave(2, dim=2)
    v = (x @ m.v_proj.weight.T).view(2, 6, 2, 8).repeat_interleave(2, dim=2)
    q = q.view(2, 6, 4, 8)
    s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(8)
    p = torch.softmax(s.masked_fill(~torch.ones(6, 6).tril().bool(), float("-inf")), -1)
    o = torch.einsum("bhts,bshd->bthd", p, v).reshape(2, 6, 32)
    torch.testing.assert_close(m(x), o @ m.out_proj.weight.T, atol=1e-10, rtol=0)


def test_module_cache_requires_input_pos():
    m = MultiheadDiffAttention(embed_dim=32, num_heads=2, depth=0)
    m.setup_cache(1, 8, torch.float32)
    assert m.cache.k.shape == (1, 4, 8, 8) and m.cache.v.shape == (1, 2, 8, 16)
    with pytest.raises(ValueError, match="input_pos"):
        m(torch.randn(1, 3, 32))


def test_sdpa_is_what_fast_path_uses():
    # sanity: the fast standard op is SDPA itself (so the benchmarks compare like with like)
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    torch.testing.assert_close(AF.attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))
