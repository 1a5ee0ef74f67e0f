"""`diffattn doctor` in a real subprocess on CPU: versions, device, each backend's status, what auto picks."""

from __future__ import annotations

import pytest
import torch
from clirun import run_diffattn

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU report")


def test_doctor_reports_and_exits_0_on_cpu(monkeypatch):
    monkeypatch.delenv("DIFFATTN_BACKEND", raising=False)
    r = run_diffattn("doctor", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for name in ("torch", "triton", "transformers", "datasets", "tensorboard", "cuda"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert torch.__version__ in out
    assert "device        cpu" in out and "threads" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) == {"sdpa", "triton", "flex", "block"}
    assert " ms" in rows["sdpa"] and " ms" in rows["block"]  # the safe paths were timed on a small case
    assert "self-check skipped" in rows["flex"]  # auto does not use flex on CPU, so it is not checked here
    assert "auto picks: standard sdpa, diff sdpa, diff_v2 sdpa, distance block, diff_distance block" in out
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("env,args,message", [
    ("bogus", [], "DIFFATTN_BACKEND must be one of auto, sdpa, triton, flex, block; got 'bogus'"),
    (None, ["--device", "cuda"], "no CUDA device is available"),
    (None, ["--device", "tpu:0"], "error:"),
])
def test_doctor_bad_input_is_one_line_and_exit_2(monkeypatch, env, args, message):
    if env is None:
        monkeypatch.delenv("DIFFATTN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DIFFATTN_BACKEND", env)
    r = run_diffattn("doctor", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
