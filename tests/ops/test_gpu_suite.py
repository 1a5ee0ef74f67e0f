"""benchmarks/gpu_suite.py on CPU at its smallest sizes: the CPU parts run, the GPU parts are reported as
skipped, and the JSON + Markdown named after the device are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA suite is the real run")


def test_gpu_suite_runs_its_cpu_parts_and_says_what_it_skipped(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("DIFFATTN_BACKEND", None)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--out", str(tmp_path),
                        "--quick"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (js,) = tmp_path.glob("*.json")
    assert js.stem.startswith("cpu-") and js.with_suffix(".md").exists()
    res = json.loads(js.read_text())
    assert set(res["tables"]) == {"v1_core", "rivals", "model_step", "da", "rehearsal"}
    assert [row[1] for row in res["tables"]["rivals"]["rows"]] == ["std", "gated", "gda", "fox", "fox+ftz", "sink"]
    assert [row[1] for row in res["tables"]["v1_core"]["rows"]] == ["std", "V1 sdpa"]
    assert [row[1] for row in res["tables"]["da"]["rows"]] == ["sdpa", "block"]
    (step,) = res["tables"]["model_step"]
    assert [row[0] for row in step["rows"]] == ["ours diff", "ours baseline"]
    assert all(float(row[2]) > 0 for row in res["tables"]["v1_core"]["rows"])  # a real time, not a placeholder
    assert res["environment"]["auto"]["diff"] == "sdpa"
    reh = res["tables"]["rehearsal"]  # the training-loop rehearsal ran on tiny models, measured, with a plan
    assert [r[:4] for r in reh["rows"]] == [["tiny", "64", "full", "off"], ["tiny_baseline", "64", "full", "off"]]
    assert all(float(r[5]) > 0 and r[6] == "-" and float(r[7]) > 0 for r in reh["rows"]), reh["rows"]
    assert all(len(r[4].split()) == 2 for r in reh["rows"])  # a loss per step
    skipped = " ".join(res["skipped"])
    for part in ("correctness tests", "Triton", "FlexAttention", "GPU sizes", "830M rehearsal"):
        assert part in skipped, part
    assert "skipped: GPU correctness tests" in r.stdout
    md = js.with_suffix(".md").read_text()
    assert "## Skipped" in md and "| 64 | V1 sdpa |" in md and "not evidence" in md
