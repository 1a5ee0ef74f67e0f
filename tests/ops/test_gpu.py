"""On a CUDA device only (skipped elsewhere): the fast kernels on the real device, against the float64 safe
paths, and their self-checks (both kernels are opt-in: `auto` runs the safe paths; docs/results/gpu/). Run by
benchmarks/gpu_suite.py.

Tolerances as tests/test_triton.py: fp32 within 1e-5 of float64 relative to the largest value; bf16/fp16
within 4 eps of it, or twice what the safe path itself loses in that dtype.
"""

from __future__ import annotations

import pytest
import torch

from diffattn import ModelConfig, TransformerLM
from diffattn import functional as AF
from diffattn.ops import backends as B

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(fn, inputs, go):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, go.to(out.dtype))
    return [out.detach(), *grads]


def _assert_close_to_exact(fast, safe, inputs, dtype, slack=None):
    go = torch.randn(fast(*inputs).shape, device="cuda")
    got = _grads(fast, inputs, go)
    exact = _grads(safe, [x.double() for x in inputs], go)
    own = _grads(safe, inputs, go)
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    for i, (a, e, s) in enumerate(zip(got, exact, own)):
        scale = e.abs().max().item()
        allowed = max(tol * max(1.0, scale), 2 * (s.double() - e).abs().max().item()) * (slack or {}).get(i, 1)
        err = (a.double() - e).abs().max().item()
        assert err <= allowed, (i, err, allowed)


# Seen on an H200 (docs/results/gpu/): flex's gradient of v_param in bf16 misses the self-check's bound
# (4.00e-01 against 2.78e-01, the same in two runs; the check's inputs are fixed), so auto keeps the block
# path; flex is opt-in anyway (slower than the block loop there).
_FLEX_BF16 = pytest.mark.xfail(strict=True, reason="flex's bf16 v_param gradient misses the bound on an H200")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", ["triton", "flex"])
def test_self_check_passes_on_cuda(kernel, dtype, request):
    if kernel == "flex" and dtype == torch.bfloat16:
        request.applymarker(_FLEX_BF16)
    if B._KERNELS[kernel].available(torch.device("cuda")) is not None:
        pytest.skip(B._KERNELS[kernel].available(torch.device("cuda")))
    B.reset()
    res = B.self_check(kernel, "cuda", dtype)
    assert res.ok, res.error


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [(2, 2, 300, 300, True, 0), (4, 2, 257, 257, False, 0), (4, 2, 100, 400, True, 300)],
                         ids=["causal", "noncausal-gqa", "causal-offset-gqa"])
def test_triton_matches_sdpa_path_at_head_dim_64(case, dtype):
    pytest.importorskip("triton")
    h, hkv, tq, tk, causal, offset = case
    d = 64
    inputs = [torch.randn(2, 2 * h, tq, d, device="cuda").to(dtype), torch.randn(2, 2 * hkv, tk, d, device="cuda")
              .to(dtype), torch.randn(2, hkv, tk, 2 * d, device="cuda").to(dtype), torch.tensor(0.6, device="cuda")]
    kw = {"causal": causal, "offset": offset}
    _assert_close_to_exact(lambda *x: AF.diff_attention(*x, backend="triton", **kw),
                           lambda *x: AF.diff_attention(*x, backend="sdpa", **kw), inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("padding", [False, True])
def test_flex_matches_block_path(dtype, padding):
    """Output and the gradients of q, k, v and w within the usual bound; the gradient of v_param (index 5), a
    sum over every score with heavy cancellation that flex accumulates with atomic adds, within twice it (on an
    H200 it came to 1.01x the bound in fp32 and 1.45x in bf16, where the block loop keeps fp32 scores)."""
    torch.manual_seed(0)
    t = 300
    inputs = [torch.randn(2, 4, t, 64, device="cuda").to(dtype), torch.randn(2, 2, t, 64, device="cuda").to(dtype),
              torch.randn(2, 2, t, 64, device="cuda").to(dtype), torch.linspace(-0.2, 0.4, 4, device="cuda"),
              torch.linspace(-1.0, 1.0, 4, device="cuda")]
    mask = None
    if padding:
        mask = torch.ones(2, t, dtype=torch.bool, device="cuda")
        mask[0, t - 40:] = False
    _assert_close_to_exact(lambda *x: AF.distance_attention(*x, attn_mask=mask, backend="flex"),
                           lambda *x: AF.distance_attention(*x, attn_mask=mask, backend="block"), inputs, dtype,
                           slack={5: 2})


@pytest.mark.parametrize("attention", ["diff", "distance", "diff_distance"])
def test_model_step_on_the_fast_kernel_matches_the_safe_path(attention, monkeypatch):
    """A bf16-autocast forward + backward of a small model on the (opt-in) fast kernel, named through
    DIFFATTN_BACKEND, against the same model on the safe path (auto's pick): same loss to bf16 accuracy, finite
    gradients."""
    B.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, d_model=128, n_layers=2, n_heads=2, attention=attention, max_seq_len=256)
    model = TransformerLM(cfg).cuda()
    ids = torch.randint(0, 128, (2, 256), device="cuda")
    losses = {}
    for env in ("fast", "auto"):
        if env == "fast":
            monkeypatch.setenv(B.ENV_VAR, "triton" if attention == "diff" else "flex")
        else:
            monkeypatch.delenv(B.ENV_VAR)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses[env] = loss.item()
    assert abs(losses["fast"] - losses["auto"]) < 2e-2, losses


# V1's core layouts (issue 49): exact against the reference op on CUDA, forward and gradients, in every dtype,
# whichever SDPA backend the call lands on (flash, cuDNN, memory-efficient) and on FlexAttention's kernel.
CASES = [(4, 2, 300, 32), (8, 8, 257, 64), (4, 4, 128, 128)]  # (h, hkv, T, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,case", [(lay, c) for lay in ("sdpa_wide", "sdpa_split") for c in CASES]
                         + [("flex_wide", CASES[0])], ids=str)  # flex compiles per shape: one case
def test_v1_layouts_match_the_reference_op(layout, case, dtype):
    h, hkv, t, d = case
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(*s, generator=g).to("cuda", dtype)
               for s in ((2, 2 * h, t, d), (2, 2 * hkv, t, d), (2, hkv, t, 2 * d)))
    lam = torch.tensor(0.6, device="cuda")
    _assert_close_to_exact(lambda *x: AF.diff_attention(*x, backend=layout), AF.diff_attention_ref,
                           [q, k, v, lam], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["sdpa_wide", "sdpa_split", "flex_wide"])
def test_v1_layout_self_checks_pass_on_cuda(layout, dtype):
    B.reset()
    res = B.self_check(layout, "cuda", dtype)
    assert res.ok, res.error
