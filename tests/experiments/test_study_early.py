"""experiments.findings.early: the early-gap summary of a finished experiment, on a hand-made study folder."""

import csv
import json

import pytest
from scipy import stats as st

from diffattn.experiments.findings.early import early_steps, early_summary, paired_gap
from diffattn.experiments.findings.figures import arm_colors
from diffattn.experiments.findings.report import early_blocks

COLS = ["step", "layer0.lambda", "layer1.lambda", "layer0.attn_to_resid", "layer1.attn_to_resid",
        "layer0.attn_rms", "layer1.attn_rms", "layer0.grad.out", "layer1.grad.out"]


def _cell(root, name, rows):
    d = root / "cells" / name
    d.mkdir(parents=True)
    with open(d / "diagnostics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLS)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def _row(step, ratio, lam=0.2, grad=3.0):
    # late rows (past the early window) leave the early columns empty, as the training loop writes them
    early = {"layer0.attn_to_resid": ratio, "layer1.attn_to_resid": 2 * ratio, "layer0.attn_rms": 1.0,
             "layer1.attn_rms": 1.0, "layer0.grad.out": grad, "layer1.grad.out": 4.0} if ratio is not None else {}
    return {"step": step, "layer0.lambda": lam, "layer1.lambda": lam, **early}


@pytest.fixture
def study(tmp_path):
    arms = []
    for name, lr, ratios in (("diff", 0.0015, (1.0, 3.0)), ("standard", 0.003, (0.1, 0.3))):
        seeds = []
        for s, r in enumerate(ratios):
            _cell(tmp_path, f"{name}-lr{lr:g}-s{s}", [_row(1, r), _row(50, r / 2), _row(100, None)])
            hist = [{"step": 10, "val_loss": 3.0 + s + (0.5 if name == "diff" else 0.0)},
                    {"step": 20, "val_loss": 2.0 + s + (0.1 * (s + 1) if name == "diff" else 0.0)}]
            seeds.append({"seed": s, "history": hist})
        # a cell at another LR must not count
        _cell(tmp_path, f"{name}-lr{2 * lr:g}-s0", [_row(1, 100.0)])
        arms.append({"name": name, "label": name.upper(), "best_lr": lr, "seeds": seeds})
    (tmp_path / "results.json").write_text(json.dumps({"spec": {"n_layers": 2}, "arms": arms}))
    return tmp_path


def test_early_summary_means_over_seeds_at_the_best_lr(study):
    s = early_summary(study, steps=(1, 60, 100))
    assert s == early_summary(study, json.loads((study / "results.json").read_text()), steps=(1, 60, 100))
    d = s["diff"]
    assert d["seeds"] == 2 and d["lr"] == 0.0015
    assert d["rows"][0]["attn_to_resid"] == pytest.approx([2.0, 4.0])   # mean of 1 and 3, layer 1 doubled
    assert d["rows"][1]["attn_to_resid"] == pytest.approx([1.0, 2.0])   # step 60 reads the row at step 50
    assert d["rows"][2]["attn_to_resid"] == pytest.approx([1.0, 2.0])   # step 100's row has no early columns
    assert d["rows"][0]["grad"]["out"] == pytest.approx(5.0)            # sqrt(3² + 4²) over layers
    assert d["rows"][0]["lambda"] == pytest.approx([0.2, 0.2])
    assert s["standard"]["rows"][0]["attn_to_resid"] == pytest.approx([0.2, 0.4])


def test_paired_gap_is_the_t_interval_of_per_seed_differences(study):
    res = json.loads((study / "results.json").read_text())
    rows = paired_gap(res, "diff", "standard")
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[0]["mean"] == pytest.approx(0.5) and rows[0]["n"] == 2
    assert rows[0]["ci95"] == pytest.approx([0.5, 0.5])                 # zero spread: a zero-width interval
    diffs = [0.1, 0.2]
    lo, hi = st.t.interval(0.95, df=1, loc=0.15, scale=st.sem(diffs))
    assert rows[1]["mean"] == pytest.approx(0.15)
    assert rows[1]["ci95"] == pytest.approx([lo, hi])


def test_default_steps_are_the_logged_early_steps(study):
    rows = [{"step": float(s), "layer0.attn_to_resid": 1.0} for s in range(12, 601, 12)] + [{"step": 700.0}]
    assert early_steps(rows) == [12, 48, 96, 252, 504]
    assert early_steps(rows[:5]) == [12, 48]          # a window of 60 steps: nothing near 100 or beyond
    assert [r["step"] for r in early_summary(study)["diff"]["rows"]] == [1, 50]


def test_report_section(study):


    res = json.loads((study / "results.json").read_text())
    res["early"] = {"arms": early_summary(study, res), "between": [
        {"candidate": "diff", "other": "standard", "gap": paired_gap(res, "diff", "standard")}]}
    b = early_blocks(res)
    text = " ".join(str(x) for x in b)
    assert "diff − standard over training" in text and "+0.1500" in text
    assert "no detectable difference at this budget for diff against standard" in text  # 1 df: a wide CI
    assert [x[0] for x in b].count("table") == 3
    assert early_blocks({"early": None}) == []


def test_arms_of_one_attention_type_get_their_own_colours():
    arms = [{"name": n, "attention": t} for n, t in
            (("diff", "diff"), ("standard", "standard"), ("diff+nosubln", "diff"), ("diff+shared_qk", "diff"))]
    c = arm_colors(arms)
    assert len(set(c.values())) == 4
    assert len(arm_colors([{"name": str(i), "attention": "diff"} for i in range(20)])) == 20  # terminates
