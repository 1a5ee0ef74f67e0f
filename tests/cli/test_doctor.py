"""`diffattn doctor` in a real subprocess on CPU: versions, device, each backend's status, what auto picks."""

from __future__ import annotations

import argparse

import pytest
import torch
from clirun import run_diffattn, run_main

from diffattn.attention.registry import ATTENTION
from diffattn.cli import doctor
from diffattn.ops import backends
from diffattn.train import machine_check

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
    backends_part, variants_part = out.split("auto picks: ")
    rows = {line.split()[0]: line for line in backends_part.splitlines() if line.startswith("  ")}
    assert set(rows) == {"sdpa", "triton", "sdpa_wide", "sdpa_split", "flex_wide", "flex", "block"}
    assert " ms" in rows["sdpa"] and " ms" in rows["block"]  # the safe paths were timed on a small case
    assert "self-check skipped" in rows["flex"]  # auto does not use flex on CPU, so it is not checked here
    # said plainly, not as an exception's text (issue 25, item 10)
    assert rows["flex"].endswith("inference only on cpu (no backward here; training uses block), so not timed")
    assert "Error" not in rows["flex"]
    picks = backends.describe("cpu")  # what each registered type declares (a new variant: no edit here)
    assert {n: picks[n] for n in ("diff", "diff_distance", "distance", "standard")} == {
        "diff": "sdpa", "diff_distance": "block", "distance": "block", "standard": "sdpa"}
    assert variants_part.splitlines()[0] == ", ".join(f"{n} {picks[n]}" for n in sorted(ATTENTION))
    why, trained = variants_part.split("attention variants")
    assert "why (the measured dispatch table, dispatch.json):" in why  # which row auto follows, per family
    assert "  diff: the safe path (sdpa): no measured row is read on cpu" in why
    # every registered variant trained one step of a one-layer model here
    variants = {line.split()[0]: line for line in trained.splitlines() if line.startswith("  ")}
    assert set(variants) == set(ATTENTION) and {"alibi", "diff_v2", "dint", "fox", "gated", "grouped_diff",
                                                "shared_diff"} <= set(variants)
    assert all(line.endswith(" ms") for line in variants.values())
    assert "DINT" in variants["dint"] and "block" in variants["distance"]
    assert "Traceback" not in r.stderr


def test_doctor_invalid_env_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.setenv("DIFFATTN_BACKEND", "bogus")
    r = run_main("doctor")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == ("error: DIFFATTN_BACKEND must be one of auto, sdpa, sdpa_wide, sdpa_split, "
                                  "flex_wide, triton, flex, block; got 'bogus'")

@pytest.mark.parametrize("args,message", [
    (["--device", "cuda"], "no CUDA device is available"),
    (["--device", "tpu:0"], "error:"),
])
def test_doctor_bad_device_is_one_line_and_exit_2(monkeypatch, capsys, args, message):
    monkeypatch.delenv("DIFFATTN_BACKEND", raising=False)
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    assert doctor.run(parser.parse_args(args)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_doctor_fails_when_a_forced_backend_cannot_run(monkeypatch, capsys):
    monkeypatch.setenv("DIFFATTN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(backends, "time_backend", lambda *a, **k: 0.001)  # keep it fast: no timing
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    assert doctor.run(parser.parse_args([])) == 2
    assert "DIFFATTN_BACKEND=triton:" in capsys.readouterr().err


def test_doctor_exits_1_when_a_backend_auto_picks_does_not_run(monkeypatch, capsys):
    monkeypatch.delenv("DIFFATTN_BACKEND", raising=False)

    def time_backend(name, device, dtype):
        if name == "block":
            raise RuntimeError("out of memory")
        return 0.001

    monkeypatch.setattr(backends, "time_backend", time_backend)
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    assert doctor.run(parser.parse_args([])) == 1
    out, err = capsys.readouterr()
    assert "RuntimeError: out of memory" in out and "block (picked by auto) did not run" in err


def test_doctor_exits_1_when_a_variant_does_not_run(monkeypatch, capsys):
    monkeypatch.delenv("DIFFATTN_BACKEND", raising=False)
    monkeypatch.setattr(backends, "time_backend", lambda *a, **k: 0.001)
    real = machine_check.one_step_ms

    def one_step(name, device, dtype, repeats=3):
        if name == "alibi":
            raise RuntimeError("no kernel for this shape")
        return real(name, device, dtype, repeats=0)

    monkeypatch.setattr(machine_check, "one_step_ms", one_step)
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    assert doctor.run(parser.parse_args([])) == 1
    out, err = capsys.readouterr()
    assert "failed: RuntimeError: no kernel for this shape" in out
    assert "attention variant(s) alibi did not run here" in err
