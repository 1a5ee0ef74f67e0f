"""DA-Transformer (distance-aware) attention: f, the reference vs the block-wise fast op (values,
gradients, gradcheck), masking after the ReLU, the differential variant, the modules, the KV cache and
`diffattn heads`."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn import functional as AF
from diffattn.attention.diff_distance import DiffDistanceAttention
from diffattn.attention.distance import DistanceAttention, distance_init
from diffattn.eval.heads import format_table, head_table, plot_heads
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerClassifier, TransformerLM
from diffattn.ops import distance_block as DK


def _params(h: int, dtype=torch.float32):
    w = (torch.randn(h, dtype=dtype) * 0.3).requires_grad_()
    vp = torch.randn(h, dtype=dtype).requires_grad_()
    return w, vp


def _qkv(b, hq, hkv, tq, tk, d, dtype=torch.float32, dv=None):
    q = torch.randn(b, hq, tq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, tk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, tk, dv or d, dtype=dtype, requires_grad=True)
    return q, k, v


# ------------------------------------------------------------------------------------------------------ f
def test_f_properties():
    vs = torch.tensor([-30.0, -3.0, 0.0, 0.7, 5.0, 30.0], dtype=torch.float64)
    # f(0) = 1 exactly
    assert torch.equal(AF.distance_f(torch.zeros_like(vs), vs), torch.ones_like(vs))
    x = torch.linspace(-1e4, 1e4, 20001, dtype=torch.float64)
    for v in vs.tolist():
        f = AF.distance_f(x, v)
        assert torch.isfinite(f).all()
        bound = 1 + math.exp(v)
        assert f.max() <= bound * (1 + 1e-12)  # bounded by 1 + e^v ...
        assert f[-1] == pytest.approx(bound, rel=1e-9)  # ... and reaches it as x -> +inf
        assert f[0] == 0.0 or f[0] < 1e-300  # -> 0 as x -> -inf
        assert (f[1:] >= f[:-1]).all()  # monotone
    # matches the definition where the naive formula does not overflow
    xs = torch.linspace(-20, 20, 81, dtype=torch.float64)
    for v in (-2.0, 0.0, 1.5):
        naive = (1 + math.exp(v)) / (1 + torch.exp(v - xs))
        torch.testing.assert_close(AF.distance_f(xs, v), naive, rtol=1e-12, atol=0)
    # f(x; 0) = 2·sigmoid(x), the default initialisation's curve
    torch.testing.assert_close(AF.distance_f(xs, 0.0), 2 * torch.sigmoid(xs))


# ------------------------------------------------------------------------------------- ref vs fast (fp32)
CASES = [
    # b, hq, hkv, tq, tk, offset, causal, mask kind, blocks
    (2, 4, 2, 37, 37, 0, True, None, (8, 16)),
    (2, 4, 2, 37, 37, 0, False, "pad", (16, 8)),
    (1, 2, 2, 19, 19, 0, False, "float", (4, 4)),
    (2, 4, 1, 9, 30, 21, True, "pad", (4, 8)),  # cached keys: queries at 21..29
    (1, 2, 1, 1, 25, 24, True, None, (256, 256)),  # one decode step
    (1, 3, 3, 23, 23, 0, True, "full", (5, 7)),  # (B, H, Tq, Tk) bool mask, odd blocks
]


def _mask(kind, b, h, tq, tk):
    if kind == "pad":
        m = torch.ones(b, tk, dtype=torch.bool)
        m[0, -5:] = False
        return m
    if kind == "float":
        keep = torch.rand(b, 1, tq, tk) > 0.3
        return torch.where(keep, 0.0, float("-inf")) + 0.1 * torch.randn(b, 1, tq, tk)
    if kind == "full":
        return torch.rand(b, h, tq, tk) > 0.3
    return None


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hq{c[1]}kv{c[2]}q{c[3]}k{c[4]}o{c[5]}c{c[6]}{c[7]}")
def test_fast_matches_reference(case):
    b, hq, hkv, tq, tk, off, causal, kind, (bq, bk) = case
    q, k, v = _qkv(b, hq, hkv, tq, tk, 8)
    w, vp = _params(hq)
    mask = _mask(kind, b, hq, tq, tk)
    ref = AF.distance_attention_ref(q, k, v, w, vp, causal=causal, attn_mask=mask, offset=off)
    fast = AF.distance_attention(q, k, v, w, vp, causal=causal, attn_mask=mask, offset=off, block_q=bq,
                                 block_k=bk)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    gr = torch.autograd.grad(ref, (q, k, v, w, vp), g)
    gf = torch.autograd.grad(fast, (q, k, v, w, vp), g)
    for name, a, e in zip("q k v w v_param".split(), gf, gr):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]], ids=["causal", "cached-pad", "full-mask"])
@pytest.mark.parametrize("how", ["threshold", "large-scores"])
def test_online_max_fallback_matches_reference(case, how, monkeypatch):
    """The fast op skips the running max when Cauchy–Schwarz bounds every score; the online-max path that
    runs otherwise must be exact too: force it (threshold below any bound), or feed scores in the hundreds."""
    b, hq, hkv, tq, tk, off, causal, kind, (bq, bk) = case
    # scores in the hundreds make fp32 (w, v) gradients lose ~1e-5 relative to cancellation: check in fp64
    dtype = torch.float32 if how == "threshold" else torch.float64
    q, k, v = _qkv(b, hq, hkv, tq, tk, 8, dtype=dtype)
    if how == "threshold":
        monkeypatch.setattr(DK, "_EXP_SAFE", -1.0)
    else:
        with torch.no_grad():
            q.mul_(12.0)
            k.mul_(12.0)
    w, vp = _params(hq, dtype)
    mask = _mask(kind, b, hq, tq, tk)
    ref = AF.distance_attention_ref(q, k, v, w, vp, causal=causal, attn_mask=mask, offset=off)
    fast = AF.distance_attention(q, k, v, w, vp, causal=causal, attn_mask=mask, offset=off, block_q=bq,
                                 block_k=bk)
    tol = 1e-5 if how == "threshold" else 1e-9
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    g = torch.randn_like(ref)
    gr = torch.autograd.grad(ref, (q, k, v, w, vp), g)
    gf = torch.autograd.grad(fast, (q, k, v, w, vp), g)
    for name, a, e in zip("q k v w v_param".split(), gf, gr):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol, msg=lambda m, n=name: f"grad {n}: {m}")


def test_positions_tensor_offset_equals_int_offset():
    q, k, v = _qkv(1, 2, 2, 4, 12, 8)
    w, vp = _params(2)
    a = AF.distance_attention(q, k, v, w, vp, offset=8)
    b = AF.distance_attention(q, k, v, w, vp, offset=torch.arange(8, 12))
    torch.testing.assert_close(a, b)
    # a query's distance to key j is |pos - j|: moving the queries changes the output
    c = AF.distance_attention(q, k, v, w, vp, offset=4, causal=False)
    d = AF.distance_attention(q, k, v, w, vp, offset=8, causal=False)
    assert not torch.allclose(c, d)


@pytest.mark.parametrize("t,block,causal", [(5, 4, True), (11, 3, True), (11, 3, False)])
def test_gradcheck_fast_float64(t, block, causal):
    q, k, v = _qkv(1, 2, 1, t, t, 2, dtype=torch.float64)
    w, vp = _params(2, torch.float64)
    mask = torch.ones(1, t, dtype=torch.bool)
    mask[0, 1] = False

    def fn(q, k, v, w, vp):
        return AF.distance_attention(q, k, v, w, vp, causal=causal, attn_mask=mask, block_q=block,
                                     block_k=block + 1)

    # T=5 / block 4: a partial block; T=11 / block 3: several blocks, causal skipping and diagonal cuts
    assert torch.autograd.gradcheck(fn, (q, k, v, w, vp), eps=1e-6, atol=1e-6, fast_mode=True)


def test_all_masked_row_gives_zeros_and_finite_grads():
    q, k, v = _qkv(1, 2, 2, 4, 6, 8)
    w, vp = _params(2)
    mask = torch.ones(1, 2, 4, 6, dtype=torch.bool)
    mask[..., 2, :] = False
    out = AF.distance_attention(q, k, v, w, vp, causal=False, attn_mask=mask, block_q=2, block_k=4)
    ref = AF.distance_attention_ref(q, k, v, w, vp, causal=False, attn_mask=mask)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, w, vp))


def test_mask_applied_after_relu_no_leak():
    """With every QKᵀ negative the ReLU zeroes all scores. Masked keys must still get exactly zero weight; the
    naive order (−inf mask, then ReLU) turns −inf into 0 and leaks exp(0) to the masked keys."""
    b, h, t, d = 1, 2, 6, 4
    q = torch.ones(b, h, t, d)
    k = -torch.ones(b, h, t, d)  # QKᵀ = −d < 0 everywhere
    v = torch.randn(b, h, t, d)
    w, vp = torch.tensor([-0.5, 0.5]), torch.zeros(2)
    pad = torch.tensor([[True, True, True, False, False, True]])
    out, maps = AF.distance_attention_ref(q, k, v, w, vp, causal=False, attn_mask=pad, return_maps=True)
    probs = maps["probs"]
    assert torch.equal(probs[..., ~pad[0]], torch.zeros_like(probs[..., ~pad[0]]))
    torch.testing.assert_close(probs[..., pad[0]], torch.full_like(probs[..., pad[0]], 1 / 4))
    fast = AF.distance_attention(q, k, v, w, vp, causal=False, attn_mask=pad)
    torch.testing.assert_close(fast, v[:, :, pad[0]].mean(2, keepdim=True).expand_as(fast))
    # the naive order leaks: masked keys get weight 1/6 each
    raw = (q @ k.transpose(-1, -2)).masked_fill(~pad[:, None, None, :], float("-inf"))
    naive = torch.softmax(torch.relu(raw) * AF.distance_f(torch.zeros(1), 0.0) / d**0.5, -1)
    assert (naive[..., ~pad[0]] > 0.1).all()


def test_relu_kills_negative_scores():
    """Scores are ReLU(QKᵀ) ⊙ f: a key with negative QKᵀ scores exactly 0, whatever its distance."""
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[-1.0, 0.0], [2.0, 0.0], [-3.0, 0.0]]]])
    v = torch.eye(3)[None, None]
    _, maps = AF.distance_attention_ref(q, k, v, torch.tensor([-0.1]), torch.tensor([0.0]), causal=False,
                                        return_maps=True)
    logits = maps["logits"][0, 0, 0]
    assert logits[0] == 0 and logits[2] == 0
    assert logits[1] == pytest.approx(2.0 * float(AF.distance_f(torch.tensor(-0.1), 0.0)) / math.sqrt(2))


def test_bad_params_shape():
    q, k, v = _qkv(1, 4, 2, 3, 3, 4)
    with pytest.raises(ValueError, match="one per query head"):
        AF.distance_attention(q, k, v, torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="one per query head"):
        AF.distance_attention_ref(q, k, v, torch.zeros(4), torch.zeros(3))


# ------------------------------------------------------------------------------------------ differential
@pytest.mark.parametrize("causal,offset,gqa", [(True, 0, 1), (False, 0, 2), (True, 5, 2)])
def test_diff_distance_fast_matches_reference(causal, offset, gqa):
    h, hkv, tq, d = 4, 4 // gqa, 13, 4
    tk = tq + offset
    q = torch.randn(2, 2 * h, tq, d, requires_grad=True)
    k = torch.randn(2, 2 * hkv, tk, d, requires_grad=True)
    v = torch.randn(2, hkv, tk, 2 * d, requires_grad=True)
    w, vp = _params(2 * h)
    lam = torch.tensor(0.6, requires_grad=True)
    pad = torch.ones(2, tk, dtype=torch.bool)
    pad[1, :2] = False
    kw = dict(causal=causal, offset=offset, attn_mask=pad)
    ref = AF.diff_distance_attention_ref(q, k, v, lam, w, vp, **kw)
    fast = AF.diff_distance_attention(q, k, v, lam, w, vp, block_q=4, block_k=8, **kw)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    for a, e in zip(torch.autograd.grad(fast, (q, k, v, lam, w, vp), g),
                    torch.autograd.grad(ref, (q, k, v, lam, w, vp), g)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_diff_distance_maps_have_their_own_parameters():
    """Map 1 of diff-head i uses (w[2i], v[2i]), map 2 uses (w[2i+1], v[2i+1]): the op equals two
    single-map distance attentions combined as A1·V − λ·A2·V, and each map's parameters get their own
    gradients."""
    h, d, t = 2, 4, 9
    q = torch.randn(1, 2 * h, t, d)
    k = torch.randn(1, 2 * h, t, d)
    v = torch.randn(1, h, t, 2 * d)
    w = torch.tensor([-0.5, 0.4, 0.2, -0.3], requires_grad=True)
    vp = torch.tensor([0.0, 1.0, -1.0, 0.5], requires_grad=True)
    lam = 0.7
    out = AF.diff_distance_attention_ref(q, k, v, lam, w, vp)
    a1 = AF.distance_attention_ref(q[:, 0::2], k[:, 0::2], v, w[0::2], vp[0::2])
    a2 = AF.distance_attention_ref(q[:, 1::2], k[:, 1::2], v, w[1::2], vp[1::2])
    torch.testing.assert_close(out, a1 - lam * a2)
    # swapping the maps' parameters changes the result (they are not shared)
    w_swapped = w.detach().view(h, 2).flip(1).flatten()
    swapped = AF.diff_distance_attention_ref(q, k, v, lam, w_swapped, vp.detach())
    assert not torch.allclose(out, swapped)
    out.sum().backward()
    assert (w.grad != 0).all() and (vp.grad != 0).all()


# ------------------------------------------------------------------------------------------------ modules
def _cfg(attention, **kw):
    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=40, attention=attention,
                rope="none", attn_options={"distance_block": 8})
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("attention", ["distance", "diff_distance"])
@pytest.mark.parametrize("rope", ["none", "interleaved"])
def test_kv_cache_decode_equals_full_forward(attention, rope):
    model = TransformerLM(_cfg(attention, rope=rope, n_kv_heads=1)).double().eval()
    ids = torch.randint(0, 50, (2, 21))
    with torch.no_grad():
        full = model(ids)
        model.setup_cache(2, 30)
        outs = [model(ids[:, :9], input_pos=torch.arange(9))]
        outs += [model(ids[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(9, 21)]
        model.clear_cache()
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attention", ["distance", "diff_distance"])
def test_fast_path_equals_reference_path_in_models(attention):
    lm = TransformerLM(_cfg(attention, n_kv_heads=1))
    ids = torch.randint(0, 50, (2, 17))
    fast = lm(ids)
    for blk in lm.blocks:
        blk.attn.use_reference = True
    torch.testing.assert_close(lm(ids), fast, rtol=1e-5, atol=1e-5)
    clf = TransformerClassifier(_cfg(attention), num_classes=3)
    pad = torch.ones(2, 17, dtype=torch.bool)
    pad[0, 11:] = False
    fast = clf(ids, pad)
    for blk in clf.encoder.body.blocks:
        blk.attn.use_reference = True
    torch.testing.assert_close(clf(ids, pad), fast, rtol=1e-5, atol=1e-5)


def test_capture_maps():
    lm = TransformerLM(_cfg("distance"))
    for blk in lm.blocks:
        blk.attn.capture = []
    lm(torch.randint(0, 50, (1, 7)))
    maps = lm.blocks[0].attn.capture[0]
    assert set(maps) == {"logits", "probs"}
    assert (maps["logits"] >= 0).all()  # post-ReLU ⊙ f scores
    torch.testing.assert_close(maps["probs"].sum(-1), torch.ones(1, 2, 7))
    lm = TransformerLM(_cfg("diff_distance"))
    lm.blocks[1].attn.capture = []
    lm(torch.randint(0, 50, (1, 7)))
    assert set(lm.blocks[1].attn.capture[0]) == {"logits1", "logits2", "probs1", "probs2", "attn", "lambda"}


def test_options_and_initialisation():
    cfg = _cfg("distance", n_heads=4, attn_options={"distance_w_init": 0.3})
    attn = DistanceAttention.from_config(cfg, 0)
    torch.testing.assert_close(attn.distance_w.data, torch.tensor([-0.3, -0.1, 0.1, 0.3]))
    assert torch.equal(attn.distance_v.data, torch.zeros(4))
    opts = {"distance_w_init": [0.1, -0.2], "distance_v_init": 1.5}
    dd = DiffDistanceAttention.from_config(_cfg("diff_distance", attn_options=opts), 1)
    torch.testing.assert_close(dd.distance_w.data, torch.tensor([0.1, 0.1, -0.2, -0.2]))  # both maps alike
    assert torch.equal(dd.distance_v.data, torch.full((4,), 1.5))
    with pytest.raises(ValueError, match="distance_w_iint"):
        DistanceAttention.from_config(_cfg("distance", attn_options={"distance_w_iint": 1}), 0)
    with pytest.raises(ValueError, match="2 numbers"):
        distance_init(2, [0.1], 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        distance_init(2, -0.1, 0.0)
    base = matched_baseline(_cfg("diff_distance"))
    assert (base.attention, base.n_heads) == ("distance", 4)
    n_diff = TransformerLM(_cfg("diff_distance")).num_params()
    n_base = TransformerLM(base).num_params()
    assert abs(n_diff - n_base) / n_base < 0.01


# -------------------------------------------------------------------------------------------------- heads
def test_head_table_and_plot(tmp_path):
    lm = TransformerLM(_cfg("distance", n_layers=1, attn_options={"distance_w_init": [-0.2, 0.3]}))
    with torch.no_grad():
        lm.blocks[0].attn.distance_v.copy_(torch.tensor([0.0, 1.0]))
    rows = head_table(lm.state_dict(), distances=[0, 2, 64])
    assert [(r["layer"], r["head"], r["map"], r["preference"]) for r in rows] == [(0, 0, None, "short"),
                                                                              (0, 1, None, "long")]
    assert rows[0]["f"][0] == 1.0 and rows[1]["f"][0] == 1.0
    assert rows[0]["f"][2] == pytest.approx(2 / (1 + math.exp(0.4)))
    assert rows[1]["f"][64] == pytest.approx((1 + math.e) / (1 + math.exp(1 - 0.3 * 64)))
    text = format_table(rows)
    assert "short" in text and "long" in text and "f(R=64)" in text
    plot_heads(rows, tmp_path / "f.png", 64)
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    neutral = head_table({"body.blocks.0.attn.distance_w": torch.tensor([1e-5]),
                          "body.blocks.0.attn.distance_v": torch.tensor([0.0])})
    assert neutral[0]["preference"] == "neutral"
    dd = TransformerLM(_cfg("diff_distance", n_layers=1))
    assert [r["map"] for r in head_table(dd.state_dict())] == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="distance_w"):
        head_table(TransformerLM(_cfg("standard")).state_dict())
