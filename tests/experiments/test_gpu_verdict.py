"""benchmarks/gpu_verdict.py rehearsed on CPU at its tiny size: the same code path as the H200 call (the corpus
from this machine's own Python source, held out by file; the plan; the throughput probe; the library's study
with one LR for all four arms and 2 seeds), ending in results.json, report.md and verdict.json under --out, so
that the device call cannot fail on a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_verdict  # noqa: E402

sys.path.remove(str(ROOT / "benchmarks"))


def test_held_out_files_are_about_one_in_twenty_and_the_lr_follows_the_studies_rule():
    names = [f"0/pkg/mod{i}.py" for i in range(4000)]
    share = sum(map(gpu_verdict.held_out, names)) / len(names)
    assert 0.04 < share < 0.06
    assert gpu_verdict.lr_for(128) == pytest.approx(2.1e-3)
    assert gpu_verdict.lr_for(512) == pytest.approx(1.05e-3, rel=0.01)


def test_the_corpus_lists_training_files_first_and_never_a_held_out_file_among_them(tmp_path):
    files = gpu_verdict.corpus_files(gpu_verdict.source_roots(), 200_000)
    assert files and all(p.suffix == ".py" for _, p in files)
    m = gpu_verdict.write_corpus(files, tmp_path / "c.jsonl")
    rows = [json.loads(line)["text"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(rows) == m["train_files"] + m["val_files"] and m["val_files"] >= 1
    assert rows[m["train_files"]:] == m["val_texts"]  # the held-out files come last, whole


def test_the_steps_fit_the_budget_and_say_when_they_fall_short_of_the_target():
    spec = gpu_verdict.make_spec(Path("c.jsonl"), gpu_verdict.SIZES["device"], 10, 0.05)
    fast = gpu_verdict.size_steps(spec, {a.name: 0.01 for a in spec.arms()}, 600, 50_000_000)
    assert fast["steps"] == fast["target_steps"] == 763 and not fast["short_of_target"]
    slow = gpu_verdict.size_steps(spec, {a.name: 0.2 for a in spec.arms()}, 420, 50_000_000)
    assert slow["short_of_target"] and slow["predicted_s"] <= 420 < gpu_verdict.size_steps(
        spec, {a.name: 0.2 for a in spec.arms()}, 10**6, 50_000_000)["predicted_s"]


@pytest.mark.slow
def test_the_tiny_rehearsal_writes_results_report_and_verdict(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFATTN_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_verdict.py"), "--out", str(tmp_path / "out"),
                        "--work", str(tmp_path / "work"), "--tiny", "--budget-minutes", "30"],
                       capture_output=True, text=True, env=env, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["events.log", "report.md", "results.json", "verdict.json",
                                                      "verdict.md"]
    info = json.loads((out / "verdict.json").read_text())
    assert info["study_exit"] == 0 and info["seeds"] == 2
    assert set(info["plan"]) == {"diff", "standard", "diff_v2", "gated"}
    assert info["tokens"]["train_tokens"] <= info["tokens"]["tokens"] - info["tokens"]["val_file_tokens"]
    results = json.loads((out / "results.json").read_text())
    assert len(json.dumps(results)) > 100
    report = (out / "report.md").read_text()
    assert "95%" in report or "CI" in report
