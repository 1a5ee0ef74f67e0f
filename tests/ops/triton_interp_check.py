"""Runs the Triton diff-attention kernel under Triton's CPU interpreter against diff_attention_ref and prints
the max |Δ| of the output and every gradient as JSON (used by tests/test_triton.py, in a fresh process).

    TRITON_INTERPRET=1 PYTHONPATH=src python tests/triton_interp_check.py

Triton must be imported with TRITON_INTERPRET=1 already set (its own jit'd library functions, tl.max, tl.sum,
are decorated at import), hence a process of its own. Small shapes (T <= 64, d = 16, 16×16 tiles) keep the
interpreter, which runs every program instance in numpy, to seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
    raise SystemExit("set TRITON_INTERPRET=1 before anything imports triton")

import torch  # noqa: E402

from diffattn import functional as AF  # noqa: E402

NAMES = ("out", "dq", "dk", "dv", "dlam")
CASES = {  # name: (b, h, hkv, tq, tk, causal, offset); GQA needs hkv >= 2 to tell i // n_rep from i % hkv
    "causal": (1, 2, 2, 40, 40, True, 0),
    "noncausal-gqa": (1, 4, 2, 33, 33, False, 0),
    "causal-offset-gqa": (2, 4, 2, 20, 50, True, 25),  # keys 45..49 come after every query
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fwd_bwd(fn, inputs, go):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, go.to(out.dtype))]


def exactness(case: tuple, dtype: torch.dtype, d: int = 16) -> dict:
    """max |Δ| of the kernel (backend="triton") against the fp64 reference on the same rounded inputs ("err"),
    the same for diff_attention_ref run in ``dtype`` ("ref_err": what the dtype allows), and the largest
    reference magnitude ("scale"), per output/gradient."""
    b, h, hkv, tq, tk, causal, offset = case
    q = torch.randn(b, 2 * h, tq, d).to(dtype)
    k = torch.randn(b, 2 * hkv, tk, d).to(dtype)
    v = torch.randn(b, hkv, tk, 2 * d).to(dtype)
    lam = torch.tensor(0.65)
    go = torch.randn(b, h, tq, 2 * d)
    kw = {"causal": causal, "offset": offset}
    got = _fwd_bwd(lambda *x: AF.diff_attention(*x, backend="triton", **kw), (q, k, v, lam), go)
    exact = _fwd_bwd(lambda *x: AF.diff_attention_ref(*x, **kw), [x.double() for x in (q, k, v, lam)], go)
    in_dtype = _fwd_bwd(lambda *x: AF.diff_attention_ref(*x, **kw), (q, k, v, lam.to(dtype)), go)
    return {
        "err": {n: (a.double() - e).abs().max().item() for n, a, e in zip(NAMES, got, exact)},
        "ref_err": {n: (a.double() - e).abs().max().item() for n, a, e in zip(NAMES, in_dtype, exact)},
        "scale": {n: e.abs().max().item() for n, e in zip(NAMES, exact)},
    }


def strided_and_float_lambda() -> float:
    """max |Δ| with q handed over as a (B, T, H, D)-strided view (as the layer does) and λ a Python float."""
    q, k, v = torch.randn(1, 4, 24, 16), torch.randn(1, 4, 24, 16), torch.randn(1, 2, 24, 32)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = AF.diff_attention(qt, k, v, 0.5, backend="triton")
    return (out - AF.diff_attention_ref(q, k, v, 0.5)).abs().max().item()


def custom_op() -> dict:
    """The kernel as a registered custom op: torch.library.opcheck's verdicts (schema, fake implementation,
    autograd registration), graph breaks when torch._dynamo traces the V1 core through it, and max |Δ| of the
    output and gradients of that core compiled (aot_eager: dynamo + AOT autograd, no C compiler needed)
    against eager."""
    from diffattn.ops import triton_diff

    q, k, v = torch.randn(1, 4, 24, 16), torch.randn(1, 4, 24, 16), torch.randn(1, 2, 24, 32)
    lam = torch.tensor([0.4])
    args = (q, k, v, lam, True, 0, 0.25, 16, 16)
    checks = torch.library.opcheck(triton_diff.diff_attn_fwd, args,
                                   test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

    def core(q, k, v, lam):
        return AF.diff_attention(q, k, v, lam, backend="triton")

    lam0 = torch.tensor(0.4)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(core)(q, k, v, lam0)
    go = torch.randn(1, 2, 24, 32)
    eager = _fwd_bwd(core, (q, k, v, lam0), go)
    compiled = _fwd_bwd(torch.compile(core, backend="aot_eager", fullgraph=True), (q, k, v, lam0), go)
    return {"opcheck": {n: str(r) for n, r in checks.items()}, "graph_breaks": explained.graph_break_count,
            "graphs": explained.graph_count,
            "compiled_err": {n: (a - b).abs().max().item() for n, a, b in zip(NAMES, compiled, eager)}}


def main() -> None:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    res: dict = {"cases": {}}
    for name, case in CASES.items():
        for dn, dt in DTYPES.items():
            if dn == "fp32" or name == "causal-offset-gqa":  # half precision on the hardest case only
                res["cases"][f"{name}/{dn}"] = exactness(case, dt)
    res["strided_float_lambda"] = strided_and_float_lambda()
    res["custom_op"] = custom_op()
    from diffattn.ops import triton_diff as triton_diff

    res["interpreted"] = triton_diff.interpreted()
    res["seconds"] = time.perf_counter() - t0
    print(json.dumps(res))


if __name__ == "__main__":
    main()
