"""Distance-aware attention on FlexAttention (backend="flex") against the materialized reference.

On CPU torch runs flex_attention eagerly (forward: a dense implementation of the same score_mod/block-mask
semantics the CUDA kernel compiles). Its backward is refused on CPU by a device check only
(``_validate_device``: "FlexAttention does not support backward on CPU"); the eager backward itself is
device-agnostic, so the gradient tests lift that check (and our own CPU guard) to verify that the score_mod
carries the gradients to q, k, v and the per-head w, v. The fused CUDA kernel itself is not run here (no GPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from diffattn import functional as AF
from diffattn.ops import distance_flex as DK

fx = pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no FlexAttention")

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _dist_inputs(hq: int, hkv: int, tq: int, tk: int, dtype=torch.float64, d: int = 8, dv: int = 6):
    q = torch.randn(2, hq, tq, d, dtype=dtype)
    k = torch.randn(2, hkv, tk, d, dtype=dtype)
    v = torch.randn(2, hkv, tk, dv, dtype=dtype)
    w = torch.linspace(-0.3, 0.5, hq, dtype=dtype)
    vp = torch.linspace(-1.0, 2.0, hq, dtype=dtype)
    return q, k, v, w, vp


def _pad_mask(tk: int) -> torch.Tensor:
    m = torch.ones(2, tk, dtype=torch.bool)
    m[0, tk - 5:] = False
    m[1, :3] = False
    return m


CASES = [  # (hq, hkv, tq, tk, causal, offset, padding)
    pytest.param(4, 4, 12, 12, True, 0, False, id="causal"),
    pytest.param(4, 2, 12, 12, False, 0, False, id="noncausal-gqa"),
    pytest.param(4, 1, 7, 19, True, 9, False, id="causal-offset-gqa"),
    pytest.param(2, 2, 12, 12, True, 0, True, id="causal-padding"),
    pytest.param(2, 1, 5, 16, True, "positions", False, id="cached-positions"),
]


def _kw(tq, tk, causal, offset, padding):
    if offset == "positions":
        offset = torch.tensor([11, 3, 15, 7, 8])[:tq]
    return {"causal": causal, "offset": offset, "attn_mask": _pad_mask(tk) if padding else None}


@pytest.mark.parametrize("hq,hkv,tq,tk,causal,offset,padding", CASES)
def test_flex_distance_forward_matches_reference_fp32(hq, hkv, tq, tk, causal, offset, padding):
    q, k, v, w, vp = _dist_inputs(hq, hkv, tq, tk, torch.float32)
    kw = _kw(tq, tk, causal, offset, padding)
    with torch.no_grad():  # the public entry point runs flex on CPU without gradients
        out = AF.distance_attention(q, k, v, w, vp, backend="flex", **kw)
        ref = AF.distance_attention_ref(q, k, v, w, vp, **kw)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


@pytest.fixture
def flex_cpu_backward(monkeypatch):
    """Lift the CPU device checks (torch's and ours) so flex's eager backward runs here."""
    monkeypatch.setattr(fx, "_validate_device", lambda *a, **k: None)
    monkeypatch.setattr(DK, "flex_unsupported", lambda *a, **k: None)


def _grads(fn, inputs, go):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, go)


@pytest.mark.parametrize("hq,hkv,tq,tk,causal,offset,padding", CASES)
def test_flex_distance_gradients_match_reference(flex_cpu_backward, hq, hkv, tq, tk, causal, offset, padding):
    inputs = _dist_inputs(hq, hkv, tq, tk)
    kw = _kw(tq, tk, causal, offset, padding)
    go = torch.randn(2, hq, tq, inputs[2].shape[-1], dtype=torch.float64)
    out, g = _grads(lambda *x: AF.distance_attention(*x, backend="flex", **kw), inputs, go)
    ref, g_ref = _grads(lambda *x: AF.distance_attention_ref(*x, **kw), inputs, go)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for name, a, b in zip(("q", "k", "v", "w", "v_param"), g, g_ref):
        assert b.abs().max() > 0, name  # the case exercises this gradient
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("h,hkv,causal,padding", [(2, 2, True, False), (2, 1, True, True), (4, 2, False, False)])
def test_flex_diff_distance_matches_reference(flex_cpu_backward, h, hkv, causal, padding):
    tq = tk = 10
    q = torch.randn(2, 2 * h, tq, 8, dtype=torch.float64)
    k = torch.randn(2, 2 * hkv, tk, 8, dtype=torch.float64)
    v = torch.randn(2, hkv, tk, 16, dtype=torch.float64)
    lam = torch.tensor(0.7, dtype=torch.float64)
    w = torch.linspace(-0.2, 0.6, 2 * h, dtype=torch.float64)
    vp = torch.linspace(-1.0, 1.5, 2 * h, dtype=torch.float64)
    kw = {"causal": causal, "attn_mask": _pad_mask(tk) if padding else None}
    go = torch.randn(2, h, tq, 16, dtype=torch.float64)
    inputs = (q, k, v, lam, w, vp)
    out, g = _grads(lambda *x: AF.diff_distance_attention(*x, backend="flex", **kw), inputs, go)
    ref, g_ref = _grads(lambda *x: AF.diff_distance_attention_ref(*x, **kw), inputs, go)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for name, a, b in zip(("q", "k", "v", "lam", "w", "v_param"), g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10, msg=lambda m, n=name: f"grad {n}: {m}")


def test_flex_scale_placement_matches_reference_for_negative_scale():
    # ReLU(s·scale) ≠ ReLU(s)·scale when scale < 0: flex must apply the scale after the ReLU, as the reference
    q, k, v, w, vp = _dist_inputs(2, 2, 8, 8)
    with torch.no_grad():
        out = AF.distance_attention(q, k, v, w, vp, scale=-0.5, backend="flex")
        ref = AF.distance_attention_ref(q, k, v, w, vp, scale=-0.5)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


def test_flex_backend_errors_and_auto_on_cpu():
    q, k, v, w, vp = _dist_inputs(2, 2, 8, 8, torch.float32)
    q.requires_grad_()
    with pytest.raises(ValueError, match="no backward on CPU"):
        AF.distance_attention(q, k, v, w, vp, backend="flex")
    with pytest.raises(ValueError, match="boolean masks only"):
        with torch.no_grad():
            AF.distance_attention(q, k, v, w, vp, attn_mask=torch.zeros(8, 8), backend="flex")
    with pytest.raises(ValueError, match="backend must be"):
        AF.distance_attention(q, k, v, w, vp, backend="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto on CPU stays on the block path: flex (eager) would warn
        out = AF.distance_attention(q, k, v, w, vp)
    out.sum().backward()
    assert q.grad is not None
