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

from diffattn.ops import backends as B

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA suite is the real run")


@pytest.mark.slow
def test_gpu_suite_runs_its_cpu_parts_and_says_what_it_skipped(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("DIFFATTN_BACKEND", None)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--out", str(tmp_path),
                        "--quick"], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    (js,) = [p for p in tmp_path.glob("*.json") if not p.stem.endswith("-dispatch")]
    assert js.stem.startswith("cpu-") and js.with_suffix(".md").exists()
    res = json.loads(js.read_text())
    assert set(res["tables"]) == {"v1_core", "rivals", "model_step", "da", "rehearsal", "v1_layouts", "v1_epilogue",
                                  "layout_steps", "layout_steps_830m", "layout_steps_compiled", "peers"}
    lay = res["tables"]["v1_layouts"]["rows"]  # every layout timed or saying why not, each call's backend named
    assert [r[1] for r in lay] == [v[0] for v in VARIANTS]
    ran = {r[1]: r for r in lay if not r[2].startswith("did not run")}
    assert {"std", "V1 sdpa", "V1 sdpa_wide", "V1 sdpa_split"} <= set(ran)
    assert ran["V1 sdpa_split"][2] == "flash x2" and ran["V1 sdpa_wide"][2] == "math x1"  # CPU SDPA's choices
    assert "no backward on CPU" in next(r[2] for r in lay if r[1] == "V1 flex_wide")
    steps = {r[0]: r for r in res["tables"]["layout_steps"]["rows"]}
    for name in ("diff", "shared_diff", "dint", "grouped_diff"):
        for layout in ("sdpa", "sdpa_wide", "sdpa_split"):
            assert float(steps[f"{name} {layout}"][3].rstrip("x")) > 0, steps
    assert float(steps["diff_v2"][3].rstrip("x")) > 0
    disp = json.loads(js.with_name(js.stem + "-dispatch.json").read_text())  # in the format auto reads
    (row,) = B.parse_rows(disp, "dispatch")
    assert (row.family, row.capability, row.dtype) == ("diff", "cpu", "float32") and row.layout in LAYOUTS
    assert row.source == f"docs/results/gpu/issue49/{js.name}"
    peers = res["tables"]["peers"]
    assert peers[0]["rows"][0][0] == "ours diff layer" and peers[0]["rows"][1][0] == "timm DiffAttention"
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


VARIANTS = [("std",), ("std flash",), ("std cudnn",), ("V1 sdpa",), ("V1 sdpa_wide",), ("V1 sdpa_wide cudnn",),
            ("V1 sdpa_wide efficient",), ("V1 sdpa_split",), ("V1 sdpa_split flash",), ("V1 flex_wide",),
            ("V1 triton",)]
LAYOUTS = ("sdpa", "sdpa_wide", "sdpa_split", "flex_wide")


def test_commit_dispatch_merges_a_runs_rows_into_the_table(tmp_path):
    gs = _suite()
    table = tmp_path / "dispatch.json"
    table.write_text(json.dumps({"about": "x", "rows": [
        {"family": "diff", "capability": "sm_90", "dtype": "bfloat16", "layout": "sdpa", "source": "old"},
        {"family": "distance", "capability": "sm_90", "dtype": "bfloat16", "layout": "block", "source": "old"}]}))
    run = tmp_path / "run-dispatch.json"
    run.write_text(json.dumps({"rows": [{"family": "diff", "capability": "sm_90", "dtype": "bfloat16",
                                         "layout": "sdpa_split", "source": "docs/results/gpu/new.json",
                                         "measured": "1.3x", "epilogue": "compiled"}]}))
    assert gs.commit_dispatch(run, table) == 0
    rows = B.parse_rows(json.loads(table.read_text()), "t")
    assert [(r.family, r.layout, r.epilogue) for r in rows] == [("distance", "block", "eager"),
                                                                 ("diff", "sdpa_split", "compiled")]
    run.write_text(json.dumps({"rows": [{"family": "diff"}]}))
    assert gs.commit_dispatch(run, table) == 2  # a malformed file changes nothing
    assert len(B.parse_rows(json.loads(table.read_text()), "t")) == 2


def _suite():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


def test_a_part_that_raises_is_listed_the_rest_run_and_results_are_saved_after_each_part(monkeypatch):
    """A device lease is short: one broken part must not cost the others, and a run killed midway keeps what it
    measured (the files are rewritten after every part)."""
    gs = _suite()
    table = {"title": "t", "header": ["x"], "rows": [["1"]]}

    def boom(*a, **k):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(gs, "environment", lambda device, dtype: {"versions": {}, "device": "cpu", "backends": [],
                                                                  "auto": {}})
    monkeypatch.setattr(gs, "core_table", boom)
    for name in ("rivals_table", "backend_table", "device_rehearsal"):
        monkeypatch.setattr(gs, name, lambda *a, **k: dict(table, rows=[["1"]]))
    monkeypatch.setattr(gs, "step_tables", lambda **k: [table])
    monkeypatch.setattr(gs, "layout_table", lambda *a, **k: (dict(table), {"V1 sdpa": {64: 1.0}}))
    monkeypatch.setattr(gs, "epilogue_ratio", lambda *a, **k: (dict(table), None))
    for name in ("layout_steps", "layout_steps_compiled", "timm_peer"):
        monkeypatch.setattr(gs, name, lambda **k: dict(table))
    saved = []
    res = gs.collect(torch.device("cpu"), quick=True, tests=False, save=lambda r: saved.append(set(r["seconds"])))
    assert res["errors"] == ["v1_core: RuntimeError: kernel exploded"]
    assert {"rivals", "model_step", "da", "rehearsal", "v1_layouts", "layout_steps"} <= set(res["tables"])
    assert "v1_core" not in res["tables"] and res["dispatch"][0]["layout"] == "sdpa"
    assert len(saved) == len(res["seconds"]) and saved[0] == {"environment"}  # one save per part, in order
    assert saved[-1] == set(res["seconds"])
    assert "## Parts that failed" in gs.markdown(res) and "kernel exploded" in gs.markdown(res)


def test_a_spent_budget_skips_the_parts_left_and_still_writes_the_files(tmp_path):
    gs = _suite()
    threads = torch.get_num_threads()
    try:
        assert gs.main(["--out", str(tmp_path), "--quick", "--no-tests", "--budget-minutes", "0"]) == 0
    finally:
        torch.set_num_threads(threads)  # main sets the benchmarks' thread count
    res = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert not res["tables"] and res["seconds"] == {}
    spent = [s for s in res["skipped"] if "time budget" in s]
    assert spent[0].startswith("environment:") and any(s.startswith("v1_core:") for s in spent)
    assert "## Skipped" in next(tmp_path.glob("*.md")).read_text()
