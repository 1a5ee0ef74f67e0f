"""The fused Triton differential-attention kernel against diff_attention_ref, under Triton's CPU interpreter.

Triton has to be imported with TRITON_INTERPRET=1 already set, so the kernel runs in a fresh process
(tests/triton_interp_check.py, about 15 s on one core) that reports max |Δ| per output/gradient as JSON; the
tests below judge those numbers. Backend selection and the error paths run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from diffattn import functional as AF
from diffattn.ops import triton_support

CHECK = Path(__file__).with_name("triton_interp_check.py")
NAMES = ("out", "dq", "dk", "dv", "dlam")


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton", reason="triton is not installed")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["interpreted"], "the kernel did not run under the interpreter"
    return res


@pytest.mark.slow  # the kernel under Triton's interpreter: minutes of CPU
@pytest.mark.parametrize("case", ["causal", "noncausal-gqa", "causal-offset-gqa"])
def test_triton_fp32_forward_and_gradients_match_reference(interp, case):
    r = interp["cases"][f"{case}/fp32"]
    for n in NAMES:
        assert r["scale"][n] > 0.1, n  # every output and gradient is exercised
        assert r["err"][n] <= 1e-5 * max(1.0, r["scale"][n]), (n, r["err"][n])


@pytest.mark.slow  # the kernel under Triton's interpreter: minutes of CPU
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_triton_half_precision_matches_reference(interp, dtype):
    """bf16/fp16 inputs with fp32 accumulation: no worse than twice the reference op run in that dtype (which
    rounds probabilities and products to it), or a few units in the last place of the largest value."""
    r = interp["cases"][f"causal-offset-gqa/{dtype}"]
    eps = torch.finfo(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])).eps
    for n in NAMES:
        assert r["err"][n] <= max(2 * r["ref_err"][n], 4 * eps * r["scale"][n]), (n, r)


@pytest.mark.slow  # the kernel under Triton's interpreter: minutes of CPU
def test_triton_strided_inputs_and_float_lambda(interp):
    assert interp["strided_float_lambda"] < 1e-5


@pytest.mark.slow  # the kernel under Triton's interpreter: minutes of CPU
def test_triton_kernel_is_a_custom_op_that_compile_traces_without_a_graph_break(interp):
    """torch.library.opcheck passes (schema, fake implementation, autograd registration); dynamo traces the V1
    core through the kernel in one graph; compiled with fullgraph, output and gradients equal eager's."""
    r = interp["custom_op"]
    assert r["opcheck"] == dict.fromkeys(("test_schema", "test_faketensor", "test_autograd_registration"),
                                         "SUCCESS"), r["opcheck"]
    assert (r["graphs"], r["graph_breaks"]) == (1, 0)
    assert max(r["compiled_err"].values()) <= 1e-6, r["compiled_err"]


def test_triton_forced_backend_rejects_what_it_cannot_run(monkeypatch):
    q, k, v, lam = torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 32), torch.tensor(0.5)
    if not triton_support.installed():
        with pytest.raises(ValueError, match="triton is not installed"):
            AF.diff_attention(q, k, v, lam, backend="triton")
        return
    with pytest.raises(ValueError, match="no attn_mask"):
        AF.diff_attention(q, k, v, lam, attn_mask=torch.ones(1, 8, dtype=torch.bool), backend="triton")
    with pytest.raises(ValueError, match="scalar λ"):
        AF.diff_attention(q, k, v, torch.ones(2, 1, 1), backend="triton")
    with pytest.raises(ValueError, match="int offset"):
        AF.diff_attention(q, k, v, lam, offset=torch.arange(8), backend="triton")
    with pytest.raises(ValueError, match="backend must be"):
        AF.diff_attention(q, k, v, lam, backend="flash")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        AF.diff_attention(q, k, v, lam, backend="triton")


def test_auto_backend_on_cpu_takes_sdpa(monkeypatch):
    """auto never runs the kernel on CPU, even with triton importable and the interpreter on."""
    calls = []
    fake = types.SimpleNamespace(diff_attention_triton=lambda *a, **k: calls.append(1) or torch.zeros(()))
    monkeypatch.setitem(sys.modules, "diffattn.ops.triton_diff", fake)
    monkeypatch.setattr(triton_support, "importable", lambda: True)
    monkeypatch.setattr(triton_support, "installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, lam = torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 32), torch.tensor(0.5)
    out = AF.diff_attention(q, k, v, lam)
    torch.testing.assert_close(out, AF.diff_attention_ref(q, k, v, lam), atol=1e-5, rtol=1e-5)
    assert not calls
    AF.diff_attention(q, k, v, lam, backend="triton")  # the fake is live: forcing the backend reaches it
    assert calls == [1]


def test_package_runs_without_triton():
    """With triton unimportable the package imports, trains a step on the SDPA path, and a forced triton
    backend names the missing package."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # import triton -> ImportError, find_spec -> None
        "import torch\n"
        "from diffattn import functional as AF, ModelConfig, TransformerLM\n"
        "m = TransformerLM(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=1, max_seq_len=8))\n"
        "m(torch.randint(0, 20, (1, 8))).sum().backward()\n"
        "q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 16)\n"
        "try:\n"
        "    AF.diff_attention(q, k, v, 0.5, backend='triton')\n"
        "except ValueError as e:\n"
        "    assert 'triton is not installed' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
