"""The attention ops in diffattn.attention.functional: fast (SDPA) vs reference (materialized), against independent
per-head oracles written here from the papers / official code, masks, offsets, gradients, and dtypes.

Sizes are tiny on purpose (2 shared CPU cores)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffattn import functional as AF

OPS = ("standard", "diff", "diff_v2")
REF = {"standard": AF.attention_ref, "diff": AF.diff_attention_ref, "diff_v2": AF.diff_v2_attention_ref}
FAST = {"standard": AF.attention, "diff": AF.diff_attention, "diff_v2": AF.diff_v2_attention}


def make_inputs(op: str, b: int, h: int, hkv: int, tq: int, tk: int, d: int,
                dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Leaf tensors [q, k, v] (+ lam / lam_logits) for ``op`` with ``h`` output heads over ``hkv`` KV heads.

    standard: q (b,h,tq,d), k/v (b,hkv,tk,d); diff: q (b,2h,tq,d), k (b,2hkv,tk,d), v (b,hkv,tk,2d), lam ();
    diff_v2: q (b,2h,tq,d), k/v (b,hkv,tk,d), lam_logits (b,h,tq).
    """
    r = lambda *s: torch.randn(*s, dtype=torch.float64)
    if op == "standard":
        ts = [r(b, h, tq, d), r(b, hkv, tk, d), r(b, hkv, tk, d)]
    elif op == "diff":
        # λ in (0, 1) as in training (λ_init 0.2..0.8); a 0-dim tensor so its gradient is checked too
        lam = torch.tensor(0.45, dtype=torch.float64)
        ts = [r(b, 2 * h, tq, d), r(b, 2 * hkv, tk, d), r(b, hkv, tk, 2 * d), lam]
    else:
        ts = [r(b, 2 * h, tq, d), r(b, hkv, tk, d), r(b, hkv, tk, d), r(b, h, tq)]
    return [t.to(dtype).requires_grad_(True) for t in ts]


def run(op: str, fast: bool, ts: list[torch.Tensor], **kw) -> torch.Tensor:
    return (FAST if fast else REF)[op](*ts, **kw)


def fwd_bwd(op: str, fast: bool, ts: list[torch.Tensor], grad_out: torch.Tensor | None = None, **kw):
    """Output and the gradients of <out, grad_out> w.r.t. every input (fresh leaves: calls don't interact)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in ts]
    out = run(op, fast, leaves, **kw)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)], grad_out


def assert_close_all(a, b, atol: float, rtol: float = 0.0, what: str = "") -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol, msg=lambda m, i=i: f"{what} input {i}: {m}")


# ------------------------------------------------------------------------------ reference vs fast, fp32
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_fast_matches_ref_fp32(op, h, hkv, causal):
    ts = make_inputs(op, 2, h, hkv, 9, 9, 8)
    o_ref, g_ref, go = fwd_bwd(op, False, ts, causal=causal)
    o_fast, g_fast, _ = fwd_bwd(op, True, ts, go, causal=causal)
    torch.testing.assert_close(o_fast, o_ref, atol=1e-5, rtol=0)
    assert_close_all(g_fast, g_ref, atol=1e-5, rtol=1e-5, what=f"{op} grad")


# ------------------------------------------------------------------------------ reference vs fast, bf16
# bf16 keeps 8 significant bits (unit roundoff 2^-8 ≈ 3.9e-3). Both paths see the same bf16-rounded inputs,
# but the reference rounds the logits (|logit| up to ~4 here, so an ulp of ~0.03 — a ~3% error in exp), the
# probabilities and the output to bf16 at every step, while the SDPA kernel accumulates in fp32 and rounds
# once. So the two differ by a few bf16 ulps of O(1) values, far above fp32's 1e-5. We bound each path's error
# against an fp64 evaluation of the same rounded inputs: 2e-2 forward (observed <= 9e-3), 4e-2 + 2% for
# gradients, which chain several rounded products (observed about half of that); and the fast path must not
# be worse than the reference by more than ~1 ulp at 1.0.
@pytest.mark.parametrize("op", OPS)
def test_fast_matches_ref_bf16(op):
    ts = make_inputs(op, 1, 4, 2, 16, 16, 16, dtype=torch.bfloat16)
    exact = [t.detach().double() for t in ts]
    o64, g64, go = fwd_bwd(op, False, exact)
    go16 = go.to(torch.bfloat16)
    o_ref, g_ref, _ = fwd_bwd(op, False, ts, go16)
    o_fast, g_fast, _ = fwd_bwd(op, True, ts, go16)
    assert o_fast.dtype == o_ref.dtype == torch.bfloat16
    err_ref = (o_ref.double() - o64).abs().max().item()
    err_fast = (o_fast.double() - o64).abs().max().item()
    assert err_ref < 2e-2 and err_fast < 2e-2, (err_ref, err_fast)
    assert err_fast <= err_ref + 4e-3, (err_ref, err_fast)
    for path, grads in (("ref", g_ref), ("fast", g_fast)):
        assert_close_all([g.double() for g in grads], g64, atol=4e-2, rtol=2e-2,
                         what=f"{op} bf16 {path} grad")


# --------------------------------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fast", [False, True], ids=["ref", "fast"])
@pytest.mark.parametrize("masking", ["causal", "offset+padding"])
def test_gradcheck_float64(op, fast, masking):
    ts = make_inputs(op, 1, 2, 1, 3, 5 if masking != "causal" else 3, 4, dtype=torch.float64)
    if masking == "causal":
        kw = dict(causal=True)
    else:
        pad = torch.tensor([[True, True, True, False, True]])  # key 3 is padding
        kw = dict(causal=True, offset=2, attn_mask=pad)
    assert torch.autograd.gradcheck(lambda *a: run(op, fast, list(a), **kw), tuple(ts), eps=1e-6, atol=1e-5)


# ------------------------------------------------------------------------------------ oracles for GQA
def _softmax_rows(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)


def _causal_keep(tq: int, tk: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + offset


def v1_oracle_official(qf, kf, vf, lam, h, hkv, d):
    """Official multihead_flashdiff_1.py semantics, head by head, on *projection outputs* (B, T, width).

    diff-head j: Q1 = q columns [2j·d, 2j·d+d), Q2 = [2j·d+d, 2j·d+2d); KV diff-head g = j // n_rep:
    K1 = k columns of sub-head 2g, K2 = sub-head 2g+1, V = v columns [2g·d, 2g·d+2d). Returns (B, h, T, 2d).
    """
    n_rep = h // hkv
    t = qf.shape[1]
    keep = _causal_keep(t, t)
    outs = []
    for j in range(h):
        g = j // n_rep
        q1, q2 = qf[..., 2 * j * d: 2 * j * d + d], qf[..., 2 * j * d + d: 2 * j * d + 2 * d]
        k1, k2 = kf[..., 2 * g * d: 2 * g * d + d], kf[..., 2 * g * d + d: 2 * g * d + 2 * d]
        v = vf[..., 2 * g * d: 2 * g * d + 2 * d]
        a1 = _softmax_rows(q1 @ k1.transpose(-1, -2) / math.sqrt(d), keep)
        a2 = _softmax_rows(q2 @ k2.transpose(-1, -2) / math.sqrt(d), keep)
        outs.append((a1 - lam * a2) @ v)
    return torch.stack(outs, dim=1)


def v1_oracle_naive_file(qf, kf, vf, lam, h, hkv, d):
    """The official *naive* file (multihead_diffattn.py): K sub-heads are repeated n_rep times *before* the
    halves are split, so query sub-head i meets key sub-head i // n_rep (another pairing when n_rep > 1)."""
    n_rep = h // hkv
    t = qf.shape[1]
    keep = _causal_keep(t, t)
    probs = []
    for i in range(2 * h):
        g = i // n_rep
        qi, kg = qf[..., i * d: (i + 1) * d], kf[..., g * d: (g + 1) * d]
        probs.append(_softmax_rows(qi @ kg.transpose(-1, -2) / math.sqrt(d), keep))
    outs = []
    for j in range(h):
        g = j // n_rep
        outs.append((probs[2 * j] - lam * probs[2 * j + 1]) @ vf[..., 2 * g * d: 2 * g * d + 2 * d])
    return torch.stack(outs, dim=1)


def to_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, n·D) -> (B, n, T, D): how the modules cut projection outputs into heads."""
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)


@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_diff_v1_gqa_pairing_matches_official_oracle(n_rep):
    hkv, d, t, b = 2, 4, 7, 2
    h = hkv * n_rep
    e = 2 * h * d
    qf = torch.randn(b, t, e, dtype=torch.float64)
    kf = torch.randn(b, t, e // n_rep, dtype=torch.float64)
    vf = torch.randn(b, t, e // n_rep, dtype=torch.float64)
    lam = 0.6
    want = v1_oracle_official(qf, kf, vf, lam, h, hkv, d)
    q, k, v = to_heads(qf, 2 * h), to_heads(kf, 2 * hkv), to_heads(vf, hkv)
    for fn in (AF.diff_attention_ref, AF.diff_attention):
        torch.testing.assert_close(fn(q, k, v, lam, causal=True), want, atol=1e-10, rtol=0)

    naive = v1_oracle_naive_file(qf, kf, vf, lam, h, hkv, d)
    if n_rep == 1:  # the two pairings coincide without GQA ...
        torch.testing.assert_close(naive, want, atol=1e-10, rtol=0)
    else:  # ... and the test can tell them apart with it
        assert (naive - want).abs().max() > 1e-2


def v2_oracle(q, k, v, lam_logits, offset=0):
    """V2 head by head: pair j = query heads (2j, 2j+1), both reading KV head (2j) // (2h / hkv)."""
    h2, hkv = q.shape[1], k.shape[1]
    group = h2 // hkv
    keep = _causal_keep(q.shape[2], k.shape[2], offset)
    d = q.shape[-1]
    heads = [_softmax_rows(q[:, i] @ k[:, i // group].transpose(-1, -2) / math.sqrt(d), keep)
             @ v[:, i // group] for i in range(h2)]
    w = torch.sigmoid(lam_logits)[..., None]
    return torch.stack([heads[2 * j] - w[:, j] * heads[2 * j + 1] for j in range(h2 // 2)], dim=1), heads


@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_diff_v2_gqa_pairing_matches_oracle(n_rep):
    hkv, d, t, b = 2, 4, 6, 2
    h = hkv * n_rep
    q, k, v, lam = make_inputs("diff_v2", b, h, hkv, t, t, d, dtype=torch.float64)
    want, heads = v2_oracle(q, k, v, lam)
    for fn in (AF.diff_v2_attention_ref, AF.diff_v2_attention):
        torch.testing.assert_close(fn(q, k, v, lam, causal=True), want, atol=1e-10, rtol=0)
    # The wrong pairing (first half minus second half) is detectably different.
    w = torch.sigmoid(lam)[..., None]
    wrong = torch.stack([heads[j] - w[:, j] * heads[j + h] for j in range(h)], dim=1)
    assert (wrong - want).abs().max() > 1e-2


def test_diff_v1_with_lambda_zero_is_standard_attention_on_first_half():
    # λ = 0 leaves softmax(Q1K1ᵀ)V: a standard op over the even sub-heads with V of width 2d.
    q, k, v, _ = make_inputs("diff", 1, 4, 2, 6, 6, 4)
    got = AF.diff_attention(q, k, v, 0.0)
    want = AF.attention_ref(q[:, 0::2], k[:, 0::2], v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_shape_errors_are_clear():
    q, k, v, lam = make_inputs("diff", 1, 4, 2, 3, 3, 4)
    for fn in (AF.diff_attention, AF.diff_attention_ref):
        with pytest.raises(ValueError, match="diff attention wants"):
            fn(q[:, :7], k, v, lam)
        with pytest.raises(ValueError, match="diff attention wants"):
            fn(q, k[:, :3], v, lam)
        with pytest.raises(ValueError, match="multiple of KV heads"):
            fn(q[:, :6], k, v, lam)  # 3 diff-heads cannot share 2 KV heads
    q, k, v, lam = make_inputs("diff_v2", 1, 3, 2, 3, 3, 4)  # 3 pairs cannot split over 2 KV heads
    for fn in (AF.diff_v2_attention, AF.diff_v2_attention_ref):
        with pytest.raises(ValueError, match="GQA group"):
            fn(q, k, v, lam)
        with pytest.raises(ValueError, match="even number"):
            fn(q[:, :5], k, v, lam)
    q, k, v = make_inputs("standard", 1, 3, 2, 3, 3, 4)
    for fn in (AF.attention, AF.attention_ref):
        with pytest.raises(ValueError, match="multiple of KV heads"):
            fn(q, k, v)
    with pytest.raises(TypeError, match="bool or floating"):
        AF.attention_ref(q[:, :2], k, v, attn_mask=torch.ones(1, 3, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ masks
def _mask_kwargs(kind: str, b: int, tq: int, tk: int) -> dict:
    pad = torch.ones(b, tk, dtype=torch.bool)
    pad[0, 1] = False
    pad[-1, -2:] = False
    m4 = torch.rand(b, 1, tq, tk) > 0.3
    m4[..., 0] = True  # keep at least one key per row here (fully-masked rows are tested separately)
    additive = lambda m: torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    return {
        "causal": dict(causal=True),
        "none": dict(causal=False),
        "bool_pad2d": dict(causal=False, attn_mask=pad),
        "add_pad2d": dict(causal=False, attn_mask=additive(pad)),
        "bool_pad2d+causal": dict(causal=True, attn_mask=pad),
        "bool_4d": dict(causal=False, attn_mask=m4),
        "add_4d+causal": dict(causal=True, attn_mask=additive(m4)),
        "soft_add_4d": dict(causal=False, attn_mask=torch.randn(b, 1, tq, tk)),  # a finite bias (ALiBi-like)
    }[kind]


MASK_KINDS = ["causal", "none", "bool_pad2d", "add_pad2d", "bool_pad2d+causal", "bool_4d", "add_4d+causal",
              "soft_add_4d"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks_ref_vs_fast(op, kind):
    ts = make_inputs(op, 2, 2, 1, 6, 6, 4)
    kw = _mask_kwargs(kind, 2, 6, 6)
    o_ref, g_ref, go = fwd_bwd(op, False, ts, **kw)
    o_fast, g_fast, _ = fwd_bwd(op, True, ts, go, **kw)
    torch.testing.assert_close(o_fast, o_ref, atol=1e-5, rtol=0)
    assert_close_all(g_fast, g_ref, atol=1e-5, rtol=1e-5, what=f"{op}/{kind} grad")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fast", [False, True], ids=["ref", "fast"])
def test_padding_mask_equals_dropping_the_keys(op, fast):
    """A key padding mask must mean exactly "these keys do not exist": compare with slicing them away."""
    b, tk = 2, 7
    q, k, v, *extra = make_inputs(op, b, 2, 2, 5, tk, 4, dtype=torch.float64)
    keep = torch.ones(b, tk, dtype=torch.bool)
    keep[0, [1, 4]] = False
    keep[1, 6] = False
    for additive in (False, True):
        mask = keep
        if additive:
            mask = torch.zeros(b, tk, dtype=torch.float64).masked_fill(~keep, float("-inf"))
        out = run(op, fast, [q, k, v, *extra], causal=False, attn_mask=mask)
        for i in range(b):
            idx = keep[i].nonzero().squeeze(1)
            sub = [q[i: i + 1], k[i: i + 1, :, idx], v[i: i + 1, :, idx],
                   *(e[i: i + 1] if e.dim() else e for e in extra)]
            torch.testing.assert_close(out[i: i + 1], run(op, False, sub, causal=False), atol=1e-10, rtol=0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fast", [False, True], ids=["ref", "fast"])
@pytest.mark.parametrize("offset_type", [int, torch.tensor])
def test_offset_matches_slice_of_full_sequence(op, fast, offset_type):
    """Queries placed after P cached keys (offset=P) give the rows P.. of the full causal result."""
    t, p = 8, 5
    ts = make_inputs(op, 2, 2, 1, t, t, 4)
    full = run(op, fast, ts, causal=True)
    q, k, v, *extra = ts
    extra = [e[..., p:] if e.dim() else e for e in extra]  # V2's per-token λ follows the queries
    part = run(op, fast, [q[:, :, p:], k, v, *extra], causal=True, offset=offset_type(p))
    torch.testing.assert_close(part, full[:, :, p:], atol=1e-5, rtol=0)
    # Against an oracle too (not only self-consistency), for the simplest op.
    if op == "diff_v2":
        want, _ = v2_oracle(q[:, :, p:].double(), k.double(), v.double(), extra[0].double(), offset=p)
        torch.testing.assert_close(part.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fast", [False, True], ids=["ref", "fast"])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_fully_masked_rows_give_zeros_and_finite_grads(op, fast, mask_kind):
    b, tq, tk = 2, 4, 5
    ts = make_inputs(op, b, 2, 1, tq, tk, 4)
    keep = torch.ones(b, 1, tq, tk, dtype=torch.bool)
    keep[0, :, 2] = False  # query row 2 of batch 0 sees nothing
    keep[1] = False  # batch 1 sees nothing at all
    mask = keep if mask_kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    out, grads, _ = fwd_bwd(op, fast, ts, causal=False, attn_mask=mask)
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0, :, [0, 1, 3]].abs().sum() > 0
    for g in grads:
        assert torch.isfinite(g).all(), "gradient through a fully-masked row must not be NaN"
    q_grad = grads[0]
    assert torch.equal(q_grad[1], torch.zeros_like(q_grad[1]))
    assert torch.equal(q_grad[0, :, 2], torch.zeros_like(q_grad[0, :, 2]))


# ------------------------------------------------------------------------------- no materialized maps
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("masking", ["causal", "padding+offset"])
def test_fast_ops_never_take_the_materializing_sdpa_path(op, masking):
    """The fast ops must run SDPA's fused kernel, never its math fallback (which builds every (Tq, Tk) map):
    on CPU the fused kernel needs equal q/k/v widths, which V1's 2d-wide values would break as they are."""
    from torch.profiler import ProfilerActivity, profile

    ts = make_inputs(op, 1, 4, 2, 16, 16 if masking == "causal" else 20, 8)
    kw = dict(causal=True) if masking == "causal" else dict(causal=True, offset=4,
                                                             attn_mask=torch.rand(1, 20) > 0.2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = run(op, True, ts, **kw)
        out.sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert not any("attention_math" in n for n in names), sorted(n for n in names if "attention" in n)
    assert any("flash_attention" in n or "efficient_attention" in n for n in names), sorted(names)


# ---------------------------------------------------------------------------------- random shapes
@settings(max_examples=25, deadline=None)
@given(
    op=st.sampled_from(OPS),
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    n_rep=st.integers(1, 3),
    tq=st.integers(1, 7),
    cached=st.integers(0, 6),
    d=st.sampled_from([2, 4, 8]),
    causal=st.booleans(),
    padded=st.booleans(),
)
def test_random_shapes_ref_vs_fast(op, b, hkv, n_rep, tq, cached, d, causal, padded):
    tk = tq + cached
    ts = make_inputs(op, b, hkv * n_rep, hkv, tq, tk, d)
    kw: dict = dict(causal=causal, offset=cached)
    if padded:
        pad = torch.rand(b, tk) > 0.3
        kw["attn_mask"] = pad
    o_ref, g_ref, go = fwd_bwd(op, False, ts, **kw)
    o_fast, g_fast, _ = fwd_bwd(op, True, ts, go, **kw)
    torch.testing.assert_close(o_fast, o_ref, atol=1e-5, rtol=0)
    assert_close_all(g_fast, g_ref, atol=1e-5, rtol=1e-5, what=f"{op} grad")
