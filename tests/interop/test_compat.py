"""diffattn.interop.unilm: the official microsoft/unilm module APIs (constructor order, forward(x, rel_pos, attn_mask),
state_dict names), checked against oracles written here from the official math and against our own modules."""

import math

import pytest
import torch
import torch.nn.functional as F

from diffattn.attention.diff import MultiheadDiffAttention, lambda_init_fn
from diffattn.attention.diff_v2 import DiffV2Attention
from diffattn.attention.standard import StandardAttention
from diffattn.interop.unilm import MultiheadDiffAttn, MultiheadFlashAttnBaseline, MultiheadFlashDiffV2
from diffattn.ops.rope import RotaryEmbedding

ATOL = 1e-5


def rope_tables(t: int, dim: int, theta: float = 10000.0):
    """The official rel_pos: cos, sin of position × theta^(-2i/dim), each (T, dim/2)."""
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float(), ang.sin().float()


def rotate_interleaved(x, cos, sin):
    """x (B, T, H, D): rotate each pair (x[2i], x[2i+1]) by its angle, in real arithmetic."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


def causal_additive(t):
    return torch.triu(torch.full((t, t), float("-inf")), 1)


def v1_official_state_dict(e, h, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = e // h // 2
    n = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    sd = {"q_proj.weight": n(e, e), "k_proj.weight": n(e // (h // hkv), e), "v_proj.weight": n(e // (h // hkv), e),
          "out_proj.weight": n(e, e), "subln.weight": 1 + n(2 * d)}
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        sd[name] = n(d)
    return sd


def v1_oracle(sd, x, h, hkv, depth, rel_pos, mask):
    """The official DiffAttn, head by head (MHA, or GQA with multihead_flashdiff_1.py's pairing)."""
    b, t, e = x.shape
    d, n_rep = e // h // 2, h // hkv
    q = rotate_interleaved((x @ sd["q_proj.weight"].T).view(b, t, 2 * h, d), *rel_pos)
    k = rotate_interleaved((x @ sd["k_proj.weight"].T).view(b, t, 2 * hkv, d), *rel_pos)
    v = (x @ sd["v_proj.weight"].T).view(b, t, hkv, 2 * d)
    li = lambda_init_fn(depth)
    lam = (torch.exp((sd["lambda_q1"] * sd["lambda_k1"]).sum()) - torch.exp((sd["lambda_q2"] * sd["lambda_k2"]).sum())
           + li)
    heads = []
    for j in range(h):
        gi = j // n_rep
        p1 = torch.softmax(q[:, :, 2 * j] @ k[:, :, 2 * gi].transpose(1, 2) / math.sqrt(d) + mask, -1)
        p2 = torch.softmax(q[:, :, 2 * j + 1] @ k[:, :, 2 * gi + 1].transpose(1, 2) / math.sqrt(d) + mask, -1)
        o = (p1 - lam * p2) @ v[:, :, gi]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * sd["subln.weight"] * (1 - li)
        heads.append(o)
    return torch.cat(heads, -1) @ sd["out_proj.weight"].T


def v2_oracle(sd, x, h, hkv, dh, rel_pos, mask, diff=True):
    """The official V2 (or its use_diff_v2=False baseline): one attention over the query heads, then pairs."""
    b, t, _ = x.shape
    hq = 2 * h if diff else h
    q = rotate_interleaved((x @ sd["q_proj.weight"].T).view(b, t, hq, dh), *rel_pos)
    k = rotate_interleaved((x @ sd["k_proj.weight"].T).view(b, t, hkv, dh), *rel_pos)
    v = (x @ sd["v_proj.weight"].T).view(b, t, hkv, dh)
    outs = []
    for i in range(hq):
        g = i // (hq // hkv)
        p = torch.softmax(q[:, :, i] @ k[:, :, g].transpose(1, 2) / math.sqrt(dh) + mask, -1)
        outs.append(p @ v[:, :, g])
    if diff:
        lam = torch.sigmoid(x @ sd["lambda_proj.weight"].T)  # (B, T, h)
        outs = [outs[2 * j] - lam[..., j : j + 1] * outs[2 * j + 1] for j in range(h)]
    return torch.cat(outs, -1) @ sd["o_proj.weight"].T


# ------------------------------------------------------------------------------------------- V1
def test_official_argument_order():
    m = MultiheadDiffAttn(512, 0, 4)  # (embed_dim, depth, num_heads)
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (4, 4, 64)
    assert m.lambda_init == pytest.approx(0.2)
    m = MultiheadDiffAttn(512, 2, 4)  # our native order would read this as 2 heads at depth 4
    assert m.num_heads == 4 and m.lambda_init == pytest.approx(lambda_init_fn(2))
    m = MultiheadDiffAttn(embed_dim=256, depth=5, num_heads=8, num_kv_heads=4)
    assert (m.num_heads, m.num_kv_heads, m.n_rep, m.head_dim) == (8, 4, 2, 16)
    assert m.lambda_init == pytest.approx(lambda_init_fn(5)) and m.scaling == pytest.approx(16**-0.5)
    assert isinstance(m, MultiheadDiffAttention)


@pytest.mark.parametrize(
    "args, match",
    [
        ((512, 0, 0), "num_heads must be a positive int, got 0"),
        ((512, -1, 4), "depth must be an int >= 0"),
        ((0, 0, 4), "embed_dim must be a positive int"),
        ((500, 0, 4), "divisible by 2·num_heads"),
        ((512, 0, 4, 0), "num_kv_heads must be a positive int"),
        ((512, 0, 4, 3), "multiple of num_kv_heads"),
        ((512, 0.5, 4), "depth must be"),
        ((512, 0, True), "num_heads must be"),
    ],
)
def test_bad_constructor_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        MultiheadDiffAttn(*args)


@pytest.mark.parametrize("h, hkv", [(2, 2), (4, 2)])
def test_v1_strict_load_matches_official_math_and_our_module(h, hkv):
    torch.manual_seed(0)
    e, t, depth = 32, 7, 3
    sd = v1_official_state_dict(e, h, hkv)
    m = MultiheadDiffAttn(e, depth, h, None if hkv == h else hkv)
    m.load_state_dict(sd, strict=True)
    assert set(m.state_dict()) == set(sd)
    x = torch.randn(2, t, e)
    rel_pos = rope_tables(t, m.head_dim)
    out = m(x, rel_pos)
    torch.testing.assert_close(out, v1_oracle(sd, x, h, hkv, depth, rel_pos, causal_additive(t)), atol=ATOL, rtol=0)
    ours = MultiheadDiffAttention(e, h, depth, hkv)
    ours.load_state_dict(sd, strict=True)
    rope = RotaryEmbedding(m.head_dim, t, style="interleaved")(torch.arange(t))
    torch.testing.assert_close(out, ours(x, rope), atol=ATOL, rtol=0)


def test_v1_additive_masks():
    torch.manual_seed(1)
    e, h, t = 32, 2, 6
    sd = v1_official_state_dict(e, h, h, seed=1)
    m = MultiheadDiffAttn(e, 1, h)
    m.load_state_dict(sd)
    x = torch.randn(1, t, e)
    rel_pos = rope_tables(t, m.head_dim)
    # the official causal mask, passed explicitly, is the default
    torch.testing.assert_close(m(x, rel_pos, causal_additive(t)), m(x, rel_pos), atol=ATOL, rtol=0)
    # an all-zero mask is bidirectional: differs from causal, matches the oracle
    zeros = torch.zeros(t, t)
    assert not torch.allclose(m(x, rel_pos, zeros), m(x, rel_pos), atol=1e-3)
    torch.testing.assert_close(m(x, rel_pos, zeros), v1_oracle(sd, x, h, h, 1, rel_pos, zeros), atol=ATOL, rtol=0)
    # a sliding window (each query sees itself and one key back) with a finite bias on the diagonal
    i = torch.arange(t)
    win = torch.where((i[None] <= i[:, None]) & (i[None] >= i[:, None] - 1), 0.0, float("-inf"))
    win = win + 0.5 * torch.eye(t)
    torch.testing.assert_close(m(x, rel_pos, win), v1_oracle(sd, x, h, h, 1, rel_pos, win), atol=ATOL, rtol=0)


def test_rel_pos_is_our_interleaved_rope():
    torch.manual_seed(2)
    t, d = 9, 8
    cos, sin = rope_tables(t, d)
    rope = RotaryEmbedding(d, t, style="interleaved")
    torch.testing.assert_close(rope.cos, cos)
    torch.testing.assert_close(rope.sin, sin)
    x = torch.randn(1, 3, t, d)  # (B, H, T, D)
    want = rotate_interleaved(x.transpose(1, 2), cos, sin).transpose(1, 2)
    torch.testing.assert_close(rope(torch.arange(t))(x), want, atol=ATOL, rtol=0)
    # a longer table is cut to T; rel_pos=None is no rotation (differs from rotating)
    m = MultiheadDiffAttn(32, 0, 2)
    xx = torch.randn(1, t, 32)
    long = rope_tables(3 * t, m.head_dim)
    torch.testing.assert_close(m(xx, long), m(xx, rope_tables(t, m.head_dim)), atol=ATOL, rtol=0)
    assert not torch.allclose(m(xx, None), m(xx, long), atol=1e-4)


def test_bad_forward_arguments():
    m = MultiheadDiffAttn(32, 0, 2)
    x = torch.randn(1, 5, 32)
    with pytest.raises(ValueError, match="rel_pos cos must have shape"):
        m(x, rope_tables(5, 4))
    with pytest.raises(ValueError, match="rel_pos must be a"):
        m(x, torch.zeros(5, 4))
    with pytest.raises(ValueError, match="additive float"):
        m(x, rope_tables(5, 8), torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"shape \(T, T\)"):
        m(x, rope_tables(5, 8), torch.zeros(1, 5))


# ------------------------------------------------------------------------------------------- V2
def v2_official_state_dict(d_model, h, hkv, dh, diff=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    sd = {"q_proj.weight": n((2 if diff else 1) * h * dh, d_model), "k_proj.weight": n(hkv * dh, d_model),
          "v_proj.weight": n(hkv * dh, d_model), "o_proj.weight": n(d_model, h * dh)}
    if diff:
        sd["lambda_proj.weight"] = n(h, d_model)
    return sd


@pytest.mark.parametrize("h, hkv", [(2, 2), (4, 2)])
def test_v2_strict_load_matches_official_math_and_our_module(h, hkv):
    torch.manual_seed(3)
    d_model, dh, t = 32, 8, 7
    sd = v2_official_state_dict(d_model, h, hkv, dh)
    m = MultiheadFlashDiffV2(True, d_model, h, hkv, dh)
    assert isinstance(m, DiffV2Attention) and m.num_q_heads == 2 * h
    m.load_state_dict(sd, strict=True)
    assert list(m.state_dict()) == list(sd)  # the official names, in the official order
    assert sum(p.numel() for p in m.parameters()) == sum(v.numel() for v in sd.values())  # o_proj counted once
    x = torch.randn(2, t, d_model)
    rel_pos = rope_tables(t, dh)
    out = m(x, rel_pos)
    torch.testing.assert_close(out, v2_oracle(sd, x, h, hkv, dh, rel_pos, causal_additive(t)), atol=ATOL, rtol=0)
    ours = DiffV2Attention(d_model, h, hkv, dh)
    ours.load_state_dict({("out_proj.weight" if k == "o_proj.weight" else k): v for k, v in sd.items()})
    rope = RotaryEmbedding(dh, t, style="interleaved")(torch.arange(t))
    torch.testing.assert_close(out, ours(x, rope), atol=ATOL, rtol=0)
    zeros = torch.zeros(t, t)  # the mask extension: bidirectional
    torch.testing.assert_close(m(x, rel_pos, zeros), v2_oracle(sd, x, h, hkv, dh, rel_pos, zeros), atol=ATOL, rtol=0)


def test_v2_baseline_switch():
    torch.manual_seed(4)
    d_model, h, hkv, dh, t = 32, 4, 2, 8, 6
    sd = v2_official_state_dict(d_model, h, hkv, dh, diff=False)
    m = MultiheadFlashDiffV2(False, d_model, h, hkv, dh)
    assert isinstance(m, MultiheadFlashAttnBaseline) and isinstance(m, StandardAttention)
    assert m.lambda_proj is None and not m.use_diff_v2
    m.load_state_dict(sd, strict=True)
    assert list(m.state_dict()) == list(sd)
    x = torch.randn(2, t, d_model)
    rel_pos = rope_tables(t, dh)
    torch.testing.assert_close(m(x, rel_pos), v2_oracle(sd, x, h, hkv, dh, rel_pos, causal_additive(t), diff=False),
                               atol=ATOL, rtol=0)
    # the same numbers as SDPA on our standard module
    ours = StandardAttention(d_model, h, hkv, dh)
    ours.load_state_dict({("out_proj.weight" if k == "o_proj.weight" else k): v for k, v in sd.items()})
    torch.testing.assert_close(m(x, rel_pos), ours(x, RotaryEmbedding(dh, t)(torch.arange(t))), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "args, match",
    [
        ((1, 32, 4, 2, 8), "use_diff_v2 must be True or False"),
        ((True, 32, 0, None, 8), "num_heads must be a positive int"),
        ((True, 32, 4, 3, 8), "multiple of num_kv_heads"),
        ((True, 32, 4, None, 0), "head_dim must be a positive int"),
        ((False, -1, 4, None, 8), "d_model must be a positive int"),
    ],
)
def test_v2_bad_constructor_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        MultiheadFlashDiffV2(*args)


def test_v2_trains_through_the_alias():
    """Gradients reach the one o_proj weight (the out_proj alias adds no parameter)."""
    m = MultiheadFlashDiffV2(True, 16, 2, None, 8)
    x = torch.randn(1, 4, 16)
    F.mse_loss(m(x, rope_tables(4, 8)), torch.zeros(1, 4, 16)).backward()
    assert m.o_proj.weight.grad is not None and m.out_proj is m.o_proj
