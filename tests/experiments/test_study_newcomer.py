"""A newcomer's study (issue 32): a finished cell whose folder was deleted is trained again (it used to say
"re-run to retry them" and exit 1 on every rerun); the report says when the models are barely trained (the
unigram floor, the gain below it, tokens per parameter) instead of a bold verdict on them; its cell and trial
counts add up and are explained, under a study named for `study`; with --jobs 2 the LR-extension line is printed
once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from clirun import run_diffattn, run_main

from diffattn.experiments.findings.depth import BARELY_GAIN, barely_note, depth_sentence, training_depth, unigram_floor
from diffattn.experiments.findings.report_text import cells_sentence, verdict_text

TEXT = "It is the east, and Juliet is the sun. Arise, fair sun, and kill the envious moon. " * 40
SMALL = ["--quick", "--steps", "2", "--seq-len", "16", "--d-model", "16", "--batch-size", "2", "--threads", "1",
         "--seeds", "1", "--lrs", "0.003", "--progress-seconds", "600", "--probe-seconds", "0",
         "--poll-seconds", "0.5", "--no-progress"]


def test_a_deleted_cell_is_trained_again_and_the_report_counts_add_up(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text(TEXT)
    args = ["study", "c.txt", *SMALL, "--lr-extensions", "0", "--out", "st"]
    assert run_main(*args, cwd=tmp_path).returncode == 0
    cell = tmp_path / "st" / "cells" / "standard-lr0.003-s0"
    first = json.loads((cell / "result.json").read_text())["val_loss"]
    import shutil

    shutil.rmtree(cell)
    r = run_main(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "its result is gone (folder deleted?): training it again" in r.stderr and "incomplete" not in r.stderr
    assert json.loads((cell / "result.json").read_text())["val_loss"] == first  # the same cell, deterministic
    r = run_main(*args, cwd=tmp_path)  # and nothing more to do after that
    assert r.returncode == 0 and "training it again" not in r.stderr
    results = json.loads((tmp_path / "st" / "results.json").read_text())
    assert results["plan"]["study_name"].startswith("study-")
    assert results["incomplete"] is None and results["cells"]["finished"] == 2
    line = cells_sentence(results)
    assert line.startswith("Cells finished: 2 of 2: 2 in the base grid (arms × LRs × seeds);")
    assert "COMPLETE 3" in line and "counts twice" in line  # two cells, one of them trained twice
    report = (tmp_path / "st" / "report.md").read_text()
    assert "Training depth: the unigram floor" in report


@pytest.mark.slow  # two worker processes (each imports torch) train 6 tiny cells
def test_with_two_jobs_the_lr_extension_line_is_printed_once(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text(TEXT)
    r = run_diffattn("study", "c.txt", *SMALL, "--lr-extensions", "1", "--jobs", "2", "--out", "st",
                     cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(re.findall(r"LR extension \(best LR at an edge\)", r.stderr)) == 1, r.stderr
    results = json.loads((tmp_path / "st" / "results.json").read_text())
    line = cells_sentence(results)
    assert line.startswith("Cells finished: 6 of 6: 2 in the base grid (arms × LRs × seeds), 4 LR-extension cells")
    complete = sum(c.get("COMPLETE", 0) for c in results["study"].values())
    assert complete == 6 and any("-lrext-" in name for name in results["study"])


def test_the_unigram_floor_and_when_a_verdict_is_on_barely_trained_models() -> None:
    class Source:
        vocab_size = 4
        tokens = np.array([0, 0, 1, 2] * 50 + [0, 1, 2, 3] * 10)
        splits = {"train": (0, 200), "val": (200, 240)}

    counts = np.array([100, 50, 50, 0]) + 1.0
    want = -np.log(counts / counts.sum())[Source.tokens[200:]].mean()
    assert unigram_floor(Source, 1000) == pytest.approx(want)
    arms = [{"name": "diff", "val_loss_mean": 2.95, "params": 1000}, {"name": "standard", "val_loss_mean": 2.9,
                                                                      "params": 1000}]
    d = training_depth(3.0, arms, 500)
    assert d["barely"] and d["arms"]["standard"]["gain_nats"] == pytest.approx(0.1)
    assert d["arms"]["diff"]["tokens_per_param"] == 0.5
    assert not training_depth(3.0, [{"name": "x", "val_loss_mean": 3.0 * (1 - BARELY_GAIN) - 0.01,
                                     "params": 10}], 10)["barely"]
    results = {
        "verdict": {"candidate": "diff", "baseline": "standard", "seeds": [0, 1, 2], "conclusion": "worse",
                    "diff_minus_baseline": 0.05, "ci95": [0.01, 0.09]},
        "arms": [{**a, "label": a["name"], "best_lr": 1e-3, "lrs": [1e-3], "bracketed": True, "val_loss_ci95": [0, 0],
                  "bpc_mean": 4.0} for a in arms],
        "spec": {"data": "/x/c.txt", "tokenizer": "char", "steps": 33, "batch_size": 16, "seq_len": 128,
                 "lrs": [1e-3], "seeds": [0, 1, 2]},
        "depth": d,
    }
    text = verdict_text(results)
    assert text.startswith("**Barely trained: at this budget neither model is far below the unigram floor")
    assert "DIFF is worse" not in text and "unigram floor (a model that ignores context) is 3.000" in text
    results["depth"] = training_depth(3.0, [{**a, "val_loss_mean": 1.5} for a in arms], 500)
    assert verdict_text(results).startswith("**DIFF is worse than its parameter-matched baseline at this budget.**")


def test_arms_above_the_unigram_floor_are_said_to_be_above_it() -> None:
    """Issue 39: `study --quick` printed "the best arm is only -0.060 nats/token below the unigram floor" while both
    arms were above it, and report.md said "below it by -0.060": a loss above the floor is said to be above it."""
    arms = [{"name": "diff", "val_loss_mean": 3.1, "params": 1000}, {"name": "standard", "val_loss_mean": 3.06,
                                                                     "params": 1000}]
    above = training_depth(3.0, arms, 500)
    note = barely_note(above)
    assert "the best arm is 0.060 nats/token above, not below, the unigram floor (3.000 nats/token)" in note, note
    assert "-0.0" not in note and "only" not in note
    sentence = depth_sentence(above, 500)
    assert "against it: diff 0.100 above (3%), standard 0.060 above (2%)" in sentence, sentence
    assert "-" not in sentence.split("against it:")[1].split(", after")[0]
    mixed = training_depth(3.0, [{**arms[0], "val_loss_mean": 2.95}, arms[1]], 500)
    assert "the best arm is only 0.050 nats/token below the unigram floor" in barely_note(mixed)
    assert "diff 0.050 below (2%), standard 0.060 above (2%)" in depth_sentence(mixed, 500)


def test_only_the_process_that_creates_a_round_announces_it() -> None:
    import optuna

    from diffattn.experiments.study.optuna_log import opens_first

    storage = optuna.storages.InMemoryStorage()
    assert opens_first(storage, "study-x-lrext-abc") and not opens_first(storage, "study-x-lrext-abc")
