"""``diffattn verdicts``: per-text paired differences at each arm's best LR and the across-text average, checked
against hand computations on made-up study results; bad folders and unknown arms are one line, exit 2."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from diffattn.experiments.findings.paired_tables import across, text_rows
from diffattn.experiments.study.folder_results import read_results
from tests.clirun import run_main


def _results(losses: dict[str, dict[float, list[float]]]) -> dict:
    arms = []
    for name, sweep in losses.items():
        best = min(sweep, key=lambda lr: sum(sweep[lr]))
        arms.append({"name": name, "label": name.upper(), "best_lr": best, "bracketed": True, "params": 1,
                     "lr_sweep": [{"lr": lr, "seeds": [{"seed": s, "val_loss": v} for s, v in enumerate(vals)]}
                                  for lr, vals in sweep.items()]})
    return {"arms": arms}


TEXT1 = _results({"standard": {1e-3: [2.0, 2.1, 2.2], 2e-3: [1.9, 2.0, 2.1]},
                  "gated": {1e-3: [1.8, 1.95, 2.0], 2e-3: [2.5, 2.5, 2.5]}})
TEXT2 = _results({"standard": {1e-3: [3.0, 3.0, 3.1]}, "gated": {1e-3: [3.1, 3.05, 3.3]}})


def test_each_arm_at_its_best_lr_paired_with_the_reference():
    rows = {r["arm"]: r for r in text_rows(TEXT1, "standard")}
    assert rows["standard"]["lr"] == 2e-3 and rows["gated"]["lr"] == 1e-3 and rows["standard"]["diff"] is None
    d = [1.8 - 1.9, 1.95 - 2.0, 2.0 - 2.1]
    m, half = sum(d) / 3, stats.t.ppf(0.975, 2) * stats.tstd(d) / math.sqrt(3)
    got = rows["gated"]["diff"]
    assert got["mean"] == pytest.approx(m) and got["ci95"] == pytest.approx([m - half, m + half])
    assert got["conclusion"] == "better"


def test_across_texts_averages_the_per_text_means_with_welch_degrees_of_freedom():
    (row,) = across([TEXT1, TEXT2], "standard")
    d1, d2 = [-0.1, -0.05, -0.1], [0.1, 0.05, 0.2]
    v1, v2 = stats.tvar(d1) / 3, stats.tvar(d2) / 3
    mean = (sum(d1) / 3 + sum(d2) / 3) / 2
    se = math.sqrt(v1 + v2) / 2
    df = (v1 + v2) ** 2 / (v1**2 / 2 + v2**2 / 2)
    half = stats.t.ppf(0.975, df) * se
    assert row["mean"] == pytest.approx(mean) and row["ci95"] == pytest.approx([mean - half, mean + half])
    assert (row["texts"], row["better"], row["worse"]) == (2, 1, 0)  # text 2: +0.12, interval across 0


def test_cli_tables_and_one_line_errors(tmp_path):
    for name, res in (("a", TEXT1), ("b", TEXT2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    r = run_main("verdicts", tmp_path / "a", tmp_path / "b", "--names", "one,two")
    assert r.returncode == 0 and "### one" in r.stdout and "### across 2 texts (one, two)" in r.stdout
    assert "| GATED |" in r.stdout
    r = run_main("verdicts", tmp_path / "a", "--against", "nope")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no arm 'nope'" in r.stderr
    r = run_main("verdicts", tmp_path / "missing")
    assert r.returncode == 2 and "not a finished study" in r.stderr


def test_a_study_in_progress_is_read_from_its_finished_cells(tmp_path):
    from diffattn.experiments.study.spec import StudySpec, write_spec

    spec = StudySpec.from_dict({"data": "x", "variants": ["fox"], "lrs": [1e-3, 2e-3], "seeds": [0, 1],
                                "head_dims": [32], "steps": 10})
    write_spec(tmp_path, spec, {})
    losses = {("standard", 1e-3): [2.0, 2.2], ("standard", 2e-3): [1.9, 2.1], ("fox", 1e-3): [1.8, 2.0],
              ("fox", 2e-3): [1.7, None], ("diff", 1e-3): [2.5, 2.6]}  # fox at 2e-3: one seed still running
    for (arm, lr), vals in losses.items():
        for seed, v in enumerate(vals):
            if v is not None:
                cell = tmp_path / "cells" / f"{arm}-lr{lr}-s{seed}"
                cell.mkdir(parents=True)
                (cell / "result.json").write_text(json.dumps({"arm": arm, "lr": lr, "seed": seed, "val_loss": v}))
    for name in ("fox-lr0.002-s1-d32", "zz-fox-lr0.002-s1-d256"):  # the size ladder's cells, sorted either side
        (tmp_path / "cells" / name).mkdir()
        d_model = int(name.rsplit("-d", 1)[1])
        (tmp_path / "cells" / name / "result.json").write_text(json.dumps(
            {"arm": "fox", "lr": 2e-3, "seed": 1, "val_loss": 0.5, "d_model": d_model}))
    rows = {r["arm"]: r for r in text_rows(read_results(tmp_path), "standard")}
    assert rows["fox"]["lr"] == 1e-3 and rows["fox"]["bracketed"] is False  # 2e-3 unfinished: not a candidate
    assert rows["standard"]["lr"] == 2e-3 and rows["fox"]["diff"]["mean"] == pytest.approx(-0.1)
