"""Backend selection (diffattn.ops.backends): the self-check that lets auto pick a fast kernel, its fallback, the
DIFFATTN_BACKEND override, and that CPU behaviour stays as it was.

No GPU here: the "checked device" is pretended by adding "cpu" to backends.CHECK_DEVICE_TYPES; the real Triton
kernel runs under its interpreter (in a subprocess, TRITON_INTERPRET must be set before triton imports) and
FlexAttention through its eager CPU path with torch's CPU-backward guard lifted (as tests/test_flex.py does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from diffattn import functional as AF
from diffattn.ops import backends as B
from diffattn.ops import distance_flex as DK

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    B.use_table(None)
    yield
    B.use_table(None)


@pytest.fixture
def pretend_cpu_is_checked(monkeypatch):
    monkeypatch.setattr(B, "CHECK_DEVICE_TYPES", {"cuda", "cpu"})


def _fake_triton(monkeypatch, result=None, error=None):
    """Replace the registered V1 fast kernel by one that returns sdpa·``result`` or raises ``error``; the fake
    is only ever run by the self-check (a failed check keeps diff_attention off the real Triton path). The fake
    is not opt-in (the real one is: slower on an H200), and a measured row for cpu/float32 names it, so these tests
    see auto's self-check at work."""
    real = B._KERNELS["triton"]
    calls = []

    def run(backend, x):
        out = real.run("sdpa", x)
        if backend == "triton":
            calls.append(1)
            if error is not None:
                raise error
            return out * result
        return out

    fake = dataclasses.replace(real, run=run, available=lambda device: None, opt_in=None)
    _swap(monkeypatch, fake)
    B.use_table([B.Row("diff", "cpu", "float32", "triton", "a test's pretend measurement")])
    return calls


def _swap(monkeypatch, kernel):
    monkeypatch.setitem(B._KERNELS, kernel.name, kernel)
    monkeypatch.setitem(B._FAMILIES, kernel.family,
                        [kernel if k.name == kernel.name else k for k in B._FAMILIES[kernel.family]])


def _v1():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(1, 4, 12, 16, generator=g), torch.randn(1, 4, 12, 16, generator=g),
            torch.randn(1, 2, 12, 32, generator=g), torch.tensor(0.5))


def test_cpu_default_is_the_safe_path_and_runs_no_check():
    builtin = {"alibi": "sdpa", "diff": "sdpa", "diff_distance": "block", "diff_v2": "sdpa", "dint": "sdpa",
               "distance": "block", "fox": "sdpa", "gated": "sdpa", "grouped_diff": "sdpa", "shared_diff": "sdpa",
               "standard": "sdpa"}
    picks = B.describe("cpu")
    assert {n: picks[n] for n in builtin} == builtin  # (a variant added later: the test below)
    assert B.results() == []


def test_every_registered_type_is_described_from_its_declaration():
    """describe() lists what the attention registry declares (the kernel family's safe op, or SDPA without one);
    no list of types lives in ops."""
    from diffattn.attention.registry import ATTENTION

    picks = B.describe("cpu")
    assert list(picks) == sorted(ATTENTION)
    for name, cls in ATTENTION.items():
        want = B.safe_path(cls.kernel_family) if cls.kernel_family else "sdpa"
        assert picks[name] == want, name
    assert set(B._KERNELS) == {"triton", "sdpa_wide", "sdpa_split", "flex_wide", "flex"}
    for kernel in B._KERNELS.values():  # each family declares its own self-check case and what it compares
        inputs = kernel.make_inputs(torch.device("cpu"), torch.float32)
        assert len(kernel.grad_names) == len(inputs) + 1 and kernel.grad_names[0] == "out"


@pytest.mark.parametrize("broken", ["wrong-numbers", "raises"])
def test_broken_kernel_falls_back_with_exactly_one_warning(pretend_cpu_is_checked, monkeypatch, broken):
    if broken == "raises":
        calls = _fake_triton(monkeypatch, error=RuntimeError("PTX compile failed: sm_90a unsupported"))
    else:
        calls = _fake_triton(monkeypatch, result=1.01)
    q, k, v, lam = _v1()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [AF.diff_attention(q, k, v, lam) for _ in range(3)]
    mine = [w for w in caught if "self-check" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    msg = str(mine[0].message)
    assert "triton" in msg and "sdpa" in msg
    assert ("PTX compile failed" in msg) if broken == "raises" else ("max|Δ|" in msg)
    assert calls == [1]  # checked once, then only the cached verdict
    for out in outs:
        torch.testing.assert_close(out, AF.diff_attention(q, k, v, lam, backend="sdpa"))
    assert B.describe("cpu")["diff"] == "sdpa"
    assert "triton failed its self-check" in B.describe_line("cpu")


def test_passing_kernel_is_picked_after_one_check(pretend_cpu_is_checked, monkeypatch):
    calls = _fake_triton(monkeypatch, result=1.0)
    picks = [B.choose("diff", torch.device("cpu"), torch.float32) for _ in range(3)]
    assert picks == ["triton"] * 3 and calls == [1]
    assert B.choose("diff", torch.device("cpu"), torch.float64) == "sdpa"  # unchecked dtype: safe path
    (res,) = B.results()
    assert res.ok and res.err["out"] <= res.allowed["out"]


def test_real_flex_passes_its_self_check_and_runs_when_named(pretend_cpu_is_checked, monkeypatch):
    fx = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(fx, "_validate_device", lambda *a, **k: None)  # flex's CPU backward guard
    monkeypatch.setattr(DK, "flex_unsupported", lambda *a, **k: None)
    used = []
    real_flex = DK.flex_distance
    monkeypatch.setattr(DK, "flex_distance", lambda *a, **k: used.append(1) or real_flex(*a, **k))
    # flex_attention compiles itself even called eagerly on CPU: shapes another test of this process gave it
    # (tests/ops/test_flex.py) make dynamo retrace with dynamic shapes, which it cannot do for this score_mod
    torch._dynamo.reset()
    res = B.self_check("flex", "cpu", torch.float32)
    assert res.ok, res.error
    assert set(res.err) == {"out", "dq", "dk", "dv", "dw", "dv_param"}  # output and every gradient, w and v included
    used.clear()
    q, k, v, w, vp = B.check_inputs("distance", torch.device("cpu"), torch.float32)
    with torch.no_grad():
        AF.distance_attention(q, k, v, w, vp)
        assert used == []  # passing is not enough: flex is opt-in (slower than the block loop on an H200)
        monkeypatch.setenv(B.ENV_VAR, "flex")
        out = AF.distance_attention(q, k, v, w, vp)
        ref = AF.distance_attention_ref(q, k, v, w, vp)
    assert used == [1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_real_triton_kernel_passes_its_self_check_under_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    code = (
        "import json, torch\n"
        "import diffattn.attention  # the variants register their kernels\n"
        "from diffattn.ops import backends as B\n"
        "B.CHECK_DEVICE_TYPES.add('cpu')\n"
        "r = B.self_check('triton', 'cpu', torch.float32)\n"
        "print(json.dumps({'ok': r.ok, 'error': r.error, 'err': r.err, 'pick': B.choose('diff', "
        "torch.device('cpu'), torch.float32), 'interpreted': __import__('diffattn.ops.triton_diff').ops.triton_diff"
        ".interpreted()}))\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    env.pop(B.ENV_VAR, None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["ok"], res["error"]
    assert res["interpreted"] and res["pick"] == "sdpa"  # passing is not enough: the kernel is opt-in
    assert len(res["err"]) == 5 and max(res["err"].values()) < 1e-4


def test_an_opt_in_kernel_is_never_autos_pick_but_runs_when_named(pretend_cpu_is_checked, monkeypatch):
    assert B._KERNELS["triton"].opt_in  # the real V1 kernel: measured slower than its SDPA path on an H200
    calls = _fake_triton(monkeypatch, result=1.0)
    _swap(monkeypatch, dataclasses.replace(B._KERNELS["triton"], opt_in="slower"))  # a row names it: still not
    cpu = torch.device("cpu")
    assert B.choose("diff", cpu, torch.float32) == "sdpa" and calls == []  # not even checked
    assert B.describe("cpu")["diff"] == "sdpa"
    monkeypatch.setenv(B.ENV_VAR, "triton")
    assert B.choose("diff", cpu, torch.float32) == "triton"


def test_env_override(pretend_cpu_is_checked, monkeypatch):
    calls = _fake_triton(monkeypatch, result=1.0)
    cpu = torch.device("cpu")
    monkeypatch.setenv(B.ENV_VAR, "sdpa")
    assert B.choose("diff", cpu, torch.float32) == "sdpa" and calls == []  # forced: no self-check
    monkeypatch.setenv(B.ENV_VAR, "block")  # names the other family: diff keeps auto (checked, passes)
    assert B.choose("diff", cpu, torch.float32) == "triton" and calls == [1]
    assert B.choose("distance", cpu, torch.float32) == "block"
    monkeypatch.setenv(B.ENV_VAR, "FLEX")
    assert B.describe("cpu")["diff_distance"] == "flex"


def test_env_override_reaches_the_ops_and_names_what_cannot_run(monkeypatch):
    used = []
    real_flex = DK.flex_distance
    monkeypatch.setattr(DK, "flex_distance", lambda *a, **k: used.append(1) or real_flex(*a, **k))
    q, k, v, w, vp = B.check_inputs("distance", torch.device("cpu"), torch.float32)
    monkeypatch.setenv(B.ENV_VAR, "flex")  # on CPU, where auto alone never takes flex
    with torch.no_grad():
        AF.distance_attention(q, k, v, w, vp)
    assert used == [1]
    monkeypatch.setenv(B.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"DIFFATTN_BACKEND=triton: .*(CUDA|not installed)"):
        AF.diff_attention(*_v1())


def test_invalid_env_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(B.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=r"DIFFATTN_BACKEND must be one of auto, sdpa, sdpa_wide, sdpa_split, "
                                         r"flex_wide, triton, flex, block; "
                                         r"got 'cuda'"):
        AF.diff_attention(*_v1())


def test_compiled_code_reads_only_the_cache(pretend_cpu_is_checked, monkeypatch):
    """Traced code never runs a self-check: with no verdict cached it takes the safe path; with a passing
    verdict cached (as describe() leaves before training compiles), the fast kernel."""
    calls = _fake_triton(monkeypatch, result=1.0)

    def fn(t):
        return t if B.choose("diff", t.device, t.dtype) == "triton" else -t

    f = torch.compile(fn, backend="eager")
    torch._dynamo.reset()
    x = torch.ones(2)
    assert torch.equal(f(x), -x) and calls == [] and B.results() == []
    torch._dynamo.reset()
    B.describe("cpu")
    assert calls == [1]
    assert torch.equal(f(x), x) and calls == [1]
    torch._dynamo.reset()


def test_train_cli_rejects_an_invalid_env_value_in_one_line(monkeypatch, tmp_path):
    from clirun import run_main

    monkeypatch.setenv(B.ENV_VAR, "fast")
    (tmp_path / "in.txt").write_text("some text " * 50)
    r = run_main("train", "--config", "tiny", "--data.path", tmp_path / "in.txt", "--out", tmp_path / "run",
                     "--train.steps", "1")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == ("error: DIFFATTN_BACKEND must be one of auto, sdpa, sdpa_wide, sdpa_split, "
                                  "flex_wide, triton, flex, block; got 'fast'")
    assert not (tmp_path / "run").exists()


def test_our_constant_marker_is_what_torch_compiler_sets() -> None:
    """B.assume_constant_result stands in for torch.compiler.assume_constant_result without importing
    torch._dynamo at import time (issue 25, item 3): it must mark a function exactly as that does, on this torch."""

    def ours() -> int:
        return 1

    def torchs() -> int:
        return 1

    assert B.assume_constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) != {}
    for fn in (B.env_backend, B._pick_cached):
        assert {k: v for k, v in vars(fn).items() if k in vars(torchs)} == vars(torchs), fn.__name__
