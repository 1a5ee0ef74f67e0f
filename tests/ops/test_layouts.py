"""V1's core layouts (``sdpa``, ``sdpa_wide``, ``sdpa_split``, ``flex_wide``; :mod:`diffattn.ops.wide_v`) against
the materialized reference op: forward and gradients in fp32 and bf16, GQA, causality, the types built on V1's
core (Shared DIFF, DINT, GDA), the fused epilogue, and the measured dispatch table ``auto`` reads."""

from __future__ import annotations

import json

import pytest
import torch

import diffattn.attention  # noqa: F401  (registers the variants and their kernels)
from diffattn.attention import functional as AF
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.ops import backends as B
from diffattn.ops.norm import RMSNorm, diff_epilogue, fused_diff_epilogue
from diffattn.ops.wide_v import BACKEND_LAYOUTS as LAYOUTS

TRAINED = ("sdpa", "sdpa_wide", "sdpa_split")  # the layouts with a backward on CPU (flex has none here)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    monkeypatch.delenv(B.EPILOGUE_VAR, raising=False)
    B.use_table(None)
    yield
    B.use_table(None)


def _inputs(seed: int, dtype: torch.dtype, h=4, hkv=2, t=37, d=16):
    """q (2, 2h, t, d), k (2, 2hkv, t, d), v (2, hkv, t, 2d), λ 0.6 (fp32), from a fresh generator."""
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(*s, generator=g).to(dtype) for s in ((2, 2 * h, t, d), (2, 2 * hkv, t, d), (2, hkv, t, 2 * d))]
    return [*qkv, torch.tensor(0.6)]


def _fwd_bwd(fn, inputs, go):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, go.to(out.dtype))
    return [out.detach(), *grads]


def _errors(fn, dtype, seed, **kw):
    """max |Δ| of ``fn``'s output and gradients (q, k, v, λ) in ``dtype`` against the reference op in float64,
    and what is allowed: 1e-5 × the largest value in fp32; in bf16 twice what the reference op itself loses there
    (or 4 eps × the largest value)."""
    inputs = _inputs(seed, dtype, **kw)
    go = torch.randn(inputs[0].shape[0], inputs[0].shape[1] // 2, inputs[0].shape[2], 2 * inputs[0].shape[3],
                     generator=torch.Generator().manual_seed(seed + 1))
    got = _fwd_bwd(fn, inputs, go)
    exact = _fwd_bwd(AF.diff_attention_ref, [x.double() for x in inputs], go.double())
    own = _fwd_bwd(AF.diff_attention_ref, inputs, go)
    names = ("out", "dq", "dk", "dv", "dlam")
    err = {n: (a.double() - e).abs().max().item() for n, a, e in zip(names, got, exact)}
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    allowed = {n: max(tol * max(1.0, e.abs().max().item()), 2 * (s.double() - e).abs().max().item())
               for n, e, s in zip(names, exact, own)}
    return err, allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", TRAINED)
def test_each_layout_matches_the_reference_op_forward_and_gradients(layout, dtype):
    for seed in (0, 7):  # fresh inputs: the same function on any valid input
        err, allowed = _errors(lambda q, k, v, lam: AF.diff_attention(q, k, v, lam, backend=layout), dtype, seed)
        bad = {n: (err[n], allowed[n]) for n in err if not err[n] <= allowed[n]}
        assert not bad, bad
        print(f"{layout} {dtype}: " + ", ".join(f"{n} {err[n]:.1e}" for n in err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_layout_matches_the_reference_op_forward(dtype):
    """FlexAttention runs on CPU forward only (torch has no CPU backward for it); its gradients are checked on
    CUDA (tests/ops/test_gpu.py::test_flex_wide_layout_gradients)."""
    q, k, v, lam = _inputs(3, dtype)
    with torch.no_grad():
        got = AF.diff_attention(q, k, v, lam, backend="flex_wide")
        exact = AF.diff_attention_ref(q.double(), k.double(), v.double(), lam.double())
        own = AF.diff_attention_ref(q, k, v, lam)
    err = (got.double() - exact).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    assert err <= max(tol * exact.abs().max().item(), 2 * (own.double() - exact).abs().max().item()), err
    with pytest.raises(ValueError, match="flex_wide.*no backward on CPU"):
        AF.diff_attention(*(x.requires_grad_() for x in _inputs(3, torch.float32)), backend="flex_wide")


@pytest.mark.parametrize("layout", [*TRAINED, "flex_wide"])
def test_no_output_depends_on_a_later_token(layout):
    """Change every token after position c: the outputs up to c stay what they were, bit for bit."""
    q, k, v, lam = _inputs(11, torch.float32)
    c = 20
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, c + 1:] = torch.randn_like(x[:, :, c + 1:]) * 5
    with torch.no_grad():
        a = AF.diff_attention(q, k, v, lam, backend=layout)
        b = AF.diff_attention(q2, k2, v2, lam, backend=layout)
    assert torch.equal(a[:, :, :c + 1], b[:, :, :c + 1])
    assert not torch.equal(a[:, :, c + 1:], b[:, :, c + 1:])


@pytest.mark.parametrize("layout", TRAINED)
def test_masks_offsets_and_no_gqa_match_the_reference(layout):
    q, k, v, lam = _inputs(5, torch.float32, h=2, hkv=2, t=9)
    kk, vv = (torch.cat([x, x.flip(2)], dim=2) for x in (k, v))  # 18 keys, queries at 9..17
    mask = torch.rand(1, 1, 9, 18, generator=torch.Generator().manual_seed(2)) > 0.3
    for kw in ({"offset": 9}, {"offset": 9, "attn_mask": mask}, {"causal": False}):
        keys = (kk, vv) if "offset" in kw else (k, v)
        got = AF.diff_attention(q, *keys, lam, backend=layout, **kw)
        torch.testing.assert_close(got, AF.diff_attention_ref(q, *keys, lam, **kw), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", TRAINED)
def test_grouped_diff_takes_the_layouts_through_the_shared_core(layout):
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 8, 21, 16, generator=g), torch.randn(1, 4, 21, 16, generator=g), torch.randn(
        1, 2, 21, 32, generator=g)
    got = AF.grouped_diff_attention(q, k, v, 0.7, 3, backend=layout)
    torch.testing.assert_close(got, AF.grouped_diff_attention_ref(q, k, v, 0.7, 3), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("attention", ["diff", "shared_diff", "dint", "grouped_diff"])
def test_the_types_on_v1s_core_give_the_same_model_on_every_layout(attention, monkeypatch):
    """A forced layout (DIFFATTN_BACKEND) reaches each type through the shared core; output and every
    parameter's gradient equal the safe path's."""
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, max_seq_len=32, attention=attention)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))

    def run():
        model.zero_grad()
        out = model(ids).float()
        out.logsumexp(-1).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setenv(B.ENV_VAR, "sdpa")
    base, grads = run()
    for layout in ("sdpa_wide", "sdpa_split"):
        monkeypatch.setenv(B.ENV_VAR, layout)
        out, g2 = run()
        torch.testing.assert_close(out, base, atol=1e-5, rtol=1e-5)
        for n in grads:
            torch.testing.assert_close(g2[n], grads[n], atol=1e-5, rtol=1e-4, msg=f"{layout} {n}")


def test_epilogue_is_the_unfused_subtraction_and_norm_bit_for_bit():
    g = torch.Generator().manual_seed(6)
    o1, o2 = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8, generator=g) + 0.5)
    lam = torch.tensor(0.37)
    want = norm(o1 - lam * o2, scale=0.8)
    assert torch.equal(diff_epilogue(o1, o2, lam, norm.weight * 0.8, norm.eps), want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_epilogue_in_the_model_matches_the_eager_one(dtype, monkeypatch):
    """DIFFATTN_EPILOGUE=compiled runs λ, the subtraction, the norm and the scale as one torch.compile region
    (inductor); output and gradients match the eager epilogue (fp32 to rounding, bf16 to a few ulps)."""
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, max_seq_len=32, attention="diff")
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(dtype)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    outs = []
    for mode in ("eager", "compiled"):
        monkeypatch.setenv(B.EPILOGUE_VAR, mode)
        model.zero_grad()
        out = model(ids).float()
        out.logsumexp(-1).mean().backward()
        outs.append((out.detach(), [p.grad.float().clone() for p in model.parameters() if p.grad is not None]))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outs[1][0], outs[0][0], **tol)
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, **tol)
    assert fused_diff_epilogue  # the compiled path ran (the eager one is diff_epilogue itself)


# ------------------------------------------------------------------------------------------- dispatch table
def test_the_shipped_table_parses_and_cites_results_files():
    rows = B.table()
    assert rows and all(r.source.startswith("docs/results/") for r in rows)
    names = {k.name for k in B.family_kernels("diff")} | {"sdpa", "block", "flex"}
    assert all(r.layout in names for r in rows)
    assert not [r for r in rows if r.capability == "cpu"]  # CPU: the safe path, nothing measured there


def test_no_row_means_the_safe_path_and_doctor_says_so(monkeypatch):
    monkeypatch.setattr(B, "CHECK_DEVICE_TYPES", {"cuda", "cpu"})
    assert B.choose("diff", torch.device("cpu"), torch.float32) == "sdpa"
    assert B.explain("diff", "cpu", torch.float32) == "no measurement for cpu/float32: safe path (sdpa)"
    assert B.results() == []  # nothing was checked


def test_a_measured_row_is_picked_after_its_self_check_and_cited(monkeypatch):
    monkeypatch.setattr(B, "CHECK_DEVICE_TYPES", {"cuda", "cpu"})
    B.use_table([B.Row("diff", "cpu", "float32", "sdpa_split", "docs/results/gpu/x.json", "1.2x")])
    assert B.choose("diff", torch.device("cpu"), torch.float32) == "sdpa_split"
    assert B.choose("diff", torch.device("cpu"), torch.bfloat16) == "sdpa"  # no row for bf16
    (res,) = B.results()
    assert res.ok and res.kernel == "sdpa_split"
    assert B.explain("diff", "cpu", torch.float32) == ("sdpa_split: measured row cpu/float32 "
                                                       "(docs/results/gpu/x.json: 1.2x)")
    assert B.describe("cpu")["grouped_diff"] == "sdpa_split"  # the types on V1's core follow it


def test_rows_naming_an_opt_in_or_unknown_kernel_keep_the_safe_path(monkeypatch):
    monkeypatch.setattr(B, "CHECK_DEVICE_TYPES", {"cuda", "cpu"})
    B.use_table([B.Row("diff", "cpu", "float32", "triton", "docs/results/gpu/x.json"),
                 B.Row("diff", "cpu", "bfloat16", "warp_speed", "docs/results/gpu/x.json")])
    assert B.choose("diff", torch.device("cpu"), torch.float32) == "sdpa"
    assert "opt-in" in B.explain("diff", "cpu", torch.float32)
    assert B.choose("diff", torch.device("cpu"), torch.bfloat16) == "sdpa"


def test_cpu_ignores_rows_entirely():
    B.use_table([B.Row("diff", "cpu", "float32", "sdpa_split", "docs/results/gpu/x.json")])
    assert B.choose("diff", torch.device("cpu"), torch.float32) == "sdpa"
    assert B.epilogue("diff", "cpu", torch.float32) == "eager"


@pytest.mark.parametrize("bad", [{"rows": [{"family": "diff"}]}, {"rows": "x"}, [],
                                 {"rows": [{"family": "diff", "capability": "sm_90", "dtype": "bfloat16",
                                            "layout": "sdpa", "source": "s", "epilogue": "fused"}]}])
def test_a_malformed_table_is_a_one_line_error(bad):
    with pytest.raises(ValueError, match="dispatch|row 0"):
        B.parse_rows(json.loads(json.dumps(bad)), "dispatch.json")


def test_layout_names_are_the_registered_kernels():
    assert set(LAYOUTS) - {"sdpa"} <= {k.name for k in B.family_kernels("diff")}
